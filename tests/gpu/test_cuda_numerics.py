"""GPU numerics against float64 references. Skipped without CUDA; run on the device with
`python -m pytest -q tests/gpu` (bench/ab_step.sh runs it first)."""
import pytest
import torch

import train_gpt as tg
import dataclasses

from helpers import (BOS, TINY, VOCAB, copy_mixture_reference, cu_seqlens_of, dense_pointer_reference,
                     pointer_log_masses, random_tiny_model, relative_error, tiny_config)
from test_train import random_attention_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("window", [128, 1024])
def test_compiled_flex_attention_matches_float64(window):
    T, H, D = 4096, 6, 128
    g = torch.Generator().manual_seed(window)
    tokens = torch.randint(0, VOCAB - 1, (T,), generator=g, dtype=torch.int32)
    tokens[torch.randint(0, T, (12,), generator=g)] = BOS
    q, k, v = (torch.randn(T, H, D, generator=g).div(D ** 0.5).to(torch.bfloat16) for _ in range(3))
    flex = tg.FlexAttention(T, torch.device("cuda"))
    attend = torch.compile(lambda q, k, v, mask: flex(q, k, v, mask), fullgraph=True)
    qkv = [t.cuda().requires_grad_() for t in (q, k, v)]
    out = attend(*qkv, flex.prepare(tokens.numel(), cu_seqlens_of(tokens.cuda(), BOS), {"S": window})["S"])
    out.float().square().sum().backward()

    ref_qkv = [t.double().requires_grad_() for t in (q, k, v)]
    sdpa = tg.SdpaAttention()
    ref = sdpa(*ref_qkv, sdpa.prepare(tokens.numel(), cu_seqlens_of(tokens, BOS), {"S": window})["S"])
    ref.square().sum().backward()
    assert relative_error(out.cpu(), ref.detach()) < 1e-2
    for got, want in zip(qkv, ref_qkv):
        assert relative_error(got.grad.cpu(), want.grad) < 2e-2


@pytest.mark.parametrize("window, max_doc_len", [(128, 4096), (1024, 4096), (1024, 256)])
def test_fa3_attention_matches_float64(window, max_doc_len):
    """The FA3 backend (where flash_attn_interface imports: bench/fa3_build.sh builds it), given the padded
    document starts, count and longest document that the loader hands it, in a compiled function as the trainer
    calls it: forward and gradients against float64. With max_doc_len 256 the longest document is longer, and
    the kernels take the whole length as max_seqlen."""
    fa3_module = pytest.importorskip("flash_attn_interface", reason="FlashAttention-3 is not installed")
    T, H, D = 4096, 6, 128
    g = torch.Generator().manual_seed(window)
    tokens = torch.randint(0, VOCAB - 1, (T,), generator=g, dtype=torch.int32)
    tokens[torch.randint(0, T, (12,), generator=g)] = BOS
    q, k, v = (torch.randn(T, H, D, generator=g).div(D ** 0.5).to(torch.bfloat16) for _ in range(3))
    slot = tg._Slot(T, False, BOS)
    slot.fill([torch.cat([tokens, tokens[:1]]).numpy().astype("uint16")])
    fa3 = tg.FlashAttention3(fa3_module, max_doc_len)
    assert slot.documents < T // 256 and 256 < slot.longest_document <= 4096
    attend = torch.compile(lambda q, k, v, mask: fa3(q, k, v, mask), fullgraph=True)
    qkv = [t.cuda().requires_grad_() for t in (q, k, v)]
    mask = fa3.prepare(tokens.numel(), slot.cu_seqlens.cuda(), {"S": window}, slot.documents, slot.longest_document)
    out = attend(*qkv, mask["S"])
    out.float().square().sum().backward()

    ref_qkv = [t.double().requires_grad_() for t in (q, k, v)]
    sdpa = tg.SdpaAttention()
    ref = sdpa(*ref_qkv, sdpa.prepare(tokens.numel(), cu_seqlens_of(tokens, BOS), {"S": window})["S"])
    ref.square().sum().backward()
    assert relative_error(out.cpu(), ref.detach()) < 1e-2
    for got, want in zip(qkv, ref_qkv):
        assert relative_error(got.grad.cpu(), want.grad) < 2e-2


