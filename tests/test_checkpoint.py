"""Checkpoints on the CPU: a run stopped and resumed trains exactly as one that never stopped, at world sizes 1 and 2
and across them; --eval_only reproduces a run's final validation on 1 and 2 processes; sample.py continues a prompt;
bad checkpoints get one line and change nothing."""
import dataclasses
import os
import re
import sys

import numpy as np
import pytest
import torch

import sample
import train_gpt as tg
from helpers import TINY, run_on_ranks


def config(data, tmp_path, **overrides):
    train, val = data
    cfg, _ = tg.parse_cli(["--device=cpu", *TINY, f"--train_files={train}", f"--val_files={val}",
                           "--micro_batch_tokens=128", "--num_iterations=8", "--val_loss_every=4",
                           f"--log_dir={tmp_path}"] + [f"--{k}={v}" for k, v in overrides.items()])
    return cfg


def run(cfg, comm=None):
    comm = comm or tg.Comm()
    log = tg.RunLog(cfg, comm)
    result = tg.train(cfg, comm, log)
    log.finish()
    return result


def final_checksum(cfg) -> str:
    text = open(os.path.join(cfg.log_dir, f"{cfg.run_id}.txt")).read()
    return re.findall(r"^final weights: .*$", text, re.M)[-1]


def _run_on_rank(rank, world_size, cfg):
    result = run(cfg, tg.Comm(rank, world_size))
    return result.train_losses, result.val_losses


@pytest.fixture(scope="module")
def whole_run(module_tiny_data, tmp_path_factory):
    """8 steps uninterrupted, checkpoints every 2 steps and at the end (world size 1)."""
    tmp = tmp_path_factory.mktemp("whole")
    cfg = config(module_tiny_data, tmp, run_id="whole", save_checkpoint=tmp / "final.pt", checkpoint_every=2)
    return cfg, run(cfg)


def test_checkpoints_are_written_every_n_steps_and_at_the_end(whole_run):
    cfg, result = whole_run
    folder = os.path.dirname(cfg.save_checkpoint)
    assert sorted(f for f in os.listdir(folder) if f.endswith(".pt")) == [
        "final.pt", "final_step000002.pt", "final_step000004.pt", "final_step000006.pt"]
    assert not [f for f in os.listdir(folder) if f.endswith(".tmp")]
    checkpoint = tg.read_checkpoint(cfg.save_checkpoint, "resume")
    assert checkpoint["step"] == 8 and checkpoint["train_losses"] == pytest.approx(result.train_losses)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_resumed_run_trains_exactly_as_one_never_stopped(whole_run, module_tiny_data, tmp_path, world_size):
    """Stopped after step 2 (Adam has stepped once on two steps' gradients, Muon twice; no validation there) and
    resumed: the same per-step training losses, validations and final weights, bit for bit at world size 1; the
    world-2 run resumes its own world-2 checkpoint."""
    cfg, whole = whole_run
    if world_size == 1:
        reference, resume_from = whole, cfg.save_checkpoint.replace("final.pt", "final_step000002.pt")
        resumed_cfg = dataclasses.replace(cfg, run_id="resumed", resume=resume_from, save_checkpoint="",
                                          checkpoint_every=0, log_dir=str(tmp_path))
        resumed = run(resumed_cfg)
        assert resumed.train_losses == whole.train_losses and resumed.val_losses == whole.val_losses
        assert final_checksum(resumed_cfg) == final_checksum(cfg)
        assert "resumed from" in open(tmp_path / "resumed.txt").read()
        return
    two = dataclasses.replace(cfg, run_id="two", save_checkpoint=str(tmp_path / "two.pt"), log_dir=str(tmp_path))
    reference = run_on_ranks(_run_on_rank, 2, two)[0]
    resumed_cfg = dataclasses.replace(two, run_id="two_resumed", resume=str(tmp_path / "two_step000004.pt"),
                                      save_checkpoint="", checkpoint_every=0)
    resumed = run_on_ranks(_run_on_rank, 2, resumed_cfg)[0]
    assert resumed == reference
    assert final_checksum(resumed_cfg) == final_checksum(two)


