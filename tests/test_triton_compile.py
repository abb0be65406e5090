"""The copy pointer's Triton kernels compiled ahead of time for Hopper (sm_90) on a machine without a GPU: Triton's
whole pipeline down to ptxas, which rejects what the interpreter lets pass (types that differ between the branches of
a loop, tile shapes tl.dot cannot take). tests/gpu runs them against float64 on a GPU."""
import pytest

pytest.importorskip("triton", reason="Triton is not installed")
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import train_gpt as tg  # noqa: E402

TYPES = dict(Q="*bf16", K="*bf16", Tokens="*i64", Targets="*i64", Docs="*i64", Sink="*fp32", LogZ="*fp32",
             LogHits="*fp32", GradZ="*fp32", GradHits="*fp32", DQ="*bf16", DK="*bf16", T="i32")


@pytest.mark.parametrize("name", ["forward", "queries", "keys"])
def test_copy_pointer_kernels_compile_for_hopper(name):
    kernel, blocks = {"forward": (tg._copy_scores_kernel, tg.COPY_FWD_BLOCKS),
                      "queries": (tg._copy_scores_dq_kernel, tg.COPY_BWD_BLOCKS),
                      "keys": (tg._copy_scores_dk_kernel, tg.COPY_BWD_BLOCKS)}[name]
    constexprs = dict(SCALE=128 ** -0.5, BAND=2048, D=128, BLOCK_M=blocks[0], BLOCK_N=blocks[1])
    # Every other argument is a pointer or an int: inductor hands a float argument to a kernel as fp64, so floats
    # are constexprs (a KeyError here names a new argument that needs a type)
    signature = {name: "constexpr" if name in constexprs else TYPES[name] for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=tg.COPY_WARPS))
    assert "cubin" in compiled.asm and compiled.metadata.shared > 0
