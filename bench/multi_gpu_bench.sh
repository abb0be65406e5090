#!/usr/bin/env bash
# One device call on a machine of several GPUs (repo root), results in $OUT:
#   OUT=/some/dir [NPROC=N] [FLAGS="..."] bash bench/multi_gpu_bench.sh [bench|record|diloco]
# bench   bench/bench_step.py at world size N (NPROC, default every GPU) and at world size 1, then the scaling per
#         stage: tokens/s per GPU at N over that at 1 (synchronous data parallelism runs at its slowest GPU's pace,
#         so the one-GPU row's own GPU matters: on two 2xH200 the same code scaled 97.8% or 94.5% by which GPU ran
#         it); the two-GPU NCCL tests (tests/gpu/test_cuda_ranks.py) first
# record  the full default run at world size N on the bench stream, its log in $OUT
# diloco  data parallelism on 2 GPUs against streaming DiLoCo with 2 one-GPU replicas at equal tokens on bench2
#         (micro-batches of 4,096 tokens, 300 steps: no token repeats), a lighthouse on this machine; torchft from
#         a carried .whl/ (pip download torchft==0.2.0 -d .whl --python-version 3.12 --only-binary=:all:
#         --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64)
# FLAGS adds train_gpt.py flags to every run. PACK_CACHE=1 packs the inductor cache under $OUT/cache/ at the end:
# carried back as .cache/ it spares the next machine most of a cold compile (a cache written on H100s found no
# graph on an H200).
set -uo pipefail
what=${1:-bench}
source bench/common.sh
restore_inductor_cache
[ "${PACK_CACHE:-0}" = 1 ] && trap pack_inductor_cache EXIT
nproc=${NPROC:-$(nvidia-smi -L | grep -c "^GPU")}
read -ra flags <<< "${FLAGS:-}"
data=(--train_files="$BENCH2/docs_train_*.bin" --val_files="$BENCH2/docs_val_000000.bin" --val_tokens=2097152)

case $what in
bench)
    timeout 600 python3 -m pytest -q tests/gpu/test_cuda_ranks.py 2>&1 | tail -3
    for world in "$nproc" 1; do
        timeout "${BENCH_LIMIT_S:-300}" torchrun --nproc_per_node="$world" bench/bench_step.py --bench_steps=8 \
            "${data[0]}" "${flags[@]}" > "$OUT/bench_x$world.txt" 2>&1
        echo "== bench_step, $world GPU(s) (exit $?)"
        grep -E "^compile_time|^ +[0-9]+ +[0-9]+ +\(|^ {31}|^graphs" "$OUT/bench_x$world.txt"
    done
    python3 - "$OUT/bench_x$nproc.txt" "$OUT/bench_x1.txt" <<'SCALING'
import re, sys
# a stage line: stage, micro-batches per rank, windows, mean step ms, max/med, tokens/s, ...
row = re.compile(r"^\s+(\d+)\s+(\d+)\s+\(\d+, \d+\)\s+[\d.]+\s+[\d.]+\s+([\d,]+)", re.M)
world = int(re.search(r"world size (\d+)", open(sys.argv[1]).read()).group(1))
many, one = ({int(s): float(t.replace(",", "")) for s, _, t in row.findall(open(p).read())} for p in sys.argv[1:])
cells = [f"stage {s}: {100 * many[s] / (world * one[s]):.1f}%" for s in sorted(many) if s in one]
print(f"scaling, tokens/s per GPU at {world} GPUs over 1 GPU: " + ", ".join(cells or ["no stage lines to compare"]))
SCALING
    ;;
record)
    start=$SECONDS
    timeout 590 torchrun --nproc_per_node="$nproc" train_gpt.py "${data[@]}" --val_loss_every=250 \
        --run_id="default_x$nproc" "${flags[@]}" \
        > "$OUT/default_x$nproc.stdout" 2>&1
    echo "== default run, $nproc GPUs: exit $? after $((SECONDS - start))s"
    grep -E "^compile_time|val_loss|step times|peak memory|^final" "$OUT/default_x$nproc.stdout" | cut -c1-220
    cp "logs/default_x$nproc.txt" "$OUT/" 2>/dev/null
    ;;
diloco)
    [ -d .whl ] && python3 -m pip install -q --no-index --find-links .whl torchft 2>&1 | tail -2
    short=(--micro_batch_tokens=4096 --val_loss_every=0 --num_iterations=300 --extension_steps=0)
    timeout 300 torchrun --nproc_per_node=2 --master_port=29601 train_gpt.py "${data[@]}" "${short[@]}" \
        --stages="16 1 128:384 896 1,0.5,0.25>0; 32 1.52 384:896 2048 1,0.5>0; 48 1.73 640:1408 2048 1; 48 0.15 768:1664 2048 1" \
        --adam_period=1 --run_id=dp2 "${flags[@]}" > "$OUT/dp2.stdout" 2>&1
    echo "== data parallelism, 2 GPUs, a replica's batch doubled (exit $?)"
    grep -E "^compile_time|val_loss|step times|^final" "$OUT/dp2.stdout"
    python3 -c "import torchft" 2>/dev/null || { echo "== DiLoCo skipped: torchft does not import (carry .whl/)"; exit 0; }
    python3 -c "
import time
from torchft.coordination import LighthouseServer
print(LighthouseServer(bind='[::]:29510', min_replicas=2).address(), flush=True)
time.sleep(600)" > /tmp/lighthouse.txt 2>&1 &
    lighthouse=$!
    for _ in $(seq 60); do [ -s /tmp/lighthouse.txt ] && break; sleep 1; done
    export TORCHFT_LIGHTHOUSE=$(head -1 /tmp/lighthouse.txt)
    for r in 0 1; do
        CUDA_VISIBLE_DEVICES=$r timeout 300 torchrun --nproc_per_node=1 --master_port=$((29610 + r)) train_gpt.py \
            "${data[@]}" "${short[@]}" --diloco=1 --replica=$r --run_id=diloco$r "${flags[@]}" \
            > "$OUT/diloco$r.stdout" 2>&1 &
    done
    wait %2 %3
    for r in 0 1; do
        echo "== DiLoCo replica $r"
        grep -E "^compile_time|val_loss|step times|^final" "$OUT/diloco$r.stdout"
    done
    kill "$lighthouse" 2>/dev/null
    ;;
*) echo "usage: bash bench/multi_gpu_bench.sh [bench|record|diloco]" >&2; exit 2 ;;
esac
