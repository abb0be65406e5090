"""--tail_ema_from: the average against its formula, the blended weights of a run (with their norms kept, or not)
against the weights of the same run without it, a resumed run against one that never stopped, the flag checks."""
import dataclasses
import os

import pytest
import torch

import train_gpt as tg
from helpers import TINY
from test_checkpoint import config, final_checksum, run

NAMES = ("embed.weight", "lm_head.weight")


@pytest.mark.parametrize("keep_norms", [False, True])
def test_the_average_follows_its_formula_and_blends_into_the_weights(keep_norms):
    """Weights w_1 .. w_5 after steps 1 .. 5, start 3: the average is w_3, then a <- a + (1 - d)(w_s - a); the blend
    moves each weight its share of the way to the average, and with keep_norms each matrix is scaled back to the norm
    of w_5 (float64 reference)."""
    cfg = dataclasses.replace(tg.Config(**tg.RECORD_2026_02), num_iterations=10, tail_ema_from=0.3, tail_ema_decay=0.8,
                              tail_ema_blend=0.65, tail_ema_keep_norms=keep_norms)
    model = tg.GPT(dataclasses.replace(cfg, **dict(zip(("num_layers", "model_dim", "num_heads", "head_dim"),
                                                       (1, 32, 1, 32)), attn_layout="S", value_embed_layout=".",
                                                   paired_head_layers="", skip_from=0, skip_to=0, backout_from=-1,
                                                   bigram_rows=0)), tg.SdpaAttention(), torch.float32)
    ema = tg.TailEMA(model, cfg)
    assert ema.start == 3
    g = torch.Generator().manual_seed(0)
    history = []
    for done in range(1, 6):
        with torch.no_grad():
            for p in ema.params:
                p.copy_(torch.randn(p.shape, generator=g))
        history.append([p.detach().double().clone() for p in ema.params])
        ema.after_step(done)
        assert (ema.average is None) == (done < 3)
    want = [w.clone() for w in history[2]]
    for weights in history[3:]:
        want = [a + 0.2 * (w - a) for a, w in zip(want, weights)]
    for got, expected in zip(ema.average, want):
        torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    ema.blend_into_weights()
    for p, last, average in zip(ema.params, history[-1], want):
        blended = last + 0.65 * (average - last)
        if keep_norms:
            assert blended.norm() < 0.9 * last.norm()  # averaging random draws shortens them
            blended *= last.norm() / blended.norm()
        torch.testing.assert_close(p.double(), blended, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def averaged_runs(module_tiny_data, tmp_path_factory):
    """8 steps with the tail average from step 4 and the same run without it; Adam steps every step, so that a
    checkpoint may follow each."""
    tmp = tmp_path_factory.mktemp("tail")
    runs = {}
    for name, frac, every in (("with", 0.5, 0), ("all", 0.5, 1), ("norms", 0.5, 1), ("kinds", 0.5, 0),
                              ("without", 0.0, 0)):
        cfg = config(module_tiny_data, tmp, run_id=name, save_checkpoint=tmp / f"{name}.pt", checkpoint_every=1,
                     tail_ema_from=frac, tail_ema_decay=0.7, adam_period=1, tail_ema_all=every,
                     tail_ema_keep_norms=name == "norms", tail_ema_kinds=name == "kinds", tail_ema_fast_decay=0.4)
        runs[name] = (cfg, run(cfg))
    return runs


def weights_at(cfg, step=None):
    path = cfg.save_checkpoint if step is None else tg.checkpoint_path_at(cfg.save_checkpoint, step)
    return tg.read_checkpoint(path, "resume")


@pytest.mark.parametrize("run_name", ["with", "all", "norms"])
def test_a_run_ends_with_its_weights_blended_with_their_tail_average(averaged_runs, run_name):
    """The embedding and head, or with --tail_ema_all every parameter, end as the formula of the step checkpoints
    (with --tail_ema_keep_norms each matrix at its norm before the blend); the others as without the average."""
    (cfg, result), (plain_cfg, plain) = averaged_runs[run_name], averaged_runs["without"]
    assert result.train_losses == plain.train_losses  # the average does not touch the training
    assert result.val_losses[:-1] == plain.val_losses[:-1] and result.val_losses[-1] != plain.val_losses[-1]
    last = weights_at(plain_cfg)["model"]  # the weights after step 8, unblended
    final = weights_at(cfg)
    averaged = [name for name in last if name in NAMES or (cfg.tail_ema_all and not name.endswith("_signs"))]
    after = {step: weights_at(cfg, step)["model"] for step in (4, 5, 6, 7)}  # the weights after each step
    for name in averaged:
        average = after[4][name].double()
        for step in (5, 6, 7):
            average += 0.3 * (after[step][name].double() - average)
        average += 0.3 * (last[name].double() - average)
        blended = last[name].double() + 0.65 * (average - last[name])
        if cfg.tail_ema_keep_norms and blended.ndim >= 2:
            blended *= last[name].double().norm() / blended.norm()
        torch.testing.assert_close(final["model"][name].double(), blended, rtol=1e-5, atol=1e-6)
    assert len(final["tail_ema"]) == len(averaged) and len(averaged) > (2 if cfg.tail_ema_all else 1)
    assert all(torch.equal(final["model"][name], last[name]) for name in last if name not in averaged)
    what = "every parameter" if cfg.tail_ema_all else "the embedding and head"
    kept = ", norms kept" if cfg.tail_ema_keep_norms else ""
    assert f"blended into {what}: 65% of it{kept}\n" in open(os.path.join(cfg.log_dir, f"{run_name}.txt")).read()


def test_a_run_with_the_kinds_blends_only_their_weights(averaged_runs):
    """--tail_ema_kinds in a run: the same training, another final validation, the log's line, and the scalars,
    gates and bigram table as without the average."""
    (cfg, result), (plain_cfg, plain) = averaged_runs["kinds"], averaged_runs["without"]
    assert result.train_losses == plain.train_losses and result.val_losses[-1] != plain.val_losses[-1]
    last, final = weights_at(plain_cfg)["model"], weights_at(cfg)["model"]
    moved = {name for name in last if not torch.equal(final[name], last[name])}
    assert moved == {name for name in last if name in NAMES or name.endswith(("qkvo_w", "fc_w", "proj_w"))
                     or name.startswith("value_embeds.")}
    # slow: embedding, head, query-key rows, value-output rows, MLP; fast: value-output rows, MLP, value tables
    assert len(weights_at(cfg)["tail_ema"]) == 2 + 3 * len([n for n in last if n.endswith("qkvo_w")]) + 2 * len(
        [n for n in last if n.endswith(("fc_w", "proj_w"))]) + len([n for n in last if n.startswith("value_embeds.")])
    log = open(os.path.join(cfg.log_dir, "kinds.txt")).read()
    assert "blended into each kind of weight, slow and fast average by the record's shares\n" in log


@pytest.mark.parametrize("run_name", ["with", "kinds"])
def test_a_resumed_run_keeps_its_tail_average(averaged_runs, tmp_path, run_name):
    """Resumed after step 6, inside the averaged tail: the same losses and final weights, bit for bit."""
    cfg, whole = averaged_runs[run_name]
    resumed_cfg = dataclasses.replace(cfg, run_id="resumed", resume=tg.checkpoint_path_at(cfg.save_checkpoint, 6),
                                      save_checkpoint="", checkpoint_every=0, log_dir=str(tmp_path))
    resumed = run(resumed_cfg)
    assert resumed.train_losses == whole.train_losses and resumed.val_losses == whole.val_losses
    assert final_checksum(resumed_cfg) == final_checksum(cfg)


@pytest.mark.parametrize("flags, message", [
    (["--tail_ema_from=1"], "--tail_ema_from=1.0 --tail_ema_decay=0.9933 --tail_ema_blend=0.65: use a fraction"),
    (["--tail_ema_from=0.6", "--tail_ema_decay=1"], "use a fraction in \\[0, 1\\), a decay in \\(0, 1\\)"),
    (["--tail_ema_from=0.6", "--diloco=1"], "--tail_ema_from with --diloco=1"),
    (["--tail_ema_kinds=1"], "--tail_ema_kinds=1 needs --tail_ema_from above 0"),
    (["--tail_ema_kinds=1", "--tail_ema_from=0.6", "--tail_ema_all=1"], "--tail_ema_all=0 \\(it picks its own"),
    (["--tail_ema_kinds=1", "--tail_ema_from=0.6", "--tail_ema_fast_decay=1"], "in \\(0, 1\\), not 1.0"),
])
def test_tail_ema_flags_are_checked(flags, message):
    with pytest.raises(tg.UserError, match=message):
        tg.validate_config(tg.parse_cli(["--device=cpu", *TINY, *flags])[0])


@pytest.mark.parametrize("keep_norms", [False, True])
def test_the_kinds_blend_a_slow_and_a_fast_average_by_their_shares(keep_norms):
    """--tail_ema_kinds on a model with attention, an MLP and value tables: a slow and a fast average of the record's
    parts, each after its formula; at the blend the embedding and head take 0.65 of the slow, the query and key rows
    0.55 of it, the value and output rows and the MLP 0.35 slow + 0.65 fast, the value tables the fast one; nothing
    else moves (float64 reference)."""
    cfg = dataclasses.replace(tg.Config(**tg.RECORD_2026_02), num_iterations=10, tail_ema_from=0.3, tail_ema_decay=0.8,
                              tail_ema_fast_decay=0.5, tail_ema_kinds=True, tail_ema_keep_norms=keep_norms)
    model = tg.GPT(dataclasses.replace(cfg, **dict(zip(("num_layers", "model_dim", "num_heads", "head_dim"),
                                                       (2, 32, 1, 32)), attn_layout="SL", value_embed_layout="0.",
                                                   paired_head_layers="", skip_from=0, skip_to=1, backout_from=-1,
                                                   bigram_rows=0, vocab_size=64)), tg.SdpaAttention(), torch.float32)
    ema = tg.TailEMA(model, cfg)
    g = torch.Generator().manual_seed(1)
    history = []
    for done in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        history.append({name: p.detach().double().clone() for name, p in model.named_parameters()})
        ema.after_step(done)

    def average(name, decay, rows=slice(None)):
        a = history[2][name][rows].clone()
        for weights in history[3:]:
            a += (1 - decay) * (weights[name][rows] - a)
        return a

    last = history[-1]
    ema.blend_into_weights()
    d = 32
    expected = {}  # (name, first row, end row) -> the blended weights
    for name in ("embed.weight", "lm_head.weight"):
        expected[name, None, None] = last[name] + 0.65 * (average(name, 0.8) - last[name])
    for i in range(2):
        name = f"blocks.{i}.attn.qkvo_w"
        qk, vo = slice(0, 2 * d), slice(2 * d, 4 * d)
        expected[name, 0, 2 * d] = last[name][qk] + 0.55 * (average(name, 0.8, qk) - last[name][qk])
        expected[name, 2 * d, 4 * d] = 0.35 * average(name, 0.8, vo) + 0.65 * average(name, 0.5, vo)
        for part in ("fc_w", "proj_w"):
            name = f"blocks.{i}.mlp.{part}"
            expected[name, None, None] = 0.35 * average(name, 0.8) + 0.65 * average(name, 0.5)
    expected["value_embeds.0.weight", None, None] = average("value_embeds.0.weight", 0.5)
    params = dict(model.named_parameters())
    for (name, first, end), want in expected.items():
        rows = slice(first, end)
        if keep_norms:
            want = want * last[name][rows].norm() / want.norm()
        torch.testing.assert_close(params[name].detach()[rows].double(), want, rtol=1e-5, atol=1e-6)
    untouched = [name for name in params if not any(name == n for n, _, _ in expected)]
    assert untouched and all(torch.equal(params[name].detach().double(), last[name]) for name in untouched)
    assert ema.describe(5) == ("tail average of steps 3..5 blended into each kind of weight, slow and fast average "
                               "by the record's shares" + (", norms kept" if keep_norms else ""))
