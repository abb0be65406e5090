"""Experiment (device, not part of the tests): the MLP's fc matmul with relu^2 in its epilogue as a Gluon
(Triton 3.6) ping-pong kernel on Hopper, against the trainer's Triton kernel (relu2_matmul) and cuBLAS.

Ping-pong: per CTA a 1-warp TMA loader and two 4-warp consumers that take the CTA's tiles in turn. A turn
barrier lets only one consumer run its main loop at a time, so each consumer's epilogue (relu^2, bf16, shared
memory, TMA store) runs while the other one's MMAs keep the tensor cores busy -- the overlap the trainer's
Triton kernel lacks (its epilogue stalls the MMAs at K = 768).

    python bench/bench_gluon_mlp.py

1xH100, Triton 3.6, [65536, 768] @ [3072, 768]^T, two device calls on two machines (2026-11-24): correct (error against
float64 1.7e-3, as the Triton kernel's), but not faster. 128 x 128 tiles: 0.630 / 0.624-0.667 ms with 4-5 stages
(0.76-0.79 with 3), against 0.638 / 0.561 ms for the trainer's Triton kernel and 0.462 / 0.504 ms for cuBLAS's
matmul alone. A consumer's whole fp32 accumulator must fit its 4 warps' registers (128 x 128: 128 a thread), so
the tiles cannot grow to the Triton kernel's 128 x 256, and at 128 x 128 each tile reads 64 FLOPs per byte of
operands from L2. Tiles of 128 x (128 + 64) in two accumulators (77 FLOPs per byte; Gluon wants power-of-two
shapes) were slower still: 0.747 ms (BK 64, 3 stages) and 0.688 ms (BK 32, 6 stages), so L2 traffic is not what
holds it back (that variant, a second copy of the loader, consumer and kernel with two B descriptors and two
accumulators, is in the history at commit dbda030). A third call (another machine: Triton kernel 0.531 ms,
cuBLAS 0.480) gave 128 x 128 with 4 stages 0.559 ms but 5 stages 0.663, and BK 32 with 8 stages 0.765: the
kernel's speed swings more between runs than the Triton kernel's. Dropping the thread barrier before each stage release (a race, timed only to price it) did not
help (0.601 ms). Left to find: why the hand-off between the consumers is this uneven, and TMA multicast over a
2-CTA cluster (to halve operand traffic), which Gluon 3.6 lacks.
"""
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@gluon.jit
def _tile_origin(tile, tiles_m, tiles_n, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = gl.minimum(tiles_m - first_m, GROUP_M)
    row0 = (first_m + (tile % per_group) % group_rows) * BM
    col0 = ((tile % per_group) // group_rows) * BN
    return row0, col0


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BM: gl.constexpr, BN: gl.constexpr,
            BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, PROGRAMS: gl.constexpr):
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    count = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, PROGRAMS):
        row0, col0 = _tile_origin(tile, tiles_m, tiles_n, BM, BN, GROUP_M)
        for k in range(0, K, BK):
            slot = count % STAGES
            mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row0, k], ready.index(slot), a_bufs.index(slot))
            tma.async_copy_global_to_shared(b_desc, [col0, k], ready.index(slot), b_bufs.index(slot))
            count += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, turn, out_desc, out_buf, M, N, K, BM: gl.constexpr,
              BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
              PROGRAMS: gl.constexpr, ME: gl.constexpr):
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    steps = gl.cdiv(K, BK)
    mine = 0
    for tile in range(gl.program_id(0) + ME * PROGRAMS, tiles_m * tiles_n, 2 * PROGRAMS):
        row0, col0 = _tile_origin(tile, tiles_m, tiles_n, BM, BN, GROUP_M)
        # consumer 0's first wait passes at once (a fresh barrier counts as phase 1 done)
        mbarrier.wait(turn.index(ME), (mine & 1) ^ (1 - ME))
        count = (2 * mine + ME) * steps
        acc = gl.zeros([BM, BN], gl.float32, mma_layout)
        previous = 0
        for step in range(steps):
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            acc, _, _ = warpgroup_mma_wait(1, deps=(acc, a_bufs.index(slot), b_bufs.index(slot)))
            if step > 0:  # the MMA before this one is done: its stage can be refilled
                gl.thread_barrier()
                mbarrier.arrive(empty.index(previous))
            previous = slot
            count += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(empty.index(previous))
        mbarrier.arrive(turn.index(1 - ME))  # the other consumer's main loop may start
        post = gl.maximum(acc, 0.0)
        post = post * post
        tma.store_wait(0)  # this consumer's previous tile has left out_buf
        out_buf.store(post.to(gl.bfloat16))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [row0, col0], out_buf)
        mine += 1
    tma.store_wait(0)


