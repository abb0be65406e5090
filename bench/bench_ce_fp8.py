"""Device benchmark (not part of the tests): the FP8 head's fused loss-and-gradient kernel at a packed forward's
65,536 rows, over launch shapes, against the loads and stores of two passes over each row around no arithmetic
(the memory floor); with the loss's and the gradient's error against float64 on two kinds of logits (Gaussian, and
model-like: most logits low, a few dozen candidates per row above them). Prints median milliseconds (CUDA events,
warm-up excluded), three interleaved rounds.

    python bench/bench_ce_fp8.py [ROWS]     # 65,536 by default; the trainer's packed forward has 131,072
"""
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402
from timing import kernel_median_ms as median_ms  # noqa: E402


@triton.jit
def _memory_floor_kernel(Logits, Targets, Loss, Grad, V, stride, BLOCK: tl.constexpr):
    """The loss kernel's memory traffic without its arithmetic: one pass reads the row and stores a sum as the
    loss, a second reads it again and writes the gradient's dtype."""
    row = tl.program_id(0).to(tl.int64)
    Logits += row * stride
    Grad += row * V
    target = tl.load(Targets + row)
    cols = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        inside = start + cols < V
        total += tl.load(Logits + start + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(Loss + row, tl.sum(total, axis=0) - tl.load(Logits + target).to(tl.float32))
    for start in range(0, V, BLOCK):
        inside = start + cols < V
        x = tl.load(Logits + start + cols, mask=inside, other=0.0).to(tl.float32)
        grad = x + tl.where(start + cols == target, 1.0, 0.0)
        tl.store(Grad + start + cols, grad.to(Grad.dtype.element_ty), mask=inside)


def memory_floor(logits, targets, losses, grad_q, block=8192, warps=32):
    rows, vocab = logits.shape
    _memory_floor_kernel[(rows,)](logits, targets, losses, grad_q, vocab, logits.stride(0), BLOCK=block,
                                  num_warps=warps)


def trainer(logits, targets, cap, losses, grad_q, block=None, warps=None):
    chosen = tg.CE_FP8_BLOCK, tg.CE_FP8_WARPS
    tg.CE_FP8_BLOCK, tg.CE_FP8_WARPS = block or chosen[0], warps or chosen[1]
    try:
        tg.softcapped_ce_fp8(logits, targets, (cap, 0.0, cap / 4), losses, grad_q)
    finally:
        tg.CE_FP8_BLOCK, tg.CE_FP8_WARPS = chosen


def float64_reference(logits, targets, cap):
    z = cap * torch.sigmoid(logits.double() * (4.0 / cap))
    p = torch.softmax(z, dim=1)
    loss = torch.logsumexp(z, dim=1) - z.gather(1, targets[:, None])[:, 0]
    p[torch.arange(len(targets)), targets] -= 1.0
    s = torch.sigmoid(logits.double() * (4.0 / cap))
    return loss, p * 4.0 * s * (1.0 - s)


def make_logits(kind, rows, vocab, gen):
    if kind == "randn*4":
        return torch.randn(rows, vocab, device="cuda", generator=gen).mul_(4).to(torch.bfloat16)
    # model-like: most logits low, a few dozen candidates per row well above them
    logits = torch.randn(rows, vocab, device="cuda", generator=gen).mul_(2).sub_(4)
    top = torch.randint(0, vocab, (rows, 32), device="cuda", generator=gen)
    logits.scatter_(1, top, torch.rand(rows, 32, device="cuda", generator=gen) * 14 + 2)
    return logits.to(torch.bfloat16)


def main():
    rows, vocab, cap = int(sys.argv[1]) if sys.argv[1:] else 65536, 50304, 30.0
    gen = torch.Generator(device="cuda").manual_seed(0)
    losses = torch.empty(rows, device="cuda")
    grad_q = torch.empty(rows, vocab, device="cuda", dtype=torch.float8_e5m2)
    check = 1024
    logits = None
    for kind in ("randn*4", "model-like"):
        del logits  # one set of logits at a time: 131,072 rows take 13 GB, and 26 GB in float32 on the way
        logits = make_logits(kind, rows, vocab, gen)
        targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
        if kind == "model-like":  # the target is usually among the candidates
            targets = logits.float().argmax(dim=1)
        ref_loss, ref_grad = float64_reference(logits[:check], targets[:check], cap)
        print(f"{kind}: mean float64 loss of {check} rows {ref_loss.mean().item():.6f}", flush=True)
        grad_q.zero_()
        trainer(logits, targets, cap, losses, grad_q)
        got = grad_q[:check].double() / tg.GRAD_E5M2_MAX
        grad_err = ((got - ref_grad).norm() / ref_grad.norm()).item()
        bias = (losses[:check].double() - ref_loss).mean().item()
        worst = (losses[:check].double() - ref_loss).abs().max().item()
        print(f"  the trainer's kernel: loss bias {bias:+.2e}, max {worst:.2e}; gradient error {grad_err:.4f}",
              flush=True)
    copy = torch.empty_like(logits)
    print(f"yardstick, a copy of the bf16 logits: {median_ms(lambda: copy.copy_(logits)):.3f} ms")
    runs = {"memory floor, two passes and no arithmetic (8192, 32)": lambda: memory_floor(logits, targets, losses,
                                                                                          grad_q)}
    for block, warps in ((4096, 8), (8192, 16), (8192, 32), (16384, 16), (16384, 32)):
        runs[f"trainer's kernel ({block}, {warps})"] = functools.partial(trainer, logits, targets, cap, losses,
                                                                        grad_q, block, warps)
    times = {name: [] for name in runs}
    for _ in range(3):  # interleaved rounds: the spread across rounds shows the noise
        for name, run in runs.items():
            times[name].append(median_ms(run))
    for name, ms in times.items():
        print(f"{name}: " + " / ".join(f"{m:.3f}" for m in ms) + " ms", flush=True)


if __name__ == "__main__":
    main()
