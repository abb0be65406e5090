"""The prefix-token loss (--prefix_loss_schedule): the prefix table, its schedule, its config checks, and the model's
loss with it against the cross-entropies written out. Its kernel: tests/test_triton_interpreter.py, tests/gpu."""
import dataclasses

import pytest
import torch

import train_gpt as tg
from helpers import BOS, TINY, cu_seqlens_of, learnable_documents, random_tiny_model, write_shard


def test_each_token_gets_its_longest_proper_prefix_that_is_a_token():
    vocab = [b"a", b"b", b"ab", b"abc", b"abd", b"bca", None, b"abcd", b"xyz", b"\xe2\x82"]
    got = tg.longest_prefix_tokens(vocab).tolist()
    #        a   b   ab  abc abd bca  special abcd xyz (no prefix token) partial UTF-8 (no prefix token)
    assert got == [-1, -1, 0, 2, 2, 1, -1, 3, -1, -1]


def test_gpt2_prefix_tokens_where_tiktoken_has_its_files():
    try:
        import tiktoken
        encoding = tiktoken.get_encoding("gpt2")
    except Exception:
        pytest.skip("tiktoken's gpt2 files are not available offline")
    table = tg.gpt2_prefix_tokens(50304)
    the, th = encoding.encode(" the")[0], encoding.encode(" th")[0]
    assert table[the] == th and table[encoding.encode("a")[0]] == -1
    assert table[encoding.eot_token] == -1 and (table[50257:] == -1).all()
    assert (table[:50256] >= 0).sum() == 50256 - 256  # all but the single bytes


def test_the_prefix_weight_follows_its_schedule_after_the_multi_token_weights():
    cfg = tg.Config(num_iterations=480, extension_steps=40, mtp_schedule="1,0.5,0.25>0/1,0.5>0/1",
                    prefix_loss_schedule="0.25/0.25>0/0")
    s = tg.Schedule(cfg)
    assert s.loss_terms == 4
    assert s.mtp_weights(0) == [1.0, 0.5, 0.25, 0.25]
    assert s.mtp_weights(240) == [1.0, 0.25, 0.0, 0.125]  # half-way through the second stage's ramps
    assert s.mtp_weights(400) == [1.0, 0.0, 0.0, 0.0] and s.mtp_weights(519) == [1.0, 0.0, 0.0, 0.0]
    alone = tg.Schedule(tg.Config(mtp_schedule="", prefix_loss_schedule="0.25/0.1/0"))
    assert alone.loss_terms == 2 and alone.mtp_weights(0) == [1.0, 0.25]
    for flags, message in ((["--prefix_loss_schedule=0.25/0"], "one weight of 0 or more per stage"),
                           (["--prefix_loss_schedule=0.25,1/0/0"], "one weight per stage"),
                           (["--prefix_loss_schedule=x/0/0"], "bad --prefix_loss_schedule"),
                           ([*TINY, "--prefix_loss_schedule=0.25/0/0"], "needs GPT-2's vocabulary")):
        with pytest.raises(tg.UserError, match=message):
            tg.validate_config(tg.parse_cli(flags)[0])


@pytest.mark.parametrize("fp8_head", [False, True])
def test_the_model_adds_the_prefix_token_cross_entropy_to_its_loss(fp8_head):
    """A tiny model whose prefix table maps some tokens to others: its training loss is the mean over rows of the
    weighted cross-entropies of its soft-capped logits to the tokens 1 and 2 ahead and to the next token's prefix
    token (where it has one), each weight normalised; next-token only for validation ([1.0])."""
    cfg = dataclasses.replace(tg.parse_cli(TINY)[0], mtp_schedule="1,0.5/1,0.5/1", prefix_loss_schedule="0.5/0.5/0",
                              fp8_head=fp8_head)
    model = random_tiny_model(cfg)
    with torch.no_grad():
        model.prefix_tokens.copy_(torch.randint(-1, cfg.vocab_size, model.prefix_tokens.shape,
                                                generator=torch.Generator().manual_seed(1)))
    tokens = torch.randint(0, cfg.vocab_size, (256,), generator=torch.Generator().manual_seed(2))
    tokens[0] = BOS
    targets = torch.roll(tokens, -1)
    bigrams = torch.from_numpy(tg.bigram_hash(tokens.numpy(), cfg.bigram_rows, cfg.bos_token))
    masks = model.prepare_masks(tokens, cu_seqlens_of(tokens, BOS), (32, 64))
    seen = []
    head = model.loss_head
    model.loss_head = lambda x, targets: (seen.append(x.detach()), head(x, targets))[1]
    model.set_mtp_weights([1.0, 0.5, 0.5])
    loss = model(tokens, targets, masks, bigrams)
    x, weight, cap = tg.rms_norm(seen[0]), model.lm_head.weight.detach(), (cfg.logit_softcap, cfg.logit_offset,
                                                                          cfg.logit_divisor)
    # the FP8 head quantises x and the head: score the reference with the same quantised logits
    z = tg.softcap(fp8_logits(x, weight) if fp8_head else x @ weight.T, cap).double()
    lse = torch.logsumexp(z, dim=1)
    ce = lambda rows, target: lse[rows] - z[rows, target]  # noqa: E731
    want = torch.zeros(256, dtype=torch.float64)
    for i in range(256):
        want[i] += 0.5 * ce(i, targets[i])
        if i % cfg.micro_batch_tokens + 1 < cfg.micro_batch_tokens:
            want[i] += 0.25 * ce(i, targets[i + 1])
        prefix = model.prefix_tokens[targets[i]]
        if prefix >= 0:
            want[i] += 0.25 * ce(i, prefix)
    torch.testing.assert_close(loss.double(), want.mean(), rtol=1e-5, atol=1e-6)
    model.set_mtp_weights([1.0])  # validation: the next token alone
    next_only = (lse - z.gather(1, targets[:, None].long())[:, 0]).mean()
    torch.testing.assert_close(model(tokens, targets, masks, bigrams).double(), next_only, rtol=1e-5, atol=1e-6)


def fp8_logits(x, weight):
    """The FP8 head's logits: x and the weight quantised to e4m3 with its per-tensor scales."""
    e4m3 = torch.float8_e4m3fn
    x_scale = x.size(1) ** 0.5 / tg.E4M3_MAX
    w_scale = (weight.abs().amax() / tg.E4M3_MAX).clamp(min=1e-30)
    x_q = (x / x_scale).clamp(-448, 448).to(e4m3).float() * x_scale
    w_q = (weight / w_scale).clamp(-448, 448).to(e4m3).float() * w_scale
    return x_q @ w_q.T


def test_without_tiktoken_the_prefix_loss_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    train, val = tmp_path / "t_train_000001.bin", tmp_path / "t_val_000000.bin"
    write_shard(train, learnable_documents(20_000, seed=1))
    write_shard(val, learnable_documents(4_000, seed=2))
    monkeypatch.setitem(__import__("sys").modules, "tiktoken", None)  # `import tiktoken` fails
    code = tg.main(["--device=cpu", "--preset=tiny", f"--bos_token={BOS}", f"--train_files={train}", f"--val_files={val}",
                    "--prefix_loss_schedule=0.25/0/0", f"--log_dir={tmp_path / 'logs'}"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: --prefix_loss_schedule needs tiktoken's gpt2 encoding, which did not load")
    assert not (tmp_path / "logs").exists()
