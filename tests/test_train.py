"""Tests of train_gpt.py on the CPU: config, data loading, attention, schedule and model pieces (whole runs:
test_runs.py)."""
import dataclasses
import gc
import math
import re
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest
import torch

import train_gpt as tg
from helpers import (BOS, REPO, TINY, TOKENS, VOCAB, cu_seqlens_of, learnable_documents, run_cli, tiny_config,
                     train_scheduled_steps, write_shard)

BATCHES = dict(bos=BOS, vocab_size=VOCAB)  # bos_aligned_batches' and Prefetcher's arguments for these shards

# ---------------------------------------------------------------------------------------------- config

def test_unknown_option_is_named_with_the_nearest_names():
    with pytest.raises(tg.UserError, match=r"unknown option --nope; `python train_gpt.py --help` lists them"):
        tg.parse_cli(["--nope=1"])
    with pytest.raises(tg.UserError, match=r"unknown option --lr \(did you mean --adam_lr or --muon_lr or --outer_lr"):
        tg.parse_cli(["--lr=0.01"])
    with pytest.raises(tg.UserError, match=r"unknown option --adam-lr \(did you mean --adam_lr\?\); `python train_gpt"):
        tg.parse_cli(["--adam-lr=0.01"])


def test_dash_h_is_help(capsys):
    assert tg.parse_cli(["-h"])[1] == {"help": "1"}
    assert tg.main(["-h"]) == 0 and capsys.readouterr().out.startswith("usage: train_gpt.py")


@pytest.mark.parametrize("arg, message", [
    ("--num_iterations=ten", "bad value for --num_iterations"),
    ("--compile=maybe", "bad value for --compile"),
    ("--final_windows=768", "bad value for --final_windows"),
    ("--attn_layout=SSL", "--attn_layout='SSL'"),
    ("--stages=8 1 128:384 896 1; 12 1 128:384 896 1", "batches positive multiples of 8"),
    ("--stages=8 1 128:384", "bad value for --stages"),
    ("--device=tpu", "--device=tpu: use one of cuda, cpu"),
    ("--preset=huge", "unknown --preset=huge"),
    ("--bos_token=50257", "--vocab_size=50257 --bos_token=50257"),
    ("--vocab_size=70000", "shards hold 16-bit tokens"),
    ("--adam_period=-1", "--adam_period=-1: use 0 .. 99"),
    ("--adam_lr=nan", "--adam_lr=nan: give a finite number"),  # every float flag
    ("--muon_lr=inf", "--muon_lr=inf: give a finite number"),
    ("--adam_lr=1e30", "--adam_lr=1e+30: use 0 .. 1"),  # its lr**2 decay would overflow in the warm-up
    ("--muon_lr=-0.1", "--muon_lr=-0.1: use 0 .. 1"),
    ("--val_loss_every=-5", "--val_loss_every=-5: use 0 .. 1e+09"),
    ("--stages=8 inf 128:384 896 1; 8 0.1 128:384 896 1", "lr in (0, 99)"),
    ("--paired_head_layers=0,x", "bad value for --paired_head_layers"),
    ("--paired_head_layers=11", "--paired_head_layers=11: distinct layers with attention, 0 .. 10"),
    ("--xsa_layers=6", "--xsa_layers=6: distinct layers with attention"),
])
def test_bad_values_are_named(arg, message):
    with pytest.raises(tg.UserError, match=re.escape(message)):
        tg.parse_cli([arg])


def test_the_defaults_are_the_records_schedule_and_the_tiny_preset_their_model_scaled_down():
    cfg, _ = tg.parse_cli(["--muon_lr=0.03"])
    assert cfg.muon_lr == 0.03 and cfg.stages == tg.STAGES and (cfg.num_iterations, cfg.extension_steps) == (1270, 15)
    assert tg.Schedule(cfg).mtp_weights(0) == [1.0, 0.5, 0.25]
    assert [tg.Schedule(cfg).adam_updates(s) for s in range(4)] == [False, True, False, True]  # the speedrun's odd steps
    assert dataclasses.replace(cfg, diloco=True).period == 1  # syncs land between any two steps
    tiny, _ = tg.parse_cli(["--preset=tiny"])
    model_fields = {f.name for f in dataclasses.fields(tg.Config) if f.metadata["group"] == "model"}
    # the tiny preset changes sizes and layer numbers, never turns a part off
    assert all(tiny.copy_pointer and tiny.longest_match and tiny.bigram_rows for _ in [0])
    assert {name for name in model_fields if getattr(tiny, name) != getattr(cfg, name)} <= {
        "num_layers", "model_dim", "num_heads", "head_dim", "attn_layout", "value_embed_layout", "paired_head_layers",
        "xsa_layers", "skip_from", "skip_to", "attn_input_from", "backout_from", "bigram_rows"}
    assert [len(stage.mtp) for stage in tiny.stages] == [len(stage.mtp) for stage in cfg.stages]


def test_the_defaults_build_the_full_size_record_model():
    cfg, _ = tg.parse_cli(["--device=cpu"])
    assert [stage.doc_len for stage in cfg.stages] == [896, 2048, 2048, 2048]
    with torch.device("meta"):  # shapes only
        model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    # XSA on the record's layers, its strengths per token from the gates; MUDD into the last layer and the head
    assert [i for i, lanes in enumerate(model.token_gates.lanes) if "xsa" in lanes] == [1, 3, 4, 7]
    assert model.bigram_embed.weight.shape == (3 * 5 * 50304, 192) and model.bigram_signs.shape == (8192, 192)
    assert model.copy_pointer is not None and model.copy_pointer.band == 2048 and model.longest_match is not None
    # Muon takes Q and K per head pair, V and O whole; the MLP's output projection at twice the lr
    assert model.blocks[0].attn.qkvo_w.opt.split == ((256, 6), (768, 2)) and model.blocks[0].mlp.proj_w.opt.lr == 2


def test_preset_and_overrides():
    cfg, flags = tg.parse_cli(["--preset=tiny", "--num_iterations=3", "--muon_lr=0.01", "--compile=1",
                               "--paired_head_layers=0,1", "--final_windows=32:64"])
    assert (cfg.model_dim, cfg.num_iterations, cfg.muon_lr, cfg.compile) == (64, 3, 0.01, True)
    assert (cfg.paired_head_layers, cfg.final_windows) == ((0, 1), (32, 64))
    assert flags == {"preset": "tiny"}
    assert tg.Config().model_dim == 768
    stages = "8 1 16:32 64 1,0.5>0; 16 0.15 32:64 64 1"
    assert tg.parse_cli(["--preset=tiny", f"--stages={stages}"])[0].stages == (
        tg.Stage(8, 1.0, (16, 32), 64, ((1.0, 1.0), (0.5, 0.0))), tg.Stage(16, 0.15, (32, 64), 64, ((1.0, 1.0),)))
    assert tg.format_value(tg.parse_stages(stages), "stages") == stages


def test_bad_input_is_one_line_without_traceback(tmp_path):
    result = run_cli(["--device=cpu", "--preset=tiny", "--train_files=nowhere/*.bin"], cwd=tmp_path)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --train_files='nowhere/*.bin' matches no files")
    assert not (tmp_path / "logs").exists()  # nothing written for a run that never started


def test_cuda_requested_without_cuda_is_an_error(tiny_data, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    train, val = tiny_data
    assert tg.main([*TINY, f"--train_files={train}", f"--val_files={val}"]) == 1
    assert "pass --device=cpu" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["fa3", "flex"])
def test_a_gpu_attention_on_a_cpu_is_named(tiny_data, backend):
    """FA3 runs on CUDA only, and torch's FlexAttention has no backward on a CPU: one line, not a compile traceback."""
    cfg = tiny_config(*tiny_data, attn_backend=backend)
    with pytest.raises(tg.UserError, match=rf"^--attn_backend={backend} needs --device=cuda"):
        tg.make_attention(cfg, torch.device("cpu"), cfg.micro_batch_tokens)


