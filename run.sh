#!/usr/bin/env bash
# A record attempt on this machine's GPUs:  ./run.sh [--name=value ...]
# Installs nothing. Checks the config and the data first, so mistakes show as one line, then runs
# torchrun with one process per GPU (8, 4, 2 or 1; NPROC=... to choose; with --device=cpu, NPROC processes, 1 unless set).
set -euo pipefail
cd "$(dirname "$0")"

if [ -n "${NPROC:-}" ]; then
    case "$NPROC" in
        1|2|4|8) ;;
        *) echo "error: NPROC=$NPROC: use 1, 2, 4 or 8 (every stage's batch splits evenly over those)" >&2; exit 1 ;;
    esac
fi
# torchrun's own default for several processes, one thread each, set here so that it prints no banner about it
quiet_threads() { if [ "$NPROC" -gt 1 ]; then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi; }
# torchrun with its stderr filtered: once a process says "error: ...", that line shows once, and what follows it on
# stderr (the other processes' tracebacks, torchrun's failure report) is left out; before it everything passes.
launch() {
    local status=0
    torchrun --standalone --nproc_per_node="$NPROC" train_gpt.py "$@" 2> >(awk '
        /^error: / { if (!seen[$0]++) { print; fflush() } failed = 1; next }
        !failed { print; fflush() }' >&2) || status=$?
    wait 2>/dev/null || true  # the filter has written everything
    exit "$status"
}
# --help and --check are answered by train_gpt.py alone: nothing launches.
case " $* " in
    *" --help "*|*" -h "*) exec python train_gpt.py --help ;;
    *" --check "*) exec python train_gpt.py "$@" ;;
esac
# One line on stderr for a bad flag, a missing GPU or bad data (a missing shard names the download command).
python train_gpt.py --check "$@" || exit 1
case " $* " in
    *" --device=cpu "*)
        echo "launching ${NPROC:=1} process(es) on the CPU"
        quiet_threads
        launch "$@" ;;
esac
gpus=$(python -c "import torch; print(torch.cuda.device_count())")  # --check has imported torch
if [ -n "${NPROC:-}" ] && [ "$NPROC" -gt "$gpus" ]; then
    echo "error: NPROC=$NPROC, but torch sees $gpus GPU(s)" >&2
    exit 1
fi
if [ -z "${NPROC:-}" ]; then
    NPROC=0
    for n in 8 4 2 1; do
        if [ "$gpus" -ge "$n" ]; then NPROC=$n; break; fi
    done
fi
if [ "$NPROC" -eq 0 ]; then
    echo "error: no CUDA GPU found; a CPU run: NPROC=2 ./run.sh --device=cpu --preset=tiny --train_files=..." >&2
    exit 1
fi
echo "launching on $NPROC of $gpus GPUs"
quiet_threads
launch "$@"
