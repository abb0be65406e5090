"""Device benchmark: FlashAttention-4's Hopper kernels (flash_attn.cute) and FlashAttention-3 against FlexAttention
(not part of the tests).

    python bench/bench_fa4.py

FA4 travels in two calls (bench/fa4_site.sh); FA3 is built on the device (bench/fa3_build.sh). A variant
whose package is missing prints FAILED. For the trainer's attention (causal, within documents, a
sliding window, q already scaled) this prints
1. errors against a float64 reference (4,096 tokens, both windows of the last stage): output and q/k/v gradients,
   for flex's Triton kernels, flex with BACKEND=FLASH (FA4 kernels under flex's block masks) and FA4's varlen call;
2. median ms of forward and of forward + backward at the trainer's packed length (8 x 16,384 tokens), with the
   document boundaries of /tmp/bench (bench/unpack_bench.py) or random ones.
A variant that fails prints its error and the others go on.

1xH100, torch 2.11, flash-attn-4 4.0.0b36 (2026-11-24), 131,072 tokens of the bench stream (107 documents):
flex forward 1.175 / 1.368 ms and forward + backward 4.008 / 5.027 ms (short / long window); FA4's varlen call
1.548 / 1.774 and 4.412 / 4.889 ms (max_seqlen the length; the longest document instead: within 0.1 ms). Errors
against float64 were the same to three digits for both. flex's BACKEND=FLASH failed in the CuTe compiler
("Expected TensorSSA, but got int"). So FA4 brings nothing here, and the trainer keeps flex.

FlashAttention-3 (flash-attention 0251105a built by bench/fa3_build.sh; 1xH100, 2026-11-24, same tokens): the
same errors as flex; forward 0.579 / 0.763 ms and forward + backward 2.328 / 2.918 ms with the 107 documents alone
(max_seqlen 2048, the longest), against flex's 1.161 / 1.316 and 4.014 / 5.048. Padded as the loader pads (8,193
sequences) the backward launches a block per sequence and key tile: 8.92 / 9.47 ms with max_seqlen 2048, 395 ms
with max_seqlen the whole length. Hence the trainer's FA3 backend cuts the list and bounds max_seqlen.
"""
import functools
import glob
import sys
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402
from timing import median_ms  # noqa: E402


def tokens_of(cfg: tg.Config, length: int) -> torch.Tensor:
    files = sorted(glob.glob("/tmp/bench/docs_train_*.bin"))
    batches = tg.train_batches_for_rank(files, cfg, tg.Comm()) if files else tg.dummy_batches(cfg, seed=0)
    parts, have = [], 0
    while have < length:
        window = next(batches)[:-1]
        parts.append(window)
        have += len(window)
    return torch.from_numpy(np.concatenate(parts)[:length].astype(np.int64)).cuda()


def cu_seqlens_padded(tokens: torch.Tensor, micro: int, bos: int) -> torch.Tensor:
    """Document starts of every micro-batch, then the length, padded with it to max_documents: the trainer's."""
    starts = []
    for i in range(0, len(tokens), micro):
        starts += (tg.micro_batch_document_starts(tokens[i:i + micro].cpu().numpy(), bos) + i).tolist()
    T = len(tokens)
    starts += [T] * (tg.max_documents(T) + 1 - len(starts))
    return torch.tensor(starts, dtype=torch.int32, device=tokens.device)


class Variants:
    """Each attention variant as f(q, k, v, kind) on [T, heads, dim] tensors."""

    def __init__(self, T: int, cu_seqlens: torch.Tensor, windows: dict, tokens: torch.Tensor):
        self.T, self.cu, self.windows = T, cu_seqlens, windows
        self.flex = tg.FlexAttention(T, torch.device("cuda"))
        self.masks = self.flex.prepare(tokens.numel(), cu_seqlens, windows)
        self.compiled = {}
        self.doc_max = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())

    def _flex(self, options):
        key = str(options)
        if key not in self.compiled:
            self.compiled[key] = torch.compile(
                functools.partial(self.flex.flex_attention, scale=1.0, kernel_options=options),
                dynamic=False, fullgraph=True)
        fn = self.compiled[key]

        def run(q, k, v, kind):
            y = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                   block_mask=self.masks[kind])
            return y[0].transpose(0, 1)
        return run

    def _fa4(self, max_seqlen):
        def run(q, k, v, kind):  # imported here: a missing package fails this variant only
            from flash_attn.cute import flash_attn_varlen_func
            w = self.windows[kind]
            y = flash_attn_varlen_func(q, k, v, cu_seqlens_q=self.cu, cu_seqlens_k=self.cu, max_seqlen_q=max_seqlen,
                                       max_seqlen_k=max_seqlen, softmax_scale=1.0, causal=True, window_size=(w - 1, 0))
            return y[0] if isinstance(y, tuple) else y
        return run

    def _fa3(self, cu_seqlens, max_seqlen):
        def run(q, k, v, kind):  # imported here: a missing package fails this variant only
            from flash_attn_interface import flash_attn_varlen_func
            w = self.windows[kind]
            y = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                       max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, softmax_scale=1.0,
                                       causal=True, window_size=(w - 1, 0))
            return y[0] if isinstance(y, tuple) else y
        return run

    def all(self):
        unpadded = torch.unique_consecutive(self.cu)  # the padding repeats the length
        return {
            "flex triton": self._flex(None),
            "flex FLASH": self._flex({"BACKEND": "FLASH"}),
            "fa4 varlen max=T": self._fa4(self.T),
            f"fa4 varlen max={self.doc_max}": self._fa4(self.doc_max),
            "fa3 padded max=T": self._fa3(self.cu, self.T),
            f"fa3 padded max={self.doc_max}": self._fa3(self.cu, self.doc_max),
            f"fa3 unpadded max={self.doc_max}": self._fa3(unpadded, self.doc_max),
        }


