#!/usr/bin/env bash
# One device call: GPU numerics tests, then a timed training run on the bench stream, with the inductor
# cache carried between calls. Usage (repo root, on the GPU machine):
#   OUT=/some/dir bash bench/device_run.sh RUN_ID TIMEOUT_S [train_gpt.py flags...]
# NPROC=N runs the training under torchrun on N GPUs (a record run: NPROC=2 SKIP_GPU_TESTS=1 ... RUN_ID 560).
# Expects .bench2/*.bin.xz (copies of ../shared/bench2) and, optionally, .cache/inductor.tar.xz.part*.
set -uo pipefail
run_id=$1; budget=$2; shift 2
OUT=${OUT:-/tmp/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache

source bench/inductor_cache.sh

python3 bench/unpack_bench.py
restore_inductor_cache
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

if [ "${SKIP_GPU_TESTS:-0}" != 1 ]; then
    timeout 300 python3 -m pytest -q tests/gpu ${GPU_TEST_ARGS:-} 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
fi

if [ "${BENCH:-0}" = 1 ]; then
    timeout 200 python3 bench/bench_optimizers.py 2>&1 | tail -12 | tee "$OUT/bench.txt"
fi

start=$(date +%s)
launcher=(python3)
[ "${NPROC:-1}" -gt 1 ] && launcher=(torchrun --nproc_per_node="$NPROC")
timeout "$budget" "${launcher[@]}" ${TRAINER:-train_gpt.py} --train_files='/tmp/bench2/docs_train_*.bin' \
    --val_files=/tmp/bench2/docs_val_000000.bin --val_tokens=2097152 --train_repeat=1 \
    --run_id="$run_id" "$@" > "$OUT/train_stdout.txt" 2>&1
echo "train exit code $? after $(( $(date +%s) - start ))s"
grep -v "train_time" "$OUT/train_stdout.txt" | tail -20
grep "train_time" "$OUT/train_stdout.txt" | awk 'NR % 25 == 0' | tail -20
cp "logs/$run_id.txt" "$OUT/" 2>/dev/null

pack_inductor_cache
