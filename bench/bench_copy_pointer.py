"""Device benchmark of the copy pointer's cost (not part of the tests): at a packed forward's tokens, compiled by
inductor, forward + backward of
  - pointer: CopyPointer's projections and banded scores (copy_log_probs) at each band, in plain torch and with
    the Triton kernels (_CopyScores),
  - head: the FP8 head's loss with multi-token weights, without and with the copy mixture (the fused kernel),
each the median of many calls after a warm-up, and the peak memory each adds. The pointer's numbers say whether
the kernels pay; the head's whether the mixture costs the fused loss anything.

    python bench/bench_copy_pointer.py [TOKENS]     (default 131072: 8 micro-batches of 16,384)
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_gpt as tg  # noqa: E402
from timing import median_ms  # noqa: E402

DIM, HEAD_DIM, VOCAB, SLOT, DOC = 768, 128, 50304, 50257, 1500
CAP = (23.0, 5.0, 7.5)


def inputs(T: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = tg.rms_norm(torch.randn(T, DIM, generator=g, device="cuda")).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 5000, (T,), generator=g, device="cuda")  # a small vocabulary: the pointer has hits
    targets = torch.cat([tokens[1:], tokens[:1]])
    starts = torch.arange(T, device="cuda") % DOC == 0
    return h, tokens, targets, torch.cumsum(starts.long(), 0)


def peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def main():
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
    h, tokens, targets, documents = inputs(T)
    print(f"{torch.cuda.get_device_name()}, {T} tokens, documents of {DOC}")
    for band in (1024, 2048, 4096):
        for use_triton in (False, True):
            pointer = tg.CopyPointer(DIM, HEAD_DIM, band, use_triton).cuda()

            def step():
                log_copy, log_sink = pointer(h, tokens, targets, documents)
                (log_copy.clamp(min=-30).sum() + log_sink.sum()).backward()

            compiled = torch.compile(step, fullgraph=False, dynamic=False)
            ms = median_ms(compiled)
            print(f"pointer band {band}, {'Triton kernels' if use_triton else 'plain torch'}: forward + backward "
                  f"{ms:.2f} ms, peak {peak_gib(compiled):.2f} GiB")
    weight = (torch.randn(VOCAB, DIM, device="cuda") * 0.02).requires_grad_()
    mtp = (torch.tensor([1.0, 0.5, 0.25], device="cuda") / 1.75, 16384)
    log_copy = torch.full((T,), -2.0, device="cuda", requires_grad=True)
    log_sink = torch.full((T,), -1.0, device="cuda", requires_grad=True)
    for name, copy in (("head", None), ("head + copy mixture", (SLOT, log_copy, log_sink))):
        def head():
            tg.fp8_softcapped_head(h, weight, targets, CAP, True, mtp, copy).backward()
        ms = median_ms(head)
        print(f"{name}: forward + backward {ms:.2f} ms, peak {peak_gib(head):.2f} GiB")


if __name__ == "__main__":
    main()
