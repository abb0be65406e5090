"""Device benchmark of the loss head's cross-entropy (not part of the tests): the fused Triton kernels vs
the plain-torch expression compiled by inductor, forward + backward on [16384, 50304] bf16 logits, plus a
sweep of the kernels' block size and warp count (eager); then the whole head (matmul + loss, gradients for
the activations and the weight) in bf16 against --fp8_head's FP8 version; then ways to make the FP8 weight
gradient's [V, T] layout from its [T, V] output (the trainer's transpose_fp8 per tile, and torch's copy); then
the FP8 head's fused loss-and-gradient kernel. Prints median milliseconds (CUDA events, warm-up excluded) and
effective memory bandwidths.

    python bench/bench_loss.py            # the loss kernels
    python bench/bench_loss.py head       # bf16 head against the FP8 head
    python bench/bench_loss.py fp8_grad   # ways to make the FP8 gradient's [V, T] layout from [T, V]
    python bench/bench_loss.py packed     # at a packed forward's 65,536 rows: the FP8 head's fused loss and
                                              # gradient kernel, against the two kernels it replaced
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


def main():
    rows, vocab, cap = 16384, 50304, 30.0
    logits = (torch.randn(rows, vocab, device="cuda") * 4).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device="cuda")

    def step(use_triton, compiled=True):
        torch._dynamo.reset()
        loss_fn = lambda x, y: tg.softcapped_cross_entropy(x, y, (cap, 0.0, cap / 4), use_triton)  # noqa: E731
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
        return tg.softcapped_cross_entropy(x @ w.to(x.dtype).T, y, (cap, 0.0, cap / 4), True)

    def fp8_head(x, w, y):
        return tg.fp8_softcapped_head(x, w, y, (cap, 0.0, cap / 4), True)

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


def fp8_grad():
    rows, vocab = 16384, 50304
    grad_q = (torch.randn(rows, vocab, device="cuda") * 100).to(torch.float8_e5m2)
    # The weight gradient's [V, T] layout, made from [T, V]; each way must give torch's bits.
    as_bytes = lambda t: t.view(torch.uint8)  # noqa: E731  (fp8 has no equality kernel everywhere)
    reference = as_bytes(grad_q).t().contiguous()
    candidates = [("torch's contiguous() of the transposed view", lambda: grad_q.t().contiguous())]
    for m, n, w in ((64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (32, 128, 4)):
        chosen = " (the trainer's)" if (m, n, w) == (64, 128, 4) else ""
        candidates.append((f"transpose_fp8 tile {m}x{n}, {w} warps{chosen}",
                           functools.partial(tg.transpose_fp8, grad_q, m, n, w)))
    for name, run in candidates:
        same = torch.equal(as_bytes(run()), reference)
        ms = median_ms(run)
        print(f"[V, T] from [T, V], {name}: {ms:.3f} ms ({2 * grad_q.numel() / ms / 1e6:.0f} GB/s), "
              f"{'same bits' if same else 'DIFFERENT bits'}")


@triton.jit
def _two_kernel_gradient(Logits, Targets, Lse, GradLoss, GradScale, Out, T, V, stride, cap: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    """The FP8 head's gradient kernel before 2026-11-24, launched in the backward after the forward's loss kernel
    (_softcapped_ce_forward_kernel) had kept each row's logsumexp: the yardstick for the fused kernel."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok, col_ok = rows < T, cols < V
    inside = row_ok[:, None] & col_ok[None, :]
    s = tl.sigmoid(tl.load(Logits + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=inside,
                           other=0.0).to(tl.float32) * (4.0 / cap))
    lse = tl.load(Lse + rows, mask=row_ok, other=0.0)
    target = tl.load(Targets + rows, mask=row_ok, other=-1)
    grad = tl.load(GradLoss + rows, mask=row_ok, other=0.0) / tl.load(GradScale)
    d = tl.exp(cap * s - lse[:, None]) - tl.where(cols[None, :] == target[:, None], 1.0, 0.0)
    value = grad[:, None] * d * 4.0 * s * (1.0 - s)
    tl.store(Out + rows[:, None].to(tl.int64) * V + cols[None, :], value.to(tl.float8e5), mask=inside)


