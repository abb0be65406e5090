"""Lightweight dynamically composable attention (--dc_window): the composed window attention against its formula
written out per token in float64, the model with it against the model without it at the start, the launch checks,
and where its parameters train."""
import dataclasses

import pytest
import torch

import train_gpt as tg
from helpers import TINY, random_tiny_model, train_scheduled_steps
from test_mudd import loss_of, random_batch


def composed_reference(q, k, v, starts, w1, w2, window):
    """Per token t: each head's softmax over the keys of t's document among its last `window`, mixed over heads by
    w1[t], read out of every head's values and scaled by w2[t, h]."""
    T, heads, _ = q.shape
    out = torch.zeros_like(q, dtype=torch.float64)
    first = 0
    for t in range(T):
        if starts[t]:
            first = t
        keys = list(range(max(first, t - window + 1), t + 1))
        composed = torch.zeros(len(keys), dtype=torch.float64)
        for g in range(heads):
            scores = torch.stack([q[t, g].double() @ k[j, g].double() for j in keys])
            composed += w1[t, g].double() * torch.softmax(scores, 0)
        for h in range(heads):
            out[t, h] = w2[t, h].double() * (composed[:, None] * v[keys, h].double()).sum(0)
    return out


@pytest.mark.parametrize("T, window, block", [(37, 5, 8), (40, 12, 8), (16, 3, 128)])
def test_composed_window_attention_is_its_formula(T, window, block):
    """Lengths that leave a partial block (37), a window longer than a block (12 > 8), one block wider than T;
    documents that start mid-block and one of a single token."""
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(T, 3, 4, generator=g) for _ in range(3))
    starts = torch.zeros(T, dtype=torch.bool)
    starts[[0, 6, 7, T - 10]] = True
    w1, w2 = torch.randn(T, 3, generator=g), torch.randn(T, 3, generator=g)
    got = tg.composed_window_attention(q, k, v, starts, w1, w2, window, block=block)
    torch.testing.assert_close(got.double(), composed_reference(q, k, v, starts, w1, w2, window), rtol=1e-5, atol=1e-5)


def dc_config(**overrides) -> tg.Config:
    cfg, _ = tg.parse_cli(["--device=cpu", *TINY, "--dc_window=6"])
    return dataclasses.replace(cfg, **overrides)


def test_the_model_with_composed_attention_starts_as_the_model_without_it():
    """w2 starts at zero, so the composed attention adds nothing; once its mixer's output weights move, it does, and
    the loss's gradient reaches the mixer."""
    cfg, without = dc_config(), dc_config(dc_window=0)
    plain = random_tiny_model(without)
    composed = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    missing, unexpected = composed.load_state_dict(plain.state_dict(), strict=False)
    last = cfg.num_layers - 1
    assert sorted(missing) == [f"blocks.{last}.attn.dc_mix.{name}" for name in ("bias", "w1", "w2")] and not unexpected
    batch = random_batch(cfg)
    torch.testing.assert_close(loss_of(composed, cfg, batch), loss_of(plain, without, batch), rtol=1e-6, atol=0)
    mix = composed.blocks[last].attn.dc_mix
    with torch.no_grad():
        mix.w2.normal_(0, 0.5)
    loss = loss_of(composed, cfg, batch)
    assert abs(loss.item() - loss_of(plain, without, batch).item()) > 1e-4
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (mix.w1, mix.w2, mix.bias))


def test_the_composed_attention_trains_with_adam_at_the_records_settings():
    cfg = dc_config()
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    optimizers = tg.build_optimizers(model, cfg)
    mix = model.blocks[-1].attn.dc_mix
    adam = next(opt for opt in optimizers if isinstance(opt, tg.DistAdam))
    groups = [group for group in adam.param_groups if any(p is mix.w2 or p is mix.bias for p in group["params"])]
    assert [group["lr"] for group in groups] == [pytest.approx(cfg.adam_lr * 0.1)] * 2
    assert all(group["betas"] == (0.9, 0.99) for group in groups)
    assert [group["weight_decay"] > 0 for group in groups] == [True, False]
    before = mix.w2.detach().clone()
    train_scheduled_steps(model, optimizers, cfg, steps=4)
    assert not torch.equal(before, mix.w2)


@pytest.mark.parametrize("flags, message", [
    (["--dc_window=-1"], "--dc_window=-1: use 0 (off) or a number of keys"),
    (["--dc_window=8", "--attn_layout=SLS-", "--value_embed_layout=01.."], "on a last layer with attention"),
    (["--dc_window=8", "--paired_head_layers=3"], "whose heads do not attend in pairs"),
])
def test_composed_attention_launch_checks(flags, message):
    with pytest.raises(tg.UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tg.validate_config(tg.parse_cli(["--device=cpu", *TINY, *flags])[0])