def test_fa3_under_cuda_graphs_matches_float64_as_the_window_changes():
    """FA3 as the forwards under CUDA graphs call it: in a function compiled with reduce-overhead, the op captured
    with the rest, its window, max_seqlen and count of document starts ints, one recorded graph per value. Two
    windows in turn, three calls each (warm-up, recording, replay), each call's output and gradients against
    float64: a replay that kept another window, or kernels left outside the graph, would show."""
    fa3_module = pytest.importorskip("flash_attn_interface", reason="FlashAttention-3 is not installed")
    T, H, D = 4096, 6, 128
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB - 1, (T,), generator=g, dtype=torch.int32)
    tokens[torch.randint(0, T, (12,), generator=g)] = BOS
    q, k, v = (torch.randn(T, H, D, generator=g).div(D ** 0.5).to(torch.bfloat16) for _ in range(3))
    slot = tg._Slot(T, False, BOS)
    slot.fill([torch.cat([tokens, tokens[:1]]).numpy().astype("uint16")])
    fa3 = tg.FlashAttention3(fa3_module, 4096)
    attend = torch.compile(lambda q, k, v, mask: fa3(q, k, v, mask), fullgraph=True, mode="reduce-overhead")
    cu_seqlens = slot.cu_seqlens.cuda()
    sdpa, references = tg.SdpaAttention(), {}
    for window in (128, 1024) * 3:
        if window not in references:
            ref_qkv = [t.double().requires_grad_() for t in (q, k, v)]
            ref = sdpa(*ref_qkv, sdpa.prepare(T, cu_seqlens_of(tokens, BOS), {"S": window})["S"])
            ref.square().sum().backward()
            references[window] = ref.detach(), [t.grad for t in ref_qkv]
        torch.compiler.cudagraph_mark_step_begin()
        qkv = [t.cuda().requires_grad_() for t in (q, k, v)]
        mask = fa3.prepare(T, cu_seqlens, {"S": window}, slot.documents, slot.longest_document)["S"]
        out = attend(*qkv, mask)
        out.float().square().sum().backward()
        want, want_grads = references[window]
        assert relative_error(out.cpu(), want) < 1e-2, window
        for got, expected in zip(qkv, want_grads):
            assert relative_error(got.grad.cpu(), expected) < 2e-2, window


@pytest.mark.parametrize("backend", ["flex", "fa3"])
def test_compiled_paired_head_attention_matches_float64(backend):
    """A paired-head layer (its value gate, XSA and output gates on, the key offset on) compiled in bf16 with the backend for the doubled
    sequence, as GPT builds it: output and gradients against the same layer in float64 on the CPU with SDPA
    (which tests/test_train.py checks against loops)."""
    T, H, D, window = 2048, 6, 128, 384
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB - 1, (T,), generator=g, dtype=torch.int32)
    tokens[torch.randint(0, T, (8,), generator=g)] = BOS
    starts = tokens == BOS
    slot = tg._Slot(T, False, BOS)
    slot.fill([torch.cat([tokens, tokens[:1]]).numpy().astype("uint16")])
    if backend == "fa3":
        fa3_module = pytest.importorskip("flash_attn_interface", reason="FlashAttention-3 is not installed")
        attend = tg.FlashAttention3(fa3_module, T).for_paired_heads()
    else:
        attend = tg.FlexAttention(T, torch.device("cuda")).for_paired_heads()
    mask = attend.prepare(2 * T, 2 * slot.cu_seqlens.cuda(), {"S": window}, slot.documents,
                          2 * slot.longest_document)["S"]
    # layer 3 of the default model, paired, with a value embedding and its own gate
    cfg = dataclasses.replace(tg.Config(), value_embed_layout="...0......1", paired_head_layers=(3,))
    layer = tg.CausalSelfAttention(cfg, 3)
    assert layer.paired and layer.shift_keys and layer.gate_w is not None
    with torch.no_grad():
        layer.qkvo_w.uniform_(-(3 ** 0.5) * 0.5 / (H * D) ** 0.5, (3 ** 0.5) * 0.5 / (H * D) ** 0.5)
        layer.gate_w.normal_(std=0.5)
    x, value_embed = torch.randn(T, H * D, generator=g), torch.randn(T, H * D, generator=g)
    gates = tg.LayerGates(None, torch.randn(T, H, generator=g), torch.rand(T, H, generator=g))
    results = []
    for device, dtype, run in (("cuda", torch.bfloat16, torch.compile(layer.cuda(), fullgraph=True)),
                               ("cpu", torch.float64, None)):
        layer.zero_grad(set_to_none=True)
        rotary = tg.Rotary(D, T, T, 0.1, True).to(device)
        inputs = x.to(device, dtype).requires_grad_()
        if device == "cpu":
            layer = layer.cpu().double()
            sdpa = tg.SdpaAttention()
            run, attend, mask = layer, sdpa, sdpa.prepare(2 * T, 2 * cu_seqlens_of(tokens, BOS), {"S": window})["S"]
        token = tg.LayerGates(None, *(t.to(device, dtype) for t in (gates.xsa, gates.out)))
        out = run(inputs, value_embed.to(device, dtype), rotary.tables(True), mask, attend, starts.to(device), None, token)
        out.float().square().sum().backward()
        results.append((out.detach().double().cpu(), inputs.grad.double().cpu(), layer.qkvo_w.grad.double().cpu(),
                        layer.gate_w.grad.double().cpu()))
    (out, *grads), (ref, *ref_grads) = results
    assert relative_error(out, ref) < 1e-2
    for got, want in zip(grads, ref_grads):
        assert relative_error(got, want) < 3e-2


