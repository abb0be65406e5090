"""Device benchmark of the MLP's fused Triton matmuls (train_gpt._FusedReLU2MLP) at a packed forward's size
(65,536 tokens), not part of the tests:

1. each launch shape of relu2_matmul (the fc matmul squaring in its epilogue; the backward's first matmul
   multiplying by the activation's derivative) over a sweep of tiles, against cuBLAS's matmul alone and
   cuBLAS plus inductor's elementwise kernel (what the trainer runs with --fused_mlp=0), with the error against
   float64 on the first 4,096 rows;
2. the MLP forward + backward, compiled, fused (each tile config given) against --fused_mlp=0, and the
   gradients' error against float64;
3. (fp8, asked for by name) the same forward + backward with the forward's two matmuls in FP8 (the speedrun's
   FP8 MLP idea: torch._scaled_mm, per-tensor scales of x and of relu(h)^2, per-matrix weight scales, the backward
   in bf16), with the activation's scale measured in the forward (dynamic) or given (delayed: the amax pass left
   out), against the bf16 variants: does it pay at our size? Its output against float64 of the same quantized
   operands (the matmuls themselves) and against the unquantized MLP (what FP8 costs in precision).

    python bench/bench_mlp.py [sweep|mlp|fp8]      # sweep and mlp by default
Prints median ms (CUDA events, warm-up excluded) and TFLOP/s.
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402
from timing import kernel_median_ms as median_ms  # noqa: E402

T, DIM, HIDDEN = 65536, 768, 3072
CHECK_ROWS = 4096
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT, warps, stages), as train_gpt.RELU2_MM_CONFIG. Tried and dropped
# (2026-11-24, 1xH100): loading the backward's post tile before the K loop (3-50 ms: the tile sat in registers
# through the loop), tl.range(warp_specialize=True) (no faster), 2 programs per SM with tiles small enough for two
# (slower); tiles over 232 KB of shared memory fail, and so do 256 x 256 tiles over 16 warps (ptxas
# finds 128 registers a thread too few for the wgmma), which would have read a third less from L2.
CONFIGS = [
    (128, 256, 64, 8, 2, 8, 3), (128, 256, 64, 16, 2, 8, 3), (256, 128, 64, 16, 2, 8, 3), (128, 128, 64, 8, 2, 4, 3),
    (128, 256, 128, 8, 2, 8, 2), (256, 128, 128, 8, 2, 8, 2), (128, 128, 128, 8, 2, 4, 3), (128, 256, 32, 8, 2, 8, 5),
    (128, 256, 32, 8, 2, 8, 6), (256, 128, 32, 8, 2, 8, 5),
]


def relative_error(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def sweep():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, DIM, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(HIDDEN, DIM, device="cuda", generator=g) * DIM ** -0.5).to(torch.bfloat16)
    dy = torch.randn(T, DIM, device="cuda", generator=g).to(torch.bfloat16)
    flops = 2 * T * DIM * HIDDEN
    ref_h = x[:CHECK_ROWS].double() @ w.double().t()
    ref_post = F.relu(ref_h).square()
    post = ref_post.to(torch.bfloat16)
    post_full = F.relu(x @ w.t()).square()
    ref_grad = (dy[:CHECK_ROWS].double() @ w.double().t()) * 2 * post.double().sqrt()

    def show(name, ms, error=None):
        extra = f"  error {error:.1e}" if error is not None else ""
        print(f"  {name:64s} {ms:7.3f} ms  {flops / ms / 1e9:5.0f} TFLOP/s{extra}", flush=True)

    print(f"[T={T}, {DIM}] @ [{HIDDEN}, {DIM}]^T, bf16")
    show("cuBLAS matmul alone", median_ms(lambda: x @ w.t()))
    plain_fwd = torch.compile(lambda x, w: F.relu(x @ w.t()).square(), dynamic=False)
    plain_bwd = torch.compile(lambda dy, w, post: (dy @ w.t()) * 2 * post.sqrt(), dynamic=False)
    show("cuBLAS + inductor relu^2 (forward)", median_ms(lambda: plain_fwd(x, w)),
         relative_error(plain_fwd(x, w)[:CHECK_ROWS], ref_post))
    show("cuBLAS + inductor derivative (backward)", median_ms(lambda: plain_bwd(dy, w, post_full)),
         relative_error(plain_bwd(dy, w, post_full)[:CHECK_ROWS], ref_grad))
    default = tg.RELU2_MM_CONFIG
    times, failed = {}, set()
    for config in CONFIGS:
        tg.RELU2_MM_CONFIG = config
        for name, run, reference in (("forward", lambda: tg.relu2_matmul(x, w), ref_post),
                                     ("backward", lambda: tg.relu2_matmul(dy, w, post_full), ref_grad)):
            try:
                ms = median_ms(run)
                error = relative_error(run()[:CHECK_ROWS], reference)
            except Exception as error:  # a tile that does not fit (shared memory) is reported and skipped
                print(f"  {name} {config}: {type(error).__name__}: {str(error)[:160]}")
                failed.add(config)
                continue
            show(f"Triton {name} {config}", ms, error)
            times[config] = times.get(config, 0.0) + ms
    tg.RELU2_MM_CONFIG = default
    times = {config: ms for config, ms in times.items() if config not in failed}
    winner = min(times, key=times.get) if times else None
    print(f"fastest forward + backward: {winner}")
    return winner


def mlp_inputs(seed):
    """x and the output's gradient (bf16, [T, DIM]) and the two weights (float32, [HIDDEN, DIM]), drawn from seed."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, DIM, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    grad_out = torch.randn(T, DIM, device="cuda", generator=g).to(torch.bfloat16)
    fc_w = (torch.randn(HIDDEN, DIM, device="cuda", generator=g) * DIM ** -0.5).requires_grad_()
    proj_w = (torch.randn(HIDDEN, DIM, device="cuda", generator=g) * HIDDEN ** -0.5).requires_grad_()
    return x, grad_out, fc_w, proj_w


