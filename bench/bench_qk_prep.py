"""Device benchmark of the attention's input preparation (not part of the tests): the q/k rms-norm, the rotary
embedding, the value-embedding mix and the q scale between the qkv matmul and the attention, compiled by inductor,
forward and forward + backward at a packed forward's 131,072 tokens. Variants of the rotary's formulation are
checked against the first (largest difference of outputs and gradients) and timed; the generated code of
each goes to $OUT/qk_prep_<variant>.py.

    python bench/bench_qk_prep.py

1xH100, 2026-11-24, two calls: forward + backward 1.827 / 1.771 ms with chunk + cat ('halves'), 1.720 / 1.617 ms
with the flip (forward 0.565 / 0.560 against 0.571 / 0.541 ms). The halves' backward was one looped reduction
kernel that wrote the rotary's gradient for q and k to memory in fp32 and read it back; the flip's backward needs
no such buffer. Gradients differ by up to 1.6e-2 (bf16 outputs, another summation order). With
TORCHINDUCTOR_MULTI_KERNEL=1 (inductor picks persistent or looped reductions by timing them): 1.795 and 1.622 ms.
"""
import os
import sys
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_gpt as tg  # noqa: E402
from timing import median_ms  # noqa: E402


def rotary_halves(x, cos, sin):
    """The rotation as the trainer wrote it until 2026-11-24: chunk into halves, rotate, cat."""
    T = x.size(0)
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:T, None, :], sin[:T, None, 0, :]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1).type_as(x)


def rotary_flip(x, cos, sin):
    """The trainer's apply_rotary: a [T, heads, 2, dim/2] view, the halves swapped by a flip, no cat."""
    return tg.apply_rotary(x, cos, sin)


def prep(rotary, heads, head_dim):
    def run(qkv, value_embed, value_mix, cos, sin, scale):
        T = qkv.size(0)
        q, k, v = qkv.view(T, 3, heads, head_dim).unbind(1)
        q, k = tg.rms_norm(q), tg.rms_norm(k)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        v = value_mix[0] * v + value_mix[1] * value_embed.view_as(v)
        return (q * scale).type_as(k), k, v
    return run


def main():
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    cfg = tg.Config()
    tg.configure_inductor(cfg, torch.device("cuda"))  # the trainer's inductor options
    T, heads, head_dim = 8 * cfg.micro_batch_tokens, cfg.num_heads, cfg.head_dim
    dim = heads * head_dim
    rope = tg.Rotary(head_dim, T, period=cfg.micro_batch_tokens).cuda()
    rope.set_window_history([384, 896, 1408])
    cos, sin, scale = rope.tables()
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(T, 3 * dim, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    value_embed = torch.randn(T, dim, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    value_mix = torch.tensor([0.5, 0.5], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grads = [torch.randn(T, heads, head_dim, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)]
    inputs = (qkv, value_embed, value_mix)
    reference = None
    for name, rotary in (("halves", rotary_halves), ("flip", rotary_flip)):
        torch._dynamo.reset()
        fn = torch.compile(prep(rotary, heads, head_dim), dynamic=False, fullgraph=True)

        def forward_backward():
            for t in inputs:
                t.grad = None
            outs = fn(qkv, value_embed, value_mix, cos, sin, scale)
            torch.autograd.backward(outs, grads)
            return [o.detach() for o in outs] + [t.grad for t in inputs]
        results, codes = run_and_get_code(forward_backward)
        (out_dir / f"qk_prep_{name}.py").write_text("\n\n# ==== next graph ====\n\n".join(codes))
        if reference is None:
            reference = [r.clone() for r in results]
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(results, reference))
        with torch.no_grad():
            forward = median_ms(lambda: fn(qkv, value_embed, value_mix, cos, sin, scale), repeats=30, warmup=5)
        both = median_ms(forward_backward, repeats=30, warmup=5)
        print(f"{name:8s} forward {forward:.3f} ms, forward + backward {both:.3f} ms, "
              f"largest difference from 'halves' {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