@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("shape", [(4, 768, 768), (3072, 768), (8, 768, 3072)])
def test_bf16_orthogonalize_matches_float64(shape, use_triton):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    got = tg.orthogonalize(g.cuda(), use_triton).double().cpu()
    # the same iteration in float64
    X = g.double()
    X = X.mT if X.size(-2) > X.size(-1) else X
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6)
    for a, b, c in tg.POLAR_EXPRESS_COEFFS:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    want = X.mT if g.size(-2) > g.size(-1) else X
    assert relative_error(got, want) < 3e-2
    # Gaussian square matrices have singular values near 0 that five iterations cannot lift (even in
    # float64); on a spectrum inside the method's design range every value must land in the band.
    singular_values = torch.linalg.svdvals(tg.orthogonalize(well_conditioned(*shape).cuda(), use_triton).double())
    assert singular_values.min() > 0.7 and singular_values.max() < 1.2


def well_conditioned(*shape, seed=0):
    """Random singular vectors, singular values spread evenly over [0.05, 1]."""
    g = torch.Generator().manual_seed(seed)
    *batch, m, n = shape
    r = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(*batch, m, r, generator=g))
    V, _ = torch.linalg.qr(torch.randn(*batch, n, r, generator=g))
    return U @ torch.diag_embed(torch.linspace(0.05, 1, r).expand(*batch, r)) @ V.mT


def test_gpu_bf16_loss_matches_cpu_fp32():
    """The whole model: compiled, FlexAttention, bf16 on the GPU vs SDPA, fp32 on the CPU."""
    cfg, _ = tg.parse_cli([*TINY, "--micro_batch_tokens=1024", "--stages=8 1 128:256 1024 1; 8 0.15 128:256 1024 1",
                           "--final_windows=256:512", "--compile=1"])
    torch.manual_seed(0)
    cpu_model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    with torch.no_grad():  # leave the zero init so every path carries signal
        for p in cpu_model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.02)
    cuda = torch.device("cuda")
    gpu_model = tg.GPT(cfg, tg.FlexAttention(1024, cuda), torch.bfloat16, kernels=tg.choose_kernels(cfg, cuda)).cuda()
    gpu_model.load_state_dict(cpu_model.state_dict())
    tg.compile_model(gpu_model, cfg, model_graphs=False)
    tokens, *_ = random_attention_inputs(T=1025, seed=3)
    inputs, targets = tokens[:-1], tokens[1:].long()
    bigrams = torch.from_numpy(tg.bigram_hash(inputs.numpy(), cfg.bigram_rows, cfg.bos_token))
    losses = []
    for model, device in ((cpu_model, "cpu"), (gpu_model, "cuda")):
        x, y = inputs.to(device), targets.to(device)
        masks = model.prepare_masks(x, cu_seqlens_of(x, cfg.bos_token), (128, 256))
        losses.append(model(x, y, masks, bigrams.to(device)).item())
    assert abs(losses[1] - losses[0]) / losses[0] < 1e-2, losses


# The shapes Muon sees in the default model: 40 attention projections of 768 x 768, 22 MLP matrices
# stored 3072 x 768 (iterated transposed, 768 x 3072), and an odd shape for the edge masks.
SYMMETRIC_SHAPES = [(40, 768, 768), (22, 768, 3072), (3, 200, 136)]


@pytest.mark.parametrize("shape", SYMMETRIC_SHAPES)
def test_symmetric_matmul_kernel_matches_float64(shape):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(*shape, generator=g).div(shape[-1] ** 0.5).to(torch.bfloat16)
    Xc = X.cuda()
    A = torch.full((shape[0], shape[1], shape[1]), float("nan"), device="cuda", dtype=torch.bfloat16)  # poisoned
    tg.symmetric_matmul(Xc, out=A)
    ref_A = X.double() @ X.double().mT
    assert not A.isnan().any()
    assert relative_error(A.cpu(), ref_A) < 1e-2
    B = torch.full_like(A, float("nan"))
    tg.symmetric_matmul(A, out=B, alpha=-2.3, beta=0.7, Y=A)
    A64 = A.double().cpu()
    assert not B.isnan().any()
    assert relative_error(B.cpu(), 0.7 * A64 - 2.3 * A64 @ A64) < 1e-2


def test_dist_adam_resumes_from_a_state_dict_saved_on_the_cpu():
    """torchft hands a healing replica its peer's optimizer state as CPU tensors."""
    def make():
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(64, 32, device="cuda"))
        return weight, tg.DistAdam([dict(params=[weight])], lr=1e-2, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)

    def adam_step(weight, opt, seed):
        weight.grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed)).cuda()
        opt.step()

    weight, opt = make()
    adam_step(weight, opt, 1)
    saved = torch.utils._pytree.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t,
                                         {"weight": weight, "opt": opt.state_dict()})
    adam_step(weight, opt, 2)

    resumed, resumed_opt = make()
    with torch.no_grad():
        resumed.copy_(saved["weight"])
    resumed_opt.load_state_dict(saved["opt"])
    adam_step(resumed, resumed_opt, 2)
    assert torch.equal(resumed, weight)


