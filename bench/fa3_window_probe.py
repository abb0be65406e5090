"""Can FlashAttention-3's window be a symbolic int under torch.compile, so that one graph serves every window pair
(issue: cold start)? On the GPU machine with FA3 importable (`source bench/fa3_build.sh site`):
    python3 bench/fa3_window_probe.py
For each way of compiling, five windows in a row through one compiled attention + loss, forward and backward: the
graphs dynamo made, the CUDA graphs recorded, and the largest difference to eager in the loss and q's gradient."""
import time

import torch
import torch._dynamo
from torch._dynamo.utils import counters

import flash_attn_interface as fa3

T, HEADS, HEAD_DIM, DOC = 16384, 6, 128, 2048
WINDOWS = (384, 896, 1408, 1664, 2560)


def attention_loss(q, k, v, cu_seqlens, max_seqlen, window):
    y = fa3.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                                   max_seqlen_k=max_seqlen, softmax_scale=1.0, causal=True, window_size=(window - 1, 0))
    y = y[0] if isinstance(y, tuple) else y
    return (y.float() * torch.linspace(-1, 1, y.size(-1), device=y.device)).sum()


def inputs(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(T, HEADS, HEAD_DIM, device="cuda", generator=g, dtype=torch.bfloat16) * 0.3
               for _ in range(3))
    return [t.requires_grad_() for t in (q, k, v)]


def run(label, fn, compiled_cudagraphs=False):
    cu_seqlens = torch.arange(0, T + 1, DOC, device="cuda", dtype=torch.int32)
    worst, start = 0.0, time.perf_counter()
    for repeat in range(3 if compiled_cudagraphs else 1):  # CUDA graphs record at a later call
        for i, window in enumerate(WINDOWS):
            q, k, v = inputs(i)
            loss = fn(q, k, v, cu_seqlens, DOC, window)
            loss.backward()
            q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
            want = attention_loss(q2, k2, v2, cu_seqlens, DOC, window)
            want.backward()
            worst = max(worst, abs(loss.item() - want.item()) / abs(want.item()),
                        ((q.grad - q2.grad).abs().max() / q2.grad.abs().max()).item())
    print(f"{label}: graphs {counters['stats']['unique_graphs']}, {time.perf_counter() - start:.1f} s, "
          f"largest relative difference to eager {worst:.2e}", flush=True)


def main():
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    ways = [("static (dynamic=False, as train_gpt.py)", dict(dynamic=False)),
            ("automatic dynamic (dynamic=None)", dict(dynamic=None)),
            ("automatic dynamic under CUDA graphs", dict(dynamic=None, mode="reduce-overhead"))]
    for label, kwargs in ways:
        torch._dynamo.reset()
        counters.clear()
        try:
            run(label, torch.compile(attention_loss, fullgraph=True, **kwargs), "mode" in kwargs)
        except Exception as e:  # a way that does not compile is an answer too
            print(f"{label}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)


if __name__ == "__main__":
    main()