def test_world_size_must_divide_8(monkeypatch, tiny_data, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(tg.UserError, match="world size 3 is not supported"):
        tg.init_distributed(tiny_config("x", "y"))
    # under torchrun every rank hits it: rank 0 says it, in one line, and the others say nothing
    train, val = tiny_data
    for rank, lines in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        assert tg.main(["--device=cpu", *TINY, f"--train_files={train}", f"--val_files={val}"]) == 1
        err = capsys.readouterr().err
        assert len(err.splitlines()) == lines and err.count("world size 3 is not supported") == lines


# ------------------------------------------------------------------------------------------------ data

def test_bos_aligned_batches(tmp_path):
    tokens = learnable_documents(20_000, seed=5)
    path = str(write_shard(tmp_path / "s.bin", tokens))
    length, max_doc_len = 257, 64
    batches = list(tg.bos_aligned_batches([path], length, max_doc_len, repeat=False, **BATCHES))
    assert len(batches) > 10
    bos_positions = set(np.flatnonzero(tokens == BOS).tolist())
    previous_end = -1
    for shard_tokens, spans in batches:
        assert sum(end - start for start, end in spans) == length
        for start, end in spans:
            assert start in bos_positions and start > previous_end  # whole documents, in order
            assert end - start <= max_doc_len
            assert not bos_positions & set(range(start + 1, end))  # never two documents in one span
            previous_end = end - 1
        window = np.concatenate([shard_tokens[s:e] for s, e in spans])
        assert window[0] == BOS


def test_the_next_shard_is_indexed_while_this_one_is_read(tmp_path, monkeypatch):
    shards = [learnable_documents(3_000, seed=s) for s in (11, 12, 13)]
    paths = [str(write_shard(tmp_path / f"s_{i}.bin", t)) for i, t in enumerate(shards)]
    length, max_doc_len = 257, 64
    expected = [(i, spans) for i, p in enumerate(paths)
                for _, spans in tg.bos_aligned_batches([p], length, max_doc_len, repeat=False, **BATCHES)]
    started = [threading.Event() for _ in paths]
    threads = set()
    indexed = tg.document_starts

    def watched(path, *args):
        threads.add(threading.current_thread().name)
        started[paths.index(path)].set()
        return indexed(path, *args)

    monkeypatch.setattr(tg, "document_starts", watched)
    got = []
    for tokens, spans in tg.bos_aligned_batches(paths, length, max_doc_len, repeat=False, **BATCHES):
        shard = next(i for i, t in enumerate(shards) if np.array_equal(np.asarray(tokens), t))
        if not any(i == shard for i, _ in got) and shard + 1 < len(paths):
            assert started[shard + 1].wait(10), f"shard {shard + 1} not indexed while shard {shard} is read"
        got.append((shard, spans))
    assert got == expected
    assert all(name.startswith("shard-index") for name in threads), threads


def test_shards_without_documents_are_named(tmp_path):
    path = str(write_shard(tmp_path / "s.bin", np.full(5_000, 7, dtype=np.uint16)))
    for repeat in (False, True):
        with pytest.raises(tg.DataError, match="no batch of 257 tokens could be built from .*s.bin"):
            next(tg.bos_aligned_batches([path], 257, 64, repeat=repeat, **BATCHES))


@pytest.mark.parametrize("world_size", [1, 2])
def test_doc_len_schedule_cuts_documents_per_stage(tiny_data, world_size):
    """Documents cut at 16 tokens in the first stage's micro-batches, 64 in the second's, 128 after (the tiny
    schedule: 24 steps of 8, 8 and 16 micro-batches: 64, 64, then 128 micro-batches), at any world size."""
    cfg = tiny_config(*tiny_data, micro_batch_tokens=128)
    cfg = dataclasses.replace(cfg, stages=tuple(s._replace(doc_len=n) for s, n in zip(cfg.stages, (16, 64, 128, 128))))
    assert tg.Schedule(cfg).stage_starts == [64, 128, 256]
    longest = {0: 0, 1: 0, 2: 0}
    for rank in range(world_size):
        batches = tg.train_batches_for_rank(tg.shard_paths(cfg.train_files, "train_files"), cfg,
                                            tg.Comm(rank=rank, world_size=world_size))
        for i, window in zip(range(256 // world_size), batches):
            stage = tg.Schedule(cfg).stage_of_micro_batch(i * world_size + rank)
            starts = list(np.flatnonzero(window[:-1] == BOS)) + [len(window) - 1]
            assert starts[0] == 0
            longest[stage] = max(longest[stage], max(np.diff(starts)))
    assert longest[0] == 16 and longest[1] == 64 and longest[2] > 64  # the data's documents reach 121 tokens


def test_closing_the_prefetcher_stops_the_loaders_threads(tiny_data):
    """No loader thread outlives close(): a thread still in numpy or torch when the interpreter exits aborts the
    process ("terminate called without an active exception")."""
    cfg = tiny_config(*tiny_data, micro_batch_tokens=128)
    paths = tg.shard_paths(cfg.train_files, "train_files")
    assert len(paths) > 1  # so the next shard is being indexed on the helper thread
    batches = tg.Prefetcher(tg.drop(3, tg.train_batches_for_rank(paths, cfg, tg.Comm())), 128, torch.device("cpu"),
                            bos=BOS)
    batches.next()
    assert any(t.name.startswith("shard-index") for t in threading.enumerate())
    batches.close()
    assert not batches.thread.is_alive()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("shard-index")]


def test_ranks_split_the_global_batch_sequence(tmp_path):
    path = str(write_shard(tmp_path / "s.bin", learnable_documents(20_000, seed=6)))
    cfg = tg.Config(micro_batch_tokens=128, **TOKENS)
    single = list(tg.train_batches_for_rank([path], cfg, tg.Comm(0, 1)))
    ranks = [list(tg.train_batches_for_rank([path], cfg, tg.Comm(r, 2))) for r in range(2)]
    assert all(np.array_equal(single[2 * i + r], ranks[r][i]) for r in range(2) for i in range(len(ranks[1])))


def write_bad_shard(path, problem):
    tokens = np.arange(100, dtype="<u2")
    header = np.zeros(256, dtype="<i4")
    header[:3] = (20240520, 1, len(tokens))
    if problem == "magic":
        header[0] = 12345
    if problem == "version":
        header[1] = 7
    data = header.tobytes() + tokens.tobytes()
    if problem == "truncated":
        data = data[:-10]
    if problem == "short header":
        data = data[:100]
    if problem == "count":
        header[2] = 5000
        data = header.tobytes() + tokens.tobytes()
    path.write_bytes(data)


@pytest.mark.parametrize("problem, message", [
    ("magic", "not a token shard (magic number 12345, expected 20240520)"),
    ("version", "shard version 7 is not supported"),
    ("truncated", "header says 100 tokens (1,224 bytes) but the file has 1,214 bytes"),
    ("count", "header says 5,000 tokens"),
    ("short header", "too short for the 1024-byte shard header"),
])
def test_bad_shard_errors_name_file_and_problem(tmp_path, problem, message):
    path = tmp_path / "bad_000000.bin"
    write_bad_shard(path, problem)
    with pytest.raises(tg.DataError) as err:
        tg.shard_paths(str(tmp_path / "bad_*.bin"), "train_files")
    assert str(err.value).startswith(str(path)) and message in str(err.value)


def test_tokens_outside_the_vocabulary_are_named(tmp_path):
    """Data from another tokenizer (here GPT-2's BOS, 50256, in a 128-token vocabulary): one error naming the
    shard or the validation files and the first bad token, before a launch for the first training shard and the
    validation tokens, and from the loader for a later training shard."""
    good = learnable_documents(5_000, seed=8)
    bad = good.copy()
    bad[1234] = 50256
    files = {name: str(write_shard(tmp_path / f"{name}.bin", tokens))
             for name, tokens in (("good_train", good), ("bad_train", bad), ("good_val", good), ("bad_val", bad))}
    message = "token 50256 at position 1,234 is not below --vocab_size=128"
    cfg = tg.Config(**TOKENS, device="cpu", train_files=files["bad_train"], val_files=files["good_val"],
                    val_tokens=4096)
    with pytest.raises(tg.DataError, match=re.escape(f"{files['bad_train']}: {message}")):
        tg.check_inputs(cfg)
    cfg = dataclasses.replace(cfg, train_files=files["good_train"], val_files=files["bad_val"])
    with pytest.raises(tg.DataError, match=re.escape(f"--val_files={files['bad_val']!r}: {message}")):
        tg.check_inputs(cfg)
    batches = tg.bos_aligned_batches([files["good_train"], files["bad_train"]], 257, 64, repeat=False, **BATCHES)
    with pytest.raises(tg.DataError, match=re.escape(f"{files['bad_train']}: {message}")):
        for _ in batches:
            pass


def test_check_names_every_bad_training_shard_in_one_line(tmp_path):
    """--check reads every training shard: a bad token in the second and a cut third are one line naming both."""
    good = learnable_documents(5_000, seed=8)
    bad = good.copy()
    bad[777] = 50256
    write_shard(tmp_path / "t_000001.bin", good)
    write_shard(tmp_path / "t_000002.bin", bad)
    cut = write_shard(tmp_path / "t_000003.bin", good)
    cut.write_bytes(cut.read_bytes()[:-100])
    val = write_shard(tmp_path / "v_000000.bin", good)
    cfg = tg.Config(**TOKENS, device="cpu", train_files=str(tmp_path / "t_*.bin"), val_files=str(val), val_tokens=4096)
    with pytest.raises(tg.DataError) as err:
        tg.check_inputs(cfg)
    assert str(err.value).startswith(f"2 bad shards: {tmp_path / 't_000002.bin'}: token 50256 at position 777 is not "
                                     "below --vocab_size=128")
    assert f" | {tmp_path / 't_000003.bin'}: header says 5,0" in str(err.value) and "\n" not in str(err.value)


CUT_UNDER_THE_LOADER = """
import os, sys, numpy as np, train_gpt as tg
sys.path.insert(0, "tests")
from helpers import learnable_documents, write_shard
path = write_shard(__import__("pathlib").Path(sys.argv[1]), learnable_documents(250_000, seed=3))
batches = tg.bos_aligned_batches([str(path)], 4097, 4096, repeat=False, bos=127, vocab_size=128)
next(batches)
os.truncate(path, 4096)  # the file cut to its header and a few tokens while the run reads it
print(sum(int(tokens[start:end].max()) < 128 for tokens, spans in batches for start, end in spans) > 30)
"""


def test_a_shard_cut_under_a_running_loader_does_not_kill_it(tmp_path):
    """The loader reads a shard whole (a mapped file cut under it would end the process with SIGBUS)."""
    result = subprocess.run([sys.executable, "-c", CUT_UNDER_THE_LOADER, str(tmp_path / "s.bin")], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "True", (result.returncode, result.stderr[-500:])


def test_empty_glob_is_named(tmp_path):
    with pytest.raises(tg.DataError, match=r"--val_files='.*none_\*\.bin' matches no files"):
        tg.shard_paths(str(tmp_path / "none_*.bin"), "val_files")


def test_a_folder_given_as_shards_is_named(tmp_path):
    (tmp_path / "shards").mkdir()
    with pytest.raises(tg.DataError, match=r"--train_files='.*shards' matches the folder .*shards: give the shard "
                                           r"files, e.g. --train_files='.*shards/\*\.bin'"):
        tg.shard_paths(str(tmp_path / "shards"), "train_files")


def test_too_little_validation_data(tiny_data):
    train, val = tiny_data
    cfg = tiny_config(train, val, val_tokens=1_000_192)
    with pytest.raises(tg.DataError, match="fewer than --val_tokens=1,000,192"):
        tg.check_inputs(cfg)


def test_running_out_of_training_data(tmp_path):
    path = str(write_shard(tmp_path / "s.bin", learnable_documents(2_000, seed=7)))
    cfg = tg.Config(micro_batch_tokens=256, **TOKENS)
    batches = tg.Prefetcher(tg.train_batches_for_rank([path], cfg, tg.Comm()), 256, torch.device("cpu"), bos=BOS)
    with pytest.raises(tg.DataError, match="training data ran out"):
        for _ in range(100):
            batches.next()
    batches.close()
    passes = []
    repeating = tg.Prefetcher(tg.train_batches_for_rank([path], dataclasses.replace(cfg, train_repeat=True), tg.Comm(),
                                                        on_new_pass=passes.append), 256, torch.device("cpu"), bos=BOS)
    for _ in range(100):
        repeating.next()
    repeating.close()
    assert passes[:3] == [2, 3, 4]  # the data ran out many times, and each start-over was reported


def test_prefetcher_delivers_every_window_intact(tmp_path):
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, BOS, 129).astype(np.uint16) for _ in range(20)]
    for w in windows:
        w[[0, 50, 51]] = BOS
    batches = tg.Prefetcher(iter(windows), 128, torch.device("cpu"), slots=2, bos=BOS)
    for w in windows:
        b = batches.next()
        assert torch.equal(b.inputs, torch.from_numpy(w[:-1].astype(np.int32)))
        assert torch.equal(b.targets, torch.from_numpy(w[1:].astype(np.int64)))
        assert b.cu_seqlens[:5].tolist() == [0, 50, 51, 128, 128]
    batches.close()
    # forwards of differing counts (a stage each): each holds its windows in order, its own length's document
    # starts (a short forward after a long one in the same slot shows no stale tokens), and the rows it reads
    sizes = [3, 1, 2, 3, 1, 2]
    batches = tg.Prefetcher(iter(windows), 128, torch.device("cpu"), slots=2, packed=3, sizes=sizes, bigram_rows=4096,
                            bos=BOS)
    taken = 0
    for size in sizes:
        b = batches.next()
        ours = windows[taken: taken + size]
        taken += size
        assert torch.equal(b.inputs, torch.from_numpy(np.concatenate([w[:-1] for w in ours]).astype(np.int32)))
        assert torch.equal(b.targets, torch.from_numpy(np.concatenate([w[1:] for w in ours]).astype(np.int64)))
        assert len(b.cu_seqlens) == tg.max_documents(128 * size) + 1
        starts = [s + 128 * i for i in range(size) for s in (0, 50, 51)]
        assert b.cu_seqlens.tolist() == starts + [128 * size] * (len(b.cu_seqlens) - len(starts))
        assert b.documents == len(starts)
        assert b.rows["bigrams"].tolist() == np.unique(b.bigrams.numpy()).tolist()
    batches.close()


# ------------------------------------------------------------------------------------------- attention

def naive_attention(q, k, v, tokens, window):
    """Float64 loops: causal, same document (a document starts at each BOS), within `window` positions."""
    q, k, v = q.double(), k.double(), v.double()
    T = q.size(0)
    doc = np.cumsum(tokens.numpy() == BOS)
    out = torch.zeros_like(q)
    for i in range(T):
        keys = [j for j in range(max(0, i - window + 1), i + 1) if doc[j] == doc[i]]
        scores = torch.einsum("hd,jhd->hj", q[i], k[keys])
        out[i] = torch.einsum("hj,jhd->hd", scores.softmax(-1), v[keys])
    return out


def random_attention_inputs(T=128, H=2, D=16, seed=0, starts=6):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB - 1, (T,), generator=g, dtype=torch.int32)
    tokens[torch.randint(0, T, (starts,), generator=g)] = BOS  # documents of irregular length; first one has no BOS
    q, k, v = (torch.randn(T, H, D, generator=g) for _ in range(3))
    return tokens, q, k, v


