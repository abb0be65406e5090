"""Device check, not part of the tests: do the Triton kernels and flex attention give the same result every time?

A kernel without atomics that returns different bits for the same inputs has a race (or reads memory it did not
write), and a race is a candidate for runs that end in NaN or "unspecified launch failure" at random steps. Each
kernel path runs forward and backward REPEATS times on fixed inputs at the sizes of a FRESH ml_bench forward (two
packed micro-batches of 4,096 tokens), and each result is compared with the first: bit for bit where the kernel
has no atomics, within 1e-5 relative where it adds with atomics (the row-gradient kernel). --hog=N starts N
processes that keep the same GPU busy with matmuls meanwhile (runs side by side are where the failures were seen).

    python bench/race_check.py [--repeats=200] [--hog=3] [--tokens=8192]
Prints per kernel path: repeats, results that differ, the largest difference, and non-finite values seen.
"""
import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402

HOG = """
import torch, time
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.time() + {seconds}
while time.time() < end:
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
"""


def leaves_grads(fn, leaves):
    """fn's outputs and the gradients of their sum of squares with respect to leaves, detached."""
    for leaf in leaves:
        leaf.grad = None
    outs = fn()
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum(o.float().square().sum() if o.dim() else o.float() for o in outs).backward()
    return [o.detach().clone() for o in outs] + [leaf.grad.detach().clone() for leaf in leaves]


def paths(tokens: int, device: torch.device):
    """(name, function returning a list of result tensors, exact?) per Triton kernel path of the trainer."""
    g = torch.Generator(device=device).manual_seed(0)
    bf = dict(device=device, dtype=torch.bfloat16)
    dim, hidden, vocab = 768, 3072, 50304

    x = (torch.randn(tokens, dim, generator=g, **bf)).requires_grad_()
    fc = (torch.randn(hidden, dim, generator=g, **bf) * dim ** -0.5).requires_grad_()
    proj = (torch.randn(hidden, dim, generator=g, **bf) * hidden ** -0.5).requires_grad_()
    yield "fused MLP", lambda: leaves_grads(lambda: tg._FusedReLU2MLP.apply(x, fc, proj), [x, fc, proj]), True

    h = tg.rms_norm(torch.randn(tokens, dim, generator=g, **bf)).requires_grad_()
    head = (torch.randn(vocab, dim, generator=g, **bf) * 0.005).float().requires_grad_()
    targets = torch.randint(0, 50257, (tokens,), generator=g, device=device)
    cap = (23.0, 5.0, 7.5)
    mtp = (torch.tensor([1.0, 0.5, 0.25], device=device), tokens // 2)
    yield ("FP8 head, multi-token", lambda: leaves_grads(
        lambda: tg.fp8_softcapped_head(h, head, targets, cap, True, mtp), [h, head]), True)

    stack = torch.randn(12, 768, 3072, generator=g, device=device)
    yield "Newton-Schulz (symmetric kernel)", lambda: [tg.orthogonalize(stack, True)], True

    q = torch.randn(tokens, 64, generator=g, **bf).requires_grad_()
    k = torch.randn(tokens, 64, generator=g, **bf).requires_grad_()
    sink = torch.zeros(1, device=device, requires_grad=True)
    toks = torch.randint(0, 512, (tokens,), generator=g, device=device)
    nexts = torch.randint(0, 512, (tokens,), generator=g, device=device)
    docs = torch.cumsum((torch.rand(tokens, generator=g, device=device) < 1 / 700).long(), 0)
    yield ("copy pointer scores", lambda: leaves_grads(
        lambda: tg.copy_log_probs(q, k, sink, toks, nexts, docs, 2048, True), [q, k, sink]), True)

    # flex attention as the model calls it (compiled, the block masks of FlexAttention.prepare, documents of about 700
    # tokens, the last stage's long window), forward and backward
    flex = tg.FlexAttention(tokens, device)
    starts = torch.nonzero(torch.rand(tokens, generator=g, device=device) < 1 / 700).flatten().int()
    cu = torch.cat([torch.zeros(1, dtype=torch.int32, device=device), starts, torch.full((1,), tokens, device=device,
                                                                                         dtype=torch.int32)])
    masks = flex.prepare(tokens, cu.unique(), {"L": 11 * 128})
    attend = torch.compile(flex.__call__, dynamic=False, fullgraph=True)
    hq, hk, hv = (torch.randn(tokens, 6, 128, generator=g, **bf).requires_grad_() for _ in range(3))
    yield ("flex attention, compiled", lambda: leaves_grads(lambda: attend(hq, hk, hv, masks["L"]), [hq, hk, hv]),
           True)

    table = torch.randn(vocab, dim, generator=g, device=device)
    indices = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    row_grads = torch.randn(tokens, dim, generator=g, device=device)

    def rows():
        out = tg.gather_rows(table, indices, torch.bfloat16, True)
        grad = torch.zeros_like(table)
        tg.add_rows_([grad], indices, [row_grads], True)
        return [out, grad]
    yield "row gather and row-gradient add", rows, False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200, help="runs of each kernel path")
    parser.add_argument("--hog", type=int, default=0, help="processes keeping the GPU busy meanwhile")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per forward")
    args = parser.parse_args()
    if not torch.cuda.is_available() or tg.triton is None:
        print("error: bench/race_check.py needs a CUDA GPU and Triton")
        return 1
    device = torch.device("cuda")
    hogs = [subprocess.Popen([sys.executable, "-c", HOG.format(seconds=3600)]) for _ in range(args.hog)]
    try:
        if hogs:
            time.sleep(20)  # their CUDA start
        failed = False
        for name, run, exact in paths(args.tokens, device):
            try:
                first = run()
            except Exception as e:  # one path's failure should not hide the others' results
                print(f"{name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                failed = True
                continue
            differ, largest, non_finite = 0, 0.0, sum(int(not torch.isfinite(t).all()) for t in first)
            scale = max(b.float().abs().max().item() for b in first)
            for _ in range(args.repeats - 1):
                results = run()
                non_finite += sum(int(not torch.isfinite(t).all()) for t in results)
                worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(results, first))
                if (worst > 0) if exact else (worst > 1e-5 * scale):
                    differ += 1
                largest = max(largest, worst)
            torch.cuda.synchronize()
            failed |= differ > 0 or non_finite > 0
            print(f"{name}: {args.repeats} runs, {differ} differ from the first"
                  f"{'' if exact else ' beyond 1e-5 relative'}, largest difference {largest:.3g}, "
                  f"non-finite results {non_finite}", flush=True)
        return int(failed)
    finally:
        for hog in hogs:
            hog.kill()


if __name__ == "__main__":
    sys.exit(main())
