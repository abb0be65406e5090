"""Device benchmark of the MLP (rms_norm -> fc -> ReLU^2 -> proj, plus the residual) forward + backward on
one micro-batch, compiled in each torch.compile mode given (default: default and max-autotune-no-cudagraphs,
where inductor may pick Triton GEMM templates with the ReLU^2 fused into their epilogue), then with a candidate
not in the trainer yet: fused_relu2_mlp, whose fc matmul squares in its epilogue and whose backward multiplies
by the ReLU^2 derivative in the epilogue of the matmul that makes it (the speedrun fused its MLP the same way
in 2025). Prints the compile time and median ms per variant; not part of the tests.

    python tests/gpu/bench_mlp.py [MODE ...]
1xH100 (2026-11-23): default 1.321 ms, max-autotune-no-cudagraphs 1.295 ms (44 s more cold compile). The
candidate does not pay: 1.486 ms against 1.087 ms for default in the same call (its two Triton matmuls are
slower than cuBLAS by more than the elementwise passes they remove), relative difference 5.8e-3 in bf16; in
Triton's interpreter, in float32 (the interpreter's bf16 tl.dot is wrong), it matches a float64 reference to
2e-7 in the output and all three gradients.
"""
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402
from bench_optimizers import kernel_median_ms as median_ms  # noqa: E402


@triton.autotune(
    configs=[triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8), num_warps=w, num_stages=st)
             for m, n, k, w, st in ((128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                                    (256, 128, 64, 8, 3), (64, 256, 64, 4, 4))],
    key=["M", "N", "K", "GRAD"])
@triton.jit
def _matmul_relu2_kernel(X, W, A, Out, M, N, K, GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """X [M, K] @ W[N, K]^T, both contiguous along K, then an epilogue: relu(.)^2 (GRAD=False), or, with GRAD,
    the gradient of relu(h)^2 given its value A = relu(h)^2: . * 2 sqrt(A). Programs walk GROUP_M row blocks
    per column block, so the tiles running at once share their operands in L2."""
    pid = tl.program_id(0)
    blocks_m, blocks_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * blocks_n)) * GROUP_M
    group_m = min(blocks_m - first_m, GROUP_M)
    block_m = first_m + (pid % (GROUP_M * blocks_n)) % group_m
    block_n = (pid % (GROUP_M * blocks_n)) // group_m
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        x = tl.load(X + rows[:, None].to(tl.int64) * K + (k0 + ks)[None, :], mask=(rows[:, None] < M) & k_ok[None, :],
                    other=0.0)
        w = tl.load(W + cols[:, None].to(tl.int64) * K + (k0 + ks)[None, :], mask=(cols[:, None] < N) & k_ok[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    if GRAD:
        a = tl.load(A + offsets, mask=inside, other=0.0).to(tl.float32)
        out = acc * 2.0 * tl.sqrt(a)
    else:
        out = tl.maximum(acc, 0.0)
        out = out * out
    tl.store(Out + offsets, out.to(Out.dtype.element_ty), mask=inside)


def _matmul_relu2(x, w, a=None):
    M, K = x.shape
    N = w.shape[0]
    out = x.new_empty(M, N)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _matmul_relu2_kernel[grid](x, w, a if a is not None else out, out, M, N, K, GRAD=a is not None)
    return out


class _FusedReLU2MLP(torch.autograd.Function):
    """relu(x @ fc_w^T)^2 @ proj_w keeping only the activation a = relu(h)^2 for the backward (relu(h) is
    sqrt(a)); x, fc_w [hidden, dim], proj_w [hidden, dim] in the compute dtype, contiguous."""

    @staticmethod
    def forward(ctx, x, fc_w, proj_w):
        a = _matmul_relu2(x, fc_w)
        ctx.save_for_backward(x, fc_w, proj_w, a)
        return a @ proj_w

    @staticmethod
    def backward(ctx, grad_y):
        x, fc_w, proj_w, a = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_h = _matmul_relu2(grad_y, proj_w, a)  # grad_y @ proj_w^T, then the epilogue
        return grad_h @ fc_w, grad_h.t() @ x, a.t() @ grad_y


def fused_relu2_mlp(x, fc_w, proj_w):
    return _FusedReLU2MLP.apply(x, fc_w.to(x.dtype), proj_w.to(x.dtype))


def main():
    modes = sys.argv[1:] or ["default", "max-autotune-no-cudagraphs"]
    cfg = tg.Config()
    T, dim = cfg.micro_batch_tokens, cfg.model_dim
    torch.manual_seed(0)
    mlp = tg.MLP(dim, cfg.mlp_ratio * dim).cuda()
    with torch.no_grad():
        for w in (mlp.fc_w, mlp.proj_w):
            w.uniform_(-0.02, 0.02)
    x = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)

    def block(x):
        return x + mlp(tg.rms_norm(x))

    def fused_block(x):
        return x + fused_relu2_mlp(tg.rms_norm(x), mlp.fc_w, mlp.proj_w)

    flops = 3 * 2 * 2 * T * dim * cfg.mlp_ratio * dim  # two matmuls, forward + two backward each
    reference = None
    for name, fn, mode in [(mode, block, mode) for mode in modes] + [("candidate fused_relu2_mlp", fused_block, "default")]:
        torch._dynamo.reset()
        compiled = torch.compile(fn, dynamic=False, fullgraph=True, mode=None if mode == "default" else mode)

        def step():
            x.grad = mlp.fc_w.grad = mlp.proj_w.grad = None
            compiled(x).backward(grad_out)
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        grads = [x.grad.float(), mlp.fc_w.grad.float(), mlp.proj_w.grad.float()]
        reference = reference or grads
        diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, reference))
        ms = median_ms(step)
        print(f"{name:28s} compile {compile_s:6.1f} s  {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s  "
              f"rel. diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