@pytest.mark.parametrize("window", [1, 7, 32, 128])
def test_sdpa_path_matches_naive_reference(window):
    tokens, q, k, v = random_attention_inputs(seed=window)
    backend = tg.SdpaAttention()
    mask = backend.prepare(tokens.numel(), cu_seqlens_of(tokens, BOS), {"S": window})["S"]
    got = backend(q, k, v, mask)
    ref = naive_attention(q, k, v, tokens, window)
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_flex_path_matches_sdpa_path():
    tokens, q, k, v = random_attention_inputs(T=512, seed=1)
    sdpa, flex = tg.SdpaAttention(), tg.FlexAttention(512, torch.device("cpu"))
    windows = {"S": 100, "L": 384}
    cu = cu_seqlens_of(tokens, BOS)
    sdpa_masks, flex_masks = sdpa.prepare(tokens.numel(), cu, windows), flex.prepare(tokens.numel(), cu, windows)
    for kind in windows:
        assert torch.allclose(flex(q, k, v, flex_masks[kind]), sdpa(q, k, v, sdpa_masks[kind]), atol=1e-5)


def dense_blocks(counts, indices):
    """[q_blocks, kv_blocks] booleans from a BlockMask's (count, index) lists."""
    counts, indices = counts[0, 0], indices[0, 0]
    dense = torch.zeros(indices.shape, dtype=torch.bool)
    for row, n in enumerate(counts.tolist()):
        dense[row, indices[row, :n].long()] = True
    return dense


