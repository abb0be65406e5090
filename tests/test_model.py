"""The model's parts against their formulas: the dense connections (MUDD), the per-token gates, the copy pointer and
its mixture; and the GPU checks before a launch."""
import dataclasses

import pytest
import torch

import train_gpt as tg
from helpers import BOS, TINY, cu_seqlens_of, pointer_inputs, random_tiny_model, train_scheduled_steps

NO_GATES = tg.LayerGates(None, None, None)


def tiny(**overrides) -> tg.Config:
    return dataclasses.replace(tg.parse_cli(["--device=cpu", *TINY])[0], **overrides)


def random_batch(cfg, T=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    tokens[0] = tokens[70] = BOS
    targets = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    bigrams = torch.randint(0, cfg.bigram_rows, (T,), generator=g)
    return tokens, targets, bigrams


def loss_of(model, batch):
    tokens, targets, bigrams = batch
    masks = model.prepare_masks(tokens, cu_seqlens_of(tokens, BOS), (32, 64))
    return model(tokens, targets, masks, bigrams)


# ---------------------------------------------------------------------------------------------- MUDD

def test_dense_mix_is_its_formula_and_starts_at_its_initial_weights():
    torch.manual_seed(0)
    mix = tg.DenseMix(16, [1.5, -0.5, 0.0], lr=0.25)
    x = torch.randn(5, 16)
    torch.testing.assert_close(mix(x), torch.tensor([1.5, -0.5, 0.0]).expand(5, 3))  # W2 starts at zero
    with torch.no_grad():
        mix.w2.normal_()
    hidden = 0.5 * (x @ mix.w1.T) * (1 + torch.erf((x @ mix.w1.T) / 2 ** 0.5))  # exact GELU
    torch.testing.assert_close(mix(x), (hidden @ mix.w2.T + mix.bias) * 0.1)
    # Adam at a quarter of the base lr (speedrun 2026-04-22), the weights decayed
    assert mix.w1.opt == mix.w2.opt == tg.Opt(lr=0.25, wd=1.0) and mix.bias.opt == tg.Opt(lr=0.25)


def test_mudd_mixes_its_sources_into_the_last_layer_and_before_the_head():
    """Every weight of both mixers random: the last block's input and LayerMix, and the head's input, are the
    formulas of the streams recorded in the forward (the stream entering layer 0, the outputs of layers
    backout_from, last - 1 and skip_from, the first value embedding)."""
    cfg = tiny(backout_from=0)  # distinct layer outputs of the tiny model for mid, previous and skip
    model = random_tiny_model(cfg)
    with torch.no_grad():
        for mix in (model.mudd_layer, model.mudd_head):
            mix.bias.normal_()
        model.longest_match.bucket_embed.zero_()  # the head's other addition: none
    seen = {}

    def record(key, value):  # returns None, so that a hook changes nothing
        seen[key] = value
    last = cfg.num_layers - 1
    model.blocks[0].register_forward_pre_hook(lambda _, args: record("x_in", args[0]))
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda _, args, out, i=i: record(i, out))
    model.blocks[last].register_forward_pre_hook(lambda _, args: record("last", args))
    head = model.loss_head
    model.loss_head = lambda x, targets, *context: (record("head", x), head(x, targets, *context))[1]
    tokens, targets, bigrams = batch = random_batch(cfg)
    loss_of(model, batch)

    x_in, mid, previous, skip = seen["x_in"], seen[cfg.backout_from], seen[last - 1], seen[cfg.skip_from]
    assert len({mid.data_ptr(), previous.data_ptr(), skip.data_ptr()}) == 3
    w = model.mudd_layer(previous)
    x, mix = seen["last"][0], seen["last"][8]  # Block.forward(x, ..., attn_input, mix, token)
    torch.testing.assert_close(x, (1 + w[:, 5:6]) * previous + w[:, 3:4] * x_in + w[:, 4:5] * mid)
    torch.testing.assert_close(mix.value, w[:, 0:1] * x_in + w[:, 1:2] * mid + w[:, 2:3] * previous)
    half = cfg.num_heads // 2
    assert mix.value_gate.shape == (len(tokens), cfg.num_heads, 1)
    torch.testing.assert_close(mix.value_gate[:, :half, 0], w[:, 6:7].expand(-1, half))
    torch.testing.assert_close(mix.value_gate[:, half:, 0], w[:, 7:8].expand(-1, half))
    torch.testing.assert_close(torch.cat(mix.scales, dim=1), w[:, 8:14])
    c = model.mudd_head(seen[last])
    value_embed = torch.nn.functional.embedding(tokens, model.value_embeds[0].weight)
    want = seen[last] + sum(c[:, k:k + 1] * source for k, source in enumerate((x_in, mid, previous, value_embed, skip)))
    torch.testing.assert_close(seen["head"], want)


