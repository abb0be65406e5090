"""Dense connections into every layer from --dense_from on: the model with them against the model without them at
the start, each layer's input against its formula of the streams recorded in the forward, where their parameters
train and sync, and the launch check."""
import dataclasses

import pytest
import torch

import train_gpt as tg
from helpers import BOS, TINY, cu_seqlens_of, random_tiny_model


def dense_config(**overrides) -> tg.Config:
    cfg, _ = tg.parse_cli(["--device=cpu", *TINY, "--dense_from=1"])
    return dataclasses.replace(cfg, **overrides)


def loss_of(model, batch):
    tokens, targets, bigrams = batch
    masks = model.prepare_masks(tokens, cu_seqlens_of(tokens, BOS), (32, 64))
    return model(tokens, targets, masks, bigrams)


def random_batch(cfg, T=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    tokens[0] = tokens[70] = BOS
    return tokens, torch.randint(0, cfg.vocab_size, (T,), generator=g), torch.randint(0, cfg.bigram_rows, (T,), generator=g)


def test_the_model_with_dense_connections_starts_as_the_model_without_them():
    with_dense, without = dense_config(), dense_config(dense_from=-1)
    plain = random_tiny_model(without)
    dense = tg.GPT(with_dense, tg.SdpaAttention(), torch.float32)
    missing, unexpected = dense.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected
    assert sorted({name.split(".dense_mix")[0] for name in missing}) == [f"blocks.{i}" for i in (1, 2, 3)]
    assert [block.dense_mix.bias.numel() if block.dense_mix else 0 for block in dense.blocks] == [0, 1, 2, 3]
    batch = random_batch(with_dense)
    torch.testing.assert_close(loss_of(dense, batch), loss_of(plain, batch), rtol=1e-6, atol=0)
    with torch.no_grad():
        for mix in dense.dense_mixes():
            mix.w2.normal_(0, 0.1)
    assert abs(loss_of(dense, batch).item() - loss_of(plain, batch).item()) > 1e-3


def test_each_layer_input_adds_its_mix_of_the_earlier_streams():
    """Every mixing weight random. Layer i's input is layer i-1's output plus the mix (weights from that output) of
    the stream entering layer 0 and the outputs of layers 0 .. i-2; the skip's target layer (2 in the tiny model)
    also takes the gated skip, so layers 1 and 3 are checked."""
    cfg = dense_config(value_embed_init_std=0.5)
    model = random_tiny_model(cfg)
    with torch.no_grad():
        for mix in model.dense_mixes():
            mix.bias.normal_()
    seen = {}

    def record(key, value):  # returns None, so that a hook changes nothing
        seen[key] = value
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda _, args, i=i: record(("in", i), args[0]))
        block.register_forward_hook(lambda _, args, out, i=i: record(("out", i), out))
    loss_of(model, random_batch(cfg))
    outputs = [seen[("out", i)] for i in range(cfg.num_layers)]
    sources = [seen[("in", 0)], *outputs]
    assert cfg.skip_to == 2
    for i in (1, 3):
        w = model.blocks[i].dense_mix(outputs[i - 1])
        want = outputs[i - 1] + sum(w[:, k:k + 1] * sources[k] for k in range(i))
        torch.testing.assert_close(seen[("in", i)], want)


def test_dense_connections_train_with_mudds_adam_group_and_sync_with_their_layer():
    cfg = dense_config(dense_from=2)
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    assert [block.dense_mix is not None for block in model.blocks] == [False, False, True, True]
    groups = tg.build_optimizers(model, cfg)[1].param_groups
    weights = [g for g in groups if any(p is model.blocks[2].dense_mix.w1 for p in g["params"])][0]
    biases = [g for g in groups if any(p is model.blocks[3].dense_mix.bias for p in g["params"])][0]
    assert {id(p) for p in weights["params"]} == {id(p) for m in model.dense_mixes() for p in (m.w1, m.w2)}
    assert weights["lr"] == biases["lr"] == cfg.adam_lr * 0.25
    assert weights["weight_decay"] == cfg.adam_weight_decay and biases["weight_decay"] == 0.0
    fragments = tg.diloco_fragments(model, 2)  # raises unless every parameter is in exactly one fragment
    assert any(p is model.blocks[3].dense_mix.w1 for p in fragments[-1].parameters())


@pytest.mark.parametrize("value", ["0", "4", "-2"])
def test_dense_from_is_checked(value):
    with pytest.raises(tg.UserError, match=f"--dense_from={value}: use a layer 1 .. num_layers-1"):
        tg.validate_config(tg.parse_cli(["--device=cpu", *TINY, f"--dense_from={value}"])[0])