@pytest.mark.parametrize("window", [1, 127, 128, 129, 255, 383, 1024])
@pytest.mark.parametrize("documents", [3, 40])
def test_flex_block_lists_equal_create_block_mask(window, documents):
    """Our block classification (skip / partial / full) against torch's own, which evaluates every position."""
    from torch.nn.attention.flex_attention import create_block_mask
    T = 1024
    g = torch.Generator().manual_seed(window * documents)
    tokens = torch.randint(0, VOCAB - 1, (T,), generator=g, dtype=torch.int32)
    tokens[torch.randint(0, T, (documents,), generator=g)] = BOS
    tokens[256:640] = 7  # one document spanning whole blocks, so full blocks appear
    tokens[256] = BOS
    flex = tg.FlexAttention(T, torch.device("cpu"))
    ours = flex.prepare(tokens.numel(), cu_seqlens_of(tokens, BOS), {"S": window})["S"]
    reference = create_block_mask(flex.mask_mods["S"], None, None, T, T, device="cpu")
    assert torch.equal(dense_blocks(ours.kv_num_blocks, ours.kv_indices),
                       dense_blocks(reference.kv_num_blocks, reference.kv_indices))
    assert torch.equal(dense_blocks(ours.full_kv_num_blocks, ours.full_kv_indices),
                       dense_blocks(reference.full_kv_num_blocks, reference.full_kv_indices))
    assert torch.equal(dense_blocks(ours.q_num_blocks, ours.q_indices),
                       dense_blocks(reference.q_num_blocks, reference.q_indices))


def test_flex_masks_keep_their_tensors_across_micro_batches():
    """Each micro-batch's masks are written into the first one's tensors (fixed addresses for CUDA graphs)
    and hold what masks made afresh would."""
    T = 1024
    flex = tg.FlexAttention(T, torch.device("cpu"))
    other = random_attention_inputs(T=T, seed=2)[0]
    first = flex.prepare(other.numel(), cu_seqlens_of(other, BOS), {"S": 100, "L": 300})
    addresses = {kind: [t.data_ptr() for t in flex._mask_tensors(mask)] for kind, mask in first.items()}
    tokens = random_attention_inputs(T=T, seed=3)[0]
    windows = {"S": 200, "L": 640}
    second = flex.prepare(tokens.numel(), cu_seqlens_of(tokens, BOS), windows)
    fresh = tg.FlexAttention(T, torch.device("cpu")).prepare(tokens.numel(), cu_seqlens_of(tokens, BOS), windows)
    for kind in windows:
        assert [t.data_ptr() for t in flex._mask_tensors(second[kind])] == addresses[kind]
        for ours, reference in zip(flex._mask_tensors(second[kind]), flex._mask_tensors(fresh[kind])):
            assert torch.equal(ours, reference)


def test_flex_masks_of_another_length_are_that_lengths_own():
    """A forward of another length (a stage that packs another number of micro-batches) gets masks of its own
    length, equal to those of a FlexAttention made for it, and the first length's masks keep their tensors."""
    flex = tg.FlexAttention(512, torch.device("cpu"))
    short = random_attention_inputs(T=512, seed=4)[0]
    first = flex.prepare(short.numel(), cu_seqlens_of(short, BOS), {"S": 100})["S"]
    addresses = [t.data_ptr() for t in flex._mask_tensors(first)]
    long = random_attention_inputs(T=1024, seed=5)[0]
    ours = flex.prepare(long.numel(), cu_seqlens_of(long, BOS), {"S": 200})["S"]
    fresh = tg.FlexAttention(1024, torch.device("cpu")).prepare(long.numel(), cu_seqlens_of(long, BOS), {"S": 200})["S"]
    assert ours.seq_lengths == (1024, 1024)
    for mine, reference in zip(flex._mask_tensors(ours), flex._mask_tensors(fresh)):
        assert torch.equal(mine, reference)
    again = flex.prepare(short.numel(), cu_seqlens_of(short, BOS), {"S": 100})["S"]
    assert [t.data_ptr() for t in flex._mask_tensors(again)] == addresses


def test_flex_needs_whole_blocks():
    with pytest.raises(tg.UserError, match="micro_batch_tokens=1000: flex attention needs a multiple of 128"):
        tg.FlexAttention(1000, torch.device("cpu"))


