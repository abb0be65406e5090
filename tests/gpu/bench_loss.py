"""Device benchmark of the loss head's cross-entropy (not part of the tests): the fused Triton kernels vs
the plain-torch expression compiled by inductor, forward + backward on [16384, 50304] bf16 logits, plus a
sweep of the kernels' block size and warp count (eager); then the whole head (matmul + loss, gradients for
the activations and the weight) in bf16 against --fp8_head's FP8 version; then the FP8 head's gradient kernel
alone, per output layout and tile, and candidates that make the [V, T] layout by transposing the [T, V] one
(not in the trainer). Prints median milliseconds (CUDA events, warm-up excluded) and effective memory
bandwidths.

    python tests/gpu/bench_loss.py            # the loss kernels
    python tests/gpu/bench_loss.py head       # bf16 head against the FP8 head
    python tests/gpu/bench_loss.py fp8_grad   # the FP8 gradient kernel's tiles
"""
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402
from bench_optimizers import kernel_median_ms as median_ms  # noqa: E402  (tests/gpu is the script's directory)


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


@triton.jit
def _transpose_kernel(In, Out, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Out [N, M] = In [M, N]^T, one tile per program: a candidate for the FP8 gradient's [V, T] layout,
    read from the [T, V] one (half the bytes of the logits) instead of recomputed from the logits."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    tile = tl.load(In + rows[:, None].to(tl.int64) * N + cols[None, :], mask=inside)
    tl.store(Out + cols[:, None].to(tl.int64) * M + rows[None, :], tl.trans(tile), mask=tl.trans(inside))


def transpose(x: torch.Tensor, out: torch.Tensor, block_m: int, block_n: int, warps: int = 4) -> torch.Tensor:
    M, N = x.shape
    _transpose_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](x, out, M, N, BLOCK_M=block_m,
                                                                        BLOCK_N=block_n, num_warps=warps)
    return out


def fp8_grad():
    rows, vocab, cap = 16384, 50304, 30.0
    logits = (torch.randn(rows, vocab, device="cuda") * 4).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    grad_loss = torch.full((rows,), 1.0 / rows, device="cuda")
    _, lse = tg._softcapped_ce_rows(logits, targets, cap)
    grad_scale = grad_loss.abs().amax() / tg.GRAD_E5M2_MAX
    copy = torch.empty_like(logits)
    ms = median_ms(lambda: copy.copy_(logits))
    print(f"yardstick, a copy of the bf16 logits: {ms:.3f} ms ({4 * logits.numel() / ms / 1e6:.0f} GB/s)")
    grad = torch.empty_like(logits)
    ms = median_ms(lambda: tg._softcapped_ce_backward_kernel[(rows,)](
        logits, targets, lse, grad_loss, grad, vocab, logits.stride(0), grad.stride(0), cap, BLOCK=tg.CE_BLOCK,
        num_warps=tg.CE_WARPS))
    print(f"yardstick, the bf16 gradient kernel: {ms:.3f} ms ({4 * logits.numel() / ms / 1e6:.0f} GB/s)")
    for transposed in (False, True):
        out = torch.empty(*((vocab, rows) if transposed else (rows, vocab)), device="cuda", dtype=torch.float8_e5m2)
        for block_t, block_v in ((128, 64), (64, 128), (64, 64), (128, 128)):
            ms = median_ms(lambda: tg._softcapped_ce_backward_fp8_kernel[
                (triton.cdiv(rows, block_t), triton.cdiv(vocab, block_v))](
                logits, targets, lse, grad_loss, grad_scale, out, rows, vocab, logits.stride(0), cap,
                TRANSPOSED=transposed, BLOCK_T=block_t, BLOCK_V=block_v, num_warps=4))
            chosen = " (the trainer's)" if tg.CE_FP8_TILES[transposed] == (block_t, block_v) else ""
            print(f"fp8 gradient {'[V, T]' if transposed else '[T, V]'} tile {block_t}x{block_v}: {ms:.3f} ms "
                  f"({3 * logits.numel() / ms / 1e6:.0f} GB/s){chosen}")
    # Candidate: the [V, T] layout as a transpose of the [T, V] output (each must hold the same bits).
    grads = {}
    for transposed in (False, True):
        block_t, block_v = tg.CE_FP8_TILES[transposed]
        grads[transposed] = torch.empty(*((vocab, rows) if transposed else (rows, vocab)), device="cuda",
                                        dtype=torch.float8_e5m2)
        tg._softcapped_ce_backward_fp8_kernel[(triton.cdiv(rows, block_t), triton.cdiv(vocab, block_v))](
            logits, targets, lse, grad_loss, grad_scale, grads[transposed], rows, vocab, logits.stride(0), cap,
            TRANSPOSED=transposed, BLOCK_T=block_t, BLOCK_V=block_v, num_warps=4)
    out = torch.empty_like(grads[True])
    as_bytes = lambda t: t.view(torch.uint8)  # noqa: E731  (fp8 has no equality kernel everywhere)
    candidates = [("torch copy_ of the transposed view", lambda: out.copy_(grads[False].t()))]
    candidates += [(f"Triton tile {m}x{n}, {w} warps", functools.partial(transpose, grads[False], out, m, n, w))
                   for m, n, w in ((64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (32, 128, 4))]
    for name, run in candidates:
        out.zero_()
        run()
        same = torch.equal(as_bytes(out), as_bytes(grads[True]))
        ms = median_ms(run)
        print(f"candidate [V, T] from [T, V], {name}: {ms:.3f} ms ({2 * grads[False].numel() / ms / 1e6:.0f} GB/s), "
              f"{'same bits' if same else 'DIFFERENT bits'}")


if __name__ == "__main__":
    {"head": head, "fp8_grad": fp8_grad}.get(sys.argv[1] if sys.argv[1:] else "", main)()
