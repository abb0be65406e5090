"""NCCL's reduce-scatter and all-gather alone, at the sizes DistAdam sends, on every GPU of the machine:

    torchrun --nproc_per_node=N bench/nccl_alone.py        (NCCL_* variables as set around it)

One line: the NCCL settings it ran under, then, in fp32 and in bf16, seven reduce-scatters and seven all-gathers of a
value table's size (50,304 x 768) one after the other, and an all-gather of the bigram table's size (754,560 x 192,
fp32): the median of ten, and the bytes each rank sends per millisecond (the bus rate NVLink carries). Against the
step bench's collectives (bench_step.py's collective_order) it tells whether the wire or the step sets their time.
"""
import os

import torch
import torch.distributed as dist

from timing import median_ms  # this script's folder is the import path's first entry


def timed_ms(run, repeats: int) -> float:
    """timing.median_ms of run() with every rank starting together: three untimed calls, a barrier, then the timed
    ones."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    dist.barrier()
    return median_ms(run, repeats=repeats, warmup=0)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    table = 50304 * 768
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        fulls = [torch.randn(table, device="cuda", dtype=dtype) for _ in range(7)]
        shards = [torch.empty(table // world, device="cuda", dtype=dtype) for _ in range(7)]
        sent = 7 * table * fulls[0].element_size() * (world - 1) / world
        scatter = timed_ms(lambda: [dist.reduce_scatter_tensor(s, f, op=dist.ReduceOp.AVG)
                                    for f, s in zip(fulls, shards)], 10)
        gather = timed_ms(lambda: [dist.all_gather_into_tensor(f, s) for f, s in zip(fulls, shards)], 10)
        results.append(f"{str(dtype).removeprefix('torch.')}: 7 RS {scatter:.3f} ms {sent / scatter / 1e6:.0f} GB/s, "
                       f"7 AG {gather:.3f} ms {sent / gather / 1e6:.0f} GB/s")
    bigram = torch.randn(754560 * 192, device="cuda")
    shard = torch.empty(bigram.numel() // world, device="cuda")
    gather = timed_ms(lambda: dist.all_gather_into_tensor(bigram, shard), 10)
    results.append(f"bigram AG fp32 {gather:.3f} ms {bigram.numel() * 4 * (world - 1) / world / gather / 1e6:.0f} GB/s")
    if rank == 0:
        settings = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                            if k.startswith("NCCL_") and k != "NCCL_NVLS_ENABLE")
        print(f"[{settings or 'defaults'}] " + "; ".join(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
