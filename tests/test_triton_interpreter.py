"""The fused cross-entropy kernels, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1), against
float64. The interpreter must be switched on before the kernels are defined, so this runs in a fresh
process. tests/gpu checks the same kernels compiled on a GPU."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="Triton is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = textwrap.dedent("""
    import torch, train_gpt as tg
    g = torch.Generator().manual_seed(0)
    for rows, vocab in ((37, 1001), (5, 2048)):
        logits = (torch.randn(rows, vocab, generator=g) * 8).to(torch.bfloat16)
        targets = torch.randint(0, vocab, (rows,), generator=g)
        x = logits.clone().requires_grad_()
        (2.5 * tg.softcapped_cross_entropy(x, targets, 30.0, use_triton=True)).backward()
        ref_x = logits.double().requires_grad_()
        ref = torch.nn.functional.cross_entropy(30.0 * torch.sigmoid(ref_x / 7.5), targets)
        (2.5 * ref).backward()
        loss = tg.softcapped_cross_entropy(logits, targets, 30.0, use_triton=True)
        grad_error = ((x.grad.double() - ref_x.grad).norm() / ref_x.grad.norm()).item()
        print(rows, vocab, loss.item(), ref.item(), grad_error)
""")


def test_softcapped_cross_entropy_kernels_match_float64_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")[:2]
    for line in lines:
        rows, vocab, loss, ref, grad_error = line.split()
        assert abs(float(loss) - float(ref)) < 1e-5 * float(ref), line
        assert float(grad_error) < 1e-2, line  # the gradient is stored in bf16
    assert len(lines) == 2
