"""Dynamic dense connections (--mudd, MUDD): the mixing MLP against its formula, the model with it against the model
without it at the start, the wiring of every source into the last layer and the head, the last block's per-token
scales, extra value and value gate against a static block, and where its parameters train."""
import dataclasses

import pytest
import torch

import train_gpt as tg
from helpers import BOS, TINY, cu_seqlens_of, random_tiny_model


def mudd_config(**overrides) -> tg.Config:
    cfg, _ = tg.parse_cli(["--device=cpu", *TINY, "--sublayer_scales=1", "--mudd=1"])
    return dataclasses.replace(cfg, **overrides)


def random_batch(cfg, T=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    tokens[0] = tokens[70] = BOS
    targets = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    bigrams = torch.randint(0, cfg.bigram_rows, (T,), generator=g)
    return tokens, targets, bigrams


def loss_of(model, cfg, batch):
    tokens, targets, bigrams = batch
    masks = model.prepare_masks(tokens, cu_seqlens_of(tokens, BOS), (32, 64))
    return model(tokens, targets, masks, bigrams)


def test_dense_mix_is_its_formula_and_starts_at_its_initial_weights():
    torch.manual_seed(0)
    mix = tg.DenseMix(16, [1.5, -0.5, 0.0])
    x = torch.randn(5, 16)
    torch.testing.assert_close(mix(x), torch.tensor([1.5, -0.5, 0.0]).expand(5, 3))  # W2 starts at zero
    with torch.no_grad():
        mix.w2.normal_()
    hidden = 0.5 * (x @ mix.w1.T) * (1 + torch.erf((x @ mix.w1.T) / 2 ** 0.5))  # exact GELU
    torch.testing.assert_close(mix(x), (hidden @ mix.w2.T + mix.bias) * 0.1)


def test_the_model_with_mudd_starts_as_the_model_without_it():
    """At the start every mixing weight is its initial value for every token: no value or stream mixed in, the last
    layer's scales those of a static block, the head's backout of 0.5. With zero value tables (the default) the
    value-embedding gate, 2 instead of 2 sigmoid(0), changes nothing, so the two models give one loss; once the
    mixers' output weights move, the losses differ."""
    with_mudd, without = mudd_config(), mudd_config(mudd=False)
    plain = random_tiny_model(without)
    with torch.no_grad():  # the value tables stay zero
        for table in plain.value_embeds:
            table.weight.zero_()
    mixed = tg.GPT(with_mudd, tg.SdpaAttention(), torch.float32)
    missing, unexpected = mixed.load_state_dict(plain.state_dict(), strict=False)
    assert all(name.startswith("mudd_") for name in missing)
    last = f"blocks.{with_mudd.num_layers - 1}."
    assert sorted(unexpected) == sorted([last + "residual_scales", last + "output_scales", last + "injection", "backout"])
    batch = random_batch(with_mudd)
    torch.testing.assert_close(loss_of(mixed, with_mudd, batch), loss_of(plain, without, batch), rtol=1e-6, atol=0)
    with torch.no_grad():
        mixed.mudd_layer.w2.normal_(0, 0.1)
        mixed.mudd_head.w2.normal_(0, 0.1)
    assert abs(loss_of(mixed, with_mudd, batch).item() - loss_of(plain, without, batch).item()) > 1e-3


def test_mudd_mixes_its_sources_into_the_last_layer_and_before_the_head():
    """Every weight of both mixers random: the last block's input and LayerMix, and the head's input, are the
    formulas of the streams recorded in the forward (the stream entering layer 0, the outputs of layers
    backout_from, last - 1 and skip_from, the first value embedding)."""
    cfg = mudd_config(value_embed_init_std=0.5, backout_from=0)  # four distinct layer outputs of the tiny model
    model = random_tiny_model(cfg)
    with torch.no_grad():
        for mix in (model.mudd_layer, model.mudd_head):
            mix.bias.normal_()
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
    loss_of(model, cfg, batch)

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
    """A block with a LayerMix against a static block with the same weights: per-token scales equal to the static
    ones and a value gate of 1 (the static gate at zero weights: 2 sigmoid(0)) give its output; an extra value e in
    v gives the output of the value embedding ve + e / (the value-embedding scale), which adds the same to v."""
    cfg = mudd_config()
    torch.manual_seed(0)
    static, mixed = tg.Block(cfg, has_attention=True), tg.Block(cfg, has_attention=True, mixed=True)
    assert mixed.residual_scales is None and mixed.injection is None and mixed.lambdas is None
    static.attend = mixed.attend = tg.SdpaAttention()
    with torch.no_grad():
        for p in static.parameters():
            p.normal_(0, 0.3)
        static.attn.gate_w[1].zero_()
    mixed.load_state_dict(static.state_dict(), strict=False)
    T, dim, heads = 12, cfg.model_dim, cfg.num_heads
    x, x0, bigram, ve, extra = (torch.randn(T, dim) for _ in range(5))
    rotary = tg.Rotary(cfg.head_dim, max_len=T)
    tokens = torch.full((T,), 3, dtype=torch.int32)
    mask = static.attend.prepare(T, cu_seqlens_of(tokens, BOS), {"S": T})["S"]
    starts = torch.zeros(T, dtype=torch.bool)
    r, o, (a, b) = static.residual_scales, static.output_scales, static.injection
    scales = tuple(s.expand(T, 1) for s in (r[0], o[0], a, b, r[1], o[1]))
    gate = torch.ones(T, heads, 1)
    want = static(x, x0, ve, rotary.tables(), mask, bigram, starts)
    got = mixed(x, x0, ve, rotary.tables(), mask, bigram, starts, mix=tg.LayerMix(torch.zeros(T, dim), gate, scales))
    torch.testing.assert_close(got, want)
    shifted = ve + extra / static.value_scales[1]
    want = static(x, x0, shifted, rotary.tables(), mask, bigram, starts)
    got = mixed(x, x0, ve, rotary.tables(), mask, bigram, starts, mix=tg.LayerMix(extra, gate, scales))
    torch.testing.assert_close(got, want)


def test_mudd_trains_with_adam_at_a_quarter_of_its_lr_and_is_checked():
    cfg = mudd_config()
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    groups = tg.build_optimizers(model, cfg)[1].param_groups
    weights = [g for g in groups if any(p is model.mudd_layer.w1 for p in g["params"])][0]
    biases = [g for g in groups if any(p is model.mudd_head.bias for p in g["params"])][0]
    assert {id(p) for p in weights["params"]} == {id(p) for m in (model.mudd_layer, model.mudd_head) for p in (m.w1, m.w2)}
    assert weights["lr"] == biases["lr"] == cfg.adam_lr * 0.25
    assert weights["weight_decay"] == cfg.adam_weight_decay and biases["weight_decay"] == 0.0
    assert model.backout is None
    fragments = tg.diloco_fragments(model, 2)  # raises unless every parameter is in exactly one fragment
    assert any(p is model.mudd_head.w1 for p in fragments[-1].parameters())
    for flags in (["--mudd=1"], ["--mudd=1", "--sublayer_scales=1", "--backout_from=-1"]):
        with pytest.raises(tg.UserError, match="--mudd=1 needs --sublayer_scales=1, --backout_from below the last"):
            tg.validate_config(tg.parse_cli(["--device=cpu", *TINY, *flags])[0])