def test_a_checkpoint_resumes_at_another_world_size(whole_run, tmp_path):
    """World size 1's checkpoint of step 4 resumed by 2 processes: the optimizers' shards are cut anew, the math
    is the same (within float32 rounding of the different reduction order)."""
    cfg, whole = whole_run
    resumed_cfg = dataclasses.replace(cfg, run_id="to_two", resume=cfg.save_checkpoint.replace("final.pt",
                                      "final_step000004.pt"), save_checkpoint="", checkpoint_every=0,
                                      log_dir=str(tmp_path))
    losses, val_losses = run_on_ranks(_run_on_rank, 2, resumed_cfg)[0]
    np.testing.assert_allclose(losses, whole.train_losses, rtol=1e-5)
    np.testing.assert_allclose([v for _, v in val_losses], [v for _, v in whole.val_losses], rtol=1e-5)


def _evaluate_on_rank(rank, world_size, cfg):
    comm = tg.Comm(rank, world_size)
    log = tg.RunLog(cfg, comm)
    loss = tg.evaluate_checkpoint(cfg, comm, log)
    log.finish()
    return loss


@pytest.mark.parametrize("world_size", [1, 2])
def test_eval_only_reproduces_the_final_validation(whole_run, tmp_path, world_size):
    """A world-1 run's checkpoint validated by 1 or 2 processes (each its share of the validation tokens)."""
    cfg, whole = whole_run
    eval_cfg = dataclasses.replace(cfg, run_id="eval", eval_only=True, init_from=cfg.save_checkpoint,
                                   save_checkpoint="", checkpoint_every=0, log_dir=str(tmp_path))
    if world_size == 1:
        loss = _evaluate_on_rank(0, 1, eval_cfg)
    else:
        loss = run_on_ranks(_evaluate_on_rank, 2, eval_cfg)[0]
    assert loss == pytest.approx(whole.val_losses[-1][1], rel=1e-5)
    assert f"val_loss:{loss:.4f}" in (tmp_path / "eval.txt").read_text()