def test_the_last_block_takes_its_scales_value_and_gate_from_the_layer_mix():
    """The last block (its scales, extra value and value gate from a LayerMix) against another block with the same
    weights: per-token scales equal to its static ones and a value gate of 1 (its own gate at zero weights: 2
    sigmoid(0)) give its output; an extra value e in v gives that of the value embedding ve + e / (the embedding's
    scale), which adds the same to v."""
    cfg = tiny(attn_layout="SL-S", paired_head_layers=(), xsa_layers=())  # layers 0 and 3 alike
    torch.manual_seed(0)
    static, mixed = tg.Block(cfg, 0, False), tg.Block(cfg, 3, False)
    assert mixed.residual_scales is None and mixed.attn.gate_w is None
    static.attend = mixed.attend = tg.SdpaAttention()
    with torch.no_grad():
        for p in static.parameters():
            p.normal_(0, 0.3)
        static.attn.gate_w.zero_()
    missing, _ = mixed.load_state_dict(static.state_dict(), strict=False)
    assert not missing
    T, dim, heads = 12, cfg.model_dim, cfg.num_heads
    x, x0, bigram, ve, extra = (torch.randn(T, dim) for _ in range(5))
    rope = tg.Rotary(cfg.head_dim, T, T, 0.1, False).tables()
    tokens = torch.full((T,), 3, dtype=torch.int32)
    mask = static.attend.prepare(T, cu_seqlens_of(tokens, BOS), {"S": T})["S"]
    starts = torch.zeros(T, dtype=torch.bool)
    r, o, a, b = static.residual_scales, static.output_scales, torch.randn(T, 1), torch.randn(T, 1)
    token = tg.LayerGates((a, b), None, None)
    scales = (r[0].expand(T, 1), o[0].expand(T, 1), a, b, r[1].expand(T, 1), o[1].expand(T, 1))
    gate = torch.ones(T, heads, 1)
    want = static(x, x0, ve, rope, mask, bigram, starts, None, None, token)
    got = mixed(x, x0, ve, rope, mask, bigram, starts, None, tg.LayerMix(torch.zeros(T, dim), gate, scales), NO_GATES)
    torch.testing.assert_close(got, want)
    shifted = ve + extra / static.attn.value_scales[1]
    want = static(x, x0, shifted, rope, mask, bigram, starts, None, None, token)
    got = mixed(x, x0, ve, rope, mask, bigram, starts, None, tg.LayerMix(extra, gate, scales), NO_GATES)
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------------------------- per-token gates

def test_the_gate_lanes_and_their_starting_values():
    """The tiny model (layers SL-L, skip 1 -> 2, XSA on 1, 2 heads): the first MLP serves layers 0 and 1, the second,
    reading the stream after layer 1, layers 2 and 3; the last layer's x0 and bigram scales are MUDD's."""
    gates = tg.GPT(tiny(), tg.SdpaAttention(), torch.float32).token_gates
    assert gates.split == 2
    assert gates.lanes == [
        {"inject": (False, 0, 2)},
        {"inject": (False, 2, 2), "xsa": (False, 4, 2), "out": (False, 6, 2)},
        {"skip": (True, 0, 1)},
        {"out": (True, 1, 2)},
    ]
    x = torch.randn(3, 64)
    torch.testing.assert_close(gates.pre(x), torch.tensor([0, 0.05, 0, 0.05, 0, 0, 0.25, 0.25]).expand(3, 8))
    torch.testing.assert_close(gates.post(x), torch.tensor([0.5, 0.25, 0.25]).expand(3, 3))