class StandInFA3:
    """FA3's two interface functions as the trainer's fa3_varlen op calls them, in plain float32 torch:
    causal attention within each document of cu_seqlens, FA3's window semantics (window_size_left keys to the
    left of the query, plus itself), with the output's log-sum-exp. Records each call's max_seqlen and how many
    document starts it was given, forward and backward."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _scores(q, k, cu_seqlens, window_left):
        positions = torch.arange(len(q))
        doc = torch.searchsorted(cu_seqlens[1:].long(), positions, right=True)
        distance = positions[:, None] - positions[None, :]
        allowed = (doc[:, None] == doc[None, :]) & (distance >= 0) & (distance <= window_left)
        return torch.einsum("qhd,khd->hqk", q.float(), k.float()).masked_fill(~allowed, float("-inf"))

    def _attend(self, q, k, v, cu_seqlens, max_seqlen, window_left):
        bounds = cu_seqlens.tolist()
        assert bounds[-1] == len(q) and max_seqlen >= max(end - start for start, end in zip(bounds, bounds[1:]))
        scores = self._scores(q, k, cu_seqlens, window_left)
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)
        return out, scores.logsumexp(-1)

    def _flash_attn_forward(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                            causal, window_size_left, window_size_right):
        assert causal and softmax_scale == 1.0 and window_size_right == 0
        assert cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k
        self.calls.append((max_seqlen_q, len(cu_seqlens_q)))
        out, lse = self._attend(q, k, v, cu_seqlens_q, max_seqlen_q, window_size_left)
        return out, lse, None, None

    def _flash_attn_backward(self, grad, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             dq, dk, dv, softmax_scale, is_causal, window_size_left, window_size_right):
        # The op runs below autograd, so the gradients are written out: dS = P (dP - rowsum(dO * O)).
        assert cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k
        self.calls.append((max_seqlen_q, len(cu_seqlens_q)))
        probs = self._scores(q, k, cu_seqlens_q, window_size_left).softmax(-1)
        grad, out = grad.float(), out.float()
        d_probs = torch.einsum("qhd,khd->hqk", grad, v.float())
        d_scores = probs * (d_probs - (grad * out).sum(-1).T[:, :, None])
        dq.copy_(torch.einsum("hqk,khd->qhd", d_scores, k.float()))
        dk.copy_(torch.einsum("hqk,qhd->khd", d_scores, q.float()))
        dv.copy_(torch.einsum("hqk,qhd->khd", probs, grad))


def test_fa3_path_passes_documents_window_and_length():
    """FA3 itself needs a Hopper GPU; a varlen stand-in checks what we hand it: the document starts cut to T/256 + 1
    entries and max_seqlen the bound on documents, or the length where a document is longer (or where the loader
    gave no facts), as ints, with the output and gradients of SDPA's."""
    T = 2048
    tokens, q, k, v = random_attention_inputs(T=T, seed=2)
    slot = tg._Slot(T, False, BOS)
    slot.fill([np.concatenate([tokens.numpy(), [0]]).astype(np.uint16)])
    longest, entries = slot.longest_document, T // 256 + 1
    assert slot.documents < entries and longest < T and len(slot.cu_seqlens) > entries
    sdpa = tg.SdpaAttention()
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    want = sdpa(*qkv, sdpa.prepare(tokens.numel(), cu_seqlens_of(tokens, BOS), {"S": 9})["S"])
    want_grads = torch.autograd.grad(want.square().sum(), qkv)
    kernels = StandInFA3()
    for max_doc_len, facts, want_entries, want_max in ((longest, (slot.documents, longest), entries, longest),
                                                       (longest - 1, (slot.documents, longest), entries, T),
                                                       (longest, (), len(slot.cu_seqlens), T)):
        fa3 = tg.FlashAttention3(kernels, max_doc_len)
        mask = fa3.prepare(tokens.numel(), slot.cu_seqlens, {"S": 9}, *facts)["S"]
        assert mask[0] is slot.cu_seqlens  # the op cuts it, so the compiled graph sees one shape
        assert mask[1:] == (9, want_max, want_entries) and all(type(n) is int for n in mask[1:])
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fa3(*qkv, mask)
        assert torch.allclose(out, want, atol=1e-5) and kernels.calls[-1] == (want_max, want_entries)
        grads = torch.autograd.grad(out.square().sum(), qkv)
        assert kernels.calls[-1] == (want_max, want_entries)  # the backward's
        for got, expected in zip(grads, want_grads):
            assert torch.allclose(got, expected, atol=1e-4)


def test_fa3_compiles_one_graph_for_every_window_and_length():
    """The window, max_seqlen and the count of document starts reach FA3 as ints that FA3_HOST_INT_SOURCES marks
    symbolic: compiled as the trainer compiles (dynamic=False), one graph, forward and backward, serves three windows,
    both max_seqlen cases and the cut and uncut document starts, each equal to eager."""
    from torch._dynamo.testing import CompileCounterWithBackend
    T = 1024  # 4 documents, fewer than the 5 starts the cut keeps (one per 256 tokens)
    tokens, q, k, v = random_attention_inputs(T=T, seed=3, starts=3)
    slot = tg._Slot(T, False, BOS)
    slot.fill([np.concatenate([tokens.numpy(), [0]]).astype(np.uint16)])
    kernels = StandInFA3()
    fa3 = tg.FlashAttention3(kernels, slot.longest_document)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def whole(q, k, v, masks):
        return fa3(q, k, v, masks["S"]).square().sum()
    whole = torch.compile(whole, backend=counter, fullgraph=True, dynamic=False)
    handed = set()
    entries = T // 256 + 1
    for window in (9, 130, 700):
        # the second longer, as in validation; the third with as many documents as the cut keeps starts
        for documents, longest in ((slot.documents, slot.longest_document), (slot.documents, slot.longest_document + 1),
                                   (entries, slot.longest_document)):
            mask = fa3.prepare(tokens.numel(), slot.cu_seqlens, {"S": window}, documents, longest)["S"]
            handed.add(mask[2:])
            results = []
            for run, arg in ((lambda q, k, v, m: fa3(q, k, v, m).square().sum(), mask), (whole, {"S": mask})):
                qkv = [t.clone().requires_grad_() for t in (q, k, v)]
                with torch.compiler.config.patch(dynamic_sources=tg.FA3_HOST_INT_SOURCES):
                    loss = run(*qkv, arg)
                results.append((loss, *torch.autograd.grad(loss, qkv)))
                assert kernels.calls[-1] == mask[2:]  # what the kernels were handed, the backward's too
            for got, expected in zip(results[1], results[0]):
                assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert handed == {(slot.longest_document, entries), (T, entries), (slot.longest_document, len(slot.cu_seqlens))}
    assert counter.frame_count == 1


# --------------------------------------------------------------------------------------- model pieces

NO_GATES = tg.LayerGates(None, None, None)


def attention_layer(i: int, heads: int = 2, head_dim: int = 8, **overrides):
    """Layer i's attention of the tiny model at a smaller width, with random weights."""
    cfg = dataclasses.replace(tg.parse_cli(TINY)[0], model_dim=heads * head_dim, num_heads=heads, head_dim=head_dim,
                              **overrides)
    torch.manual_seed(0)
    attn = tg.CausalSelfAttention(cfg, i)
    attn.qkvo_w.data.normal_()
    return cfg, attn