@gluon.jit
def _relu2_pingpong_kernel(a_desc, b_desc, out_desc, M, N, K, BM: gl.constexpr, BN: gl.constexpr,
                           BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, PROGRAMS: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    out0 = gl.allocate_shared_memory(out_desc.dtype, [BM, BN], out_desc.layout)
    out1 = gl.allocate_shared_memory(out_desc.dtype, [BM, BN], out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, empty, turn, out_desc, out0, M, N, K, BM, BN, BK, STAGES, GROUP_M,
                     PROGRAMS, 0)),
        (_consumer, (a_bufs, b_bufs, ready, empty, turn, out_desc, out1, M, N, K, BM, BN, BK, STAGES, GROUP_M,
                     PROGRAMS, 1)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BM, BN, BK, STAGES, GROUP_M, PROGRAMS)),
    ], [4, 1], [232, 24])


def relu2_pingpong(a: torch.Tensor, b: torch.Tensor, bm=128, bn=128, bk=64, stages=4, group_m=8) -> torch.Tensor:
    """relu(a @ b^T)^2 in bf16: a [M, K], b [N, K] contiguous bf16."""
    M, K = a.shape
    N = b.size(0)
    out = a.new_empty(M, N)
    layout = lambda shape: gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)  # noqa: E731
    programs = min(torch.cuda.get_device_properties(a.device).multi_processor_count,
                   (M // bm) * (N // bn))
    _relu2_pingpong_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [bm, bk], layout([bm, bk])),
        TensorDescriptor.from_tensor(b, [bn, bk], layout([bn, bk])),
        TensorDescriptor.from_tensor(out, [bm, bn], layout([bm, bn])),
        M, N, K, bm, bn, bk, stages, group_m, programs, num_warps=4)
    return out


def main():
    import train_gpt as tg
    from timing import kernel_median_ms as median_ms
    T, dim, hidden = 65536, 768, 3072
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, dim, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(hidden, dim, device="cuda", generator=g) * dim ** -0.5).to(torch.bfloat16)
    flops = 2 * T * dim * hidden
    ref = torch.relu(x[:4096].double() @ w.double().t()).square()
    print(f"[{T}, {dim}] @ [{hidden}, {dim}]^T, bf16")
    for name, run in (("cuBLAS matmul alone", lambda: x @ w.t()),
                      ("trainer's Triton relu2_matmul", lambda: tg.relu2_matmul(x, w)),
                      ("Gluon ping-pong 128x128x64, 4 stages", lambda: relu2_pingpong(x, w)),
                      ("Gluon ping-pong 128x128x64, 3 stages", lambda: relu2_pingpong(x, w, stages=3)),
                      ("Gluon ping-pong 128x128x64, 5 stages", lambda: relu2_pingpong(x, w, stages=5))):
        try:
            out = run()
            torch.cuda.synchronize()
            error = ((out[:4096].double() - ref).norm() / ref.norm()).item() if out.shape[1] == hidden else float("nan")
            if name.startswith("cuBLAS"):
                error = float("nan")
            ms = median_ms(run)
        except Exception as exc:  # an experiment: report and go on
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:600]}", flush=True)
            continue
        print(f"  {name:44s} {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s  error {error:.1e}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
