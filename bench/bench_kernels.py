"""Each Triton kernel of train_gpt.py against the plain-torch path it replaces, at the full config's shapes, on the
device (not in CI):

    python bench/bench_kernels.py [NAME ...]      # names: orthogonalize mlp head rows copy (default: all)

Per kernel, first the numerics: the largest error of each path against a float64 computation of the same inputs,
relative to the reference's largest value (the kernel's should be no worse than torch's), then the timing: the
median of 30 calls after 5 untimed ones, each call between two CUDA events and synchronized before the next.
"""
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402

DEVICE = "cuda"


def median_ms(fn, repeats: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def error(value, reference) -> float:
    reference = reference.double()
    return ((value.double() - reference).abs().max() / reference.abs().max().clamp(min=1e-30)).item()


def compare(name: str, triton_fn, torch_fn, reference) -> None:
    """reference: the float64 result; the two paths return comparable tensors (or tuples of them)."""
    as_tuple = lambda x: x if isinstance(x, tuple) else (x,)
    ref = as_tuple(reference)
    errors = [max(error(v, r) for v, r in zip(as_tuple(fn()), ref)) for fn in (triton_fn, torch_fn)]
    kernel_ms, torch_ms = median_ms(triton_fn), median_ms(torch_fn)
    print(f"{name:<44} error vs float64: Triton {errors[0]:.2e}, torch {errors[1]:.2e}; "
          f"{kernel_ms:7.3f} ms against {torch_ms:7.3f} ms ({torch_ms / kernel_ms:.2f}x)", flush=True)


def bench_orthogonalize():
    # Muon's largest group: the MLP matrices, [768, 3072], a dozen to a rank at world size 1
    grads = torch.randn(12, 768, 3072, device=DEVICE)
    X = grads.double()  # the same iteration in float64 (orthogonalize runs bf16 on a GPU)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6)
    for a, b, c in tg.POLAR_EXPRESS_COEFFS:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    reference = X
    compare("orthogonalize 12 x [768, 3072] (Muon)", lambda: tg.orthogonalize(grads, True),
            lambda: tg.orthogonalize(grads, False), reference)


def bench_mlp():
    T, dim, hidden = 65536, 768, 3072
    x = torch.randn(T, dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    fc = (torch.randn(hidden, dim, device=DEVICE) * dim ** -0.5).bfloat16().requires_grad_()
    proj = (torch.randn(hidden, dim, device=DEVICE) * hidden ** -0.5).bfloat16().requires_grad_()
    grad_y = torch.randn(T, dim, device=DEVICE, dtype=torch.bfloat16)

    def run(fused: bool, dtype=None):
        inputs = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (x, fc, proj)]
        y = tg._FusedReLU2MLP.apply(*inputs) if fused else F.relu(inputs[0] @ inputs[1].T).square() @ inputs[2]
        y.backward(grad_y.to(y.dtype))
        return (y, *(t.grad for t in inputs))

    compare(f"MLP forward + backward [{T}, {dim}] x {hidden}", lambda: run(True), lambda: run(False),
            run(False, torch.float64))


def bench_head():
    T, dim, vocab = 32768, 768, 50304
    x = tg.rms_norm(torch.randn(T, dim, device=DEVICE)).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, dim, device=DEVICE) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (T,), device=DEVICE)

    def run(fp8: bool, dtype=torch.bfloat16):
        xs, w = x.detach().to(dtype).requires_grad_(), weight.detach().clone().requires_grad_()
        if fp8:
            loss = tg._Fp8SoftcappedHead.apply(xs, w, targets, tg.LOGIT_CAP, None, 0)
        else:
            loss = tg.multi_token_losses(tg.softcap(xs @ w.to(dtype).T, tg.LOGIT_CAP), targets, None).mean()
        loss.backward()
        return loss, xs.grad, w.grad

    compare(f"head loss (FP8 against bf16) [{T}, {dim}] x {vocab}", lambda: run(True), lambda: run(False),
            run(False, torch.float64))


def bench_rows():
    T, dim, rows = 65536, 768, 50304
    tokens = torch.randint(0, rows, (T,), device=DEVICE) % 4096  # frequent rows: many adds to the same row
    grads = torch.randn(T, dim, device=DEVICE, dtype=torch.bfloat16)
    table = torch.randn(rows, dim, device=DEVICE)

    def add(use_triton: bool):
        out = torch.zeros(rows, dim, device=DEVICE)
        tg.add_rows_([out], tokens, [grads], use_triton)
        return out

    reference = torch.zeros(rows, dim, device=DEVICE, dtype=torch.float64).index_add_(0, tokens, grads.double())
    compare(f"row gradients, {T} rows into [{rows}, {dim}]", lambda: add(True), lambda: add(False), reference)
    compare(f"row gather to bf16, {T} of [{rows}, {dim}]", lambda: tg.gather_rows(table, tokens, torch.bfloat16, True),
            lambda: tg.gather_rows(table, tokens, torch.bfloat16, False), table.double()[tokens])


def bench_copy():
    T, d, band = 65536, 128, tg.COPY_BAND
    q, k = (torch.randn(T, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    sink = torch.zeros((), device=DEVICE)
    tokens = torch.randint(0, 512, (T,), device=DEVICE)
    targets = torch.roll(tokens, -1)
    documents = torch.arange(T, device=DEVICE) // 1500

    def run(use_triton: bool, dtype=torch.bfloat16):
        qs, ks = q.detach().to(dtype).requires_grad_(), k.detach().to(dtype).requires_grad_()
        log_copy, log_sink = tg.copy_log_probs(qs, ks, sink.to(dtype), tokens, targets, documents, band, use_triton)
        (log_copy.clamp(min=-30).sum() + log_sink.sum()).backward()
        return log_copy.clamp(min=-30), qs.grad, ks.grad

    compare(f"copy pointer scores [{T}, {d}], band {band}", lambda: run(True), lambda: run(False),
            run(False, torch.float64))


BENCHES = {"orthogonalize": bench_orthogonalize, "mlp": bench_mlp, "head": bench_head, "rows": bench_rows,
           "copy": bench_copy}


def main() -> int:
    names = sys.argv[1:] or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"error: no kernel bench {unknown[0]!r}; choose from {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or tg.triton is None:
        print("error: the kernel benches need a CUDA GPU and Triton", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for name in names:
        BENCHES[name]()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