def test_each_layer_receives_its_lanes_of_the_two_gate_mlps():
    """Random gate MLPs: the x0 and bigram scales, XSA strengths and output gates each block receives are the lanes
    of pre(x0) and post(layer 1's output), and the skip into layer 2 adds sigmoid(skip_gate) * its lane times that
    output."""
    cfg = tiny()
    model = random_tiny_model(cfg)
    gates = model.token_gates
    with torch.no_grad():
        for mix in (gates.pre, gates.post):
            mix.bias.normal_()
    seen = {}

    def record(i):
        def hook(module, args):
            seen[i] = (args[0].detach().clone(), args[1].detach().clone(), args[-1])
        return hook
    handles = [block.register_forward_pre_hook(record(i)) for i, block in enumerate(model.blocks)]
    handles.append(model.blocks[1].register_forward_hook(lambda module, args, out: seen.update(after_1=out.detach())))
    loss_of(model, random_batch(cfg))
    for handle in handles:
        handle.remove()
    pre = gates.pre(seen[0][1]).detach()  # of x0
    after_1 = seen["after_1"]  # layer 1's output: the skip's source and the second MLP's input
    post = gates.post(after_1).detach()
    torch.testing.assert_close(seen[2][0], after_1 + torch.sigmoid(model.skip_gate.detach()) * post[:, :1] * after_1)
    want = {0: (pre[:, 0:2], None, None), 1: (pre[:, 2:4], pre[:, 4:6], pre[:, 6:8]), 2: (None, None, None),
            3: (None, None, post[:, 1:3])}
    for i, (inject, xsa, out) in want.items():
        token = seen[i][2]
        for got, expected in ((None if token.inject is None else torch.cat(token.inject, dim=1), inject),
                              (token.xsa, xsa), (token.out, out)):
            assert (got is None) == (expected is None), i
            if expected is not None:
                torch.testing.assert_close(got, expected)


def test_the_gates_train_with_adam_at_the_records_settings():
    cfg = tiny()
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    post = model.token_gates.post
    assert post.w2.opt == tg.Opt(lr=0.1, wd=1.0) and post.bias.opt == tg.Opt(lr=0.1)
    optimizers = tg.build_optimizers(model, cfg)
    groups = [group for group in optimizers[1].param_groups if any(p is post.w2 or p is post.bias for p in group["params"])]
    assert sorted((group["lr"], group["weight_decay"]) for group in groups) == [
        (pytest.approx(cfg.adam_lr * 0.1), 0.0), (pytest.approx(cfg.adam_lr * 0.1), tg.ADAM_WD)]
    before = post.w2.detach().clone()
    train_scheduled_steps(model, optimizers, cfg, steps=4)
    assert not torch.equal(before, post.w2)
    fragments = tg.diloco_fragments(model, 2)  # raises unless every parameter is in exactly one fragment
    assert any(p is model.token_gates.pre.w1 for p in fragments[-1].parameters())


# ------------------------------------------------------------------------------------- the copy pointer

def pointer_reference(q, k, sink, tokens, targets, documents, band):
    """(log mass on targets[t], log sink mass) per query, one softmax per query in float64; sink: [T] or [1]."""
    q, k, sink = q.double(), k.double(), sink.double().expand(q.size(0))
    log_copy, log_sink = [], []
    for t in range(q.size(0)):
        keys = [j for j in range(max(0, t - band + 1), t + 1) if documents[j] == documents[t]]
        p = torch.softmax(torch.stack([q[t] @ k[j] / q.size(1) ** 0.5 for j in keys] + [sink[t]]), 0)
        hit = sum((p[i] for i, j in enumerate(keys) if tokens[j] == targets[t]), torch.tensor(0.0, dtype=torch.float64))
        log_copy.append(torch.log(hit))
        log_sink.append(torch.log(p[-1]))
    return torch.stack(log_copy), torch.stack(log_sink)


@pytest.mark.parametrize("band", [128, 256])
def test_the_banded_pointer_is_one_softmax_per_query(band):
    """Every query's mass on earlier positions of its document holding its target, and on the sink, within 1e-5 of a
    float64 softmax over exactly those keys; where none holds the target, about -1e9."""
    q, k, sink, tokens, targets, documents = pointer_inputs()
    log_copy, log_sink = tg.copy_log_probs(q, k, sink, tokens, targets, documents, band)
    want_copy, want_sink = pointer_reference(q, k, sink, tokens, targets, documents, band)
    hit = torch.isfinite(want_copy)
    assert 50 < hit.sum() < len(hit)  # both kinds of query
    torch.testing.assert_close(log_copy.double()[hit], want_copy[hit], rtol=0, atol=1e-5)
    torch.testing.assert_close(log_sink.double(), want_sink, rtol=0, atol=1e-5)
    assert (log_copy[~hit] < -1e8).all()


def test_the_mixture_sums_to_one_over_the_next_token():
    """exp(-loss) summed over every candidate next token (the gate's column aside) is 1 at every position, with the
    gate open: the pointer's mass, the sink's and the LM's add up."""
    q, k, sink, tokens, _, documents = pointer_inputs(T=256)
    vocab, slot = 9, 6  # columns 7 and 8 stand for the head's padding rows
    z = torch.randn(256, vocab, generator=torch.Generator().manual_seed(1)) * 2
    z[:, slot] += 2.0  # alpha around a half
    total = torch.zeros(256, dtype=torch.float64)
    for y in [c for c in range(vocab) if c != slot]:
        targets = torch.full((256,), y)
        log_copy, log_sink = tg.copy_log_probs(q, k, sink, tokens, targets, documents, 128)
        total += torch.exp(-tg.copy_mixture_losses(z, targets, slot, log_copy, log_sink, None).double())
    torch.testing.assert_close(total, torch.ones_like(total), rtol=0, atol=1e-5)