def mlp(configs):
    x, grad_out, fc_w, proj_w = mlp_inputs(1)
    rows = slice(0, CHECK_ROWS)
    ref_in = [t.detach()[rows].double().requires_grad_() if i == 0 else t.detach().double().requires_grad_()
              for i, t in enumerate((x, fc_w, proj_w))]
    (F.relu(ref_in[0] @ ref_in[1].t()).square() @ ref_in[2]).backward(grad_out[rows].double())
    flops = 3 * 2 * 2 * T * DIM * HIDDEN
    print(f"MLP forward + backward, compiled, T={T}")
    variants = [("--fused_mlp=0", False, None)] + [(f"fused {c}", True, c) for c in configs]
    for name, fused, config in variants:
        if config is not None:
            tg.RELU2_MM_CONFIG = config
        torch._dynamo.reset()
        module = tg.MLP(DIM, HIDDEN, fused=fused).cuda()
        with torch.no_grad():
            module.fc_w.copy_(fc_w)
            module.proj_w.copy_(proj_w)
        run = torch.compile(module, dynamic=False, fullgraph=True)

        def step():
            x.grad = module.fc_w.grad = module.proj_w.grad = None
            run(x).backward(grad_out)
        ms = median_ms(step)
        # the weight gradients sum over all rows: check them on a run over the first CHECK_ROWS rows only
        x_part = x.detach()[rows].clone().requires_grad_()
        module.fc_w.grad = module.proj_w.grad = None
        run(x_part).backward(grad_out[rows])
        errors = [relative_error(got, ref.grad) for got, ref in zip((x_part.grad, module.fc_w.grad, module.proj_w.grad), ref_in)]
        print(f"  {name:64s} {ms:7.3f} ms  {flops / ms / 1e9:5.0f} TFLOP/s  gradient errors "
              + " ".join(f"{e:.1e}" for e in errors), flush=True)


E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def to_e4m3(t, scale):
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def amax_scale(t):
    return (t.detach().abs().amax().float() / E4M3_MAX).clamp(min=1e-12)


