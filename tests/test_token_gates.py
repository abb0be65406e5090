"""Per-token gates (--token_gates, the speedrun 2026-05-27 record): the lanes of the two gate MLPs and their starting
values, a gated block against a static block with the same weights, what each layer of the model receives, and where
the gates' parameters train."""
import dataclasses

import pytest
import torch

import train_gpt as tg
from helpers import BOS, TINY, cu_seqlens_of, random_tiny_model, train_scheduled_steps
from test_mudd import loss_of, random_batch


def gated_config(**overrides) -> tg.Config:
    cfg, _ = tg.parse_cli(["--device=cpu", *TINY, "--sublayer_scales=1", "--token_gates=1", "--xsa_layers=1,3"])
    return dataclasses.replace(cfg, **overrides)


def test_the_gate_lanes_and_their_starting_values():
    """The tiny model (layers SLSL, skip 1 -> 2, XSA on 1 and 3, 2 heads): the first MLP serves layers 0 and 1, the
    second, reading the stream after layer 1, layers 2 and 3."""
    cfg = gated_config()
    gates = tg.GPT(cfg, tg.SdpaAttention(), torch.float32).token_gates
    assert gates.split == 2
    assert gates.lanes == [
        {"inject": (False, 0, 2)},
        {"inject": (False, 2, 2), "xsa": (False, 4, 2), "out": (False, 6, 2)},
        {"skip": (True, 0, 1), "inject": (True, 1, 2)},
        {"inject": (True, 3, 2), "xsa": (True, 5, 2), "out": (True, 7, 2)},
    ]
    x = torch.randn(3, cfg.model_dim)
    torch.testing.assert_close(gates.pre(x), torch.tensor([0, 0.05, 0, 0.05, 0, 0, 0.25, 0.25]).expand(3, 8))
    torch.testing.assert_close(gates.post(x), torch.tensor([0.5, 0, 0.05, 0, 0.05, 0, 0, 0.25, 0.25]).expand(3, 9))
    # with MUDD the last layer's scales are MUDD's
    mudd = tg.GPT(gated_config(mudd=True), tg.SdpaAttention(), torch.float32).token_gates
    assert "inject" not in mudd.lanes[3] and mudd.lanes[3]["out"] == (True, 5, 2)


