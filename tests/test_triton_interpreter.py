"""The Triton kernels, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1), against float64. The
interpreter must be switched on before the kernels are defined, so the checks run in a process of their own: one
that imports torch and train_gpt once and forks a child per check (each check sets the module's globals as it
needs). tests/gpu checks the same kernels compiled on a GPU."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="Triton is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Reads {name: script} on stdin and runs each script in a child forked after the imports, all at once, its output in
# <folder>/<name>.out and .err; prints {name: exit code}.
RUN_CHECKS = textwrap.dedent("""
    import json, os, sys, traceback
    import torch, train_gpt
    folder, checks, children = sys.argv[1], json.load(sys.stdin), {}
    for name, script in checks.items():
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                sys.stdout = open(os.path.join(folder, name + ".out"), "w")
                sys.stderr = open(os.path.join(folder, name + ".err"), "w")
                exec(compile(script, name, "exec"), {"__name__": "__main__"})
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[name] = pid
    print(json.dumps({name: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for name, pid in children.items()}))
""")


@pytest.fixture(scope="module")
def interpreter(tmp_path_factory):
    """Runs every check of this module (the module's *CHECK scripts) in the interpreter at once; returns a function
    of a check's script that asserts it ran to the end and returns its standard output."""
    folder = tmp_path_factory.mktemp("interpreter")
    names = {script: name for name, script in globals().items() if name.endswith("CHECK")}
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    done = subprocess.run([sys.executable, "-c", RUN_CHECKS, str(folder)], input=json.dumps(
        {name: script for script, name in names.items()}), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    codes = json.loads(done.stdout.splitlines()[-1])

    def run(script: str) -> str:
        name = names[script]
        assert codes[name] == 0, (folder / f"{name}.err").read_text()[-3000:]
        return (folder / f"{name}.out").read_text()
    return run


FP8_GRAD_CHECK = textwrap.dedent("""
    import torch, train_gpt as tg
    g = torch.Generator().manual_seed(0)
    rows, vocab, cap = 37, 1001, 30.0
    logits = (torch.randn(rows, vocab, generator=g) * 8).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    losses = torch.zeros(rows)
    # a float32 gradient: the interpreter's float32 -> e5m2 conversion drops the carry of a mantissa rounded up
    # (124.5 becomes 64; a GPU gives 128), so the e5m2 output is checked on the GPU (tests/gpu)
    grad = torch.zeros(rows, vocab)
    tg.CE_FP8_BLOCK, tg.CE_FP8_TAIL = 256, 128  # 1001 = 3 blocks and a tail of 233 in two masked pieces
    tg.softcapped_ce_fp8(logits, targets, (cap, 0.0, cap / 4), losses, grad)
    x = logits.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(cap * torch.sigmoid(x / (cap / 4)), targets, reduction="none")
    ref.sum().backward()  # each row's gradient for an upstream gradient of 1
    quantised = (torch.randn(rows, vocab, generator=g) * 100).to(torch.float8_e5m2)
    print(((losses.double() - ref.detach()).abs().max() / ref.detach().abs().max()).item(),
          ((grad.double() / tg.GRAD_E5M2_MAX - x.grad).norm() / x.grad.norm()).item(),
          tg.transpose_fp8(quantised).view(torch.uint8).equal(quantised.view(torch.uint8).t().contiguous()))
""")


def test_fp8_loss_and_gradient_kernel_matches_float64_and_the_transpose_keeps_the_bits_in_the_interpreter(interpreter):
    stdout = interpreter(FP8_GRAD_CHECK)
    loss_error, grad_error, same = stdout.split()
    assert float(loss_error) < 1e-5, stdout
    assert float(grad_error) < 1e-5, stdout
    assert same == "True", "transpose_fp8 must give the bits of torch's transpose"


MTP_CHECK = textwrap.dedent("""
    import torch, train_gpt as tg
    g = torch.Generator().manual_seed(0)
    rows, vocab, period, cap = 24, 1001, 8, (23.0, 5.0, 7.5)
    logits = (torch.randn(rows, vocab, generator=g) * 8).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[5] = targets[6] = targets[7]  # a token repeated: rows 5 and 6 have one target at several offsets
    weights = torch.tensor([1.0, 0.5, 0.25]) / 1.75
    losses, grad = torch.zeros(rows), torch.zeros(rows, vocab)  # float32 gradient: see FP8_GRAD_CHECK
    tg.CE_FP8_BLOCK, tg.CE_FP8_TAIL = 256, 128
    tg.softcapped_ce_fp8(logits, targets, cap, losses, grad, (weights, period))
    x = logits.double().requires_grad_()
    z = cap[0] * torch.sigmoid((x + cap[1]) / cap[2])
    ref = torch.zeros(rows, dtype=torch.float64)
    for i in range(rows):
        for k in range(3):
            if i % period + k < period:  # inside the row's micro-batch
                ref[i] += weights[k].double() * (torch.logsumexp(z[i], 0) - z[i, targets[i + k]])
    ref.sum().backward()
    print(((losses.double() - ref.detach()).abs().max() / ref.detach().abs().max()).item(),
          ((grad.double() / tg.GRAD_E5M2_MAX - x.grad).norm() / x.grad.norm()).item(),
          grad.abs().max().item() <= tg.GRAD_E5M2_MAX)
""")


def test_fp8_loss_kernel_with_multi_token_weights_and_a_shifted_cap_in_the_interpreter(interpreter):
    """Three offsets weighted 1 : 0.5 : 0.25, micro-batches of 8 rows (the last rows of each predict fewer tokens),
    a token that is the target at several offsets, and the speedrun's 23 * sigmoid((x + 5) / 7.5): losses and
    gradient against float64 autograd, no gradient value past the e5m2 scale."""
    loss_error, grad_error, bounded = interpreter(MTP_CHECK).split()
    assert float(loss_error) < 1e-5 and float(grad_error) < 1e-5 and bounded == "True"


COPY_CHECK = textwrap.dedent("""
    import torch, train_gpt as tg
    from helpers import copy_mixture_reference, pointer_log_masses
    g = torch.Generator().manual_seed(0)
    rows, vocab, period, cap, slot = 24, 1001, 8, (23.0, 5.0, 7.5), 997
    logits = (torch.randn(rows, vocab, generator=g) * 8).to(torch.bfloat16)
    logits[:, slot] = (torch.randn(rows, generator=g) * 4 + 8).to(torch.bfloat16)  # gates from shut to wide open
    logits[:6, slot] = torch.linspace(-14, -4, 6)  # and shut tight: alpha from 1e-8 to 1e-5
    targets = torch.randint(0, 990, (rows,), generator=g)
    targets[5] = targets[6] = targets[7]
    log_copy, log_sink = pointer_log_masses(rows, g)
    weights = torch.tensor([1.0, 0.5, 0.25]) / 1.75
    losses, grad = torch.zeros(rows), torch.zeros(rows, vocab)
    d_copy, d_sink = torch.zeros(rows), torch.zeros(rows)
    tg.CE_FP8_BLOCK, tg.CE_FP8_TAIL = 256, 128
    tg.softcapped_ce_fp8(logits, targets, cap, losses, grad, (weights, period), (slot, log_copy, log_sink, d_copy, d_sink))
    ref, ref_grad, ref_copy, ref_sink = copy_mixture_reference(logits, targets, cap, slot, log_copy, log_sink,
                                                               (weights, period))
    print(((losses.double() - ref).abs().max() / ref.abs().max()).item(),
          ((grad.double() / tg.GRAD_E5M2_MAX - ref_grad).norm() / ref_grad.norm()).item(),
          max((d_copy.double() - ref_copy).abs().max().item(), (d_sink.double() - ref_sink).abs().max().item()),
          grad.abs().max().item() <= tg.GRAD_E5M2_MAX,
          ((grad[:, slot].double() / tg.GRAD_E5M2_MAX - ref_grad[:, slot]).abs() / ref_grad[:, slot].abs()).max().item())
""")


def test_fp8_loss_kernel_with_the_copy_mixture_in_the_interpreter(interpreter):
    """The copy mixture's next-token term with multi-token weights and the shifted cap, gates from shut to wide open,
    rows with and without a hit for the pointer: losses, the logit gradient and the two log-masses' derivatives
    against float64 autograd of copy_mixture_losses, no gradient value past the e5m2 scale; the gate's own
    gradient, as small as alpha where the gate is shut, within 1e-3 of it (the FMA units' exp: 1e-4)."""
    loss_error, grad_error, pointer_error, bounded, gate_error = interpreter(COPY_CHECK).split()
    assert float(loss_error) < 1e-5 and float(grad_error) < 1e-5 and float(pointer_error) < 1e-5
    assert bounded == "True" and float(gate_error) < 1e-3, gate_error


POINTER_CHECK = textwrap.dedent("""
    import torch, train_gpt as tg
    from helpers import dense_pointer_reference, pointer_inputs
    g = torch.Generator().manual_seed(1)
    for band, sink_per_query in ((128, False), (256, True)):
        q, k, sink, tokens, targets, documents = pointer_inputs()
        if sink_per_query:
            sink = torch.randn(q.size(0), generator=g)
        grads = torch.randn(2, q.size(0), generator=g)  # upstream gradients of log_copy and log_sink
        ref_inputs = [t.double().requires_grad_() for t in (q, k, sink)]
        ref_copy, ref_sink = dense_pointer_reference(*ref_inputs, tokens, targets, documents, band)
        ((ref_copy * grads[0]).sum() + (ref_sink * grads[1]).sum()).backward()
        inputs = [t.clone().requires_grad_() for t in (q, k, sink)]
        log_copy, log_sink = tg.copy_log_probs(*inputs, tokens, targets, documents, band, use_triton=True)
        ((log_copy * grads[0]).sum() + (log_sink * grads[1]).sum()).backward()
        hit = ref_copy > -1e8
        print(band, int(hit.sum()), (log_copy.double() - ref_copy)[hit].abs().max().item(),
              bool((log_copy[~hit] < -1e8).all()), (log_sink.double() - ref_sink).abs().max().item(),
              max(((x.grad.double() - r.grad).norm() / r.grad.norm()).item() for x, r in zip(inputs, ref_inputs)))
""")


def test_copy_pointer_kernels_match_float64_in_the_interpreter(interpreter):
    """The pointer's log-masses and the gradients of queries, keys and sink (one score, or one per query) against
    float64 autograd over the whole score matrix, at two bands (the key tiles before a block's documents skipped),
    hits and no hits among the rows."""
    lines = interpreter(POINTER_CHECK).splitlines()
    assert len(lines) == 2
    for line in lines:
        band, hits, copy_error, missed, sink_error, grad_error = line.split()
        assert 50 < int(hits) < 384, line
        assert float(copy_error) < 1e-5 and missed == "True" and float(sink_error) < 1e-5, line
        assert float(grad_error) < 1e-5, line


ROWS_CHECK = textwrap.dedent("""
    import torch, train_gpt as tg
    g = torch.Generator().manual_seed(0)
    # a run of one row longer than a chunk, a length that leaves a partial chunk, a dim that leaves a partial block
    for T, rows, dim, frequent in ((1000, 50, 300, True), (33, 1000, 40, False)):
        indices = torch.randint(0, rows, (T,), generator=g)
        if frequent:
            indices[torch.randperm(T, generator=g)[: T // 2]] = 3
        row_grads = [torch.randn(T, dim, generator=g) for _ in range(3)]
        grads = [torch.randn(rows, dim, generator=g) for _ in range(3)]
        want = [grad.double().index_add(0, indices, rg.double()) for grad, rg in zip(grads, row_grads)]
        tg.add_rows_(grads, indices, row_grads, use_triton=True)
        print(max(((got.double() - ref).abs().max() / ref.abs().max()).item() for got, ref in zip(grads, want)))
    # bf16 row gradients (the value and bigram rows are looked up in bf16) are added in float32
    row_grads = [torch.randn(300, 40, generator=g).to(torch.bfloat16)]
    grads = [torch.zeros(20, 40)]
    indices = torch.randint(0, 20, (300,), generator=g)
    want = torch.zeros(20, 40, dtype=torch.float64).index_add(0, indices, row_grads[0].double())
    tg.add_rows_(grads, indices, row_grads, use_triton=True)
    print(((grads[0].double() - want).abs().max() / want.abs().max()).item())
    table = torch.randn(1000, 300, generator=g)
    indices = torch.randint(0, 1000, (77,), generator=g)
    # the interpreter rounds float32 to bf16 toward zero (a GPU to nearest, tests/gpu checks the bits): one bf16 step
    got, want = tg.gather_rows(table, indices, torch.bfloat16, True).float(), table[indices]
    print(bool(((got - want).abs() <= want.abs() * 2 ** -7).all()))
""")


def test_row_gradient_and_gather_kernels_in_the_interpreter(interpreter):
    stdout = interpreter(ROWS_CHECK)
    *errors, gathered_equal = stdout.split()
    assert len(errors) == 3 and max(float(e) for e in errors) < 1e-6, stdout  # fp32 sums in another order
    assert gathered_equal == "True", "gather_rows must give each looked-up row, converted to bf16"


MLP_CHECK = textwrap.dedent("""
    import torch, train_gpt as tg
    g = torch.Generator().manual_seed(0)
    # float32 (the interpreter's bf16 tl.dot is not the GPU's); rows that leave a partial tile, both epilogue splits
    for rows, dim, hidden, split in ((300, 64, 256, 1), (200, 96, 512, 2)):
        tg.RELU2_MM_CONFIG = (64, 64, 32, 2, split, 4, 2)
        inputs = [torch.randn(rows, dim, generator=g), torch.randn(hidden, dim, generator=g) * 0.2,
                  torch.randn(hidden, dim, generator=g) * 0.2]
        grad_y = torch.randn(rows, dim, generator=g)
        ref = [t.double().requires_grad_() for t in inputs]
        y_ref = torch.relu(ref[0] @ ref[1].t()).square() @ ref[2]
        y_ref.backward(grad_y.double())
        got = [t.clone().requires_grad_() for t in inputs]
        y = tg._FusedReLU2MLP.apply(*got)
        y.backward(grad_y)
        pairs = [(y, y_ref)] + [(a.grad, b.grad) for a, b in zip(got, ref)]
        print(max(((a.double() - b).norm() / b.norm()).item() for a, b in pairs))
""")


def test_fused_mlp_kernel_matches_float64_in_the_interpreter(interpreter):
    """The MLP's Triton matmul (relu^2 in the forward's epilogue, its derivative in the backward's) inside
    _FusedReLU2MLP, output and the three gradients against the plain MLP in float64."""
    errors = interpreter(MLP_CHECK).split()
    assert len(errors) == 2 and max(float(e) for e in errors) < 1e-5, errors


MUON_APPLY_CHECK = textwrap.dedent("""
    import torch, train_gpt as tg
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(96, 40, generator=g).requires_grad_(), torch.randn(5000, 3, generator=g).requires_grad_()]
    # a partial block; 15000 elements, several blocks of 4096
    updates = [(torch.randn(w.shape, generator=g) * 0.5).to(torch.bfloat16) for w in weights]
    opt = tg.Muon([dict(params=[weights[0]], weight_decay=0.5), dict(params=[weights[1]], weight_decay=0.0)], lr=0.02,
                  momentum=0.9)
    opt.fill_scalars()
    for i, (w, u) in enumerate(zip(weights, updates)):
        w = w.detach()
        ops, fused = w.clone(), w.clone()
        opt.group_index_of[ops] = i
        opt._apply([ops], u[None])  # the plain-torch path
        tg.muon_apply_(fused, u, opt.scalars[i, 3:], bool(opt.param_groups[i]["weight_decay"]))
        neg_lr, neg_decay = opt.scalars[i, 3:].double()
        w64, u64 = w.double(), u.double()
        ref = w64 + torch.where(u64 * w64 >= 0, w64, 0.0) * neg_decay + u64 * neg_lr
        print(torch.equal(ops, fused), ((fused.double() - ref).abs().max() / ref.abs().max()).item(),
              (fused != w).float().mean().item())
""")


def test_muon_apply_kernel_keeps_the_plain_torch_bits_in_the_interpreter(interpreter):
    """muon_apply_ (Muon's update and cautious decay in one pass) against Muon's plain-torch path and float64, with
    and without decay, over a partial block and several blocks."""
    lines = interpreter(MUON_APPLY_CHECK).split("\n")[:2]
    for line in lines:
        equal, error, changed = line.split()
        assert equal == "True", line
        assert float(error) < 1e-6, line
        assert float(changed) > 0.9, line  # the step moved the weights
    assert len(lines) == 2
