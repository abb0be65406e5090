"""One line per torchrun worker: its rank and the CPUs it may run on (bench/multi_gpu_bench.sh's "numa" bench
prints it to show what --numa-binding did)."""
import os

cpus = sorted(os.sched_getaffinity(0))
print(f"rank {os.environ.get('RANK', '?')}: {len(cpus)} CPUs, {cpus[0]}-{cpus[-1]}", flush=True)