def test_a_closed_gate_is_the_plain_multi_token_loss():
    """With the gate's logit far below the others the mixture is the LM alone: the multi-token losses exactly."""
    q, k, sink, tokens, targets, documents = pointer_inputs(T=256)
    z = torch.randn(256, 12, generator=torch.Generator().manual_seed(2))
    z[:, 10] = -1e4
    log_copy, log_sink = tg.copy_log_probs(q, k, sink, tokens, targets, documents, 128)
    mtp = (torch.tensor([0.6, 0.3, 0.1]), 128)
    torch.testing.assert_close(tg.copy_mixture_losses(z, targets, 10, log_copy, log_sink, mtp),
                               tg.multi_token_losses(z, targets, mtp))


def test_the_model_gates_its_pointer_with_the_row_after_the_vocabulary():
    """The head gains a padding block for the gate (128 tokens: 256 rows); the model's loss is the mixture of its
    own logits and pointer, lower than the LM's alone when the gate opens on text that repeats itself, and every
    pointer parameter and the gate's row get gradients."""
    cfg = tiny()
    model = random_tiny_model(cfg)
    assert model.lm_head.weight.shape[0] == 256
    T = 256
    period = torch.randint(0, 96, (16,), generator=torch.Generator().manual_seed(3))
    tokens = period.repeat(T // 16)
    tokens[0] = tokens[128] = BOS
    targets = torch.cat([tokens[1:], tokens[:1]])
    bigrams = torch.zeros(T, dtype=torch.long)
    masks = model.prepare_masks(tokens, cu_seqlens_of(tokens, BOS), (32, 64))
    with torch.no_grad():
        model.longest_match.scale.zero_()  # the repeats' other reader
        model.longest_match.bucket_embed.zero_()
        model.lm_head.weight[cfg.vocab_size] = -model.lm_head.weight[cfg.vocab_size].abs()  # a nearly closed gate
        model.copy_pointer.q_gain.fill_(4.0)
    closed = model(tokens, targets, masks, bigrams)
    with torch.no_grad():
        model.lm_head.weight[cfg.vocab_size] *= -20  # the gate opens
    opened = model(tokens, targets, masks, bigrams)
    assert opened < closed - 0.1
    opened.backward()
    pointer = model.copy_pointer
    for name, p in [("q_w", pointer.q_w), ("k_w", pointer.k_w), ("q_gain", pointer.q_gain), ("sink", pointer.sink)]:
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert model.lm_head.weight.grad[cfg.vocab_size].abs().sum() > 0
    # Adam: the projections at a quarter of the base lr, gain and sink with the scalars
    assert pointer.q_w.opt == pointer.k_w.opt == tg.Opt(lr=0.25)
    assert pointer.q_gain.opt == pointer.sink.opt == tg.Opt(lr=5.0)


# ------------------------------------------------------------------------------------- the GPU checks

def test_gpus_without_fp8_matmuls_or_tma_are_told_which_kernel_to_turn_off(monkeypatch):
    """The FP8 head and the fused MLP are on by default; on a GPU older than Ada/Hopper (FP8 matmuls) or Hopper (the
    MLP kernel's TMA loads) the check before a launch names the GPU and the flag, instead of a kernel failing deep
    inside the first forward."""
    if tg.triton is None:
        pytest.skip("without Triton no kernel is chosen")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    cfg = tg.Config()
    cuda = torch.device("cuda", 0)

    def check_gpu_features(config):  # with the kernels that a run on that GPU chooses
        tg.check_gpu_features(config, cuda, tg.choose_kernels(config, cuda))

    with pytest.raises(tg.UserError, match=r"A100.*pass --fp8_head=0"):
        check_gpu_features(cfg)
    no_fp8 = dataclasses.replace(cfg, fp8_head=False)
    with pytest.raises(tg.UserError, match=r"A100.*pass --fused_mlp=0"):
        check_gpu_features(no_fp8)
    check_gpu_features(dataclasses.replace(no_fp8, fused_mlp=False))  # bf16 head, unfused MLP: fine
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))  # Ada: FP8, no TMA
    check_gpu_features(dataclasses.replace(cfg, fused_mlp=False))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_gpu_features(cfg)
