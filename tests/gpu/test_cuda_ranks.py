"""Two ranks on two GPUs over NCCL. Skipped with fewer than two CUDA GPUs (bench/multi_gpu_bench.sh runs it)."""
import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import train_gpt as tg
from helpers import TINY, free_port

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def _train_on_gpu(rank, world_size, port, cfg, results):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", rank))
    received = []
    original = tg.all_gather_single

    def noting(output, *args, **kwargs):
        received.append((str(output.dtype), output.numel()))
        return original(output, *args, **kwargs)
    tg.all_gather_single = noting
    try:
        comm = tg.Comm(rank, world_size, rank)
        result = tg.train(cfg, comm, tg.RunLog(cfg, comm))
        results.put((rank, (result.train_losses, set(received))))
    finally:
        dist.destroy_process_group()


def train_on_two_gpus(cfg):
    """Rank 0's training losses and the (dtype, size) of what its all-gathers received."""
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_train_on_gpu, args=(r, 2, port, cfg, results)) for r in range(2)]
    for p in procs:
        p.start()
    by_rank = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    return by_rank[0]


def six_steps_config(tiny_data, tmp_path, *flags: str):
    """The tiny model on CUDA for six steps of 128-token micro-batches, no validation, with these flags."""
    train, val = tiny_data
    cfg, _ = tg.parse_cli(["--device=cuda", *TINY, f"--train_files={train}", f"--val_files={val}",
                           "--micro_batch_tokens=128", "--num_iterations=6", "--val_loss_every=0",
                           f"--log_dir={tmp_path}", *flags])
    return cfg


def test_cuda_graphs_on_two_ranks_train_as_without(tiny_data, tmp_path):
    """--cuda_graphs=1 on two ranks replays the compiled forward and backward as CUDA graphs, which at
    one micro-batch per forward (8 GPUs' size, where auto takes them) cut the host's launches that set the step
    (docs/performance.md): the same losses as the same graphs launched kernel by kernel, up to the order of the
    row-gradient kernel's atomic adds (rtol 1e-5, as above). An input that a graph kept from its recording instead of
    reading anew would show. Flex: at this tiny size FA3 between partitioned graphs, which trained wrong at full
    size, passed; FA3 under graphs is checked by the training losses of full-size runs."""
    cfg = six_steps_config(tiny_data, tmp_path, "--compile=1", "--attn_backend=flex", "--adam_period=1",
                           "--cuda_graphs=0", "--run_id=default")
    plain_losses, _ = train_on_two_gpus(cfg)
    graph_losses, _ = train_on_two_gpus(dataclasses.replace(cfg, cuda_graphs="1", run_id="graphs"))
    assert len(graph_losses) == cfg.num_iterations and graph_losses[-1] < graph_losses[0]
    np.testing.assert_allclose(graph_losses, plain_losses, rtol=1e-5)


def test_muon_parts_as_cuda_graphs_on_two_ranks_train_as_without(tiny_data, tmp_path):
    """Muon's CUDA graphs (auto on two ranks): its compute between its NCCL collectives and its weight update replay as CUDA
    graphs, the collectives launched around them; the same losses as the same steps launched kernel by kernel, up
    to the order of the row-gradient kernel's atomic adds (rtol 1e-5, as above)."""
    cfg = six_steps_config(tiny_data, tmp_path, "--compile=0", "--run_id=eager", "--cuda_graphs=0")
    eager_losses, _ = train_on_two_gpus(cfg)
    graph_losses, _ = train_on_two_gpus(dataclasses.replace(cfg, cuda_graphs="auto", run_id="muon_graphs"))
    assert len(graph_losses) == cfg.num_iterations and graph_losses[-1] < graph_losses[0]
    np.testing.assert_allclose(graph_losses, eager_losses, rtol=1e-5)
