"""Device benchmark of the loss head's cross-entropy (not part of the tests): the fused Triton kernels vs
the plain-torch expression compiled by inductor, forward + backward on [16384, 50304] bf16 logits, plus a
sweep of the kernels' block size and warp count (eager). Prints median milliseconds (CUDA events, warm-up excluded)
and the effective memory bandwidth of the fused version (it reads the logits twice and writes their
gradient once).

    python tests/gpu/bench_loss.py
"""
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402
from bench_optimizers import median_ms as _median_ms  # noqa: E402  (tests/gpu is the script's directory)

median_ms = functools.partial(_median_ms, repeats=30, warmup=5)


def main():
    rows, vocab, cap = 16384, 50304, 30.0
    logits = (torch.randn(rows, vocab, device="cuda") * 4).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device="cuda")

    def step(use_triton, compiled=True):
        torch._dynamo.reset()
        loss_fn = lambda x, y: tg.softcapped_cross_entropy(x, y, cap, use_triton)  # noqa: E731
        if compiled:
            loss_fn = torch.compile(loss_fn, fullgraph=True)

        def run():
            logits.grad = None
            loss_fn(logits, targets).backward()
        return run

    plain = median_ms(step(False))
    print(f"plain torch, compiled: {plain:.3f} ms (forward + backward)")
    print(f"fused, compiled (default block): {median_ms(step(True)):.3f} ms")
    gigabytes = 3 * logits.numel() * logits.element_size() / 1e9
    for block in (512, 1024, 2048, 4096):
        for warps in (4, 8, 16):
            tg.CE_BLOCK, tg.CE_WARPS = block, warps
            fused = median_ms(step(True, compiled=False))
            print(f"fused BLOCK={block:5d} warps={warps:2d}: {fused:.3f} ms ({gigabytes / fused * 1e3:.0f} GB/s, "
                  f"{plain / fused:.2f}x)")


if __name__ == "__main__":
    main()
