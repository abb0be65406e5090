"""Device benchmark of the optimizer step on the default model's parameters (not part of the tests).

    python bench/bench_optimizers.py                          # world size 1
    torchrun --nproc_per_node=2 bench/bench_optimizers.py     # with NCCL communication

Prints median milliseconds (CUDA events, warm-up excluded) for: Newton-Schulz via Triton vs plain torch
over all 32 matrices; the Adam parameters' step with DistAdam vs the all-reduce design it replaced
(all_reduce each gradient, then torch AdamW on every replica); the whole Muon step; and optimizer state
memory per rank.
"""
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402
from timing import median_ms  # noqa: E402


class AllReduceAdam:
    """The design DistAdam replaced: average every gradient with all_reduce, full AdamW state everywhere."""

    def __init__(self, groups, **hyper):
        self.params = [p for g in groups for p in g["params"]]
        self.inner = torch.optim.AdamW(groups, foreach=False, **hyper)

    def step(self):
        if dist.is_initialized():
            works = [dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, async_op=True) for p in self.params]
            for w in works:
                w.wait()
        self.inner.step()


def main():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    cfg = tg.Config()
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.bfloat16).cuda()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    results = {}

    matrices = model.matrix_params()
    attn = torch.stack([p.grad for p in matrices["attn"]]).view(-1, 768, 768)
    mlp = torch.stack([p.grad for p in matrices["mlp_in"] + matrices["mlp_out"]])
    for name, use_triton in (("ns_torch_ms", False), ("ns_triton_ms", True)):
        results[name] = median_ms(lambda: (tg.orthogonalize(attn, use_triton), tg.orthogonalize(mlp, use_triton)))

    hyper = dict(lr=cfg.adam_lr, betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=cfg.adam_weight_decay)
    adam_groups = lambda: [dict(params=[model.embed.weight] + [v.weight for v in model.value_embeds]),
                           dict(params=[model.lm_head.weight]),
                           dict(params=[model.skip_gate]  # the blocks' scalars, where the model has them
                                       + [p for b in model.blocks for p in (b.value_scales, b.lambdas) if p is not None])]
    for name, opt in (("adam_allreduce_step_ms", AllReduceAdam(adam_groups(), **hyper)),
                      ("dist_adam_step_ms", tg.DistAdam(adam_groups(), **hyper))):
        results[name] = median_ms(opt.step)
        state = opt.inner.state if isinstance(opt, AllReduceAdam) else opt.state
        results[name.replace("step_ms", "state_MiB")] = sum(
            t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t)) / 2**20

    muon = tg.Muon([dict(params=matrices["attn"], split=4), dict(params=matrices["mlp_in"] + matrices["mlp_out"])], lr=cfg.muon_lr,
                   momentum=cfg.muon_momentum, use_triton=True)
    results["muon_step_ms"] = median_ms(muon.step)
    if rank == 0:
        print(f"world_size {world} on {torch.cuda.get_device_name()}")
        for key, value in results.items():
            print(f"{key:28s} {value:10.3f}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