@pytest.mark.parametrize("compiled", [False, True])
def test_adam_update_matches_float64(compiled):
    """DistAdam's update (eager, and compiled as on the GPU in training: one kernel per bucket shape) against
    Adam with cautious lr-squared weight decay in float64, over steps whose lr changes (no new graph: lr and decay are
    tensors)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50304 * 8, generator=g)
    grads = [torch.randn(weight.shape, generator=g) * 1e-3 for _ in range(4)]
    p = torch.nn.Parameter(weight.clone().cuda())
    opt = tg.DistAdam([dict(params=[p])], lr=0.6, betas=(0.75, 0.95), eps=1e-10, weight_decay=0.025, compiled=compiled)
    ref, m, v = weight.double(), torch.zeros(weight.shape, dtype=torch.float64), torch.zeros(weight.shape, dtype=torch.float64)
    for step, grad in enumerate(grads, start=1):
        lr = 0.6 * (1 - 0.2 * step)
        opt.param_groups[0]["lr"] = lr
        p.grad = grad.cuda()
        opt.step()
        m = 0.75 * m + 0.25 * grad.double()
        v = 0.95 * v + 0.05 * grad.double() ** 2
        update = lr * (m / (1 - 0.75 ** step)) / ((v / (1 - 0.95 ** step)).sqrt() + 1e-10)
        ref = ref - update - lr ** 2 * 0.025 * (update * ref > 0) * ref
    assert relative_error(p.detach().cpu(), ref) < 1e-6


def test_normuon_matches_float64():
    """NorMuon's rescaling of bf16 orthogonalised updates (as Muon computes them on the GPU) against the same formula
    in float64 on the same input: per row of a tall block, the running mean square, the division by its root and the
    Frobenius norm kept."""
    g = torch.Generator().manual_seed(0)
    updates = [torch.randn(8, 768, 768, generator=g).to(torch.bfloat16) for _ in range(3)]
    states = [dict(), dict()]  # two matrices of 4 blocks each, as a QKVO stack
    moment = torch.zeros(8, 768, 1, dtype=torch.float64)
    for update in updates:
        got = tg.normuon_(update.cuda(), states, 4, 0.95, "second_moment_0")
        u = update.double()
        moment = 0.95 * moment + 0.05 * u.square().mean(dim=-1, keepdim=True)
        scaled = u / moment.clamp_min(1e-10).sqrt()
        want = scaled * u.norm(dim=(-2, -1), keepdim=True) / scaled.norm(dim=(-2, -1), keepdim=True)
        assert got.dtype == torch.bfloat16
        assert relative_error(got.cpu(), want) < 1e-2


def muon_on_test_matrices(g: torch.Generator, graphs: bool):
    """Seven 1024 x 256 matrices on the GPU, three of them attention-like in two runs of row blocks (Q/K-like blocks
    of 128 rows, V/O-like of 256), and a Muon over them with decay, NorMuon, slow momentum and the Triton kernels."""
    attn = [torch.randn(1024, 256, generator=g).cuda().requires_grad_() for _ in range(3)]
    mlp = [torch.randn(1024, 256, generator=g).cuda().requires_grad_() for _ in range(4)]
    opt = tg.Muon([dict(params=attn, split=((128, 4), (256, 2))), dict(params=mlp, lr_mul=2.0)], lr=0.02,
                  momentum=0.9, weight_decay=0.5, beta2=0.95, use_triton=True, slow_momentum=0.98, cuda_graphs=graphs)
    return attn, mlp, opt


def test_muon_parts_as_cuda_graphs_give_the_steps_run_kernel_by_kernel():
    """Muon's CUDA graphs: its compute between its collectives and its weight update, captured as CUDA graphs at the
    second step and replayed from then on, on the Triton Newton-Schulz, with the lr, momentum and slow share
    changing at every step (a graph that kept its recording's values would drift from the eager run): the same
    weights as the same steps launched kernel by kernel."""
    def train(graphs):
        g = torch.Generator().manual_seed(0)
        attn, mlp, opt = muon_on_test_matrices(g, graphs)
        for step in range(6):
            for group in opt.param_groups:
                group["lr"] = 0.02 * (1 - 0.1 * step)
                group["momentum"], group["fast_momentum"], group["slow_share"] = 0.85 + 0.02 * step, 0.8, 0.1 * step
            for p in attn + mlp:
                p.grad = torch.randn(p.shape, generator=g).cuda()
            opt.step()
        return [p.detach().cpu() for p in attn + mlp], opt
    eager, _ = train(False)
    graphed, opt = train(True)
    assert len(opt.graphs.graphs) == 2 * len(opt.groups)  # each group's two parts captured
    again, _ = train(False)
    assert all(torch.equal(a, b) for a, b in zip(eager, again))  # the eager steps give the same bits twice
    for got, want in zip(graphed, eager):
        assert relative_error(got, want) < 1e-6


def test_row_embedding_grads_match_dense_ones_on_the_gpu():
    """The row lookups' table gradients (the gather and row-gradient kernels, added into a dense .grad) against
    autograd's dense embedding gradients, over two micro-batches of the compiled bf16 model."""
    from helpers import dense_lookup
    cfg, _ = tg.parse_cli([*TINY, "--micro_batch_tokens=1024", "--compile=1"])
    grads = {}
    lookup = tg._RowLookup.apply
    for dense in (True, False):
        torch.manual_seed(0)
        cuda = torch.device("cuda")
        model = tg.GPT(cfg, tg.FlexAttention(1024, cuda), torch.bfloat16, kernels=tg.choose_kernels(cfg, cuda)).cuda()
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 2:
                    p.normal_(0, 0.02)
        tg.compile_model(model, cfg, model_graphs=False)
        model.prepare_grads()
        tg._RowLookup.apply = dense_lookup if dense else lookup
        try:
            for seed in (3, 4):
                tokens, *_ = random_attention_inputs(T=1025, seed=seed)
                x, y = tokens[:-1].cuda(), tokens[1:].long().cuda()
                bigrams = torch.from_numpy(tg.bigram_hash(tokens[:-1].numpy(), cfg.bigram_rows, cfg.bos_token)).cuda()
                model(x, y, model.prepare_masks(x, cu_seqlens_of(x, cfg.bos_token), (128, 256)), bigrams).backward()
        finally:
            tg._RowLookup.apply = lookup
        tables = [model.embed.weight, *(t.weight for t in model.value_embeds), model.bigram_embed.weight]
        grads[dense] = [p.grad.double().cpu() for p in tables]
    for dense, rows in zip(grads[True], grads[False]):
        assert dense.abs().sum() > 0
        assert relative_error(rows, dense) < 1e-5  # the same rows summed in another order


@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_head_matches_float64(compiled):
    """--fp8_head (_scaled_mm and the fused loss-and-gradient kernel) against the same quantised arithmetic in float64
    (tests/helpers.py), and against the unquantised head."""
    from helpers import fp8_head_reference, unquantised_head_reference
    rows, dim, vocab = 1024, 768, 50304
    g = torch.Generator().manual_seed(7)
    x = tg.rms_norm(torch.randn(rows, dim, generator=g)).to(torch.bfloat16)
    weight = torch.randn(vocab, dim, generator=g) * 0.05
    targets = torch.randint(0, vocab, (rows,), generator=g)
    head = lambda x, w, y: tg._Fp8SoftcappedHead.apply(x, w, y, (30.0, 0.0, 7.5), None, 0)  # noqa: E731
    if compiled:
        head = torch.compile(head, fullgraph=True, dynamic=False)
    xc, wc = x.cuda().requires_grad_(), weight.cuda().requires_grad_()
    loss = head(xc, wc, targets.cuda())
    loss.backward()
    assert xc.grad.dtype == torch.bfloat16 and wc.grad.dtype == torch.float32
    assert all(torch.isfinite(t).all() for t in (loss, xc.grad, wc.grad))

    every = torch.full((rows,), 1 / rows)
    ref_losses, ref_x, ref_w = fp8_head_reference(x, weight, targets, 30.0, every)
    assert relative_error(loss.detach().cpu(), ref_losses.mean()) < 2e-3  # the logits are bf16 here
    assert relative_error(xc.grad.cpu(), ref_x) < 5e-2  # bf16 logits move a few e5m2 roundings
    assert relative_error(wc.grad.cpu(), ref_w) < 5e-2
    _, exact_x, exact_w = unquantised_head_reference(x, weight, targets, 30.0, every)
    assert relative_error(xc.grad.cpu(), exact_x) < 0.15 and relative_error(wc.grad.cpu(), exact_w) < 0.15


@pytest.mark.parametrize("vocab", [50304, 50257, 3000])
def test_fp8_loss_kernel_matches_float64(vocab):
    """softcapped_ce_fp8 with its PTX approximations (tanh.approx, ex2/rcp without range fix-ups, the gradient's
    exp on the FMA units): each loss within 1e-5 of float64, and each e5m2 gradient value within the format's
    half step (12.5%) of the exact one, plus its smallest subnormal; at the trainer's vocabulary (three full
    blocks and a tail of two masked pieces), GPT-2's (an odd tail) and one smaller than a block (tail only)."""
    rows, cap = 512, 30.0
    g = torch.Generator(device="cuda").manual_seed(11)
    logits = torch.randn(rows, vocab, generator=g, device="cuda") * 2 - 4
    top = torch.randint(0, vocab, (rows, 32), generator=g, device="cuda")
    logits.scatter_(1, top, torch.rand(rows, 32, generator=g, device="cuda") * 14 + 2)  # model-like rows
    logits = logits.to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), generator=g, device="cuda")
    targets[::2] = top[::2, 0]  # half the targets among the likely tokens: their -1 dominates the row
    losses = torch.empty(rows, device="cuda")
    grad = torch.empty(rows, vocab, device="cuda", dtype=torch.float8_e5m2)
    tg.softcapped_ce_fp8(logits, targets, (cap, 0.0, cap / 4), losses, grad)

    x = logits.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(cap * torch.sigmoid(x / (cap / 4)), targets, reduction="none")
    ref.sum().backward()
    assert ((losses.double() - ref.detach()).abs() / ref.detach()).max().item() < 1e-5
    got = grad.double() / tg.GRAD_E5M2_MAX
    slack = 0.13 * x.grad.abs() + 2.0 ** -16 / tg.GRAD_E5M2_MAX
    assert ((got - x.grad).abs() <= slack).all()
    assert relative_error(got, x.grad) < 0.06  # e5m2 rounding, not a systematic error


