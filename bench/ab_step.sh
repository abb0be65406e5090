#!/usr/bin/env bash
# One device call for a speed change (repo root), results in $OUT:
#   OUT=/some/dir [TESTS="-k softcapped"] [STEPS=6] bash bench/ab_step.sh "FLAGS_A" "FLAGS_B" ...
# Runs the GPU numerics tests (pytest arguments in TESTS; TESTS=skip skips them), then bench/bench_step.py once
# per quoted flag set, in order, on one machine with one inductor cache (NAME=value words in a set are environment
# settings for that run), and prints each run's compile time and
# per-stage line (median ms, slowest/median, tokens/s, MFU, phases) and profile summary. Example, the A/B of the
# Triton kernels: bash bench/ab_step.sh "--triton_kernels=1" "--triton_kernels=0"
# With .bench2/ carried (copies of ../shared/bench2) the steps read the bench stream, else random tokens. The
# inductor cache comes from .cache/inductor.tar.xz.part* when carried and goes back under $OUT/cache.
set -uo pipefail
source bench/prelude.sh
data=()
if ls .bench2/*.bin.xz >/dev/null 2>&1; then
    python3 bench/unpack_bench.py && data=(--train_files='/tmp/bench2/docs_train_*.bin')
fi
restore_inductor_cache
if [ "${TESTS:-}" != skip ]; then
    # shellcheck disable=SC2086  # TESTS is a list of pytest arguments
    timeout "${TESTS_LIMIT_S:-200}" python3 -m pytest -q tests/gpu ${TESTS:-} 2>&1 | tail -6 | tee "$OUT/gpu_tests.txt"
fi
n=0
for flags in "$@"; do
    n=$((n + 1))
    split_flag_set "$flags"
    env "${settings[@]}" timeout "${RUN_LIMIT_S:-170}" python3 bench/bench_step.py --bench_steps="${STEPS:-6}" \
        "${data[@]}" "${options[@]}" > "$OUT/ab_$n.txt" 2>&1
    echo "== [$n] $flags (exit $?)"
    grep -E "^compile_time|^data|per forward|^ +[0-9]+ +[0-9]+ +\(|^graphs|Error|error:" "$OUT/ab_$n.txt"
    sed -n '/^profile/,$p' "$OUT/ab_$n.txt" | grep -E "^profile|GPU span|^ +[0-9.]+ +[0-9.]+%" | head -"${PROFILE_LINES:-30}"
done
if [ "${PACK_CACHE:-1}" = 1 ]; then
    pack_inductor_cache
fi
