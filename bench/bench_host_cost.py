"""Device benchmark of the host's cost of the trainer's own GPU ops: the CPU time to issue one call, not the GPU's
time to run it. Where a rank's forward is small (one or two micro-batches, as on 8 GPUs) the host issues a step
more slowly than the GPU runs it, and then every microsecond of Python around a launch is step time.

    python bench/bench_host_cost.py

Each op is called on inputs so small that the GPU finishes a call before the host has issued the next, CALLS
times back to back; the figure is the median over REPEATS of the host's microseconds per call (perf_counter),
warm-up excluded, and beside it the GPU's idle wait at the end (a check that the host, not the GPU, set the pace).
Ops that compute the same thing by another path are compared against it first (bitwise).

Rows: cuBLAS's matmul through aten (the reference), the MLP's fused matmul (relu2_matmul) as the compiled graph
calls it (the custom op) and its parts (the op's own body without the dispatcher; the tensor descriptors alone;
the Triton launch with descriptors made beforehand), a plain-pointer Triton kernel (transpose_fp8), FA3's forward
through gpt::fa3_varlen and straight, and a one-kernel inductor graph.
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402

CALLS, REPEATS, WARMUP = 200, 7, 20
M, DIM, HIDDEN = 256, 768, 3072  # a few rows: the host's cost of a call does not depend on them


def host_us(fn) -> tuple[float, float]:
    """Median host microseconds per call over REPEATS runs of CALLS back-to-back calls, and the median of the
    milliseconds the host then waited for the GPU (near 0: the host set the pace)."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    per_call, waits = [], []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        per_call.append(1e6 * (issued - start) / CALLS)
        waits.append(1e3 * (time.perf_counter() - issued))
    return statistics.median(per_call), statistics.median(waits)


def main() -> int:
    if not torch.cuda.is_available() or tg.triton is None:
        print("error: bench_host_cost.py needs a CUDA GPU and Triton", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    device = torch.device("cuda")
    a = torch.randn(M, DIM, device=device, dtype=torch.bfloat16)
    w = torch.randn(HIDDEN, DIM, device=device, dtype=torch.bfloat16) / DIM ** 0.5
    post = tg.relu2_matmul(a, w)
    body = tg.relu2_matmul._init_fn  # the op's Python function, called without torch's dispatcher
    assert torch.equal(body(a, w), post) and torch.equal(body(a, w, post), tg.relu2_matmul(a, w, post))

    block_m, block_n, block_k, group_m, split, warps, stages = tg.RELU2_MM_CONFIG
    out = torch.empty_like(post)
    TD = tg.TensorDescriptor

    def descriptors():
        return (TD.from_tensor(a, [block_m, block_k]), TD.from_tensor(w, [block_n, block_k]),
                TD.from_tensor(out, [block_m, block_n // split]))

    made = descriptors()
    programs = min(tg.triton.cdiv(M, block_m) * tg.triton.cdiv(HIDDEN, block_n),
                   torch.cuda.get_device_properties(device).multi_processor_count)

    def launch_only():
        tg._relu2_matmul_kernel[(programs,)](*made, made[2], M, HIDDEN, DIM, GRAD=False, BLOCK_M=block_m,
                                             BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, SPLIT=split,
                                             PROGRAMS=programs, num_warps=warps, num_stages=stages)

    launch_only()
    assert torch.equal(out, post)

    fp8 = torch.randn(M, HIDDEN, device=device).to(torch.float8_e5m2)
    compiled = torch.compile(lambda x: x * 2 + 1)
    compiled(a)

    rows = [("aten mm (cuBLAS), a @ w.T", lambda: a @ w.t()),
            ("relu2_matmul: the custom op", lambda: tg.relu2_matmul(a, w)),
            ("relu2_matmul: the op's body, no dispatcher", lambda: body(a, w)),
            ("relu2_matmul: its 3 tensor descriptors alone", descriptors),
            ("relu2_matmul: the Triton launch alone", launch_only),
            ("transpose_fp8 (plain-pointer Triton kernel)", lambda: tg.transpose_fp8(fp8)),
            ("inductor graph of one pointwise kernel", lambda: compiled(a))]
    try:
        import flash_attn_interface
    except ImportError:
        flash_attn_interface = None
    if flash_attn_interface is not None:
        tg.FlashAttention3(flash_attn_interface, 2048)
        heads, head_dim = 6, 128
        q, k, v = (torch.randn(M, heads, head_dim, device=device, dtype=torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0, M // 2, M], device=device, dtype=torch.int32)
        args = tg._fa3_arguments(cu, 128, M, 3)
        direct = flash_attn_interface._flash_attn_forward(q, k, v, causal=True, **args)[0]
        assert torch.equal(tg.fa3_varlen(q, k, v, cu, 128, M, 3)[0], direct)
        rows += [("FA3 forward through gpt::fa3_varlen", lambda: tg.fa3_varlen(q, k, v, cu, 128, M, 3)),
                 ("FA3 forward, _flash_attn_forward straight",
                  lambda: flash_attn_interface._flash_attn_forward(q, k, v, causal=True, **args))]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {tg.triton.__version__}: "
          f"host microseconds per call (median of {REPEATS} x {CALLS} calls), GPU wait after the last")
    for name, fn in rows:
        us, wait = host_us(fn)
        print(f"  {us:8.1f} us   {name}   (wait {wait:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