def test_fp8_loss_kernel_with_multi_token_weights_matches_float64():
    """Multi-token losses (offsets 1 : 0.5 : 0.25 inside micro-batches of 128 rows, repeated targets) with the
    speedrun's shifted cap 23 * sigmoid((x + 5) / 7.5), the PTX approximations on: losses within 1e-5 of float64,
    gradient values within e5m2's half step."""
    rows, vocab, period, cap = 512, 50304, 128, (23.0, 5.0, 7.5)
    g = torch.Generator(device="cuda").manual_seed(12)
    logits = (torch.randn(rows, vocab, generator=g, device="cuda") * 2 - 4).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), generator=g, device="cuda")
    targets[10:13] = targets[12]
    weights = torch.tensor([1.0, 0.5, 0.25], device="cuda") / 1.75
    losses = torch.empty(rows, device="cuda")
    grad = torch.empty(rows, vocab, device="cuda", dtype=torch.float8_e5m2)
    tg.softcapped_ce_fp8(logits, targets, cap, losses, grad, (weights, period))
    x = logits.double().requires_grad_()
    z = cap[0] * torch.sigmoid((x + cap[1]) / cap[2])
    lse = torch.logsumexp(z, dim=1)
    position = torch.arange(rows, device="cuda") % period
    ref = torch.zeros(rows, dtype=torch.float64, device="cuda")
    for k in range(3):
        ahead = torch.cat([targets[k:], targets[:k]])
        ref = ref + weights[k].double() * (position + k < period) * (lse - z.gather(1, ahead[:, None])[:, 0])
    ref.sum().backward()
    assert ((losses.double() - ref.detach()).abs() / ref.detach()).max().item() < 1e-5
    got = grad.double() / tg.GRAD_E5M2_MAX
    assert ((got - x.grad).abs() <= 0.13 * x.grad.abs() + 2.0 ** -16 / tg.GRAD_E5M2_MAX).all()


