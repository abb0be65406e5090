"""An all-gather through the copy engines against NCCL's, at DistAdam's table sizes, on every GPU of the machine:

    torchrun --nproc_per_node=N bench/copy_engine_gather.py

Each table lives in torch's symmetric memory (every rank can read every other rank's buffer); between two barriers each
rank copies its peers' shards out of their buffers with copy_ (the copy engines: no SMs), one peer after another or all
on streams of their own side by side, and checks that every shard arrived. Per rank: the median of ten of each, and
NCCL's all_gather_into_tensor into the same buffer. On 4xH200 the copy engines gathered at 169-191 GB/s against NCCL's
230-300 (docs/performance.md), so DistAdam keeps NCCL.
"""
import warnings

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from nccl_alone import timed_ms  # this script's folder is the import path's first entry


def main():
    warnings.filterwarnings("ignore")  # enable_symm_mem_for_group is deprecated where torch no longer needs it
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    group_name = dist.group.WORLD.group_name
    symm_mem.enable_symm_mem_for_group(group_name)
    lines = []
    for numel, name in ((50304 * 768, "table"), (754560 * 192, "bigram")):
        shard = numel // world
        buf = symm_mem.empty(numel, dtype=torch.float32, device=torch.device("cuda", rank))
        handle = symm_mem.rendezvous(buf, group_name)
        peers = {p: handle.get_buffer(p, (numel,), torch.float32) for p in range(world) if p != rank}
        streams = {p: torch.cuda.Stream() for p in peers}

        def gather(side_by_side=True):
            current = torch.cuda.current_stream()
            handle.barrier(channel=0)  # every rank's own shard written
            for p, view in peers.items():
                stream = streams[p] if side_by_side else current
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    buf[p * shard:(p + 1) * shard].copy_(view[p * shard:(p + 1) * shard])
            for p in peers:
                current.wait_stream(streams[p])
            handle.barrier(channel=1)  # every rank done reading
        # each rank's own shard holds rank + 1, the rest zeros; gathered, shard p holds p + 1 everywhere
        buf.zero_()
        buf[rank * shard:(rank + 1) * shard].fill_(rank + 1)
        torch.cuda.synchronize()
        dist.barrier()
        gather()
        torch.cuda.synchronize()
        want = torch.arange(1, world + 1, device="cuda", dtype=torch.float32).repeat_interleave(shard)
        right = torch.equal(buf[: shard * world], want)
        sent = numel * 4 * (world - 1) / world
        side_by_side, one_by_one = timed_ms(lambda: gather(True), 10), timed_ms(lambda: gather(False), 10)
        own = buf[rank * shard:(rank + 1) * shard].clone()
        nccl = timed_ms(lambda: dist.all_gather_into_tensor(buf, own), 10)
        lines.append(f"{name}: copy engines side by side {side_by_side:.3f} ms {sent / side_by_side / 1e6:.0f} GB/s, "
                     f"one after another {one_by_one:.3f} ms {sent / one_by_one / 1e6:.0f} GB/s, "
                     f"NCCL {nccl:.3f} ms {sent / nccl / 1e6:.0f} GB/s, right {right}")
    everyone = [None] * world
    dist.all_gather_object(everyone, lines)
    if rank == 0:
        for r, rank_lines in enumerate(everyone):
            for line in rank_lines:
                print(f"rank {r}: {line}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
