"""Device benchmark of the loss head's cross-entropy (not part of the tests): the fused Triton kernels vs
the plain-torch expression compiled by inductor, forward + backward on [16384, 50304] bf16 logits, plus a
sweep of the kernels' block size and warp count (eager); then the whole head (matmul + loss, gradients for
the activations and the weight) in bf16 against --fp8_head's FP8 version, with a sweep of its gradient kernel's
tile. Prints median milliseconds (CUDA events, warm-up excluded)
and the effective memory bandwidth of the fused version (it reads the logits twice and writes their
gradient once).

    python tests/gpu/bench_loss.py          # the loss kernels
    python tests/gpu/bench_loss.py head     # bf16 head against the FP8 head
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


def head():
    rows, dim, vocab, cap = 16384, 768, 50304, 30.0
    x = tg.rms_norm(torch.randn(rows, dim, device="cuda")).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, dim, device="cuda") * 0.05).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device="cuda")

    def bf16_head(x, w, y):
        return tg.softcapped_cross_entropy(x @ w.to(x.dtype).T, y, cap)

    def fp8_head(x, w, y):
        return tg.fp8_softcapped_head(x, w, y, cap)

    def step(fn, compiled=True):
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True) if compiled else fn

        def run():
            x.grad = weight.grad = None
            fn(x, weight, targets).backward()
        return run

    flops = 6 * rows * dim * vocab
    bf16 = median_ms(step(bf16_head))
    print(f"head bf16, compiled: {bf16:.3f} ms ({flops / bf16 / 1e9:.0f} TFLOP/s of matmul work)")
    fp8 = median_ms(step(fp8_head))
    print(f"head fp8, compiled: {fp8:.3f} ms ({flops / fp8 / 1e9:.0f} TFLOP/s, {bf16 / fp8:.2f}x)")
    for block_t, block_v, warps in ((128, 64, 4), (128, 128, 4), (128, 128, 8), (256, 64, 8), (64, 128, 4),
                                    (256, 32, 4)):
        tg.CE_FP8_BLOCK_T, tg.CE_FP8_BLOCK_V, tg.CE_FP8_WARPS = block_t, block_v, warps
        print(f"head fp8 eager, gradient tile {block_t}x{block_v} warps={warps}: {median_ms(step(fp8_head, False)):.3f} ms")


if __name__ == "__main__":
    head() if sys.argv[1:] == ["head"] else main()
