#!/usr/bin/env bash
# Cold and warm start of the full default config on the bench stream, one device call (repo root):
#   OUT=/some/dir bash bench/startup_bench.sh STEPS SCOPE [RUN_LIMIT_S]
# SCOPE: startup   -> cold run (empty inductor and Triton caches, no --compile_cache: the default config, its
#                     kernels untuned), then a cold run with --compile_cache=FILE (so --tune_kernels=auto tunes, and
#                     the file keeps the tuned configs), then a run from that file into empty caches: the three
#                     starts, and in the step-time lines of the first and third, untuned against tuned kernels;
#        cold      -> one cold run (empty caches, no --compile_cache): the default config's cold start alone;
#        versus    -> cold run with --compile_scope=regional, then one with whole: step_avg of both on one machine;
#        ab        -> cold run, then warm runs with plain-torch Newton-Schulz (--triton_kernels=0) and
#                     with Triton again: Muon's kernel A/B at equal length on one machine;
#        file      -> a cold run with --compile_cache=FILE (writing it), then a run from that file into empty
#                     caches: the start from the file alone, without the untuned cold run of 'startup'. The file
#                     makes --tune_kernels=auto tune: the write then takes about 7 minutes with FA3 on an H100;
#                     FLAGS="--tune_kernels=0 ..." gives the untuned write (about 2 minutes), as a plain cold start;
#        write     -> the first half of 'file' alone: a cold run writing the file ($CACHE), which stays there;
#        load      -> the second half alone: a run from that file into empty caches. With 'write' in one
#                     call and 'load' in the next on the same warm machine (within its idle release), each half
#                     gets a whole call's time: the tuned FA3 write alone takes about 8 minutes. The machine may be
#                     gone by the next call, and the file with it: 'file' in one call is the dependable measurement;
#        moved     -> 'file', then one more run from the file, of a copy of train_gpt.py in another folder
#                     (/tmp/moved): whether a start from the file depends on the folder the trainer runs in;
#        fileprofile -> 'file' with the run from the file under cProfile ($OUT/file_profile.txt): where a start
#                     from the file spends its time, imports and the model's build included;
#        profile   -> cold run under cProfile: where the compile time goes ($OUT/cold_profile.txt);
#        against   -> cold runs of train_gpt.py and of AGAINST=PATH (another version of it, e.g. from
#                     `git show REV:train_gpt.py`; default train_gpt.py itself), each into empty caches: both starts
#                     and step times in one call; AGAINST_FLAGS="..." adds flags to the second run alone (e.g.
#                     AGAINST_FLAGS="--compile_mode=default": CUDA graphs or not, at one cold start each);
#                     AGAINST_LIMIT seconds for the second (default RUN_LIMIT_S), whose cold start may be longer.
# Prints each run's compile_time / since_process_start / graphs / step_avg; logs land in $OUT. FLAGS="..." adds
# train_gpt.py flags to every run (e.g. FLAGS="--attn_backend=fa3" after `source bench/fa3_build.sh site`; once
# FA3 imports, --attn_backend=auto picks it, so name --attn_backend=flex to measure flex).
# LOADS=N: 'file', 'load' and 'startup' start N times from the file, each into empty caches (default 1): starts
# vary by several seconds from run to run. CACHE=PATH: that file (default /tmp/artifacts.bin); a file per backend
# lets a 'write' call for each, on one warm machine, precede one call that starts both cold and from their files.
# BYTECODE=1: Python keeps compiled bytecode (in /tmp/pycache) even where the environment says not to
# (PYTHONDONTWRITEBYTECODE, as on the device machine, whose torch has no .pyc files), and the installed packages are
# compiled to it first, as a pip install would have: no run compiles torch's sources.
# AUTOTUNE_PROBE=1: every run prints a line per autotune-cache lookup of a kernel that coordinate descent tunes
# (bench/autotune_probe), and the end of the call counts them by state, with the kernels that missed after a load;
# the first kernel that missed, as the write and the load compiled it, goes to $OUT/kernel_sources (for a 'load'
# after an earlier call's 'write': KEEP_CACHES=1). Each graph cache key is printed too, and each start from the file
# lists what its keys differ in from the write's (bench/autotune_probe/compare_keys.py).
set -uo pipefail
if [ "${AUTOTUNE_PROBE:-0}" = 1 ]; then export PYTHONPATH="$PWD/bench/autotune_probe${PYTHONPATH:+:$PYTHONPATH}"; fi
steps=$1; scope=$2; limit=${3:-450}; cache=${CACHE:-/tmp/artifacts.bin}
OUT=$(realpath -m "${OUT:-/tmp/device_out}"); mkdir -p "$OUT"  # absolute: the moved scope runs elsewhere
# Every scope's first run starts from empty caches, also on a machine an earlier call left warm: a 'cold' run after
# another scope found that scope's graphs in a shared cache folder. KEEP_CACHES=1 keeps an earlier call's folders
# (each run still empties its own), so 'load' after 'write' in an earlier call can compare their kernels (below).
[ "${KEEP_CACHES:-0}" = 1 ] || rm -rf /tmp/ind_* /tmp/triton_* /tmp/written_* /tmp/probe_keys
export PYTHONUNBUFFERED=1
if [ "${BYTECODE:-0}" = 1 ]; then
    unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pycache
    start=$SECONDS
    python3 -m compileall -q -j 0 "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        > /dev/null 2>&1
    echo "installed packages compiled to bytecode in $((SECONDS - start))s"