@pytest.mark.parametrize("world_size", [1, 2])
def test_val_mask_adds_the_canonical_loss_to_the_validation(whole_run, tmp_path, world_size):
    """--val_mask: val_loss as without it, and val_loss_canonical that plus the mean of log(1 - the softmax's mass on
    the tokens the mask rules out after each input token), here in float64 from the model's logits; a mask of the
    wrong shape is one line."""
    cfg, whole = whole_run
    rng = np.random.default_rng(0)
    never = rng.random((cfg.vocab_size, cfg.vocab_size)) < 0.3
    np.save(tmp_path / "mask.npy", np.packbits(never, axis=1, bitorder="little"))
    eval_cfg = dataclasses.replace(cfg, run_id="eval", eval_only=True, init_from=cfg.save_checkpoint,
                                   save_checkpoint="", checkpoint_every=0, log_dir=str(tmp_path),
                                   val_mask=str(tmp_path / "mask.npy"))
    loss = _evaluate_on_rank(0, 1, eval_cfg) if world_size == 1 else run_on_ranks(_evaluate_on_rank, 2, eval_cfg)[0]
    assert loss == pytest.approx(whole.val_losses[-1][1], rel=1e-5)
    log = (tmp_path / "eval.txt").read_text()
    canonical = float(re.search(r"eval_only: .* val_loss_canonical:(\d+\.\d+)", log).group(1))
    checkpoint = tg.read_checkpoint(cfg.save_checkpoint, "init_from")
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    tg.load_checkpoint_weights(model, checkpoint)
    windows = tg.set_up_as_validated(model, checkpoint)
    batches = tg.prefetch(tg.val_batches_for_rank(tg.shard_paths(cfg.val_files, "val_files"), cfg, tg.Comm()), cfg,
                          torch.device("cpu"), 1)
    gaps = []
    with torch.no_grad():
        for _ in range(cfg.val_tokens // cfg.micro_batch_tokens):
            batch = batches.next()
            masks = model.prepare_masks(batch.inputs, batch.cu_seqlens, windows, batch.documents,
                                        batch.longest_document)
            p = model(batch.inputs, None, masks, batch.bigrams).double().softmax(-1)[:, : cfg.vocab_size]
            ruled_out = torch.from_numpy(never[batch.inputs.numpy()])
            gaps.append(torch.log1p(-(p * ruled_out).sum(-1)))
    batches.close()
    want = loss + torch.cat(gaps).mean().item()
    assert want < loss and canonical == pytest.approx(want, abs=1.5e-4)  # the log's 4 decimals

    def compiled(*args):  # the pass runs eagerly, and leaves a compiled model as it was
        raise AssertionError("a compiled graph ran")
    model.trunk = model.find_matches = compiled
    gap = tg.canonical_gap(model, cfg, tg.Comm(), tg.shard_paths(cfg.val_files, "val_files"), windows,
                           torch.device("cpu"), torch.from_numpy(np.packbits(never, axis=1, bitorder="little")))
    assert gap == pytest.approx(torch.cat(gaps).mean().item(), abs=1e-6)
    assert model.trunk is compiled and model.find_matches is compiled
    np.save(tmp_path / "mask.npy", np.zeros((cfg.vocab_size, 3), dtype=np.uint8))
    with pytest.raises(tg.UserError, match=r"^--val_mask=.*mask.npy: uint8 \(\d+, 3\), not the bits of --vocab"):
        tg.read_val_mask(eval_cfg)


def test_eval_only_takes_the_checkpoints_settings(whole_run, tmp_path, capsys):
    """--init_from without the model's flags: its run's data, schedule and model settings come from the checkpoint
    (here the tiny model on 128-token micro-batches, its validation files); a model flag that differs from it is one
    line naming it."""
    cfg, whole = whole_run
    assert tg.main(["--device=cpu", "--compile=0", "--eval_only=1", f"--init_from={cfg.save_checkpoint}",
                    f"--log_dir={tmp_path}", "--run_id=bare"]) == 0
    assert f"val_loss:{whole.val_losses[-1][1]:.4f}" in (tmp_path / "bare.txt").read_text()
    eval_cfg, _ = tg.parse_cli(["--device=cpu", "--eval_only=1", f"--init_from={cfg.save_checkpoint}"])
    assert (eval_cfg.num_layers, eval_cfg.micro_batch_tokens, eval_cfg.vocab_size) == (4, 128, cfg.vocab_size)
    assert tg.main(["--device=cpu", "--eval_only=1", f"--init_from={cfg.save_checkpoint}", "--num_layers=5",
                    "--attn_layout=SL-LS", "--value_embed_layout=0..1."]) == 1
    err = capsys.readouterr().err
    assert ("the checkpoint's model differs: num_layers=4 (here 5), attn_layout=SL-L (here SL-LS), value_embed_layout"
            "=0..1 (here 0..1.); leave those flags out: the checkpoint gives them\n") in err, err
    assert err.count("\n") == 1


def test_eval_only_from_the_command_line(whole_run, tmp_path, capsys):
    cfg, whole = whole_run
    code = tg.main(["--device=cpu", *TINY, f"--val_files={cfg.val_files}", "--micro_batch_tokens=128",
                    "--eval_only=1", f"--init_from={cfg.save_checkpoint}", f"--log_dir={tmp_path}", "--run_id=cli"])
    assert code == 0
    assert f"val_loss:{whole.val_losses[-1][1]:.4f}" in (tmp_path / "cli.txt").read_text()


def test_bad_checkpoints_get_one_line_and_change_nothing(whole_run, tmp_path, capsys):
    cfg, _ = whole_run
    good = open(cfg.save_checkpoint, "rb").read()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good[: len(good) // 2])
    flipped = tmp_path / "flipped.pt"  # one bit of a tensor's data changed: torch loads it as it is
    flipped.write_bytes(good[: len(good) // 2] + bytes([good[len(good) // 2] ^ 1]) + good[len(good) // 2 + 1:])
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    base = ["--device=cpu", *TINY, f"--train_files={cfg.train_files}", f"--val_files={cfg.val_files}",
            "--micro_batch_tokens=128", "--num_iterations=8", f"--log_dir={tmp_path}", "--run_id=bad"]
    other_data = tmp_path / "other_train.bin"
    other_data.write_bytes(open(tg.shard_paths(cfg.train_files, "train_files")[0], "rb").read())
    cases = [
        ([f"--resume={tmp_path / 'missing.pt'}"], f"--resume={tmp_path / 'missing.pt'}: no such file"),
        ([f"--resume={truncated}"], f"--resume={truncated}: unreadable (RuntimeError): truncated, damaged or not a "
                                    "checkpoint of train_gpt.py; write it again or give another\n"),
        (["--eval_only=1", f"--init_from={truncated}"], f"--init_from={truncated}: unreadable"),
        ([f"--resume={flipped}"], f"--resume={flipped}: damaged ("),
        ([f"--resume={foreign}"], f"--resume={foreign}: not a checkpoint of train_gpt.py"),
        ([f"--resume={cfg.save_checkpoint}", "--model_dim=128", "--num_heads=4"],
         "the checkpoint's model differs: model_dim=64 (here 128), num_heads=2 (here 4); pass the model flags"),
        ([f"--resume={cfg.save_checkpoint}", f"--train_files={other_data}"], "it was trained on other data files"),
        (["--eval_only=1", f"--init_from={foreign}"], f"--init_from={foreign}: not a checkpoint of train_gpt.py"),
        (["--eval_only=1"], "--eval_only=1 needs --init_from=CHECKPOINT"),
        ([f"--resume={cfg.save_checkpoint}", "--diloco=1", "--sync_every=4"],
         "the checkpoint was written without --diloco=1; resume it without it"),
        (["--checkpoint_every=3", f"--save_checkpoint={tmp_path / 'x.pt'}"],
         "--checkpoint_every=3: 0 or a multiple of Adam's period (2)"),
    ]
    before = {f: os.path.getmtime(tmp_path / f) for f in os.listdir(tmp_path)}
    for flags, message in cases:
        assert tg.main(base + flags) == 1, flags
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err, (flags, err)
    assert {f: os.path.getmtime(tmp_path / f) for f in os.listdir(tmp_path)} == before  # not even a log
    assert not (tmp_path / "x.pt").exists() and open(cfg.save_checkpoint, "rb").read() == good


def test_logits_give_the_validation_loss_and_padding_after_the_text_changes_nothing(whole_run):
    cfg, _ = whole_run
    checkpoint = tg.read_checkpoint(cfg.save_checkpoint, "init_from")
    model, device, _ = tg.build_model(dataclasses.replace(cfg, forward_micro_batches=1), tg.Comm(), lambda line: None)
    tg.load_checkpoint_weights(model, checkpoint)
    windows = tg.set_up_as_validated(model, checkpoint)
    slot = tg._Slot(cfg.micro_batch_tokens, False, cfg.bos_token, cfg.bigram_rows)
    window = next(tg.val_batches_for_rank(tg.shard_paths(cfg.val_files, "val_files"), cfg, tg.Comm()))
    slot.fill([window])
    masks = model.prepare_masks(slot.inputs, slot.cu_seqlens, windows, slot.documents, slot.longest_document)
    seen, head = {}, model.loss_head
    model.loss_head = lambda x, *args: (seen.update(x=x), head(x, *args))[1]
    with torch.no_grad():
        loss = model(slot.inputs, slot.targets, masks, slot.bigrams)
        logits = model(slot.inputs, None, masks, slot.bigrams)
        # the loss: the logits' softmax mixed with the copy pointer's mass (sampling leaves the pointer out)
        starts = model.starts_of(slot.inputs)
        pointer = model.copy_pointer(tg.rms_norm(seen["x"]), slot.inputs, slot.targets, torch.cumsum(starts.long(), 0))
        want = tg.copy_mixture_losses(logits, slot.targets, cfg.vocab_size, *pointer,
                                      (model.mtp_weights, cfg.micro_batch_tokens)).mean()
    assert torch.allclose(want, loss, rtol=1e-5)
    # generate pads the text with zeros: other padding gives the text's positions the same logits
    text = 40
    padded = window.copy()
    padded[text:] = np.random.default_rng(0).integers(0, cfg.bos_token, len(padded) - text)
    slot.fill([padded])
    masks = model.prepare_masks(slot.inputs, slot.cu_seqlens, windows, slot.documents, slot.longest_document)
    with torch.no_grad():
        other = model(slot.inputs, None, masks, slot.bigrams)
    torch.testing.assert_close(other[:text], logits[:text])


def test_a_checkpoint_whose_model_has_a_setting_this_code_lacks_is_refused(whole_run, tmp_path, capsys):
    """config_from_dict drops names it does not know: a model setting removed since the checkpoint was written would
    otherwise vanish, and the weights load into a model of other math."""
    cfg, _ = whole_run
    checkpoint = torch.load(cfg.save_checkpoint, weights_only=True)
    assert checkpoint["model_settings"] == sorted(tg.model_fields(cfg))
    checkpoint["model_settings"].append("old_heads")
    checkpoint["config"]["old_heads"] = "0,2"
    path = tmp_path / "older.pt"
    torch.save(checkpoint, path)
    message = f"--init_from={path}: the checkpoint's model has settings this train_gpt.py lacks (old_heads=0,2); use "
    assert tg.main(["--device=cpu", "--eval_only=1", f"--init_from={path}"]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    options = dict(init_from=str(path), prompt="ab", tokens=2, temperature=0.0, seed=0, device="cpu")
    with pytest.raises(tg.CheckpointError, match=re.escape(message)):
        sample.sample(options, lambda line: None, (lambda text: list(text.encode()), bytes))


def test_sample_py_continues_the_learned_rule_and_is_reproducible(whole_run, tmp_path):
    """The tiny data's documents count up by 1 (sometimes 2) mod 97; a byte codec stands in for GPT-2 BPE."""
    cfg, _ = whole_run
    codec = (lambda text: list(text.encode("latin-1")), lambda tokens: bytes(tokens).decode("latin-1"))
    options = dict(init_from=cfg.save_checkpoint, prompt=bytes([30, 31, 32, 33, 34]).decode("latin-1"), tokens=12,
                   temperature=0.0, seed=0, device="cpu")
    lines = []
    greedy = sample.sample(options, lines.append, codec)
    steps = np.diff([34] + list(greedy.encode("latin-1")))
    assert len(greedy) == 12 and np.isin(steps % 97, [1, 2]).mean() >= 0.5, steps  # chance: 2 in 97
    assert lines == [f"sample (temperature 0.0, seed 0): {options['prompt']!r} -> {greedy!r}"]
    runs = [sample.sample(dict(options, temperature=1.0, seed=seed), lambda line: None, codec) for seed in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    with pytest.raises(tg.UserError, match=r"^--prompt: 129 tokens, the model reads at most 127"):
        sample.sample(dict(options, prompt="x" * 128), lambda line: None, codec)
    with pytest.raises(tg.CheckpointError, match="^--init_from=.*missing.pt: no such file"):
        sample.sample(dict(options, init_from=str(tmp_path / "missing.pt")), lambda line: None, codec)


def test_without_tiktoken_sample_py_says_so_in_one_line(whole_run, monkeypatch, capsys):
    cfg, _ = whole_run
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # `import tiktoken` fails
    assert sample.main([f"--init_from={cfg.save_checkpoint}", "--prompt=hello", "--device=cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: sample.py needs tiktoken's gpt2 encoding, which did not load") and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    ([], "sample.py needs --init_from and --prompt"),
    (["--prompt=hi"], "sample.py needs --init_from (python sample.py"),
    (["--init_from=x.pt", "--prompt=hi", "--temp=1"], "'--temp=1': sample.py takes --init_from=..., --prompt=..."),
    (["--init_from=x.pt", "--prompt=hi", "--tokens=many"], "bad value for --tokens: 'many'"),
    (["--init_from=x.pt", "--prompt=hi", "--tokens=0"], "--tokens=0 and --temperature=0.8: at least 1"),
    (["--init_from=x.pt", "--prompt=hi", "--device=tpu"], "--device=tpu: use cuda or cpu"),
    pytest.param(["--init_from=x.pt", "--prompt=hi"], "--device=cuda, but torch sees no CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")),
])
def test_sample_py_turns_bad_flags_into_one_line(argv, message, capsys):
    assert sample.main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_sample_py_help_prints_its_usage(capsys):
    assert sample.main(["--help"]) == 0
    assert "python sample.py --init_from=logs/run.pt --prompt=" in capsys.readouterr().out


def test_a_run_may_end_on_a_step_that_only_sums_gradients_and_still_save():
    cfg, _ = tg.parse_cli(["--preset=tiny", "--num_iterations=7", "--save_checkpoint=x.pt"])  # Adam every 2nd step
    assert tg.Schedule(cfg).total_steps % cfg.period == 1


@pytest.mark.parametrize("flags, message", [
    (["--eval_only=1"], "--eval_only=1 needs --init_from=CHECKPOINT"),
    (["--init_from=x.pt"], "--init_from is read by --eval_only=1 (to train on, use --resume; to continue a prompt, "
                           "sample.py)"),
])
def test_init_from_flags_are_checked(flags, message):
    with pytest.raises(tg.UserError, match=re.escape(message)):
        tg.parse_cli(["--preset=tiny", *flags])


def test_weights_that_are_not_finite_are_never_checkpointed_nor_loaded(module_tiny_data, tmp_path, monkeypatch,
                                                                       capsys):
    """Muon's lr made NaN in step 4's update: its loss is still finite (read a step late it would stop the run only at
    step 5), but the step-4 checkpoint is not written and the run ends there with one line; the step-2 checkpoint
    stays. A checkpoint made non-finite afterwards is refused on load, and final weights that are not finite end a
    run without a checkpoint."""
    set_hyperparameters = tg.set_hyperparameters

    def poisoned(optimizers, schedule, step):
        set_hyperparameters(optimizers, schedule, step)
        if step == 3:
            for group in optimizers[0].param_groups:
                group["lr"] = float("nan")
    monkeypatch.setattr(tg, "set_hyperparameters", poisoned)
    train, val = module_tiny_data
    base = ["--device=cpu", *TINY, f"--train_files={train}", f"--val_files={val}", "--micro_batch_tokens=128",
            "--num_iterations=8", f"--log_dir={tmp_path}"]
    path = tmp_path / "nan.pt"
    assert tg.main(base + ["--run_id=nan", f"--save_checkpoint={path}", "--checkpoint_every=2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: at step 4 weights or optimizer state are not finite (model.blocks.0.attn.qkvo_w, ")
    assert err.endswith(f"{tmp_path / 'nan_step000004.pt'} is not written, earlier checkpoints stay\n"), err
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["nan_step000002.pt"]
    assert (tmp_path / "nan.txt").read_text().endswith("==== failed ====\n")
    good = tmp_path / "nan_step000002.pt"
    checkpoint = tg.read_checkpoint(str(good), "resume")
    checkpoint = {**checkpoint, "adam": {**checkpoint["adam"]}}
    name = next(iter(checkpoint["adam"]))
    checkpoint["adam"][name] = {key: value * float("nan") if isinstance(value, torch.Tensor) else value
                                for key, value in checkpoint["adam"][name].items()}
    bad = tmp_path / "bad.pt"
    torch.save(checkpoint, bad)
    with pytest.raises(tg.CheckpointError, match=rf"holds values that are not finite \(adam\.{re.escape(name)}\."):
        tg.read_checkpoint(str(bad), "resume")
    monkeypatch.setattr(tg, "set_hyperparameters", set_hyperparameters)
    report = tg.RunState.report

    def poisoned_report(self, step_times):
        self.trainer.model.bigram_embed.weight.data[-1] = float("nan")  # a row no batch reads
        return report(self, step_times)
    monkeypatch.setattr(tg.RunState, "report", poisoned_report)
    assert tg.main(base + ["--run_id=final"]) == 1
    assert capsys.readouterr().err == "error: the final weights are not finite (bigram_embed.weight)\n"


def test_tidying_keeps_the_newest_periodic_checkpoints_and_a_live_writers_temporary(tmp_path):
    """After each periodic checkpoint and at a run's start: the newest --keep_checkpoints of the run's periodic ones
    (by time: a fresh run's step 2 is newer than an old run's step 8) stay (0: all), with its final one and other
    runs' files; a temporary whose writer is dead goes, a live one's stays."""
    cfg = tg.Config(save_checkpoint=str(tmp_path / "run.pt"), keep_checkpoints=2)
    names = [f"run_step{step:06d}.pt" for step in (2, 4, 6, 8)] + [
        "run.pt", "other_step000002.pt", f".run.pt.{os.getpid()}.tmp", ".run_step000010.pt.999999999.tmp", ".x.tmp"]
    for age, name in enumerate(reversed(names)):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (1e9 - age, 1e9 - age))  # the newest last: step 8, by its time, not its name
    tg.tidy_checkpoints(dataclasses.replace(cfg, keep_checkpoints=0))
    assert not (tmp_path / ".run_step000010.pt.999999999.tmp").exists() and len(list(tmp_path.iterdir())) == 8
    tg.tidy_checkpoints(dataclasses.replace(cfg, resume=str(tmp_path / "run_step000002.pt")))  # the one resumed stays
    assert (tmp_path / "run_step000002.pt").exists() and not (tmp_path / "run_step000004.pt").exists()
    tg.tidy_checkpoints(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".run.pt.{os.getpid()}.tmp", ".x.tmp", "other_step000002.pt", "run.pt", "run_step000006.pt",
         "run_step000008.pt"])  # without --resume the oldest goes too
