# Sourced by the device scripts: carry TORCHINDUCTOR_CACHE_DIR between device calls as .cache/ parts.
#   restore_inductor_cache   unpack .cache/inductor.tar.xz.part* (carried from the last call), if any
#   pack_inductor_cache      pack the cache into $OUT/cache/ in 15 MB parts (each file that comes back is <= 16 MB),
#                            with xz on every core (single-threaded, packing 440 MB took over a minute)

restore_inductor_cache() {
    if ls .cache/inductor.tar.xz.part* >/dev/null 2>&1; then
        mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && cat .cache/inductor.tar.xz.part* | tar -xJf - -C "$TORCHINDUCTOR_CACHE_DIR" \
            && echo "inductor cache restored: $(du -sh "$TORCHINDUCTOR_CACHE_DIR" | cut -f1)"
    fi
}

pack_inductor_cache() {
    mkdir -p "$OUT/cache"
    XZ_OPT=-T0 tar -cJf - -C "$TORCHINDUCTOR_CACHE_DIR" . 2>/dev/null | split -b 15m - "$OUT/cache/inductor.tar.xz.part"
    ls -la "$OUT/cache" | tail -n +2
}
