#!/usr/bin/env bash
# One device call on a machine of several GPUs (repo root), results in $OUT:
#   OUT=/some/dir [NPROC=N] [BENCHES="sparse dense world1"] bash bench/multi_gpu_bench.sh STEPS \
#       [all|bench|diloco|record]
# 1. bench/bench_step.py at world size N (NPROC, default every GPU of the machine) with sparse bigram comms on
#    (sparse), then off (dense), then at world size 1 on the same machine (world1); BENCHES picks which, and may add
#    "graphs" (world size N under CUDA graphs, which --compile_mode=auto leaves off there at more than one micro-batch
#    per forward: no faster on 2xH200, docs/performance.md), "split" (world size N in two graphs,
#    --compile_scope=split, whose backward overlaps the last layers' reduce-scatters), "split1" (the same at world
#    size 1, for the graph cut's own cost), "unmerged" (world size N with a collective per DistAdam bucket,
#    BENCH_ADAM_MERGE=0), "bf16" (world size N with --bf16_grad_comms),
#    "tables" (world size N with --bf16_table_gathers), "sparse_values" / "sparse_tables" (world size N with
#    --sparse_value_comms, without / with --bf16_table_gathers), "gathered" (world size N with --table_row_fetch=0),
#    "ranks" (tests/gpu/test_cuda_ranks.py: two GPUs over NCCL, bf16 table gathers checked against fp32 ones, tables
#    fetched by rows against gathered whole, CUDA graphs against none), "fa3" / "fa3_1" (FlashAttention-3 at
#    world size N / 1, carrying .fa3: bench/fa3_build.sh, or .fa3src: then FA3 is built in the background while
#    "ranks" runs, which should come first), "fa3_each" (fa3_1 on each of the N GPUs at once, every one reading the
#    same micro-batches and sending nothing: whether one GPU runs the same work slower than another, with its clocks)
#    and "fwd1" / "fwd1_graphs" (world size N at one micro-batch per forward,
#    the size each forward has at 8 GPUs, without / with CUDA graphs, which auto takes there; FLAGS picks the
#    attention, and FLAGS naming fa3 installs it from .fa3 too; under graphs FA3 is captured with the step: fa3_varlen),
#    "muon_eager" (world size N with --muon_graphs=0: Muon kernel by kernel, not as the CUDA graphs auto takes there),
#    "nccl_simple" (world size N with NCCL_PROTO=Simple, NCCL's bandwidth protocol alone: no faster than NCCL's own
#    choice on 4xH200, docs/performance.md), "nccl_channels" (world size N with NCCL_MIN_NCHANNELS=NCCL_CHANNELS, 32
#    unless set: more of NCCL's parallel rings, for the Adam steps, whose optimizer phase waits on the wire),
#    "nccl_alone" (bench/nccl_alone.py at world size N: DistAdam's collectives alone, with NCCL's defaults and with
#    32 channels and 16 MB buffers: the rate the wire gives without the step around it),
#    "same_data" (world size N with every rank reading rank 0's micro-batches: what the ranks' different documents
#    cost in waits; bench_step.py prints each rank's own forward + backward and host cost beside), "numa" (as "fa3",
#    each rank's process bound by torchrun --numa-binding=NUMA_MODE, exclusive unless set: each rank its own share of
#    the cores of its GPU's NUMA node, where "node" binds it to the whole node, which is every CPU on a one-node
#    host; whether the ranks' uneven host costs come from sharing CPUs; the GPUs' NUMA affinity and each rank's CPUs
#    first).
#    The benches read the bench stream (real document lengths and bigram rows); beside each, nvidia-smi samples every
#    GPU's utilisation, SM clock, power and temperature ($OUT/NAME.smi.csv), whose means while busy are printed;
# 2. DiLoCo against data parallelism at equal tokens on bench2, on data that does not repeat (micro-batches of
#    4,096 tokens; up to STEPS=300 read under the stream's 51.3M tokens): data parallelism on 2 GPUs with a replica's
#    batch doubled (16/32/48 micro-batches) and Adam on every step, as DiLoCo's inner Adam steps, then streaming
#    DiLoCo with 2 replicas of one GPU each (8/16/24 each; a lighthouse on this machine, torchft from .whl/) and the
#    default outer step: final validation loss of each, wall time, syncs, replica digests.
# "bench" runs step 1 only; "diloco" step 2 only (its DiLoCo runs are skipped when torchft does not import);
# "record" only the full default run at world size N on bench2 (validation every 250 steps; kernels untuned unless
# FLAGS names --tune_kernels; FA3 when .fa3 or .fa3src is carried), its log in $OUT.
# FLAGS="..." adds train_gpt.py flags to every bench and to the record run (e.g. FLAGS="--preset=record_2026_02").
# bench_step.py's own variables pass through to every bench, e.g. BENCH_PROFILE_STAGES="0 1" (a GPU profile of those
# stages too).
# Expects .bench2/*.bin.xz (copies of ../shared/bench2) and, for DiLoCo, .whl/ (torchft and its dependencies for
# py3.12: pip download torchft==0.2.0 -d .whl --python-version 3.12 --only-binary=:all:
#         --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64).
# PACK_CACHE=1 packs the inductor cache under $OUT/cache/ as the script ends: carried back as .cache/, it spares the
# next machine most of a cold compile (240-330 s at 4 GPUs, 2026-11-28). The carried paths share 64 MiB: the benches
# need one train shard of .bench2 and its validation shard, the record run all of them; bench/inductor_cache.sh packs
# a 4-GPU cache small enough. A cache written on H100s found no graph on an H200 machine (docs/performance.md).
set -uo pipefail
steps=$1; what=${2:-all}
OUT=${OUT:-/tmp/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind

python3 bench/unpack_bench.py
source bench/inductor_cache.sh
restore_inductor_cache  # .cache/inductor.tar.xz.part* when carried: kernels compiled by an earlier call
[ "${PACK_CACHE:-0}" = 1 ] && trap pack_inductor_cache EXIT
[ -d .whl ] && python3 -m pip install -q --no-index --find-links .whl torchft 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nproc=${NPROC:-$(nvidia-smi -L | grep -c "^GPU")}
read -ra flags <<< "${FLAGS:-}"
fa3_build_pid=
# the record run loads FA3 whenever it is carried, as --attn_backend=auto takes it where it imports
if [[ " ${BENCHES:-} " == *" fa3"* || "${FLAGS:-}" == *"=fa3"* || "$what" = record ]]; then
    if [ -d .fa3 ]; then
        source bench/fa3_build.sh site
    elif [ -d .fa3src ]; then  # no build carried: build it now, on half the cores, while the ranks test runs
        (MAX_JOBS=${MAX_JOBS:-$(( $(nproc) / 2 ))} OUT=$OUT bash bench/fa3_build.sh build > "$OUT/fa3_build.txt" 2>&1) &
        fa3_build_pid=$!
    fi
fi
fa3_ready() {  # before a run that may use FA3: the background build finished and importable (its parts in $OUT/fa3)
    [ -n "$fa3_build_pid" ] || return 0
    wait "$fa3_build_pid"
    echo "== FA3 built in the background: $(grep -E "^build exit|imports" "$OUT/fa3_build.txt" | tr '\n' ' ')"
    export PYTHONPATH="/tmp/fa3site${PYTHONPATH:+:$PYTHONPATH}"
    fa3_build_pid=
}

if [ "$what" = record ]; then  # the default configuration's whole schedule
    fa3_ready
    start=$SECONDS
    # With a compile cache file, as a record attempt would have. Its kernels stay untuned unless FLAGS names
    # --tune_kernels: with --tune_kernels=auto's tuning the warm-up alone ran past the 580 s limit below at 4 GPUs
    # (4xH200, 2026-11-27).
    [[ "${FLAGS:-}" == *--tune_kernels* ]] || flags+=(--tune_kernels=0)
    timeout 580 torchrun --nproc_per_node="$nproc" train_gpt.py --train_files='/tmp/bench2/docs_train_*.bin' \
        --val_files=/tmp/bench2/docs_val_000000.bin --val_tokens=2097152 --train_repeat=1 --val_loss_every=250 \
        --compile_cache=/tmp/record_compile_cache.bin \
        --run_id="default_x$nproc" "${flags[@]}" > "$OUT/default_x$nproc.stdout" 2>&1
    echo "== default run, $nproc GPUs: exit $? after $((SECONDS - start))s"
    grep -E "^(warm-up|compile_time)|val_loss|^(rank [0-9]+: )?(step times|slow step|peak memory)|train_time|graphs" \
        "$OUT/default_x$nproc.stdout" | cut -c1-220
    cp "logs/default_x$nproc.txt" "$OUT/" 2>/dev/null
    exit 0
fi

gpu_clocks() {  # gpu_clocks FILE: each GPU's mean SM clock, power and temperature over its busy samples
    awk -F', *' '$2 >= 95 {n[$1]++; c[$1] += $3; p[$1] += $4; t[$1] += $5}
        END {for (i in n) printf "GPU %s while busy (%d samples at >= 95%% utilisation): SM clock %.0f MHz, %.0f W, %.0f C\n",
                                 i, n[i], c[i] / n[i], p[i] / n[i], t[i] / n[i]}' "$1" | sort
}

# Every GPU's utilisation, SM clock, power and temperature five times a second into FILE, until killed (run it in the
# background: exec makes its pid nvidia-smi's): a rank whose GPU runs its share slower (ranks_alone) may be one held
# to a lower clock by its power cap or its heat.
sample_gpus() {  # sample_gpus FILE
    exec nvidia-smi --query-gpu=index,utilization.gpu,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits \
        -lms 200 > "$1" 2>/dev/null
}
bench_step=(bench/bench_step.py --bench_steps=8 --train_files='/tmp/bench2/docs_train_*.bin')  # and flags, then its own

bench() {  # bench NAME NPROC [flags...]
    local name=$1 nproc=$2; shift 2
    fa3_ready
    sample_gpus "$OUT/$name.smi.csv" &
    local sampler=$!
    # shellcheck disable=SC2086  # TORCHRUN_ARGS: torchrun's own options, word-split on purpose
    BENCH_SYNC_DEBUG=1 timeout "${BENCH_LIMIT_S:-240}" torchrun ${TORCHRUN_ARGS:-} --nproc_per_node="$nproc" \
        "${bench_step[@]}" "${flags[@]}" "$@" > "$OUT/$name.txt" 2>&1
    local status=$?
    kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
    echo "== $name (exit $status)"
    grep -E "^compile_time|^ +[0-9]+ +[0-9]+ +\(|^ +(host |alone,|Adam steps )|^graphs|^profile|^  rank [0-9]+: (NCCL|compute kernels)|^  rank [0-9]+'s Adam step|^    [0-9.]+ ms apart|launch order|optimizers alone|synchroniz" "$OUT/$name.txt" | grep -v "prototype"
    gpu_clocks "$OUT/$name.smi.csv"
}

each_gpu() {  # each_gpu NAME [flags...]: the one-GPU bench on every GPU at once, each its own process
    local name=$1 g pids=(); shift
    fa3_ready
    sample_gpus "$OUT/$name.smi.csv" &
    local sampler=$!
    for g in $(seq 0 $((nproc - 1))); do
        mkdir -p "/tmp/trace_gpu$g"  # each process its own profile traces: all four are rank 0
        BENCH_TRACE_DIR=/tmp/trace_gpu$g CUDA_VISIBLE_DEVICES=$g timeout "${BENCH_LIMIT_S:-240}" torchrun --nproc_per_node=1 \
            --master_port=$((29700 + g)) \
            "${bench_step[@]}" "${flags[@]}" "$@" > "$OUT/${name}_gpu$g.txt" 2>&1 &
        pids+=($!)
    done
    for g in "${!pids[@]}"; do
        wait "${pids[$g]}"
        echo "== $name: GPU $g alone (exit $?)"
        grep -E "^compile_time|^ +[0-9]+ +[0-9]+ +\(" "$OUT/${name}_gpu$g.txt"
    done
    kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
    gpu_clocks "$OUT/$name.smi.csv"
}
if [ "$what" = all ] || [ "$what" = bench ]; then
    for b in ${BENCHES:-sparse dense world1}; do
        case $b in
        sparse) bench bench_sparse "$nproc" ;;
        dense) bench bench_dense "$nproc" --sparse_bigram_comms=0 ;;
        graphs) bench bench_graphs "$nproc" --compile_mode=reduce-overhead ;;  # auto: graphs at 1 per forward only
        world1) bench bench_world1 1 ;;  # scaling efficiency: tokens/s at N GPUs over N times this
        split) bench bench_split "$nproc" --compile_scope=split ;;
        unmerged) BENCH_ADAM_MERGE=0 bench bench_unmerged "$nproc" ;;  # a collective per DistAdam bucket
        bf16) bench bench_bf16 "$nproc" --bf16_grad_comms=1 ;;  # gradients reduce-scattered in bf16
        tables) bench bench_tables "$nproc" --bf16_table_gathers=1 ;;  # value and bigram tables gathered in bf16
        sparse_values) bench bench_sparse_values "$nproc" --sparse_value_comms=1 ;;
        sparse_tables) bench bench_sparse_tables "$nproc" --sparse_value_comms=1 --bf16_table_gathers=1 ;;
        gathered) bench bench_gathered "$nproc" --table_row_fetch=0 ;;  # the tables gathered whole, not their rows
        ranks) timeout 600 python3 -m pytest -q tests/gpu/test_cuda_ranks.py > "$OUT/test_cuda_ranks.txt" 2>&1
               echo "== tests/gpu/test_cuda_ranks.py (exit $?)"; tail -3 "$OUT/test_cuda_ranks.txt" ;;
        split1) bench bench_split1 1 --compile_scope=split ;;
        fa3) bench bench_fa3 "$nproc" --attn_backend=fa3 --tune_kernels=0 ;;
        fa3_1) bench bench_fa3_1 1 --attn_backend=fa3 --tune_kernels=0 ;;
        fa3_each) each_gpu bench_fa3_each --attn_backend=fa3 --tune_kernels=0 ;;  # every GPU's own speed, same data
        fwd1) bench bench_fwd1 "$nproc" --forward_micro_batches=1 --compile_mode=default ;;  # as small as at 8 GPUs
        fwd1_graphs) bench bench_fwd1_graphs "$nproc" --forward_micro_batches=1 --compile_mode=reduce-overhead ;;
        muon_eager) bench bench_muon_eager "$nproc" --muon_graphs=0 ;;  # Muon without its CUDA graphs
        nccl_simple) NCCL_PROTO=Simple bench bench_nccl_simple "$nproc" ;;  # NCCL's bandwidth protocol only
        nccl_channels) NCCL_MIN_NCHANNELS=${NCCL_CHANNELS:-32} bench bench_nccl_channels "$nproc" ;;  # more rings
        nccl_alone) for settings in "" "NCCL_MIN_NCHANNELS=32 NCCL_BUFFSIZE=16777216"; do  # the wire alone
                        env $settings timeout 60 torchrun --nproc_per_node="$nproc" bench/nccl_alone.py 2>&1 | grep "^\["
                    done ;;
        same_data) BENCH_SAME_DATA=1 bench bench_same_data "$nproc" ;;  # every rank reads rank 0's micro-batches
        numa) binding="--numa-binding=${NUMA_MODE:-exclusive}"
              nvidia-smi topo -m | grep -E "^GPU[0-9]|Affinity" | cut -c1-160
              torchrun $binding --nproc_per_node="$nproc" --master_port=29660 bench/cpus_of_rank.py 2>&1 | sort
              TORCHRUN_ARGS=$binding bench bench_numa "$nproc" --attn_backend=fa3 --tune_kernels=0 ;;
        esac
    done
    # the scaling figures where a one-GPU row ran beside the N-GPU one (fa3 with fa3_1 or fa3_each): bench/scaling.py
    if [ -f "$OUT/bench_fa3.txt" ] && ls "$OUT" | grep -qE '^bench_fa3_(1|each_gpu[0-9]+)\.txt$'; then
        echo "== scaling"
        python3 bench/scaling.py "$OUT"
    fi
