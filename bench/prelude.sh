# Sourced first by the device scripts that run one thing per quoted flag set (repo root, on the GPU machine): $OUT,
# unbuffered Python, the inductor cache's folder and functions (inductor_cache.sh), the GPU's name, and
#   split_flag_set "$flags"   sets the arrays settings (the leading NAME=value words: environment settings for
#                             that run) and options (the rest: train_gpt.py flags)
OUT=${OUT:-/tmp/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_cache}
source bench/inductor_cache.sh
nvidia-smi --query-gpu=name --format=csv,noheader

split_flag_set() {
    settings=() options=()
    local word
    for word in $1; do
        if [[ $word =~ ^[A-Z_][A-Z0-9_]*= ]]; then settings+=("$word"); else options+=("$word"); fi
    done
}