def reference(q, k, v, grad_out, allowed):
    """float64 attention and its gradients, with a dense [T, T] mask."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k).masked_fill(~allowed, float("-inf"))
    y = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    y.backward(grad_out.double())
    return [y.detach(), q.grad, k.grad, v.grad]


def inputs(T, heads, dim, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (tg.rms_norm(torch.randn(T, heads, dim, device="cuda", generator=g)) for _ in range(3))
    q = q * 0.12 * 1.5  # the attention scale after the window growth
    grad = torch.randn(T, heads, dim, device="cuda", generator=g)
    return [t.to(torch.bfloat16) for t in (q, k, v)], grad.to(torch.bfloat16)


def forward_backward(fn, q, k, v, grad, kind):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    y = fn(q, k, v, kind)
    y.backward(grad)
    return [y.detach(), q.grad, k.grad, v.grad]


def main():
    cfg = tg.Config()
    heads, dim = cfg.num_heads, cfg.head_dim
    short, long = tg.Schedule(cfg).stage_windows[-1]
    windows = {"S": short, "L": long}
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, windows {windows}", flush=True)
    try:
        import flash_attn.cute as fa
        print(f"flash_attn.cute from {fa.__file__}", flush=True)
    except Exception:
        traceback.print_exc()

    print("\n== errors against float64 (max abs; out, dq, dk, dv), 4,096 tokens", flush=True)
    T = 4096
    tokens = tokens_of(cfg, T)
    cu = cu_seqlens_padded(tokens, cfg.micro_batch_tokens, cfg.bos_token)
    variants = Variants(T, cu, windows, tokens)
    doc = tg.document_ids(cu, T)
    pos = torch.arange(T, device="cuda")
    dist_ = pos[:, None] - pos[None, :]
    (q, k, v), grad = inputs(T, heads, dim, seed=1)
    for kind, w in windows.items():
        allowed = (dist_ >= 0) & (dist_ < w) & (doc[:, None] == doc[None, :])
        ref = reference(q, k, v, grad, allowed)
        scale = [r.abs().max().item() for r in ref]
        for name, fn in variants.all().items():
            try:
                got = forward_backward(fn, q, k, v, grad, kind)
                errs = [(g.double() - r).abs().max().item() for g, r in zip(got, ref)]
                print(f"{kind} {name:24s} " + " ".join(f"{e:.2e}" for e in errs)
                      + "   (ref max " + " ".join(f"{s:.2e}" for s in scale) + ")", flush=True)
            except Exception as e:
                print(f"{kind} {name:24s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)

    print("\n== median ms, 8 x 16,384 tokens per forward", flush=True)
    T = 8 * cfg.micro_batch_tokens
    tokens = tokens_of(cfg, T)
    cu = cu_seqlens_padded(tokens, cfg.micro_batch_tokens, cfg.bos_token)
    variants = Variants(T, cu, windows, tokens)
    docs = int((cu[1:] > cu[:-1]).sum())
    print(f"{docs} documents, longest {variants.doc_max}", flush=True)
    (q, k, v), grad = inputs(T, heads, dim, seed=2)
    for name, fn in variants.all().items():
        line = []
        for kind in windows:
            try:
                with torch.no_grad():
                    fwd = median_ms(lambda: fn(q, k, v, kind), repeats=20, warmup=3)
                both = median_ms(lambda: forward_backward(fn, q, k, v, grad, kind), repeats=20, warmup=3)
                line.append(f"{kind} fwd {fwd:.3f} fwd+bwd {both:.3f}")
            except Exception as e:
                line.append(f"{kind} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        print(f"{name:24s} " + "; ".join(line), flush=True)


if __name__ == "__main__":
    main()
