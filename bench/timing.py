"""The benchmarks' one timing helper: median milliseconds of a function's calls, each timed by CUDA events.

    from timing import median_ms, kernel_median_ms   # the scripts in bench/ run with bench/ on sys.path

Warm-up calls run first and are not timed; each timed call sits between two CUDA events and is synchronized before
the next, so a repeat is the GPU's time for one call.
"""
import functools
import statistics

import torch


def median_ms(fn, repeats=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# The single-kernel benchmarks (bench_ce_fp8, bench_flex, bench_loss, bench_mlp, bench_rows) take more samples
# of their shorter kernels.
kernel_median_ms = functools.partial(median_ms, repeats=30, warmup=5)
