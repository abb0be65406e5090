# Sourced by the device scripts: carry TORCHINDUCTOR_CACHE_DIR between device calls as .cache/ parts.
#   restore_inductor_cache   unpack .cache/inductor.tar.xz.part* (carried from the last call), if any
#   pack_inductor_cache      pack the cache into $OUT/cache/ in 15 MB parts (each file that comes back is <= 16 MB),
#                            its files in order of size, with xz in blocks on several cores (single-threaded, packing
#                            440 MB took over a minute)

restore_inductor_cache() {
    if ls .cache/inductor.tar.xz.part* >/dev/null 2>&1; then
        mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && cat .cache/inductor.tar.xz.part* | tar -xJf - -C "$TORCHINDUCTOR_CACHE_DIR" \
            && echo "inductor cache restored: $(du -sh "$TORCHINDUCTOR_CACHE_DIR" | cut -f1)"
    fi
}

pack_inductor_cache() {
    mkdir -p "$OUT/cache"
    # Inductor keys each rank's graphs apart, so a cache written at 4 GPUs holds four near-copies of each graph's entry
    # (about 36 MB each, with its Triton kernels bundled in). In order of size the copies lie side by side, where xz's
    # 64 MiB window finds each one in the copy before it. 775 MB of a 4-GPU cache packed into 16 MB so, against 45 MB
    # in name order with xz's default 8 MiB window (2026-11-28).
    (cd "$TORCHINDUCTOR_CACHE_DIR" && find . -type f -printf '%s\t%p\n' | sort -n | cut -f2- \
        | tar -cf - --no-recursion -T - | xz -T0 --lzma2=preset=3,dict=64MiB) \
        | split -b 15m - "$OUT/cache/inductor.tar.xz.part"
    ls -la "$OUT/cache" | tail -n +2
}