def test_key_offset_gives_each_key_the_still_half_of_the_previous_one():
    """On a long-window layer the key dims Rotary leaves unrotated come from the previous position, except where a
    document or micro-batch starts; the rotated dims, the queries and the values are untouched."""
    T, head_dim = 12, 16
    _, attn = attention_layer(1, head_dim=head_dim)  # the tiny model's layer 1: a long window
    assert attn.shift_keys
    rotary = tg.Rotary(head_dim, T, T, 0.1, False)
    seen = []
    x = torch.randn(T, 2 * head_dim)
    starts = torch.zeros(T, dtype=torch.bool)
    starts[[0, 5]] = True
    for shift in (False, True):
        attn.shift_keys = shift
        attn(x, None, rotary.tables(), None, lambda q, k, v, mask: seen.append(k) or v, starts, None, NO_GATES)
    k, got = seen
    assert (rotary.base_freqs[head_dim // 4:] == 0).all() and (rotary.base_freqs[: head_dim // 4] != 0).all()
    still = torch.zeros(head_dim, dtype=torch.bool)
    still[head_dim // 4: head_dim // 2] = still[3 * head_dim // 4:] = True
    want = k.clone()
    for t in range(T):
        if not starts[t]:
            want[t][:, still] = k[t - 1][:, still]
    assert torch.equal(got, want) and not torch.equal(got, k)


def own_value_inputs(T=6, dim=16):
    """An input and the rest of an attention layer's arguments, with an attention that returns each token's value."""
    starts = torch.zeros(T, dtype=torch.bool)
    return torch.randn(T, dim), (None, tg.Rotary(dim // 2, 16, 16, 0.1, False).tables(), None,
                                 lambda q, k, v, mask: v, starts, None)


def test_attention_output_scale_multiplies_the_output_and_learns():
    _, attn = attention_layer(1)
    x, args = own_value_inputs()
    plain = attn(x, *args, NO_GATES)
    attn.out_scale.data.fill_(2.0)
    y = attn(x, *args, NO_GATES)
    torch.testing.assert_close(y, 2 * plain)
    y.square().sum().backward()
    assert attn.out_scale.grad.abs().item() > 0 and attn.out_scale.opt == tg.Opt(lr=5.0)  # Adam, the scalars' lr


def paired_attention_reference(attn, x, freqs, tokens, window, scale):
    """Float64 loops for a paired-head layer: head h < H/2 of token t sits at position 2t of its pair's
    sequence, head h + H/2 at 2t + 1; a query sees the pair's keys at positions up to its own, in its document,
    fewer than `window` positions back; rotary angles are position * freq on dims (i, i + D/2)."""
    T, dim = x.shape
    H, D = attn.num_heads, attn.head_dim
    w = attn.qkvo_w.double()
    q, k, v = (x.double() @ w[: 3 * dim].T).view(T, 3, H, D).unbind(1)
    q, k = (t / t.square().mean(-1, keepdim=True).add(torch.finfo(torch.float32).eps).sqrt() for t in (q, k))
    doc = np.cumsum(tokens.numpy() == BOS)
    freqs = freqs.double()

    def rotate(vec, position):
        a, b = vec[: D // 2], vec[D // 2:]
        cos, sin = torch.cos(position * freqs), torch.sin(position * freqs)
        return torch.cat([a * cos + b * sin, b * cos - a * sin])

    half = H // 2
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            s = 2 * t + h // half
            keys = [(u, g) for u in range(T) for g in (h % half, h % half + half)
                    if 0 <= s - (2 * u + g // half) < window and doc[u] == doc[t]]
            query = rotate(q[t, h], s)
            scores = torch.stack([scale * query @ rotate(k[u, g], 2 * u + g // half) for u, g in keys])
            out[t, h] = sum(p * v[u, g] for p, (u, g) in zip(scores.softmax(0), keys))
    return out.reshape(T, dim) @ w[3 * dim:].T


@pytest.mark.parametrize("window", [1, 2, 5, 64])
def test_paired_head_attention_matches_reference(window):
    heads, head_dim, T = 4, 8, 24
    tokens, _, _, _ = random_attention_inputs(T=T, seed=window)
    _, attn = attention_layer(0, heads=heads, head_dim=head_dim)  # the tiny model's layer 0: paired, short
    assert attn.paired and not attn.shift_keys
    attn.value_scales.data.fill_(1.0)
    rotary = tg.Rotary(head_dim, T, T, 0.3, True)
    x = torch.randn(T, heads * head_dim)
    sdpa = tg.SdpaAttention()
    mask = sdpa.prepare(2 * T, 2 * cu_seqlens_of(tokens, BOS), {"S": window})["S"]
    got = attn(x, None, rotary.tables(True), mask, sdpa, torch.zeros(T, dtype=torch.bool), None, NO_GATES)
    ref = paired_attention_reference(attn, x, rotary.base_freqs, tokens, window, scale=0.3)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def test_paired_head_layers_give_one_loss_on_sdpa_and_flex():
    """A tiny model with paired heads on a short and a long layer: the same loss whichever backend builds the
    doubled sequence's masks (flex has no backward on the CPU); and paired heads change the function."""
    cfg = dataclasses.replace(tg.parse_cli(["--device=cpu", *TINY])[0], paired_head_layers=(0, 1))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB - 1, (cfg.micro_batch_tokens,), generator=g, dtype=torch.int32)
    tokens[torch.randint(0, tokens.numel(), (5,), generator=g)] = BOS
    targets = torch.roll(tokens, -1).long()
    bigrams = torch.from_numpy(tg.bigram_hash(tokens.numpy(), cfg.bigram_rows, BOS).astype(np.int64))
    losses = []
    for paired, attend in [(True, tg.SdpaAttention()), (True, tg.FlexAttention(cfg.micro_batch_tokens, torch.device("cpu"))),
                           (False, tg.SdpaAttention())]:
        torch.manual_seed(0)
        model = tg.GPT(cfg if paired else dataclasses.replace(cfg, paired_head_layers=()), attend, torch.float32)
        for p in model.parameters():
            if p.ndim >= 2:  # matrices, tables and gate weights
                p.data.normal_(std=0.1)
        masks = model.prepare_masks(tokens, cu_seqlens_of(tokens, BOS), (4, 8))
        assert set(masks) == ({"S", "L", "PS", "PL"} if paired else {"S", "L"})
        with torch.no_grad():
            losses.append(model(tokens, targets, masks, bigrams).item())
    assert math.isclose(losses[0], losses[1], rel_tol=1e-5)
    assert abs(losses[0] - losses[2]) > 1e-4


def test_exclusive_self_attention_removes_the_own_value_direction():
    """XSA's strengths come per token and head (TokenGates): with an attention that returns each token's own value,
    XSA leaves (1 - tanh(alpha)) of it; with real attention, the output less its part along the own value."""
    _, xsa = attention_layer(1)
    x, args = own_value_inputs()
    T, dim = x.shape
    alpha = torch.full((T, 2), math.atanh(0.25), requires_grad=True)
    plain = xsa(x, *args, NO_GATES)
    y = xsa(x, *args, tg.LayerGates(None, alpha, None))
    torch.testing.assert_close(y, 0.75 * plain)
    y.square().sum().backward()
    assert alpha.grad.abs().min() > 0
    sdpa = tg.SdpaAttention()
    tokens = torch.full((T,), 3, dtype=torch.int32)
    mask = sdpa.prepare(T, cu_seqlens_of(tokens, BOS), {"S": T})["S"]
    captured = {}

    def attend(q, k, v, mask):
        captured["v"], captured["y"] = v, sdpa(q, k, v, mask)
        return captured["y"]
    got = xsa(x, None, args[1], mask, attend, args[4], None, tg.LayerGates(None, alpha.detach(), None))
    unit = captured["v"] / captured["v"].norm(dim=-1, keepdim=True)
    want_y = captured["y"] - 0.25 * (captured["y"] * unit).sum(-1, keepdim=True) * unit
    torch.testing.assert_close(got, want_y.reshape(T, -1) @ xsa.qkvo_w[3 * dim:].T)
    model = tg.GPT(tg.parse_cli(TINY)[0], tg.SdpaAttention(), torch.float32)
    assert [i for i, lanes in enumerate(model.token_gates.lanes) if "xsa" in lanes] == [1]  # the tiny preset's


def test_value_gate_reads_the_stream_and_the_value_embedding():
    """2 sigmoid of a per-head gate of the stream's first 6 channels and the value embedding's first 6 scales the
    embedding into v (speedrun 2026-02-03)."""
    heads, head_dim, T = 2, 8, 5
    dim = heads * head_dim
    _, layer = attention_layer(0, paired_head_layers=())
    layer.gate_w.data.normal_()
    x, ve = torch.randn(T, dim), torch.randn(T, dim)
    _, args = own_value_inputs(T, dim)
    got = layer(x, ve, *args[1:], NO_GATES)
    v = (x @ layer.qkvo_w[2 * dim: 3 * dim].T).view(T, heads, head_dim)
    gate = torch.sigmoid(torch.cat([x[:, :6], ve[:, :6]], dim=-1) @ layer.gate_w.T)[..., None]
    want = (0.5 * v + 2 * gate * ve.view(T, heads, head_dim)).reshape(T, dim) @ layer.qkvo_w[3 * dim:].T
    torch.testing.assert_close(got, want)


def test_block_adds_its_sublayers_with_per_token_x0_and_bigram_scales():
    """x = r_a x + o_a attention(norm a) + x0_scale x0 + bigram_scale bigram, then r_m x + o_m MLP(norm x), the x0
    and bigram scales per token (LayerGates), the attention reading attn_input when given."""
    cfg = tg.parse_cli(TINY)[0]
    torch.manual_seed(0)
    block = tg.Block(cfg, 1, False)
    block.attend = tg.SdpaAttention()
    for p in block.parameters():
        p.data.normal_(std=0.3)
    T, dim = 12, cfg.model_dim
    x, x0, bigram, source = (torch.randn(T, dim) for _ in range(4))
    token = tg.LayerGates((torch.randn(T, 1), torch.randn(T, 1)), None, None)
    rope = tg.Rotary(cfg.head_dim, T, T, 0.1, False).tables()
    tokens = torch.full((T,), 3, dtype=torch.int32)
    mask = block.attend.prepare(T, cu_seqlens_of(tokens, BOS), {"S": T})["S"]
    starts = torch.zeros(T, dtype=torch.bool)
    got = block(x, x0, None, rope, mask, bigram, starts, source, None, token)
    r, o = block.residual_scales, block.output_scales
    attention = block.attn(tg.rms_norm(source), None, rope, mask, block.attend, starts, None, token)
    mid = r[0] * x + o[0] * attention + token.inject[0] * x0 + token.inject[1] * bigram
    torch.testing.assert_close(got, r[1] * mid + o[1] * block.mlp(tg.rms_norm(mid)))
    # the speedrun's 2026-03-06 settings: the residual scales at the scalars' lr, both with betas 0.9 and 0.95
    assert block.residual_scales.opt == tg.Opt(lr=5.0, betas=(0.9, 0.95))
    assert block.output_scales.opt == tg.Opt(betas=(0.9, 0.95))


def test_yarn_keeps_fast_frequencies_and_slows_slow_ones():
    freqs = torch.tensor([10.0, 1.0, 0.01])
    scaled = tg.yarn_rescale(freqs, old_window=384, new_window=896)
    assert scaled[0] == freqs[0]  # turns many times across the window: kept
    assert math.isclose(scaled[2].item(), 0.01 * 384 / 896, rel_tol=1e-6)  # slow: interpolated


def test_rotary_tables_follow_window_history():
    rotary = tg.Rotary(16, 64, 64, 0.12, False)
    fresh = rotary.cos.clone(), rotary.attn_scale.item()
    rotary.set_window_history([8, 32])
    assert rotary.attn_scale.item() > fresh[1] and not torch.equal(rotary.cos, fresh[0])
    rotary.set_window_history([8])
    assert torch.equal(rotary.cos, fresh[0]) and rotary.attn_scale.item() == fresh[1]


def test_rotary_rotates_half_pairs_and_keeps_relative_positions():
    rotary = tg.Rotary(16, 64, 64, 0.12, False)
    rotary.set_window_history([8, 32])
    cos, sin, _ = rotary.tables()
    x = torch.randn(64, 2, 16, generator=torch.Generator().manual_seed(0))
    x1, x2 = x[..., :8], x[..., 8:]
    angle_cos, angle_sin = cos[:, None], sin[:, None, 0]
    explicit = torch.cat([x1 * angle_cos + x2 * angle_sin, x2 * angle_cos - x1 * angle_sin], dim=-1)
    torch.testing.assert_close(tg.apply_rotary(x, cos, sin), explicit, rtol=0, atol=0)
    # the same q and k vectors at every position: their rotated dot product depends only on the distance
    q, k = (tg.apply_rotary(v.expand(64, 2, 16), cos, sin) for v in torch.randn(2, 1, 2, 16))
    dots = (q[:, None] * k[None]).sum(-1)  # [query position, key position, head]
    torch.testing.assert_close(dots[10, 3], dots[40, 33], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(dots[10, 3], dots[10, 4], rtol=1e-3, atol=1e-3)


def test_orthogonalize_gives_near_orthogonal_matrices():
    g = torch.randn(3, 48, 96, generator=torch.Generator().manual_seed(0))
    singular_values = torch.linalg.svdvals(tg.orthogonalize(g, use_triton=False))
    assert singular_values.min() > 0.6 and singular_values.max() < 1.25


def test_schedule_is_a_function_of_the_step():
    s = tg.Schedule(tg.Config(num_iterations=900, extension_steps=0))
    assert [s.micro_batches(i) for i in (0, 299, 300, 899)] == [8, 8, 16, 24]
    assert s.windows(0) == (128, 384) and s.windows(600) == (640, 1408) and s.windows(900) == (768, 2560)
    assert s.long_window_history(450) == [384, 896] and s.long_window_history(900) == [384, 896, 1408, 2560]
    assert s.lr_multiplier(0) == 1.0 and math.isclose(s.lr_multiplier(900), 0.15)  # the extension row's lr
    # Muon's momentum: 0.85 rising to 0.95 over 300 steps, down again over the last 50
    assert [s.muon_momentum(i) for i in (0, 150, 300, 849)] == [0.85, pytest.approx(0.9), 0.95, 0.95]
    assert s.muon_momentum(899) < 0.86


def test_the_lr_cools_down_linearly():
    """Cooldown over steps 40 .. 100 of 100, from 1.0 to the extension row's 0.1: a quarter of the way through it
    (step 55) the lr has gone a quarter of the way down (0.775); the extension keeps 0.1."""
    stages = (tg.Stage(8, 1.0, (128, 384), 896, ((1, 1),)), tg.Stage(8, 0.1, (128, 384), 896, ((1, 1),)))
    s = tg.Schedule(tg.Config(num_iterations=100, extension_steps=5, stages=stages, cooldown_frac=0.6))
    assert math.isclose(s.lr_multiplier(55), 0.775)
    for step in (0, 40, 41, 55, 70, 99, 100, 104):
        t = min(max((step - 40) / 60, 0.0), 1.0)
        assert math.isclose(s.lr_multiplier(step), 1.0 - 0.9 * t)


def test_scheduled_steps_then_extension_steps():
    """480 scheduled steps in three stages and 40 extension steps: the stages split the scheduled steps, the lr
    reaches the extension row's at their end and stays there, the extension keeps the last batch with its own windows
    (YaRN replays them, and the final validation's longer window), the momentum cools down over the last steps of
    all, and the run validates at its end."""
    s = tg.Schedule(tg.Config(num_iterations=480, extension_steps=40, val_loss_every=160))
    assert s.total_steps == 520
    assert [s.stage(i) for i in (0, 159, 160, 320, 479, 480, 519)] == [0, 0, 1, 2, 2, 3, 3]
    assert [s.micro_batches(i) for i in (0, 160, 479, 480, 519)] == [8, 16, 24, 24, 24]
    assert s.micro_batches_before(0) == 0 and s.micro_batches_before(162) == 160 * 8 + 2 * 16
    assert s.lr_multiplier(144) == 1.0 and s.lr_multiplier(145) < 1.0  # cooldown from 480 * 0.3 = 144
    assert math.isclose(s.lr_multiplier(480), 0.15) and math.isclose(s.lr_multiplier(519), 0.15)
    assert s.windows(479) == (640, 1408) and s.windows(480) == (768, 1664) and s.windows(520) == (768, 2560)
    assert s.long_window_history(500) == [384, 896, 1408, 1664]
    assert s.long_window_history(520) == [384, 896, 1408, 1664, 2560]
    assert s.muon_momentum(470) == 0.95 and s.muon_momentum(471) < 0.95 and s.muon_momentum(519) < 0.86
    assert [step for step in range(600) if s.validates(step)] == [0, 160, 320, 480, 520]
    # validation scores the model with the windows it was trained with up to then; the last with final_windows
    assert [s.windows(s.validation_step(step)) for step in (0, 160, 480, 520)] == [(128, 384), (128, 384),
                                                                                  (640, 1408), (768, 2560)]
    # the warm-up runs each pair of windows at each forward size the timed region meets: one size on one GPU, and
    # at 8 ranks 1, 2, 3 micro-batches per forward by stage and 2 in validation, each twice under CUDA graphs
    assert tg.warm_up_forwards(s, tg.Packing((8, 8, 8, 8), 8), 1, cuda_graphs=False) == {
        ((128, 384), 8): 1, ((384, 896), 8): 1, ((640, 1408), 8): 1, ((768, 1664), 8): 1, ((768, 2560), 8): 1}
    assert tg.warm_up_forwards(s, tg.Packing((1, 2, 3, 3), 2), 8, cuda_graphs=True) == {
        ((128, 384), 1): 2, ((128, 384), 2): 2, ((384, 896), 2): 2, ((640, 1408), 2): 2, ((640, 1408), 3): 2,
        ((768, 1664), 3): 2, ((768, 2560), 2): 2}
    assert tg.warm_up_forwards(s, tg.Packing((1, 1, 1, 1), 1), 8, cuda_graphs=True)[(640, 1408), 1] == 3


@pytest.mark.parametrize("adam_period, want", [(1, [True, True, False]),
                                               (2, [True, True, True])])  # step 2 only adds gradients up
def test_tied_embedding_follows_the_head_until_the_untie_step(tiny_data, adam_period, want):
    cfg = tiny_config(*tiny_data, num_iterations=3, adam_period=adam_period)
    schedule = tg.Schedule(cfg)
    assert schedule.untie_step == 2  # two thirds of the steps
    torch.manual_seed(0)
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    assert torch.equal(model.embed.weight, model.lm_head.weight) and model.lm_head.weight.std() < 0.01
    optimizers = tg.build_optimizers(model, cfg)
    same = []
    train_scheduled_steps(model, optimizers, cfg, 3,
                          after_step=lambda step: same.append(torch.equal(model.embed.weight, model.lm_head.weight)))
    assert same == want


def test_an_untie_before_adams_first_update_starts_both_states_fresh(tiny_data):
    """Untied at step 1, before Adam's first update (it steps on odd steps): the embedding gets a state of its own."""
    cfg = tiny_config(*tiny_data, num_iterations=2, adam_period=2)
    assert tg.Schedule(cfg).untie_step == 1
    torch.manual_seed(0)
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    optimizers = tg.build_optimizers(model, cfg)
    train_scheduled_steps(model, optimizers, cfg, 2)
    adam = optimizers[1]
    assert adam.state[model.embed.weight]["step"].item() == 1 and adam.state[model.lm_head.weight]["step"].item() == 1
    assert not torch.equal(model.embed.weight, model.lm_head.weight)


def test_multi_token_weights_follow_the_stages():
    s = tg.Schedule(tg.Config(num_iterations=480, extension_steps=40))
    assert s.mtp_offsets == 3
    got = {step: s.mtp_weights(step) for step in (0, 80, 159, 160, 240, 320, 519)}
    assert got[0] == [1, 0.5, 0.25] and got[80] == [1, 0.5, 0.125] and 0 < got[159][2] < 0.002
    assert got[160] == [1, 0.5, 0] and got[240] == [1, 0.25, 0] and got[320] == [1, 0, 0] and got[519] == [1, 0, 0]
    for bad in ("8 1 16:32 64 1,-1; 8 1 16:32 64 1", "8 1 16:32 64 0,1; 8 1 16:32 64 1"):
        with pytest.raises(tg.UserError, match="mtp weights not negative, the next token's above 0"):
            tg.parse_cli(["--preset=tiny", f"--stages={bad}"])


def test_loss_watch_names_step_and_rank():
    watch = tg.LossWatch(tg.Comm(rank=0, world_size=1), torch.device("cpu"))
    watch.push(0, torch.tensor(3.0))
    with pytest.raises(tg.TrainingDiverged, match="loss is nan at step 2 on rank 0"):
        watch.push(1, torch.tensor(float("nan")))
        watch.flush()
    assert watch.losses == [3.0]


def test_optimizers_follow_the_schedule_after_loading_a_state_dict(tiny_data):
    """A DiLoCo heal loads both optimizers' state dicts, which replaces their param_groups dicts; the scheduled
    lr and momentum written into the new dicts must drive the next steps, exactly as in optimizers that never
    loaded anything."""
    cfg = tiny_config(*tiny_data, num_iterations=8)
    schedule = tg.Schedule(cfg)

    def train(reload_at: int | None):
        torch.manual_seed(0)
        model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
        model.lm_head.weight.data.normal_(std=0.02)
        optimizers = tg.build_optimizers(model, cfg)

        def reload(step):
            if step == reload_at:
                for opt in optimizers:
                    opt.load_state_dict(tg.detached_copy(opt.state_dict()))
        train_scheduled_steps(model, optimizers, cfg, cfg.num_iterations, before_step=reload)
        return model.state_dict()

    # the schedule moves after step 3: lr (stage 2 and the cooldown) and Muon's momentum (its warm-up)
    assert schedule.lr_multiplier(3) != schedule.lr_multiplier(6)
    assert schedule.muon_momentum(3) != schedule.muon_momentum(6)
    reference, reloaded = train(None), train(3)
    for name, weight in reference.items():
        assert torch.equal(weight, reloaded[name]), name

def test_warm_up_restores_the_initial_model(tiny_data):
    cfg = tiny_config(*tiny_data)
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    model.lm_head.weight.data.normal_()  # non-zero head, so the warm-up's steps change every weight
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizers = tg.build_optimizers(model, cfg)
    lines = []
    schedule, packing = tg.Schedule(cfg), tg.Packing((1, 1, 1, 1), 1)
    tg.warm_up(model, optimizers, cfg, tg.Comm(), schedule, torch.device("cpu"), packing, lines.append)
    # a progress line per (windows, forward size) pair, in the order they ran
    runs = tg.warm_up_forwards(schedule, packing, 1, cuda_graphs=False)
    assert [re.match(r"warm-up (\d+)/(\d+): windows (\d+)/(\d+), 1 micro-batch\(es\) per forward", line).groups()
            for line in lines] == [(str(n), str(len(runs)), str(a), str(b)) for n, ((a, b), _) in enumerate(runs, 1)]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert all(not opt.state for opt in optimizers)


def test_a_run_freezes_the_heap_for_its_loop_unless_its_caller_froze_objects(tiny_data, tmp_path, monkeypatch):
    cfg = tiny_config(*tiny_data, num_iterations=2, val_loss_every=0, log_dir=str(tmp_path), micro_batch_tokens=128)
    during = []
    step = tg.train_step
    monkeypatch.setattr(tg, "train_step", lambda *a, **k: (during.append(gc.get_freeze_count()), step(*a, **k))[1])
    frozen = gc.get_freeze_count()  # conftest froze the imports; a frozen object may still die, never join
    assert frozen > 0
    tg.train(cfg, tg.Comm(), tg.RunLog(cfg, tg.Comm()))
    assert max(during) <= frozen and 0 < gc.get_freeze_count() <= frozen
    gc.unfreeze()
    try:
        during.clear()
        tg.train(cfg, tg.Comm(), tg.RunLog(cfg, tg.Comm()))
        assert during[0] == 0 and during[-1] > 0 and gc.get_freeze_count() == 0  # frozen for the loop, then not
    finally:
        gc.collect()
        gc.freeze()


def test_closed_optimizers_are_freed(tiny_data):
    # Their gradient hooks on the parameters are what keeps them alive while the model lives; a run closes them,
    # so they and DistAdam's gloo group do not live on to the interpreter's exit.
    cfg = tiny_config(*tiny_data)
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    optimizers = tg.build_optimizers(model, cfg)
    alive = [weakref.ref(opt) for opt in optimizers]
    del optimizers
    gc.collect()
    assert all(ref() is not None for ref in alive)  # held by the hooks
    for ref in alive:
        ref().close()
    gc.collect()
    assert all(ref() is None for ref in alive)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
