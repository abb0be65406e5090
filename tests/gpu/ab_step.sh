#!/usr/bin/env bash
# One device call for a speed change (repo root), results in $OUT:
#   OUT=/some/dir [TESTS="-k softcapped"] [STEPS=6] bash tests/gpu/ab_step.sh "FLAGS_A" "FLAGS_B" ...
# Runs the GPU numerics tests (pytest arguments in TESTS; TESTS=skip skips them), then tests/gpu/bench_step.py once
# per quoted flag set, in order, on one machine with one inductor cache, and prints each run's compile time and
# per-stage line (median ms, slowest/median, tokens/s, MFU, phases) and profile summary. Example, the A/B of the
# Triton kernels: bash tests/gpu/ab_step.sh "--triton_kernels=1" "--triton_kernels=0"
set -uo pipefail
OUT=${OUT:-/tmp/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_cache}
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${TESTS:-}" != skip ]; then
    timeout 200 python3 -m pytest -q tests/gpu ${TESTS:-} 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
fi
n=0
for flags in "$@"; do
    n=$((n + 1))
    # shellcheck disable=SC2086  # each argument is a list of flags
    timeout "${RUN_LIMIT_S:-170}" python3 tests/gpu/bench_step.py --bench_steps="${STEPS:-6}" $flags > "$OUT/ab_$n.txt" 2>&1
    echo "== [$n] $flags (exit $?)"
    grep -E "^compile_time|^ +[0-9]+ +[0-9]+ +\(|^graphs|^profile" "$OUT/ab_$n.txt"
done