class FP8ForwardMLP(torch.autograd.Function):
    """relu(x @ fc_w^T)^2 @ proj_w, both forward matmuls FP8 e4m3 with bf16 outputs; the backward in bf16 from x
    and the bf16 pre-activation."""

    @staticmethod
    def forward(ctx, x, fc_w, proj_w, h_scale):
        x_scale, fc_scale, proj_scale = amax_scale(x), amax_scale(fc_w), amax_scale(proj_w)
        pre = torch._scaled_mm(to_e4m3(x, x_scale), to_e4m3(fc_w, fc_scale).t(), scale_a=x_scale, scale_b=fc_scale,
                               out_dtype=torch.bfloat16)
        post = F.relu(pre).square()
        h_scale = amax_scale(post) if h_scale is None else h_scale
        # _scaled_mm's second operand column-major: proj_w^T made contiguous, then viewed transposed
        y = torch._scaled_mm(to_e4m3(post, h_scale), to_e4m3(proj_w, proj_scale).t().contiguous().t(),
                             scale_a=h_scale, scale_b=proj_scale, out_dtype=torch.bfloat16)
        ctx.save_for_backward(x, fc_w, proj_w, pre)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, fc_w, proj_w, pre = ctx.saved_tensors
        fc_w, proj_w = fc_w.to(torch.bfloat16), proj_w.to(torch.bfloat16)
        relu = F.relu(pre)
        grad_pre = (grad_y @ proj_w.t()) * 2 * relu
        return grad_pre @ fc_w, grad_pre.t() @ x, relu.square().t() @ grad_y, None


def fp8():
    x, grad_out, fc_w, proj_w = mlp_inputs(2)
    rows = slice(0, CHECK_ROWS)
    flops = 3 * 2 * 2 * T * DIM * HIDDEN
    with torch.no_grad():  # the float64 references: the quantized operands' exact products, and the plain MLP
        xs, fs, ps = amax_scale(x), amax_scale(fc_w), amax_scale(proj_w)
        xq = to_e4m3(x, xs).double() * xs.double()
        pre = (xq[rows] @ (to_e4m3(fc_w, fs).double() * fs.double()).t()).to(torch.bfloat16)
        post = F.relu(pre.double()).square()
        hs = amax_scale(F.relu((xq @ (to_e4m3(fc_w, fs).double() * fs.double()).t()).to(torch.bfloat16)).square())
        quantized_ref = (to_e4m3(post, hs).double() * hs.double()) @ (to_e4m3(proj_w, ps).double() * ps.double())
        plain_ref = F.relu(x[rows].double() @ fc_w.double().t()).square() @ proj_w.double()
        fixed_scale = hs.float()
    print(f"MLP forward + backward, compiled, T={T}: bf16 against FP8 forward")
    variants = [("bf16, --fused_mlp=0", "plain"), ("bf16, fused Triton", "fused"),
                ("FP8 forward, dynamic activation scale", "dynamic"), ("FP8 forward, given activation scale", "given")]
    for name, kind in variants:
        torch._dynamo.reset()
        if kind in ("plain", "fused"):
            module = tg.MLP(DIM, HIDDEN, fused=kind == "fused").cuda()
            with torch.no_grad():
                module.fc_w.copy_(fc_w)
                module.proj_w.copy_(proj_w)
            run = torch.compile(module, dynamic=False, fullgraph=True)
            params = (module.fc_w, module.proj_w)
        else:
            scale = fixed_scale if kind == "given" else None
            run = torch.compile(lambda x: FP8ForwardMLP.apply(x, fc_w, proj_w, scale), dynamic=False)
            params = (fc_w, proj_w)

        def step():
            x.grad = params[0].grad = params[1].grad = None
            run(x).backward(grad_out)
        ms = median_ms(step)
        with torch.no_grad():  # FP8's scales are the whole batch's: its rows come from a full-batch forward
            out = run(x.detach()[rows]) if kind in ("plain", "fused") else run(x.detach())[rows]
        extra = "" if kind in ("plain", "fused") else f"  vs quantized float64 {relative_error(out, quantized_ref):.1e}"
        print(f"  {name:44s} {ms:7.3f} ms  {flops / ms / 1e9:5.0f} TFLOP/s  output vs float64 MLP "
              f"{relative_error(out, plain_ref):.1e}{extra}", flush=True)


def main():
    parts = sys.argv[1:] or ["sweep", "mlp"]
    if "fp8" in parts:
        fp8()
    configs = [tg.RELU2_MM_CONFIG]
    if "sweep" in parts:
        winner = sweep()
        if winner is not None and winner not in configs:
            configs.append(winner)
    if "mlp" in parts:
        mlp(configs)


if __name__ == "__main__":
    main()
