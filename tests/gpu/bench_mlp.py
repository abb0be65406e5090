"""Device benchmark of the MLP (rms_norm -> fc -> ReLU^2 -> proj, plus the residual) forward + backward on
one micro-batch, compiled in each torch.compile mode given (default: default and max-autotune-no-cudagraphs,
where inductor may pick Triton GEMM templates with the ReLU^2 fused into their epilogue). Prints the
compile time and median ms per mode; not part of the tests.

    python tests/gpu/bench_mlp.py [MODE ...]
"""
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402
from bench_optimizers import median_ms as _median_ms  # noqa: E402

median_ms = functools.partial(_median_ms, repeats=30, warmup=5)


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

    flops = 3 * 2 * 2 * T * dim * cfg.mlp_ratio * dim  # two matmuls, forward + two backward each
    reference = None
    for mode in modes:
        torch._dynamo.reset()
        compiled = torch.compile(block, dynamic=False, fullgraph=True, mode=None if mode == "default" else mode)

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
        print(f"{mode:28s} compile {compile_s:6.1f} s  {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s  "
              f"rel. diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