def packed():
    """At a packed forward's 65,536 rows: the fused loss-and-gradient kernel over a sweep of launch shapes, against
    the two kernels it replaced (loss forward, then the gradient from the kept logsumexp), with the error of the
    dequantised gradient against float64 on the first rows."""
    rows, vocab, cap = 65536, 50304, 30.0
    logits = (torch.randn(rows, vocab, device="cuda") * 4).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    copy = torch.empty_like(logits)
    ms = median_ms(lambda: copy.copy_(logits))
    print(f"{rows} rows. yardstick, a copy of the bf16 logits: {ms:.3f} ms ({4 * logits.numel() / ms / 1e6:.0f} GB/s)")
    check = 256
    z = cap * torch.sigmoid(logits[:check].double() * (4.0 / cap))
    p = torch.softmax(z, dim=1)
    p[torch.arange(check), targets[:check]] -= 1.0
    s = torch.sigmoid(logits[:check].double() * (4.0 / cap))
    exact = p * 4.0 * s * (1.0 - s)  # d loss_row / d logits
    exact_loss = torch.logsumexp(z, dim=1) - z.gather(1, targets[:check, None])[:, 0]
    grad_q = torch.empty(rows, vocab, device="cuda", dtype=torch.float8_e5m2)

    def report(name, ms, scale):
        got = grad_q[:check].double() * scale
        error = ((got - exact).norm() / exact.norm()).item()
        print(f"{name}: {ms:.3f} ms ({3 * logits.numel() / ms / 1e6:.0f} GB/s of one read and the fp8 write), "
              f"gradient error against float64 {error:.4f}", flush=True)

    forward_ms = median_ms(lambda: tg._softcapped_ce_rows(logits, targets, (cap, 0.0, cap / 4)))
    _, lse = tg._softcapped_ce_rows(logits, targets, (cap, 0.0, cap / 4))
    grad_loss = torch.full((rows,), 1.0 / rows, device="cuda")
    grad_scale = grad_loss.abs().amax() / tg.GRAD_E5M2_MAX
    gradient = lambda: _two_kernel_gradient[(triton.cdiv(rows, 128), triton.cdiv(vocab, 64))](  # noqa: E731
        logits, targets, lse, grad_loss, grad_scale, grad_q, rows, vocab, logits.stride(0), cap,
        BLOCK_T=128, BLOCK_V=64, num_warps=4)
    gradient_ms = median_ms(gradient)
    gradient()
    print(f"before: loss kernel {forward_ms:.3f} ms + gradient kernel {gradient_ms:.3f} ms = "
          f"{forward_ms + gradient_ms:.3f} ms")
    report("before, the gradient kernel's output", gradient_ms, grad_scale.double() * rows)
    losses = torch.empty(rows, device="cuda")
    chosen = (tg.CE_FP8_BLOCK, tg.CE_FP8_WARPS)
    for config in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16)):
        tg.CE_FP8_BLOCK, tg.CE_FP8_WARPS = config
        launch = lambda: tg.softcapped_ce_fp8(logits, targets, (cap, 0.0, cap / 4), losses, grad_q)  # noqa: E731
        ms = median_ms(launch)
        launch()
        loss_error = ((losses[:check].double() - exact_loss).abs().max() / exact_loss.abs().max()).item()
        report(f"fused kernel BLOCK, warps {config}{' (the trainer' + chr(39) + 's)' if config == chosen else ''}"
               f" (loss error {loss_error:.1e})", ms, 1.0 / tg.GRAD_E5M2_MAX)
    tg.CE_FP8_BLOCK, tg.CE_FP8_WARPS = chosen


if __name__ == "__main__":
    {"head": head, "fp8_grad": fp8_grad, "packed": packed}.get(sys.argv[1] if sys.argv[1:] else "", main)()