def test_fp8_loss_kernel_with_the_copy_mixture_matches_float64():
    """The copy mixture's next-token term (gate in column 50257, gates from shut to wide open, rows with and without
    a hit for the pointer) with multi-token weights and the shifted cap, the PTX approximations on: losses and the
    log-masses' derivatives within 1e-5 of float64 autograd of copy_mixture_losses, gradient values within e5m2's
    half step."""
    rows, vocab, period, cap, slot = 512, 50304, 128, (23.0, 5.0, 7.5), 50257
    g = torch.Generator(device="cuda").manual_seed(13)
    logits = (torch.randn(rows, vocab, generator=g, device="cuda") * 2 - 4).to(torch.bfloat16)
    logits[:, slot] = (torch.randn(rows, generator=g, device="cuda") * 6 + 4).to(torch.bfloat16)
    targets = torch.randint(0, slot, (rows,), generator=g, device="cuda")
    targets[10:13] = targets[12]
    log_copy, log_sink = pointer_log_masses(rows, g, "cuda")
    weights = torch.tensor([1.0, 0.5, 0.25], device="cuda") / 1.75
    losses, d_copy, d_sink = (torch.empty(rows, device="cuda") for _ in range(3))
    grad = torch.empty(rows, vocab, device="cuda", dtype=torch.float8_e5m2)
    tg.softcapped_ce_fp8(logits, targets, cap, losses, grad, (weights, period), (slot, log_copy, log_sink, d_copy, d_sink))
    ref, ref_grad, ref_copy, ref_sink = copy_mixture_reference(logits, targets, cap, slot, log_copy, log_sink,
                                                               (weights, period))
    assert ((losses.double() - ref).abs() / ref).max().item() < 1e-5
    assert (d_copy.double() - ref_copy).abs().max().item() < 1e-5 and (d_sink.double() - ref_sink).abs().max().item() < 1e-5
    got = grad.double() / tg.GRAD_E5M2_MAX
    assert ((got - ref_grad).abs() <= 0.13 * ref_grad.abs() + 2.0 ** -16 / tg.GRAD_E5M2_MAX).all()


