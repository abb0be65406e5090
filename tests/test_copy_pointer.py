"""The copy pointer (--copy_pointer, CPLM of the speedrun's pull request #379): its banded scores against a float64
loop over every query and key, the mixture as a distribution over the next token, a closed gate giving the plain
loss, and the model's pointer and gate learning."""
import dataclasses
import re

import numpy as np
import pytest
import torch

import train_gpt as tg
from helpers import (BOS, TINY, cu_seqlens_of, fp8_head_reference, pointer_inputs, pointer_log_masses,
                     random_tiny_model, relative_error, write_shard)


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


@pytest.mark.parametrize("band, sink_per_query", [(128, False), (256, False), (128, True)])
def test_the_banded_pointer_is_one_softmax_per_query(band, sink_per_query):
    """Every query's mass on earlier positions of its document holding its target, and on the sink (one score for
    all, or one per query), within 1e-5 of a float64 softmax over exactly those keys; where none holds the target,
    about -1e9."""
    q, k, sink, tokens, targets, documents = pointer_inputs()
    if sink_per_query:
        sink = torch.randn(q.size(0), generator=torch.Generator().manual_seed(5))
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


def copy_config(**overrides) -> tg.Config:
    cfg, _ = tg.parse_cli(["--device=cpu", *TINY, "--copy_pointer=1", "--copy_band=128"])
    return dataclasses.replace(cfg, **overrides)


def test_the_model_gates_its_pointer_with_the_row_after_the_vocabulary():
    """The head gains a padding block for the gate (128 tokens: 256 rows); the model's loss is the mixture of its
    own logits and pointer, lower than the LM's alone when the gate opens on text that repeats itself, and every
    pointer parameter and the gate's row get gradients."""
    cfg = copy_config()
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
    # in the Adam groups: projections at a quarter of the base lr, gain and sink with the scalars
    adam = tg.build_optimizers(model, cfg)[1]
    lr_of = {id(p): group["lr"] for group in adam.param_groups for p in group["params"]}
    assert lr_of[id(pointer.q_w)] == lr_of[id(pointer.k_w)] == cfg.adam_lr * 0.25
    assert lr_of[id(pointer.sink)] == lr_of[id(pointer.q_gain)] == cfg.adam_lr * cfg.scalar_lr_mul


def test_a_sink_key_scores_each_query():
    """--copy_sink_key: the sink is a key of the head's width, starting at zero (a sink logit of 0, as the scalar
    sink starts); its sink mass then differs between queries, its gradient reaches the key, and it trains with the
    projections."""
    cfg = copy_config(copy_sink_key=1)
    model = random_tiny_model(cfg)
    pointer = model.copy_pointer
    assert pointer.sink.shape == (cfg.head_dim,) and not pointer.sink.any()
    g = torch.Generator().manual_seed(4)
    T = 256
    h = torch.randn(T, cfg.model_dim, generator=g)
    tokens = torch.randint(0, 6, (T,), generator=g)
    targets, documents = torch.cat([tokens[1:], tokens[:1]]), torch.zeros(T, dtype=torch.long)
    scalar = tg.CopyPointer(cfg.model_dim, cfg.head_dim, 128)
    scalar.load_state_dict({**pointer.state_dict(), "sink": torch.zeros(1)})
    for got, want in zip(pointer(h, tokens, targets, documents), scalar(h, tokens, targets, documents)):
        torch.testing.assert_close(got, want)
    with torch.no_grad():
        pointer.sink.normal_(generator=g)
    log_copy, log_sink = pointer(h, tokens, targets, documents)
    assert log_sink[1:].std() > 0.1  # the first query sees only itself
    (log_copy.clamp(min=-30).sum() + log_sink.sum()).backward()
    assert pointer.sink.grad.abs().sum() > 0
    lr_of = {id(p): group["lr"] for group in tg.build_optimizers(model, cfg)[1].param_groups for p in group["params"]}
    assert lr_of[id(pointer.sink)] == lr_of[id(pointer.q_w)] == cfg.adam_lr * 0.25
    cfg = dataclasses.replace(cfg, copy_lr_mul=1.0)  # the pull request's lr
    lr_of = {id(p): group["lr"] for group in tg.build_optimizers(model, cfg)[1].param_groups for p in group["params"]}
    assert lr_of[id(pointer.sink)] == lr_of[id(pointer.k_w)] == cfg.adam_lr


