#!/usr/bin/env bash
# One device call for a speed change (repo root), results in $OUT:
#   OUT=/some/dir [TESTS="-k mlp"] [KERNELS="mlp head"] [STEPS=6] [COLD=1] bash bench/ab_step.sh "FLAGS_A" "FLAGS_B" ...
# First the GPU tests (pytest arguments in TESTS; TESTS=skip skips them) and, with KERNELS, bench/bench_kernels.py
# (KERNELS=all: every kernel). Then one run per quoted flag set, in order, on one machine: bench/bench_step.py with
# --bench_steps=STEPS (BENCH=PATH in a set: that copy of it, e.g. an old checkout's bench/bench_step.py, which
# imports the train_gpt.py beside its folder), or, where the set names TRAINER=PATH, a short training run of that
# file over RUN_STEPS scheduled steps (default 60) and their tenth as extension steps, whose per-stage "step times"
# lines compare with another such run's. Leading
# NAME=value words of a set are that run's environment. Each run prints its compile time, start, step times and peak
# memory. COLD=1 gives every run empty inductor and Triton caches (its cold start); otherwise they share one, restored
# from a carried .cache/ and packed back under $OUT/cache (PACK_CACHE=0 skips the packing).
# Example, the Triton kernels' A/B: bash bench/ab_step.sh "--triton_kernels=1" "--triton_kernels=0"
set -uo pipefail
source bench/common.sh
data=()
[ -d "$BENCH2" ] && data=(--train_files="$BENCH2/docs_train_*.bin")
[ "${COLD:-0}" = 1 ] || restore_inductor_cache
if [ "${TESTS:-}" != skip ]; then
    # shellcheck disable=SC2086  # TESTS is a list of pytest arguments
    timeout "${TESTS_LIMIT_S:-300}" python3 -m pytest -q tests/gpu ${TESTS:-} 2>&1 | tail -8 | tee "$OUT/gpu_tests.txt"
fi
if [ -n "${KERNELS:-}" ]; then
    [ "$KERNELS" = all ] && KERNELS=
    # shellcheck disable=SC2086  # KERNELS is a list of names
    timeout 300 python3 bench/bench_kernels.py $KERNELS 2>&1 | tee "$OUT/kernels.txt"
fi
steps=${RUN_STEPS:-60}
n=0
for flags in "$@"; do
    n=$((n + 1))
    split_flag_set "$flags"
    caches=()
    if [ "${COLD:-0}" = 1 ]; then
        rm -rf "/tmp/cold_$n" && caches=(TORCHINDUCTOR_CACHE_DIR="/tmp/cold_$n/inductor" TRITON_CACHE_DIR="/tmp/cold_$n/triton")
    fi
    trainer= bench=bench/bench_step.py
    for word in "${settings[@]}"; do
        [[ $word == TRAINER=* ]] && trainer=${word#TRAINER=}
        [[ $word == BENCH=* ]] && bench=${word#BENCH=}
    done
    if [ -n "$trainer" ]; then
        command=(python3 "$trainer" "${data[@]}" --val_files="$BENCH2/docs_val_000000.bin" --val_tokens=2097152
                 --num_iterations="$steps" --extension_steps=$((steps / 10)) --val_loss_every=0 --run_id="ab_$n")
    else
        command=(python3 "$bench" --bench_steps="${STEPS:-6}" "${data[@]}")
    fi
    env "${settings[@]}" "${caches[@]}" timeout "${RUN_LIMIT_S:-300}" "${command[@]}" "${options[@]}" \
        > "$OUT/ab_$n.txt" 2>&1
    echo "== [$n] $flags (exit $?)"
    grep -E "^compile_time|^cold start|^data|per forward|^ +[0-9]+ +[0-9]+ +\(|^ {31}|^graphs|step times|peak memory|^profile|^  +[0-9.]+ +[0-9.]+%|Error|error:" \
        "$OUT/ab_$n.txt" | cut -c1-220
done
[ "${COLD:-0}" = 1 ] || [ "${PACK_CACHE:-1}" = 0 ] || pack_inductor_cache
