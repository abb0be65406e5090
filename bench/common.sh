# Sourced first by the device scripts (repo root, on the GPU machine). It sets $OUT, unbuffered Python and the
# inductor cache's folder, unpacks the carried bench stream, puts a carried FA3 build on PYTHONPATH, and defines
#   split_flag_set "$flags"   the arrays settings (leading NAME=value words: that run's environment) and options
#                             (the rest: train_gpt.py flags)
#   restore_inductor_cache    unpack .cache/inductor.tar.xz.part* (carried from an earlier call), if any
#   pack_inductor_cache       pack the cache into $OUT/cache/ in 15 MB parts (each file that comes back is <= 16 MB)
# Carried inputs, all git-ignored: .bench2/*.bin.xz (`mkdir -p .bench2 && cp ../shared/bench2/*.xz .bench2/`),
# .fa3/ (bench/fa3_build.sh), .cache/ (a packed inductor cache from an earlier call).
OUT=${OUT:-/tmp/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_cache}
BENCH2=/tmp/bench2
if ls .bench2/*.bin.xz > /dev/null 2>&1; then
    python3 - "$BENCH2" <<'UNPACK'
import lzma, pathlib, sys
out = pathlib.Path(sys.argv[1])
out.mkdir(exist_ok=True)
for packed in sorted(pathlib.Path(".bench2").glob("*.bin.xz")):
    if not (out / packed.name[:-3]).exists():
        (out / packed.name[:-3]).write_bytes(lzma.decompress(packed.read_bytes()))
UNPACK
fi
if [ -d .fa3 ] && [ ! -d /tmp/fa3site ]; then
    mkdir -p /tmp/fa3site && cat .fa3/fa3.tar.xz.part* | tar -xJ -C /tmp/fa3site
fi
[ -d /tmp/fa3site ] && export PYTHONPATH="/tmp/fa3site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>/dev/null

split_flag_set() {
    settings=() options=()
    local word
    for word in $1; do
        if [[ $word =~ ^[A-Z_][A-Z0-9_]*= ]]; then settings+=("$word"); else options+=("$word"); fi
    done
}

restore_inductor_cache() {
    if ls .cache/inductor.tar.xz.part* > /dev/null 2>&1; then
        mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && cat .cache/inductor.tar.xz.part* | tar -xJf - -C "$TORCHINDUCTOR_CACHE_DIR" \
            && echo "inductor cache restored: $(du -sh "$TORCHINDUCTOR_CACHE_DIR" | cut -f1)"
    fi
}

pack_inductor_cache() {
    mkdir -p "$OUT/cache"
    # Files in order of size: a multi-rank cache's near-copies of one graph lie side by side, inside xz's 64 MiB window
    (cd "$TORCHINDUCTOR_CACHE_DIR" && find . -type f -printf '%s\t%p\n' | sort -n | cut -f2- \
        | tar -cf - --no-recursion -T - | xz -T0 --lzma2=preset=3,dict=64MiB) \
        | split -b 15m - "$OUT/cache/inductor.tar.xz.part"
    du -sh "$OUT/cache" | cut -f1
}