def block_inputs(cfg, T=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    x, x0, bigram, ve = (torch.randn(T, cfg.model_dim, generator=g) for _ in range(4))
    rotary = tg.Rotary(cfg.head_dim, max_len=T)
    tokens = torch.full((T,), 3, dtype=torch.int32)
    mask = tg.SdpaAttention().prepare(T, cu_seqlens_of(tokens, BOS), {"S": T})["S"]
    return x, x0, ve, rotary.tables(), mask, bigram, torch.zeros(T, dtype=torch.bool)


def test_a_gated_block_is_the_static_block_at_the_same_values():
    """Per-token x0 and bigram scales and XSA strengths equal to a static block's, and output gates of 0.5 equal to
    the static block's sigmoid gate at zero weights, give its output; the value-embedding gate, the one gate the
    gated attention keeps, is the static one's."""
    static_cfg = gated_config(token_gates=False)
    torch.manual_seed(0)
    static = tg.Block(static_cfg, has_attention=True, xsa=True)
    gated = tg.Block(gated_config(), has_attention=True, xsa=True)
    assert gated.injection is None and gated.attn.xsa_alpha is None and gated.attn.gate_w.shape[0] == 1
    static.attend = gated.attend = tg.SdpaAttention()
    with torch.no_grad():
        for p in static.parameters():
            p.normal_(0, 0.3)
        static.attn.gate_w[0].zero_()  # the output gate at sigmoid(0) = 0.5
    state = static.state_dict()
    state["attn.gate_w"] = state["attn.gate_w"][1:]
    missing, unexpected = gated.load_state_dict(state, strict=False)
    assert not missing and sorted(unexpected) == ["attn.xsa_alpha", "injection"]
    inputs = block_inputs(static_cfg)
    T, heads = inputs[0].size(0), static_cfg.num_heads
    a, b = static.injection.detach()
    token = tg.LayerGates((a.expand(T, 1), b.expand(T, 1)), static.attn.xsa_alpha.detach().expand(T, heads),
                          torch.full((T, heads), 0.5))
    torch.testing.assert_close(gated(*inputs, token=token), static(*inputs))
    # the strengths and gates act per token: another row's values change only that row
    other = tg.LayerGates(token.inject, token.xsa.clone(), token.out.clone())
    other.out[5] = 0.9
    other.xsa[5] = -1.0
    changed = (gated(*inputs, token=other) - static(*inputs)).abs().amax(dim=1) > 1e-6
    assert changed[5] and changed.sum() <= T - 5  # causal: rows before 5 cannot see row 5


def test_each_layer_receives_its_lanes_of_the_two_gate_mlps():
    """Random gate MLPs: the x0 and bigram scales, XSA strengths and output gates each block receives are the lanes
    of pre(x0) and post(layer 1's output), and the skip into layer 2 adds sigmoid(skip_gate) * its lane times that
    output."""
    cfg = gated_config(value_embed_init_std=0.5)
    model = random_tiny_model(cfg)
    gates = model.token_gates
    with torch.no_grad():
        for mix in (gates.pre, gates.post):
            mix.bias.normal_()
    seen = {}

    def record(i):
        def hook(module, args, kwargs):
            seen[i] = (args[0].detach().clone(), args[1].detach().clone(), kwargs.get("token", args[-1]))
        return hook
    handles = [block.register_forward_pre_hook(record(i), with_kwargs=True) for i, block in enumerate(model.blocks)]
    handles.append(model.blocks[1].register_forward_hook(lambda module, args, out: seen.update(after_1=out.detach())))
    batch = random_batch(cfg)
    loss_of(model, cfg, batch)
    for handle in handles:
        handle.remove()
    pre = gates.pre(seen[0][1]).detach()  # of x0
    after_1 = seen["after_1"]  # layer 1's output: the skip's source and the second MLP's input
    post = gates.post(after_1).detach()
    torch.testing.assert_close(seen[2][0], after_1 + torch.sigmoid(model.skip_gate.detach()) * post[:, :1] * after_1)
    want = {0: (pre[:, 0:2], None, None), 1: (pre[:, 2:4], pre[:, 4:6], pre[:, 6:8]),
            2: (post[:, 1:3], None, None), 3: (post[:, 3:5], post[:, 5:7], post[:, 7:9])}
    for i, (inject, xsa, out) in want.items():
        token = seen[i][2]
        torch.testing.assert_close(torch.cat(token.inject, dim=1), inject)
        for got, expected in ((token.xsa, xsa), (token.out, out)):
            assert (got is None) == (expected is None)
            if expected is not None:
                torch.testing.assert_close(got, expected)


def test_the_gates_train_with_adam_at_the_records_settings():
    cfg = gated_config()
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    optimizers = tg.build_optimizers(model, cfg)
    adam = next(opt for opt in optimizers if isinstance(opt, tg.DistAdam))
    post = model.token_gates.post
    groups = [group for group in adam.param_groups if any(p is post.w2 or p is post.bias for p in group["params"])]
    assert [group["lr"] for group in groups] == [pytest.approx(cfg.adam_lr * 0.1)] * 2
    assert [group["weight_decay"] > 0 for group in groups] == [True, False]
    assert model.skip_gate_w is None
    before = post.w2.detach().clone()
    train_scheduled_steps(model, optimizers, cfg, steps=4)
    assert not torch.equal(before, post.w2)


def test_token_gates_launch_check():
    with pytest.raises(tg.UserError, match="--token_gates=1 needs --sublayer_scales=1"):
        tg.validate_config(tg.parse_cli(["--device=cpu", *TINY, "--token_gates=1"])[0])


def test_diloco_fragments_hold_the_gates_once():
    model = tg.GPT(gated_config(), tg.SdpaAttention(), torch.float32)
    fragments = tg.diloco_fragments(model, 2)  # raises unless every parameter is in exactly one fragment
    assert any(p is model.token_gates.pre.w1 for p in fragments[-1].parameters())