@pytest.mark.parametrize("band", [1024, 2048])
def test_copy_pointer_kernels_match_float64(band):
    """The pointer's Triton kernels (compiled, as in training) on bf16 queries and keys of the model's head width:
    log-masses within 1e-4 of float64 over the whole score matrix, gradients of queries, keys and sink within the
    bf16 rounding of the score gradients; documents of 3,000 tokens (longer than the band) and of 300; a sink score
    per query at one band, one for all at the other."""
    T, d = 8192, 128
    g = torch.Generator(device="cuda").manual_seed(band)
    q = (tg.rms_norm(torch.randn(T, d, generator=g, device="cuda")) * 1.5).to(torch.bfloat16)
    k = tg.rms_norm(torch.randn(T, d, generator=g, device="cuda")).to(torch.bfloat16)
    sink = torch.randn(T, generator=g, device="cuda") if band == 1024 else torch.tensor([1.3], device="cuda")
    tokens = torch.randint(0, 300, (T,), generator=g, device="cuda")
    targets = torch.cat([tokens[1:], tokens[:1]])
    positions = torch.arange(T, device="cuda")
    documents = torch.cumsum((positions % 3000 == 0) | ((positions > 6000) & (positions % 300 == 0)), 0)
    grads = torch.randn(2, T, generator=g, device="cuda")
    ref_inputs = [t.double().requires_grad_() for t in (q, k, sink)]
    ref_copy, ref_sink = dense_pointer_reference(*ref_inputs, tokens, targets, documents, band)
    ((ref_copy * grads[0]).sum() + (ref_sink * grads[1]).sum()).backward()
    inputs = [t.clone().requires_grad_() for t in (q, k, sink)]
    pointer = torch.compile(tg.copy_log_probs, fullgraph=True, dynamic=False)
    log_copy, log_sink = pointer(*inputs, tokens, targets, documents, band, use_triton=True)
    ((log_copy * grads[0]).sum() + (log_sink * grads[1]).sum()).backward()
    hit = ref_copy > -1e8
    assert 1000 < hit.sum() < T - 1000
    assert (log_copy.double() - ref_copy)[hit].abs().max().item() < 1e-4 and (log_copy[~hit] < -1e8).all()
    assert (log_sink.double() - ref_sink).abs().max().item() < 1e-4
    for got, ref in zip(inputs, ref_inputs):
        assert relative_error(got.grad, ref.grad) < 1e-2, relative_error(got.grad, ref.grad)


