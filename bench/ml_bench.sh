#!/usr/bin/env bash
# Learning per step on the bench2 stream (repo root, on the GPU machine), results in $OUT:
#   OUT=/some/dir bash bench/ml_bench.sh "FLAGS_A" "FLAGS_B" ...
# Each quoted flag set is one training run, in order, on one machine and one inductor cache: the record's schedule
# shape scaled down, 480 scheduled steps in three equal stages (8/16/24 micro-batches of 16K tokens), then 40
# extension steps at the last stage's batch and the final lr, validation of 2,097,152 tokens at steps 0, 160, 320,
# 480 and 520. Leading NAME=value words of a set are environment settings for that run (e.g. TRAINER=other.py).
# Prints per run: the validation losses, training time, per-stage step medians and peak memory; then one table of
# the losses with each run's difference to the first run's. SEEDS="0 1" runs every flag set once per seed (--seed)
# and adds a table of each set's mean over the seeds and its difference to the first set's mean: identical runs on
# one seed end up to 0.0035 apart (docs/performance.md), so one run per idea resolves little.
# Expects .bench2/*.bin.xz (copies of ../shared/bench2: `mkdir -p .bench2 && cp ../shared/bench2/*.xz .bench2/`),
# carried to the device; the inductor cache comes from .cache/inductor.tar.xz.part* when carried (PACK_CACHE=1
# packs it back under $OUT/cache).
set -uo pipefail
source bench/common.sh
restore_inductor_cache
schedule=(--train_files="$BENCH2/docs_train_*.bin" --val_files="$BENCH2/docs_val_000000.bin"
          --val_tokens=2097152 --train_repeat=1 --num_iterations=480 --extension_steps=40 --val_loss_every=160)
# PARALLEL=1 runs the sets at the same time, at most PER_GPU (default 1) to a GPU, each packing 2 micro-batches per
# forward (two warm-ups at 8 ran out of an H200's memory, three runs at 4 out of an H100's; at 2 a run reserves about
# 20 GiB): the losses are those of separate runs, the step times are not. A set waits for a free slot, and takes the
# GPU that freed it, so 8 sets on 4 GPUs run in two waves. Several runs to one H100 have died at random steps with
# "unspecified launch failure" (docs/performance.md), one to a GPU has not; PER_GPU=4 suits an H200, where 4 to 7 side
# by side ran without one. GPUS="1 2 3" takes only those GPUs (one is left free for something else, e.g.
# bench/ab_step.sh).
[ "${PARALLEL:-0}" = 1 ] && schedule+=(--forward_micro_batches=2)
read -ra gpu_list <<< "${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr "\n" " ")}"
[ ${#gpu_list[@]} -ge 1 ] || gpu_list=(0)
# FRESH=1 cuts micro-batches to 4,096 tokens: the same 520 steps read 35.4M tokens, within the stream's 51.3M, so
# no token repeats and the late losses measure learning, not memorisation (four runs side by side take about 400 s on
# an H200, compile included).
[ "${FRESH:-0}" = 1 ] && schedule+=(--micro_batch_tokens=4096)
sets=$#
seeds=(${SEEDS:-})
if [ ${#seeds[@]} -gt 0 ]; then  # each set once per seed, set by set
    expanded=()
    for flags in "$@"; do
        for seed in "${seeds[@]}"; do expanded+=("$flags --seed=$seed"); done
    done
    set -- "${expanded[@]}"
fi
slots=()  # one GPU index per run slot: PER_GPU slots per GPU, the GPUs in turn
for ((k = 0; k < ${PER_GPU:-1}; k++)); do slots+=("${gpu_list[@]}"); done
[ "${PARALLEL:-0}" = 1 ] || slots=("${gpu_list[0]}")
running=()  # the pid in each slot, empty when free
free_slot() {  # sets slot to a free slot's index, waiting for a run to end when none is free
    while true; do
        for ((slot = 0; slot < ${#slots[@]}; slot++)); do
            if [ -z "${running[$slot]:-}" ]; then return; fi
            if ! kill -0 "${running[$slot]}" 2>/dev/null; then wait "${running[$slot]}"; running[$slot]=""; return; fi
        done
        sleep 2
    done
}
n=0
for flags in "$@"; do
    n=$((n + 1))
    split_flag_set "$flags"
    free_slot
    (
        start=$(date +%s)
        env CUDA_VISIBLE_DEVICES="${slots[$slot]}" "${settings[@]}" \
            bash -c 'timeout "${RUN_LIMIT_S:-580}" python3 "${TRAINER:-train_gpt.py}" "$@"' _ \
            "${schedule[@]}" --run_id="ml_$n" "${options[@]}" > "$OUT/ml_$n.txt" 2>&1
        echo "exit $? after $(( $(date +%s) - start ))s on GPU ${slots[$slot]}" >> "$OUT/ml_$n.txt"
    ) &
    running[$slot]=$!
done
wait
n=0
for flags in "$@"; do
    n=$((n + 1))
    echo "== [$n] $flags ($(tail -1 "$OUT/ml_$n.txt"))"
    grep -E "val_loss|^compile_time|step times|peak memory|error|Error" "$OUT/ml_$n.txt" | cut -c1-200
done
# One table of the validation losses, each run's difference to the first run's at the same step after it.
python3 - "$OUT" "$#" "$sets" <<'TABLE'
import re, sys
out, runs, sets = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
losses = [dict(re.findall(r"^step:(\d+)/\d+ val_loss:([\d.]+)", open(f"{out}/ml_{n}.txt").read(), re.M))
          for n in range(1, runs + 1)]
steps = sorted({int(s) for run in losses for s in run if int(s) > 0})
print("run | " + " | ".join(str(s) for s in steps))
for n, run in enumerate(losses, 1):
    cells = []
    for s in steps:
        v, first = run.get(str(s)), losses[0].get(str(s))
        cells.append("-" if v is None else v + ("" if n == 1 or first is None else f" ({float(v) - float(first):+.4f})"))
    print(f"[{n}] | " + " | ".join(cells))
# Runs that stopped before their last validation: the last step they logged and the first error line.
for n in range(1, runs + 1):
    text = open(f"{out}/ml_{n}.txt").read()
    if re.search(r"^step:(\d+)/\1 val_loss", text, re.M):
        continue
    last = re.findall(r"^step:(\d+)/\d+", text, re.M)
    error = re.search(r"^(?:error: .*|\S*Error: .*)$", text, re.M)
    print(f"[{n}] stopped after step {last[-1] if last else 0}: {error.group(0)[:150] if error else 'no error line'}")
if runs > sets:  # SEEDS: runs come set by set, one per seed; a mean needs every seed's loss at that step
    per_set = runs // sets
    means = [{s: sum(float(run[str(s)]) for run in group) / per_set for s in steps
              if all(str(s) in run for run in group)}
             for group in (losses[i * per_set:(i + 1) * per_set] for i in range(sets))]
    print(f"set (mean of {per_set} seeds) | " + " | ".join(str(s) for s in steps))
    for i, mean in enumerate(means):
        cells = ["-" if s not in mean else f"{mean[s]:.4f}" + ("" if i == 0 or s not in means[0]
                                                               else f" ({mean[s] - means[0][s]:+.4f})") for s in steps]
        print(f"set {i + 1} | " + " | ".join(cells))
TABLE
if [ "${PACK_CACHE:-0}" = 1 ]; then
    pack_inductor_cache
fi
