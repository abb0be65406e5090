"""Canon layers (--canon_layers): the causal per-channel convolution against a per-document conv1d, the model with
zero weights against the model without them, what a changed token reaches, and where the weights train."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
from helpers import BOS, TINY, random_tiny_model, train_scheduled_steps
from test_mudd import loss_of, random_batch


def canon_config(**overrides) -> tg.Config:
    cfg, _ = tg.parse_cli(["--device=cpu", *TINY, "--sublayer_scales=1", "--canon_layers=0,1,3"])
    return dataclasses.replace(cfg, **overrides)


@pytest.mark.parametrize("kernel", [2, 4, 7])
def test_the_convolution_equals_conv1d_over_each_document(kernel):
    """Starts at 0, 5, 6 (a one-token document), 9 and 20 of 32 tokens; float64."""
    T, dim = 32, 8
    g = torch.Generator().manual_seed(kernel)
    x = torch.randn(T, dim, generator=g, dtype=torch.float64)
    weight = torch.randn(kernel, dim, generator=g, dtype=torch.float64)
    starts = torch.zeros(T, dtype=torch.bool)
    bounds = [0, 5, 6, 9, 20, T]
    starts[bounds[:-1]] = True
    got = tg.causal_channel_conv(x, weight, tg.canon_recent(starts, kernel))
    # conv1d correlates: the kernel flipped puts weight[j] on the token j back
    kernel_1d = weight.flip(0).T[:, None, :]  # [dim, 1, K]
    want = torch.cat([x[lo:hi] + F.conv1d(F.pad(x[lo:hi].T[None], (kernel - 1, 0)), kernel_1d, groups=dim)[0].T
                      for lo, hi in zip(bounds, bounds[1:])])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_model_with_zero_canon_weights_is_the_model_without_them():
    with_canon, without = canon_config(), canon_config(canon_layers="")
    model = random_tiny_model(with_canon)
    plain = tg.GPT(without, tg.SdpaAttention(), torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert not missing and sorted(unexpected) == ["blocks.0.canon", "blocks.1.canon", "blocks.3.canon"]
    assert [tuple(b.canon.shape) if b.canon is not None else None for b in model.blocks] == [
        (2, 4, with_canon.model_dim), (2, 4, with_canon.model_dim), None, (2, 4, with_canon.model_dim)]
    batch = random_batch(with_canon)
    with torch.no_grad():
        for block in model.blocks:
            if block.canon is not None:
                block.canon.zero_()
    torch.testing.assert_close(loss_of(model, with_canon, batch), loss_of(plain, without, batch), rtol=1e-6, atol=0)
    with torch.no_grad():
        model.blocks[3].canon.normal_(0, 0.3)
    assert abs(loss_of(model, with_canon, batch).item() - loss_of(plain, without, batch).item()) > 1e-3


def test_a_changed_token_reaches_only_later_tokens_of_its_document():
    """Random canon weights on every layer: changing token 60 moves the logits from position 60 on and up to the
    next document (BOS at 70), none before it and none in the next document."""
    cfg = canon_config(canon_layers="0,1,2,3")
    model = random_tiny_model(cfg)  # the canon weights too are drawn
    tokens, _, bigrams = random_batch(cfg)
    changed = tokens.clone()
    changed[60] = (tokens[60] + 1) % cfg.vocab_size

    def logits(t):
        masks = model.prepare_masks(t, torch.tensor([0, 70, len(t)], dtype=torch.int32), (32, 64))
        return model(t, None, masks, bigrams)
    with torch.no_grad():
        before, after = logits(tokens), logits(changed)
    moved = (before - after).abs().amax(dim=1) > 1e-6
    assert not moved[:60].any() and moved[60:70].all() and not moved[70:].any()


def test_canon_weights_train_with_adam_at_the_base_lr():
    cfg = canon_config()
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    optimizers = tg.build_optimizers(model, cfg)
    group = [g for g in optimizers[1].param_groups if any(p is model.blocks[0].canon for p in g["params"])][0]
    assert {id(p) for p in group["params"]} == {id(b.canon) for b in model.blocks if b.canon is not None}
    assert group["lr"] == cfg.adam_lr and group["betas"] == (0.9, 0.95) and group["weight_decay"] == 0.0
    fragments = tg.diloco_fragments(model, 2)  # raises unless every parameter is in exactly one fragment
    assert any(p is model.blocks[3].canon for p in fragments[-1].parameters())
    train_scheduled_steps(model, optimizers, cfg, steps=3)
    assert all(b.canon.abs().amax() > 0 for b in model.blocks if b.canon is not None)


@pytest.mark.parametrize("flag, message", [("--canon_kernel=1", "--canon_kernel=1: use 2 .. 16 tokens"),
                                           ("--canon_layers=4", "--canon_layers='4': use distinct layers")])
def test_canon_flags_are_checked(flag, message):
    with pytest.raises(tg.UserError, match=message):
        tg.validate_config(tg.parse_cli(["--device=cpu", *TINY, flag])[0])
