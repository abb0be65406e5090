# Sourced first by the device scripts that run one thing per quoted flag set (repo root, on the GPU machine): $OUT,
# unbuffered Python, the inductor cache's folder and functions (inductor_cache.sh), the GPU's name, and
#   split_flag_set "$flags"   sets the arrays settings (the leading NAME=value words: environment settings for
#                             that run) and options (the rest: train_gpt.py flags)
OUT=${OUT:-/tmp/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_cache}
source bench/inductor_cache.sh
# GPT-2's BPE files carried in .cache/gpt2 (copies of ../shared/gpt2's vocab.bpe and encoder.json): tiktoken's gpt2
# encoding offline, under the names its cache gives them (--bigram_normalize and --sample need it); one line says
# whether it loads
if [ -f .cache/gpt2/vocab.bpe ]; then
    export TIKTOKEN_CACHE_DIR=/tmp/tiktoken-gpt2-cache
    mkdir -p "$TIKTOKEN_CACHE_DIR"
    cp .cache/gpt2/vocab.bpe "$TIKTOKEN_CACHE_DIR/6d1cbeee0f20b3d9449abfede4726ed8212e3aee"
    cp .cache/gpt2/encoder.json "$TIKTOKEN_CACHE_DIR/6c7ea1a7e38e3a7f062df639a5b80947f075ffe6"
    python3 -c 'import tiktoken; print("tiktoken", tiktoken.__version__, "gpt2:",
                                      tiktoken.get_encoding("gpt2").n_vocab)' 2>&1 | tail -1
fi
nvidia-smi --query-gpu=name --format=csv,noheader

split_flag_set() {
    settings=() options=()
    local word
    for word in $1; do
        if [[ $word =~ ^[A-Z_][A-Z0-9_]*= ]]; then settings+=("$word"); else options+=("$word"); fi
    done
}