fi
python3 -c "import sys; print('Python bytecode cache:', 'off' if sys.dont_write_bytecode else sys.pycache_prefix or 'on')"

env | sort > "$OUT/environment.txt"  # what two calls' starts from one file might differ in
python3 bench/unpack_bench.py
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

run() {  # run NAME TRAINER INDUCTOR_DIR TRITON_DIR [flags...]
    local name=$1 trainer=$2; export TORCHINDUCTOR_CACHE_DIR=$3 TRITON_CACHE_DIR=$4; shift 4
    export AUTOTUNE_PROBE_KEYS=/tmp/probe_keys/$name; rm -rf "$AUTOTUNE_PROBE_KEYS"  # the probe's graph keys
    local start=$SECONDS
    # shellcheck disable=SC2086  # FLAGS is a list of flags
    timeout "$limit" python3 $trainer --train_files='/tmp/bench2/docs_train_*.bin' \
        --val_files=/tmp/bench2/docs_val_000000.bin --val_tokens=2097152 --train_repeat=1 --val_loss_every=0 \
        --num_iterations="$steps" --run_id="$name" ${FLAGS:-} "$@" > "$OUT/$name.stdout" 2>&1
    local rc=$?
    printf '%s: exit %s after %ss | ' "$name" "$rc" "$((SECONDS - start))"
    grep -hE "^compile_time|^compile scope|^compile cache|^warning|^error|peak memory" "$OUT/$name.stdout" | tr '\n' ' '
    grep -hE "^step times" "$OUT/$name.stdout" | cut -c1-80
    grep -E "^step:[0-9]+/[0-9]+ val_loss" "$OUT/$name.stdout" | tail -1 | grep . || echo "(no final line)"
}

write_cache() {  # write_cache NAME: a cold run writing $cache
    rm -rf "$cache" "/tmp/ind_$1" "/tmp/triton_$1" "/tmp/written_ind_$1" "/tmp/written_triton_$1"
    run "$1" train_gpt.py "/tmp/ind_$1" "/tmp/triton_$1" --compile_cache="$cache"
    ls -l "$cache"
    # Kernels that come from the file keep the paths the writing run compiled them to: a start from it must not find
    # the writer's cache folders there, as on another machine or after the cache is emptied. They move aside.
    local kind
    for kind in ind triton; do [ ! -d "/tmp/${kind}_$1" ] || mv "/tmp/${kind}_$1" "/tmp/written_${kind}_$1"; done
}

load_cache() {  # load_cache NAME [TRAINER]: LOADS runs from $cache, each into empty caches (TRAINER:
    # how they start, default train_gpt.py)
    local i
    for i in $(seq "${LOADS:-1}"); do
        rm -rf "/tmp/ind_$1" "/tmp/triton_$1"
        run "$1$([ "$i" = 1 ] || echo "$i")" "${2:-train_gpt.py}" "/tmp/ind_$1" "/tmp/triton_$1" \
            --compile_cache="$cache"
    done
}

write_then_load() {  # write_then_load WRITE_NAME LOAD_NAME [LOAD_TRAINER]: a cold run writing --compile_cache, then
    # LOADS from it
    write_cache "$1"
    load_cache "$2" "${3:-}"
}

print_profile() {  # print_profile PROF_FILE OUT_FILE: the 45 longest calls, by cumulative and by own time
    python3 -c "
import pstats, sys
for key in ('cumulative', 'tottime'):
    pstats.Stats('$1', stream=sys.stdout).sort_stats(key).print_stats(45)
" > "$2" 2>&1
}

case "$scope" in
startup)
    run cold train_gpt.py /tmp/ind_a /tmp/triton_a
    write_then_load tuned artifacts
    ;;