@pytest.mark.parametrize("shape", [(16384, 50304), (1000, 50257)])
def test_fp8_transpose_kernel_keeps_the_bits(shape):
    """transpose_fp8 makes the FP8 weight gradient's [V, T] layout: it must equal torch's transpose bit for bit,
    at the trainer's shape and at one that leaves partial tiles on both edges."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(*shape, generator=g, device="cuda") * 100).to(torch.float8_e5m2)
    got = tg.transpose_fp8(x)
    want = x.view(torch.uint8).t().contiguous()
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), want)


def test_row_gradient_kernel_matches_float64():
    """add_rows_ (the embedding tables' row gradients) at a packed forward's size, with one row as frequent as
    the commonest token, against float64."""
    g = torch.Generator(device="cuda").manual_seed(5)
    T, rows, dim = 65536, 50304, 768
    indices = torch.randint(0, rows, (T,), device="cuda", generator=g)
    indices[::3] = 13
    row_grads = [torch.randn(T, dim, device="cuda", generator=g) for _ in range(2)]
    grads = [torch.randn(rows, dim, device="cuda", generator=g) for _ in range(2)]
    want = [grad.double().index_add(0, indices, rg.double()) for grad, rg in zip(grads, row_grads)]
    tg.add_rows_(grads, indices, row_grads, use_triton=True)
    for got, ref in zip(grads, want):
        assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6


def test_gather_rows_converts_as_torch_does():
    g = torch.Generator(device="cuda").manual_seed(6)
    table = torch.randn(50304, 768, device="cuda", generator=g)
    indices = torch.randint(0, 50304, (65536 + 5,), device="cuda", generator=g)  # a partial tile at the end
    got = tg.gather_rows(table, indices, torch.bfloat16, use_triton=True)
    assert torch.equal(got, table[indices].to(torch.bfloat16))


def test_loss_watch_reads_each_loss_a_step_late_on_the_gpu():
    """Each loss goes to pinned memory behind an event; the next push (or flush) reads it, and a NaN names its step."""
    watch = tg.LossWatch(tg.Comm(), torch.device("cuda"))
    for step in range(3):
        torch.cuda._sleep(10_000_000)  # the GPU still busy when the host pushes
        watch.push(step, torch.full((), float(step), device="cuda"))
    assert watch.losses == [0.0, 1.0]
    watch.flush()
    watch.push(3, torch.full((), float("nan"), device="cuda"))
    assert watch.losses == [0.0, 1.0, 2.0]
    with pytest.raises(tg.TrainingDiverged, match="loss is nan at step 4 on rank 0"):
        watch.flush()


@pytest.mark.parametrize("rows", [16384, 1000])
@pytest.mark.parametrize("compiled", [False, True])
def test_fused_mlp_matches_float64(rows, compiled):
    """_FusedReLU2MLP (two Triton matmuls with the activation in their epilogues, three of cuBLAS's) against
    the plain MLP in float64, output and the three gradients, at a micro-batch's rows and at a count that
    leaves partial tiles; in bf16, as close as the unfused bf16 MLP is."""
    g = torch.Generator(device="cuda").manual_seed(11)
    dim, hidden = 768, 3072
    x = torch.randn(rows, dim, device="cuda", generator=g).to(torch.bfloat16)
    fc_w = torch.randn(hidden, dim, device="cuda", generator=g) * dim ** -0.5
    proj_w = torch.randn(hidden, dim, device="cuda", generator=g) * hidden ** -0.5
    grad_y = torch.randn(rows, dim, device="cuda", generator=g).to(torch.bfloat16)
    ref = [t.double().requires_grad_() for t in (x, fc_w, proj_w)]
    y_ref = torch.relu(ref[0] @ ref[1].t()).square() @ ref[2]
    y_ref.backward(grad_y.double())
    results = {}
    for fused in (True, False):
        mlp = tg.MLP(dim, fused=fused).cuda()
        with torch.no_grad():
            mlp.fc_w.copy_(fc_w)
            mlp.proj_w.copy_(proj_w)
        run = torch.compile(mlp, dynamic=False, fullgraph=True) if compiled else mlp
        xin = x.clone().requires_grad_()
        y = run(xin)
        y.backward(grad_y)
        results[fused] = [relative_error(got, want) for got, want in
                          zip((y, xin.grad, mlp.fc_w.grad, mlp.proj_w.grad), (y_ref, ref[0].grad, ref[1].grad, ref[2].grad))]
    for fused_error, plain_error in zip(results[True], results[False]):
        assert fused_error < max(2 * plain_error, 1e-2), (results, rows, compiled)


def test_fused_mlp_and_fp8_head_give_the_same_bits_every_time():
    """Neither kernel adds with atomics, so the same inputs must give the same bits on every call: a difference is a
    race or a read of memory the kernel did not write."""
    g = torch.Generator(device="cuda").manual_seed(5)
    rows, dim, hidden, vocab = 8192, 768, 3072, 50304
    x = torch.randn(rows, dim, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    fc_w = (torch.randn(hidden, dim, device="cuda", generator=g) * dim ** -0.5).to(torch.bfloat16).requires_grad_()
    proj_w = (torch.randn(hidden, dim, device="cuda", generator=g) * hidden ** -0.5).to(torch.bfloat16).requires_grad_()
    head = (torch.randn(vocab, dim, device="cuda", generator=g) * 0.005).requires_grad_()
    targets = torch.randint(0, 50257, (rows,), device="cuda", generator=g)
    mtp = (torch.tensor([1.0, 0.5, 0.25], device="cuda"), rows // 2)

    def run():
        for leaf in (x, fc_w, proj_w, head):
            leaf.grad = None
        y = tg._FusedReLU2MLP.apply(x, fc_w, proj_w)
        loss = tg._Fp8SoftcappedHead.apply(tg.rms_norm(y), head, targets, (23.0, 5.0, 7.5), *mtp)
        loss.backward()
        return [t.detach().clone() for t in (y, loss, x.grad, fc_w.grad, proj_w.grad, head.grad)]

    first = run()
    assert all(torch.isfinite(t).all() for t in first)
    for _ in range(30):
        for got, want in zip(run(), first):
            assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("graphs", [False, True])
def test_muon_fused_apply_keeps_the_bits(graphs):
    """Muon's one-pass update (muon_apply_, the default on CUDA) against the plain-torch ops: the same weights to the
    bit after six steps with decay, NorMuon and two runs of row blocks, kernel by kernel and as graphs."""
    def train(fast):
        g = torch.Generator().manual_seed(0)
        attn, mlp, opt = muon_on_test_matrices(g, graphs)
        assert opt.fused_apply  # the default with the Triton kernels
        opt.fused_apply = fast
        for step in range(6):
            for group in opt.param_groups:
                group["lr"] = 0.02 * (1 - 0.1 * step)
            for p in attn + mlp:
                p.grad = torch.randn(p.shape, generator=g).cuda()
            opt.step()
        return [p.detach().cpu() for p in attn + mlp]
    fast, slow = train(True), train(False)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


def test_canonical_gap_on_the_gpu_matches_the_cpu(tiny_data):
    """--val_mask's correction (tests/test_checkpoint.py checks it in float64 on the CPU) for one tiny model on the GPU
    and on the CPU, float32 and SDPA on both."""
    import numpy as np
    cfg = tiny_config(*tiny_data)
    never = np.random.default_rng(0).random((cfg.vocab_size, cfg.vocab_size)) < 0.3
    bits = torch.from_numpy(np.packbits(never, axis=1, bitorder="little"))
    gaps = []
    for device in (torch.device("cpu"), torch.device("cuda")):
        model = random_tiny_model(cfg).to(device)
        gaps.append(tg.canonical_gap(model, cfg, tg.Comm(), tg.shard_paths(cfg.val_files, "val_files"), (32, 64),
                                     device, bits.to(device)))
    assert gaps[0] < 0 and abs(gaps[0] - gaps[1]) < 1e-4, gaps