fi

[ "$what" = bench ] && exit 0
data=(--train_files='/tmp/bench2/docs_train_*.bin' --val_files=/tmp/bench2/docs_val_000000.bin --val_tokens=2097152
      --micro_batch_tokens=4096 --val_loss_every=0 --num_iterations="$steps" --extension_steps=0)
start=$SECONDS
timeout 300 torchrun --nproc_per_node=2 --master_port=29601 train_gpt.py "${data[@]}" --batch_schedule=16,32,48 \
    --adam_period=1 --run_id=dp2 > "$OUT/dp2.stdout" 2>&1
echo "== data parallelism, 2 GPUs, doubled batch: exit $? after $((SECONDS - start))s"
grep -E "^compile_time|val_loss|^(rank [0-9]+: )?(step times|slow step)|^final weights" "$OUT/dp2.stdout"
if ! python3 -c "import torchft" 2>/dev/null; then
    echo "== DiLoCo skipped: torchft does not import (carry .whl/ with its wheels)"
    exit 0
fi
python3 -c "
import time
from torchft.coordination import LighthouseServer
lighthouse = LighthouseServer(bind='[::]:29510', min_replicas=2)
print(lighthouse.address(), flush=True)
time.sleep(600)
" > /tmp/lighthouse.txt 2>&1 &
for _ in $(seq 60); do [ -s /tmp/lighthouse.txt ] && break; sleep 1; done  # importing torch takes a while
export TORCHFT_LIGHTHOUSE=$(head -1 /tmp/lighthouse.txt)
echo "lighthouse $TORCHFT_LIGHTHOUSE"
start=$SECONDS
for r in 0 1; do
    CUDA_VISIBLE_DEVICES=$r timeout 300 torchrun --nproc_per_node=1 --master_port=$((29610 + r)) train_gpt.py \
        "${data[@]}" --diloco=1 --replica=$r --run_id=diloco$r \
        > "$OUT/diloco$r.stdout" 2>&1 &
done
wait %2 %3
echo "== DiLoCo 2 replicas x 1 GPU: done after $((SECONDS - start))s"
for r in 0 1; do
    grep -E "^compile_time|val_loss|^diloco: [0-9]+ fragment" "$OUT/diloco$r.stdout"
    grep -cE "^diloco: step .* committed replicas 2" "$OUT/diloco$r.stdout"
done
diff <(grep "^diloco: step" "$OUT/diloco0.stdout" | cut -d" " -f3,7,12) \
     <(grep "^diloco: step" "$OUT/diloco1.stdout" | cut -d" " -f3,7,12) > /dev/null \
    && echo "replica digests equal at every sync" || echo "replica digests DIFFER"
cp logs/dp2.txt logs/diloco0.txt logs/diloco1.txt "$OUT/" 2>/dev/null
kill %1 2>/dev/null