cold)
    run cold train_gpt.py /tmp/ind_a /tmp/triton_a
    ;;
versus)
    run regional train_gpt.py /tmp/ind_r /tmp/triton_r --compile_scope=regional
    run whole train_gpt.py /tmp/ind_w /tmp/triton_w --compile_scope=whole
    ;;
ab)
    run cold_ab train_gpt.py /tmp/ind_c /tmp/triton_c
    run torch_ns train_gpt.py /tmp/ind_c /tmp/triton_c --triton_kernels=0
    run triton train_gpt.py /tmp/ind_c /tmp/triton_c
    ;;
file)
    write_then_load write from_file
    ;;
write)
    write_cache write
    ;;
load)
    [ -f "$cache" ] || { echo "no $cache: run the 'write' scope first, on the same machine"; exit 2; }
    load_cache from_file
    ;;
moved)
    write_then_load write from_file
    rm -rf /tmp/moved && mkdir -p /tmp/moved && cp train_gpt.py /tmp/moved/
    (cd /tmp/moved && load_cache from_moved)
    ;;
fileprofile)
    write_then_load write from_file "-m cProfile -o /tmp/file.prof train_gpt.py"
    print_profile /tmp/file.prof "$OUT/file_profile.txt"
    ;;
profile)
    python3 -c "import os, torch._inductor.config as c; print('compile_threads', c.compile_threads, 'cpus', len(os.sched_getaffinity(0)))"
    run cold_prof "-m cProfile -o /tmp/cold.prof train_gpt.py" /tmp/ind_p /tmp/triton_p
    print_profile /tmp/cold.prof "$OUT/cold_profile.txt"
    ;;
against)
    run cold_this train_gpt.py /tmp/ind_t /tmp/triton_t
    # shellcheck disable=SC2086  # AGAINST_FLAGS is a list of flags
    limit=${AGAINST_LIMIT:-$limit} run cold_against "${AGAINST:-train_gpt.py}" /tmp/ind_o /tmp/triton_o \
        ${AGAINST_FLAGS:-}
    ;;
*) echo "unknown scope $scope"; exit 2 ;;
esac
if [ "${AUTOTUNE_PROBE:-0}" = 1 ]; then
    for f in "$OUT"/*.stdout; do
        echo "== autotune lookups in $(basename "$f" .stdout), by state:"
        grep "^autotune-probe " "$f" | sed -E 's/.* (state=[^ ]+ tuned=[^ ]+).*$/\1/' | sort | uniq -c
        echo "   coordinate descent: $(grep -c "^autotune-probe-tuning" "$f") kernels, $(grep "^autotune-probe-tuning" "$f" \
            | awk '{s += $NF} END {printf "%.1f s", s}')"
    done
    grep -H "^autotune-probe-keys" "$OUT"/*.stdout
    for dir in /tmp/probe_keys/from_*; do  # graph keys of each start from the file against the write's
        [ -d /tmp/probe_keys/write ] && [ -d "$dir" ] || continue
        echo "== graph cache keys of $(basename "$dir") against the write's:"
        python3 bench/autotune_probe/compare_keys.py /tmp/probe_keys/write "$dir"
    done
    grep -h "^autotune-probe .*state=miss" "$OUT"/from_*.stdout 2>/dev/null | cut -c1-260 | head -20
    grep -h "^autotune-probe-tuning" "$OUT"/from_*.stdout 2>/dev/null | cut -c1-400 | head -30
    # The first kernel whose tuned config was not found after a load: its source files as the writing run and the
    # load compiled them ($OUT/kernel_sources/write and /load), to diff where their source hashes differ.
    kernel=$(grep -h "^autotune-probe .*file=absent" "$OUT"/from_*.stdout 2>/dev/null | head -1 | cut -d' ' -f2)
    if [ -n "$kernel" ] && [ -d /tmp/written_ind_write ]; then
        for side in write:/tmp/written_ind_write load:/tmp/ind_from_file; do
            mkdir -p "$OUT/kernel_sources/${side%%:*}"
            grep -rl --include='*.py' "def $kernel(" "${side#*:}" | xargs -r cp -t "$OUT/kernel_sources/${side%%:*}"
        done
        echo "== $kernel, source files of the write: $(ls "$OUT/kernel_sources/write" | tr '\n' ' ')"
        echo "   and of the load: $(ls "$OUT/kernel_sources/load" | tr '\n' ' ')"
    fi
fi
tar -C logs -czf "$OUT/logs.tgz" . 2>/dev/null  # the runs' logs, one file back
