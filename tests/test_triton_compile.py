"""The copy pointer's Triton kernels compiled ahead of time for Hopper (sm_90) on a machine without a GPU: Triton's
whole pipeline down to ptxas, which rejects what the interpreter lets pass (types that differ between the branches of
a loop, tile shapes tl.dot cannot take). tests/gpu runs them against float64 on a GPU."""
import pytest

pytest.importorskip("triton", reason="Triton is not installed")
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import train_gpt as tg  # noqa: E402

POINTERS = dict(Q="*bf16", K="*bf16", Tokens="*i64", Targets="*i64", Docs="*i64")
GRADS = dict(LogZ="*fp32", LogHits="*fp32", GradZ="*fp32", GradHits="*fp32")
SHAPE = ("BAND", "D", "BLOCK_M", "BLOCK_N")


@pytest.mark.parametrize("name", ["forward", "queries", "keys"])
def test_copy_pointer_kernels_compile_for_hopper(name):
    kernel, signature, blocks = {
        "forward": (tg._copy_scores_kernel, dict(POINTERS, Sink="*fp32", LogZ="*fp32", LogHits="*fp32", scale="fp32"),
                    tg.COPY_FWD_BLOCKS),
        "queries": (tg._copy_scores_dq_kernel, dict(POINTERS, **GRADS, DQ="*bf16", scale="fp32"), tg.COPY_BWD_BLOCKS),
        "keys": (tg._copy_scores_dk_kernel, dict(POINTERS, **GRADS, DK="*bf16", T="i32", scale="fp32"),
                 tg.COPY_BWD_BLOCKS)}[name]
    constexprs = dict(zip(SHAPE, (2048, 128, *blocks)))
    source = ASTSource(fn=kernel, signature={**signature, **{c: "constexpr" for c in SHAPE}}, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=tg.COPY_WARPS))
    assert "cubin" in compiled.asm and compiled.metadata.shared > 0