def test_the_copy_band_is_checked():
    with pytest.raises(tg.UserError, match=re.escape("--copy_band=100: use a positive multiple of 128")):
        tg.parse_cli(["--device=cpu", *TINY, "--copy_pointer=1", "--copy_band=100"])


def test_the_fp8_head_takes_the_copy_mixture():
    """The FP8 head's plain-torch path (the kernel's arithmetic; tests/test_triton_interpreter.py checks the kernel)
    with the copy mixture, multi-token weights and the shifted cap, against the float64 reference with the same
    quantisation: the loss, the input and weight gradients, and the pointer's two log-masses' gradients."""
    g = torch.Generator().manual_seed(4)
    rows, dim, vocab, slot = 96, 64, 1000, 999
    x = tg.rms_norm(torch.randn(rows, dim, generator=g))
    weight = torch.randn(vocab, dim, generator=g) * 0.3
    weight[slot] += 0.5  # a gate that takes a share
    targets = torch.randint(0, slot, (rows,), generator=g)
    log_copy, log_sink = pointer_log_masses(rows, g)
    weights, period, cap = torch.tensor([1.0, 0.5, 0.25]) / 1.75, 32, (23.0, 5.0, 7.5)
    x_, weight_, log_copy_, log_sink_ = (t.clone().requires_grad_() for t in (x, weight, log_copy, log_sink))
    loss = tg.fp8_softcapped_head(x_, weight_, targets, cap, False, (weights, period), (slot, log_copy_, log_sink_))
    loss.backward(torch.tensor(0.7))
    per_row = torch.full((rows,), 0.7 / rows)
    ref_losses, ref_x, ref_w, ref_copy, ref_sink = fp8_head_reference(
        x, weight, targets, 23.0, per_row, offset=5.0, divisor=7.5, mtp=(weights, period),
        copy=(slot, log_copy, log_sink))
    torch.testing.assert_close(loss.detach().double(), ref_losses.mean(), rtol=1e-5, atol=1e-5)
    assert relative_error(x_.grad, ref_x) < 1e-3 and relative_error(weight_.grad, ref_w) < 1e-3
    torch.testing.assert_close(log_copy_.grad.double(), ref_copy, rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(log_sink_.grad.double(), ref_sink, rtol=1e-4, atol=1e-9)
    plain = tg.fp8_softcapped_head(x, weight, targets, cap, False, (weights, period))
    assert abs(plain.item() - loss.item()) > 1e-2  # the mixture is not the plain loss


def long_documents(num_tokens: int, seed: int) -> np.ndarray:
    """BOS-prefixed documents of 250 tokens, each a random phrase of 40 tokens repeated: past 128 tokens back
    there is more to point at."""
    rng = np.random.default_rng(seed)
    docs = [np.concatenate([[BOS], np.tile(rng.integers(0, 97, 40), 7)[:249]]) for _ in range(num_tokens // 250 + 1)]
    return np.concatenate(docs)[:num_tokens]


def test_eval_only_scores_a_checkpoint_at_another_band(tmp_path):
    """The band is a run setting, as the windows are: a checkpoint trained at 128 tokens back is validated again at
    128 (the run's own final validation) and at 256 (another loss: its documents of 250 tokens leave the longer
    band more to point at)."""
    from test_train import tiny_config
    train = write_shard(tmp_path / "long_train_000001.bin", long_documents(40_000, seed=1))
    val = write_shard(tmp_path / "long_val_000000.bin", long_documents(4_000, seed=2))
    cfg = tiny_config(str(train), str(val), copy_pointer=1, copy_band=128, micro_batch_tokens=256, num_iterations=3,
                      val_loss_every=0, log_dir=str(tmp_path), run_id="trained",
                      save_checkpoint=str(tmp_path / "copy.pt"))
    trained = tg.train(cfg, tg.Comm(), tg.RunLog(cfg, tg.Comm()))
    losses = {}
    for band in (128, 256):
        eval_cfg = dataclasses.replace(cfg, run_id=f"eval_{band}", eval_only=True, init_from=cfg.save_checkpoint,
                                       save_checkpoint="", copy_band=band)
        log = tg.RunLog(eval_cfg, tg.Comm())
        losses[band] = tg.evaluate_checkpoint(eval_cfg, tg.Comm(), log)
        log.finish()
    assert losses[128] == pytest.approx(trained.val_losses[-1][1], rel=1e-5)
    assert abs(losses[256] - losses[128]) > 1e-5


@pytest.mark.parametrize("multi_token", [False, True])
def test_the_mixture_gradient_in_closed_form_is_autograd_of_its_losses(multi_token):
    """copy_mixture_grad (the FP8 head's plain-torch path; the loss kernel's formulas) in float64 against autograd
    of copy_mixture_losses: gates from shut tight to wide open, rows with and without a hit for the pointer, a
    repeated target, with and without multi-token weights."""
    g = torch.Generator().manual_seed(6)
    rows, vocab, slot = 48, 300, 299
    z = (torch.rand(rows, vocab, generator=g, dtype=torch.float64) * 23.0)
    z[:, slot] = torch.linspace(-2.0, 23.0, rows, dtype=torch.float64)  # alpha from about 1e-13 to near 1
    targets = torch.randint(0, slot, (rows,), generator=g)
    targets[5:8] = targets[7]
    log_copy, log_sink = (t.double() for t in pointer_log_masses(rows, g))
    mtp = (torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64) / 1.75, 16) if multi_token else None
    inputs = [t.clone().requires_grad_() for t in (z, log_copy, log_sink)]
    tg.copy_mixture_losses(inputs[0], targets, slot, inputs[1], inputs[2], mtp).sum().backward()
    got = tg.copy_mixture_grad(z, targets, slot, log_copy, log_sink, mtp)
    for g_, ref in zip(got, inputs):
        torch.testing.assert_close(g_, ref.grad, rtol=1e-9, atol=1e-15)
    shut = (z[:, slot] < 5.0) & (log_copy < -1e8)  # a shut gate and no hit: a tiny gradient, matched closely
    assert shut.sum() >= 3 and (got[0][shut, slot].abs() < 1e-6).all()


def test_the_fp8_head_with_the_mixture_compiles_whole_on_the_cpu():
    """The plain-torch FP8 head with the copy mixture traces into one graph (fullgraph), as the whole-model compile
    needs on a machine without the kernels, and gives the eager loss and gradients."""
    g = torch.Generator().manual_seed(8)
    rows, dim, vocab, slot = 64, 32, 200, 199
    x = tg.rms_norm(torch.randn(rows, dim, generator=g))
    weight = torch.randn(vocab, dim, generator=g) * 0.3
    targets = torch.randint(0, slot, (rows,), generator=g)
    log_copy, log_sink = pointer_log_masses(rows, g)
    mtp, cap = (torch.tensor([1.0, 0.5]) / 1.5, 16), (23.0, 5.0, 7.5)

    def head(x, weight, log_copy, log_sink):
        return tg.fp8_softcapped_head(x, weight, targets, cap, False, mtp, (slot, log_copy, log_sink))
    results = []
    for fn in (head, torch.compile(head, fullgraph=True, backend="aot_eager")):
        inputs = [t.clone().requires_grad_() for t in (x, weight, log_copy, log_sink)]
        loss = fn(*inputs)
        loss.backward()
        results.append([loss.detach()] + [t.grad for t in inputs])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
