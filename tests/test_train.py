"""Tests of train_gpt.py on the CPU: config, data loading, attention, schedule, and whole tiny runs on
one process and on two gloo processes."""
import dataclasses
import gc
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import types
import weakref
import zipfile

import numpy as np
import pytest
import torch

import train_gpt as tg
from helpers import (BOS, REPO, TINY, TOKENS, VOCAB, cu_seqlens_of, learnable_documents, random_tiny_model,
                     run_forked, run_on_ranks, train_scheduled_steps, write_shard)

BATCHES = dict(bos=BOS, vocab_size=VOCAB)  # bos_aligned_batches' arguments for these shards

STEP_LINE = re.compile(r"^step:(\d+)/(\d+)( val_loss:(\S+))? train_time:(\d+)ms step_avg:(\S+)ms( train_loss:\S+)?$")


def tiny_config(train, val, **overrides):
    cfg, _ = tg.parse_cli(["--device=cpu", *TINY, f"--train_files={train}", f"--val_files={val}"]
                          + [f"--{k}={v}" for k, v in overrides.items()])
    return cfg


def run_cli(args, cwd, nproc=1, timeout=600):
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    return subprocess.run(launcher + [str(REPO / "train_gpt.py")] + args, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------------- config

def test_unknown_option_lists_valid_names():
    with pytest.raises(tg.UserError, match=r"unknown option --nope\. Valid options: train_files, .*num_iterations"):
        tg.parse_cli(["--nope=1"])


@pytest.mark.parametrize("arg, message", [
    ("--num_iterations=ten", "bad value for --num_iterations"),
    ("--compile=maybe", "bad value for --compile"),
    ("--adam_betas=0.9", "bad value for --adam_betas"),
    ("--attn_layout=SSL", "--attn_layout='SSL'"),
    ("--batch_schedule=8,12,24", "multiple of 8"),
    ("--device=tpu", "--device=tpu"),
    ("--preset=huge", "unknown --preset=huge"),
    ("--bos_token=50257", "--bos_token=50257 must be a token of the vocabulary (below --vocab_size=50257)"),
    ("--vocab_size=70000", "--vocab_size=70000: shards hold 16-bit tokens"),
    ("--adam_period=-1", "--adam_period=-1 must be 0 (auto) or more"),
    ("--paired_head_layers=0,x", "bad --paired_head_layers='0,x'"),
    ("--paired_head_layers=11", "--paired_head_layers='11': use distinct layers 0 .. num_layers-1 (10)"),
    ("--paired_head_layers=6", "--paired_head_layers=6 names a layer without attention"),
])
def test_bad_values_are_named(arg, message):
    with pytest.raises(tg.UserError, match=re.escape(message)):
        tg.parse_cli([arg])


def test_defaults_hold_the_speedrun_options_and_plain_turns_them_off():
    cfg, _ = tg.parse_cli(["--muon_lr=0.03"])
    assert cfg.tie_embed and cfg.gates and cfg.normuon_beta2 == 0.9 and cfg.muon_lr == 0.03
    assert tg.Schedule(cfg).mtp_weights(0) == [1.0, 0.5, 0.25]
    assert [tg.Schedule(cfg).adam_updates(s) for s in range(4)] == [False, True, False, True]  # the speedrun's odd steps
    assert cfg.attn_out_scale and cfg.value_embed_scale_init == 1.0 and cfg.paired_head_layers == "0,2,5,9"
    assert tg.Schedule(dataclasses.replace(cfg, diloco=True)).adam_period == 1  # syncs land between any two steps
    plain, _ = tg.parse_cli(["--preset=plain"])
    assert not (plain.tie_embed or plain.gates or plain.smear or plain.key_offset or plain.normuon_beta2
                or plain.paired_head_layers or plain.attn_out_scale)
    assert tg.Schedule(plain).adam_period == 1
    assert plain.backout_from == -1 and tg.Schedule(plain).mtp_weights(0) == [1.0]
    # the 2026-02 record's set: the later records' ideas, the pointer and the longest match off, its step count
    for older in (plain, tg.parse_cli(["--preset=record_2026_02"])[0]):
        assert not (older.mudd or older.token_gates or older.copy_pointer or older.longest_match or older.xsa_layers
                    or older.sublayer_scales or older.bigram_signs or older.muon_slow_momentum)
        assert (older.num_iterations, older.extension_steps, older.normuon_beta2 or 0.95) == (1515, 40, 0.95)


def test_the_defaults_build_the_full_size_record_model():
    cfg, _ = tg.parse_cli(["--device=cpu"])
    assert cfg.stage_doc_lens == [896, 2048, 2048] and cfg.muon_qk_blocks == 3
    assert (cfg.num_iterations, cfg.extension_steps) == (1270, 15)  # the speedrun's 2026-07 record's step count
    with torch.device("meta"):  # shapes only: the 12-layer model without its memory
        model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    # XSA on the record's layers, its strengths per token from the gates; MUDD into the last layer and the head
    assert [i for i, lanes in enumerate(model.token_gates.lanes) if "xsa" in lanes] == [1, 3, 4, 7]
    assert model.mudd_layer is not None and model.mudd_head is not None
    assert model.bigram_embed.weight.shape == (3 * 5 * 50304, 192) and model.bigram_signs.shape == (8192, 192)
    # the pull requests' copy pointer at its full band, and the longest-match feature
    assert model.copy_pointer is not None and model.copy_pointer.band == 2048 and model.longest_match is not None


def test_preset_and_overrides():
    cfg, flags = tg.parse_cli(["--preset=tiny", "--num_iterations=3", "--adam_betas=0.9,0.99", "--compile=1"])
    assert (cfg.model_dim, cfg.num_iterations, cfg.adam_betas, cfg.compile) == (64, 3, (0.9, 0.99), True)
    assert flags == {"preset": "tiny"}
    assert tg.Config().model_dim == 768  # the default is the full record config


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
    cfg = tiny_config(*tiny_data, micro_batch_tokens=128, max_doc_len=128, doc_len_schedule="16,64,128")
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
    with pytest.raises(tg.UserError, match=re.escape("--doc_len_schedule=16,64: one length per stage")):
        tiny_config(*tiny_data, doc_len_schedule="16,64")


def test_closing_the_prefetcher_stops_the_loaders_threads(tiny_data):
    """No loader thread outlives close(): a thread still in numpy or torch when the interpreter exits aborts the
    process ("terminate called without an active exception"), which a two-process run once did at its end."""
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
    cfg = tg.Config(micro_batch_tokens=128, max_doc_len=64, **TOKENS)
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
    cfg = tg.Config(micro_batch_tokens=256, max_doc_len=128, **TOKENS)
    batches = tg.Prefetcher(tg.train_batches_for_rank([path], cfg, tg.Comm()), 256, torch.device("cpu"), bos=BOS)
    with pytest.raises(tg.DataError, match="training data ran out"):
        for _ in range(100):
            batches.next()
    batches.close()
    passes = []
    repeating = tg.Prefetcher(tg.train_batches_for_rank([path], dataclasses.replace(cfg, train_repeat=True), tg.Comm(),
                                                        on_new_pass=passes.append),
                              256, torch.device("cpu"), bos=BOS)
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
    # starts (a short forward after a long one in the same slot shows no stale tokens), and its bigram rows and tokens
    # read only
    sizes = [3, 1, 2, 3, 1, 2]
    batches = tg.Prefetcher(iter(windows), 128, torch.device("cpu"), slots=2, bos=BOS, packed=3, sizes=sizes,
                            bigram_rows=4096, token_rows=BOS + 1)
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
        assert b.bigram_rows_used.tolist() == np.unique(b.bigrams.numpy()).tolist()
        assert b.token_rows_used.tolist() == np.unique(b.inputs.numpy()).tolist()
    batches.close()



def test_prefetcher_peeks_at_the_forwards_it_hands_out_next(tmp_path):
    """peek(n): the next n forwards' row lists (what --table_row_fetch fetches for), not consumed: next() then hands
    out those forwards, in order. Past the stream's end peek gives None and next() still names the end; n must leave
    a slot free."""
    rng = np.random.default_rng(1)
    windows = [rng.integers(0, BOS, 129).astype(np.uint16) for _ in range(7)]
    batches = tg.Prefetcher(iter(windows), 128, torch.device("cpu"), slots=4, bos=BOS, bigram_rows=4096,
                            token_rows=BOS + 1)
    try:
        first = batches.next()
        assert first.token_rows_used.tolist() == np.unique(windows[0][:-1]).tolist()
        peeked = [(s.token_rows_used.tolist(), s.bigram_rows_used.tolist()) for s in batches.peek(3)]
        assert [tokens for tokens, _ in peeked] == [np.unique(w[:-1]).tolist() for w in windows[1:4]]
        assert [(s.token_rows_used.tolist(), s.bigram_rows_used.tolist()) for s in batches.peek(2)] == peeked[:2]
        for index, (tokens, bigrams) in enumerate(peeked, 1):
            b = batches.next()
            assert torch.equal(b.inputs, torch.from_numpy(windows[index][:-1].astype(np.int32)))
            assert (b.token_rows_used.tolist(), b.bigram_rows_used.tolist()) == (tokens, bigrams)
        with pytest.raises(ValueError, match="peeking 4 forwards ahead needs more than 4 loader slots"):
            batches.peek(4)
        assert len(batches.peek(3)) == 3 and batches.peek(3)[0] is not None
        batches.next(), batches.next(), batches.next()
        assert batches.peek(1) is None
        with pytest.raises(tg.DataError, match="the training data ran out"):
            batches.next()
    finally:
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
    with pytest.raises(tg.UserError, match="micro_batch_tokens=1000 must be a multiple of 128"):
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
    slot = tg._Slot(T, pin=False, bos=BOS)
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
    both max_seqlen cases and the cut and uncut document starts, in the whole model's `masks` and in a block's
    `mask` (--compile_scope=regional), each equal to eager. (Constants would make a graph per value; under CUDA
    graphs the op is then captured with the step, one recorded graph per value.)"""
    from torch._dynamo.testing import CompileCounterWithBackend
    T = 1024  # 4 documents, fewer than the 5 starts the cut keeps (one per 256 tokens)
    tokens, q, k, v = random_attention_inputs(T=T, seed=3, starts=3)
    slot = tg._Slot(T, pin=False, bos=BOS)
    slot.fill([np.concatenate([tokens.numpy(), [0]]).astype(np.uint16)])
    kernels = StandInFA3()
    fa3 = tg.FlashAttention3(kernels, slot.longest_document)
    torch._dynamo.reset()
    counter, block_counter = CompileCounterWithBackend("aot_eager"), CompileCounterWithBackend("aot_eager")

    def whole(q, k, v, masks):
        return fa3(q, k, v, masks["S"]).square().sum()

    def block(q, k, v, mask):
        return fa3(q, k, v, mask).square().sum()
    whole = torch.compile(whole, backend=counter, fullgraph=True, dynamic=False)
    block = torch.compile(block, backend=block_counter, fullgraph=True, dynamic=False)
    handed = set()
    entries = T // 256 + 1
    for window in (9, 130, 700):
        # the second longer, as in validation; the third with as many documents as the cut keeps starts
        for documents, longest in ((slot.documents, slot.longest_document), (slot.documents, slot.longest_document + 1),
                                   (entries, slot.longest_document)):
            mask = fa3.prepare(tokens.numel(), slot.cu_seqlens, {"S": window}, documents, longest)["S"]
            handed.add(mask[2:])
            results = []
            for run, arg in ((lambda q, k, v, m: fa3(q, k, v, m).square().sum(), mask), (block, mask),
                             (whole, {"S": mask})):
                qkv = [t.clone().requires_grad_() for t in (q, k, v)]
                with torch.compiler.config.patch(dynamic_sources=tg.FA3_HOST_INT_SOURCES):
                    loss = run(*qkv, arg)
                results.append((loss, *torch.autograd.grad(loss, qkv)))
                assert kernels.calls[-1] == mask[2:]  # what the kernels were handed, the backward's too
            for other in results[1:]:
                for got, expected in zip(other, results[0]):
                    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert handed == {(slot.longest_document, entries), (T, entries), (slot.longest_document, len(slot.cu_seqlens))}
    assert counter.frame_count == block_counter.frame_count == 1


# --------------------------------------------------------------------------------------- model pieces

def test_key_offset_gives_each_key_the_still_half_of_the_previous_one():
    """With shift_keys, the key dims Rotary leaves unrotated come from the previous position, except where a document
    or micro-batch starts; the rotated dims, the queries and the values are untouched."""
    torch.manual_seed(0)
    T, heads, head_dim = 12, 2, 16
    rotary = tg.Rotary(head_dim, T)
    seen = {}

    def attend(q, k, v, mask):
        seen.setdefault("k", []).append(k)
        return v
    x = torch.randn(T, heads * head_dim)
    starts = torch.zeros(T, dtype=torch.bool)
    starts[[0, 5]] = True
    plain = tg.CausalSelfAttention(heads * head_dim, heads, head_dim)
    shifted = tg.CausalSelfAttention(heads * head_dim, heads, head_dim, shift_keys=True)
    shifted.qkvo_w.data.copy_(plain.qkvo_w.data.normal_())
    for attn in (plain, shifted):
        attn(x, torch.zeros(T, heads * head_dim), torch.ones(2), rotary.tables(), None, attend, starts)
    k, got = seen["k"]
    assert (rotary.base_freqs[head_dim // 4:] == 0).all() and (rotary.base_freqs[: head_dim // 4] != 0).all()
    still = torch.zeros(head_dim, dtype=torch.bool)
    still[head_dim // 4: head_dim // 2] = still[3 * head_dim // 4:] = True
    want = k.clone()
    for t in range(T):
        if not starts[t]:
            want[t][:, still] = k[t - 1][:, still]
    assert torch.equal(got, want) and not torch.equal(got, k)


def plain_and_variant_attention(**variant):
    """A plain attention layer and one with `variant`'s options and the same random weights, an input, and the
    rest of their arguments, with an attention that returns each token's own value."""
    heads, head_dim, T = 2, 8, 6
    rotary = tg.Rotary(head_dim=head_dim, max_len=16)
    x = torch.randn(T, heads * head_dim)
    plain = tg.CausalSelfAttention(heads * head_dim, heads, head_dim)
    other = tg.CausalSelfAttention(heads * head_dim, heads, head_dim, **variant)
    other.qkvo_w.data.copy_(plain.qkvo_w.data.normal_())
    args = (torch.zeros(T, heads * head_dim), torch.ones(2), rotary.tables(), None, lambda q, k, v, mask: v,
            torch.zeros(T, dtype=torch.bool))
    return x, plain, other, args


def test_attention_output_scale_multiplies_the_output_and_learns():
    x, plain, scaled, args = plain_and_variant_attention(out_scale=True)
    assert torch.equal(scaled(x, *args), plain(x, *args))  # starts at 1
    scaled.out_scale.data.fill_(2.0)
    y = scaled(x, *args)
    torch.testing.assert_close(y, 2 * plain(x, *args))
    y.square().sum().backward()
    assert scaled.out_scale.grad.abs().item() > 0
    model = tg.GPT(dataclasses.replace(tg.parse_cli(TINY)[0], attn_out_scale=True), tg.SdpaAttention(), torch.float32)
    adam_params = {id(p) for group in tg.build_optimizers(model, model.cfg)[1].param_groups for p in group["params"]}
    assert all(id(b.attn.out_scale) in adam_params for b in model.blocks if b.attn is not None)


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
    rotary = tg.Rotary(head_dim=head_dim, max_len=T, paired=True, attn_scale=0.3)
    attn = tg.CausalSelfAttention(heads * head_dim, heads, head_dim, paired=True)
    attn.qkvo_w.data.normal_()
    x = torch.randn(T, heads * head_dim)
    sdpa = tg.SdpaAttention()
    mask = sdpa.prepare(2 * T, 2 * cu_seqlens_of(tokens, BOS), {"S": window})["S"]
    got = attn(x, torch.zeros_like(x), torch.tensor([1.0, 0.0]), rotary.paired_tables(), mask, sdpa,
               torch.zeros(T, dtype=torch.bool))
    ref = paired_attention_reference(attn, x, rotary.base_freqs, tokens, window, scale=0.3)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def test_paired_head_layers_give_one_loss_on_sdpa_and_flex():
    """A tiny model with paired heads on a short and a long layer: the same loss whichever backend builds the
    doubled sequence's masks (flex has no backward on the CPU); and paired heads change the function."""
    cfg = dataclasses.replace(tg.parse_cli(["--device=cpu", *TINY])[0], paired_head_layers="0,1")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB - 1, (cfg.micro_batch_tokens,), generator=g, dtype=torch.int32)
    tokens[torch.randint(0, tokens.numel(), (5,), generator=g)] = BOS
    targets = torch.roll(tokens, -1).long()
    bigrams = torch.from_numpy(tg.bigram_hash(tokens.numpy(), cfg.bigram_rows, BOS).astype(np.int64))
    losses = []
    for paired, attend in [(True, tg.SdpaAttention()), (True, tg.FlexAttention(cfg.micro_batch_tokens, torch.device("cpu"))),
                           (False, tg.SdpaAttention())]:
        torch.manual_seed(0)
        model = tg.GPT(cfg if paired else dataclasses.replace(cfg, paired_head_layers=""), attend, torch.float32)
        for p in model.parameters():
            p.data.normal_(std=0.1)
        masks = model.prepare_masks(tokens, cu_seqlens_of(tokens, BOS), (4, 8))
        assert set(masks) == ({"S", "L", "PS", "PL"} if paired else {"S", "L"})
        with torch.no_grad():
            losses.append(model(tokens, targets, masks, bigrams).item())
    assert math.isclose(losses[0], losses[1], rel_tol=1e-5)
    assert abs(losses[0] - losses[2]) > 1e-4


def test_exclusive_self_attention_removes_the_own_value_direction():
    """With an attention that returns each token's own value, XSA leaves (1 - tanh(alpha)) of it; alpha starts at 0
    (no change), learns, and trains in its own Adam group."""
    x, plain, xsa, args = plain_and_variant_attention(xsa=True)
    T, dim = x.shape
    assert torch.equal(xsa(x, *args), plain(x, *args))
    xsa.xsa_alpha.data.fill_(math.atanh(0.25))
    y = xsa(x, *args)
    torch.testing.assert_close(y, 0.75 * plain(x, *args))
    y.square().sum().backward()
    assert xsa.xsa_alpha.grad.abs().min() > 0
    # with real attention: the output minus its projection on the normalised own value
    sdpa = tg.SdpaAttention()
    tokens = torch.full((T,), 3, dtype=torch.int32)
    mask = sdpa.prepare(T, cu_seqlens_of(tokens, BOS), {"S": T})["S"]
    captured = {}

    def attend(q, k, v, mask):
        captured["v"], captured["y"] = v, sdpa(q, k, v, mask)
        return captured["y"]
    got = xsa(x, args[0], args[1], args[2], mask, attend, args[5])
    unit = captured["v"] / captured["v"].norm(dim=-1, keepdim=True)
    want_y = captured["y"] - 0.25 * (captured["y"] * unit).sum(-1, keepdim=True) * unit
    torch.testing.assert_close(got, want_y.reshape(T, -1) @ xsa.qkvo_w[3 * dim:].T)
    model = tg.GPT(dataclasses.replace(tg.parse_cli(TINY)[0], xsa_layers="1,3"), tg.SdpaAttention(), torch.float32)
    groups = [g for g in tg.build_optimizers(model, model.cfg)[1].param_groups
              if any(p is model.blocks[1].attn.xsa_alpha for p in g["params"])]
    assert len(groups) == 1 and groups[0]["betas"] == (0.9, 0.95) and len(groups[0]["params"]) == 2


def test_value_gate_can_read_the_value_embedding():
    heads, head_dim, T, gate_dims = 2, 8, 5, 6
    dim = heads * head_dim
    rotary = tg.Rotary(head_dim=head_dim, max_len=16)
    layer = tg.CausalSelfAttention(dim, heads, head_dim, gate_dims=gate_dims, value_gate_reads_embed=True)
    layer.qkvo_w.data.normal_()
    layer.gate_w.data.normal_()
    x, ve = torch.randn(T, dim), torch.randn(T, dim)
    mix = torch.tensor([0.5, 1.0])
    got = layer(x, ve, mix, rotary.tables(), None, lambda q, k, v, mask: v, torch.zeros(T, dtype=torch.bool))
    v = (x @ layer.qkvo_w[2 * dim: 3 * dim].T).view(T, heads, head_dim)
    out_gate = torch.sigmoid(x[:, :gate_dims] @ layer.gate_w[0].T)[..., None]
    value_gate = torch.sigmoid(torch.cat([x[:, :3], ve[:, :3]], dim=-1) @ layer.gate_w[1].T)[..., None]
    want = (out_gate * (0.5 * v + 2 * value_gate * ve.view(T, heads, head_dim))).reshape(T, dim) @ layer.qkvo_w[3 * dim:].T
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("sublayer_scales", [False, True])
def test_block_residual_forms(sublayer_scales):
    """The two residual forms of Block, from its own attention and MLP: one scale per layer with x0 and the bigram
    added first, or per-sublayer residual and output scales with x0 and the bigram added after attention; the
    attention reads attn_input (normed) when given."""
    cfg = dataclasses.replace(tg.parse_cli(TINY)[0], sublayer_scales=sublayer_scales)
    torch.manual_seed(0)
    block = tg.Block(cfg, has_attention=True)
    block.attend = tg.SdpaAttention()
    for p in block.parameters():
        p.data.normal_(std=0.3)
    T, dim = 12, cfg.model_dim
    x, x0, bigram, source, ve = (torch.randn(T, dim) for _ in range(5))
    rotary = tg.Rotary(cfg.head_dim, max_len=T)
    tokens = torch.full((T,), 3, dtype=torch.int32)
    mask = block.attend.prepare(T, cu_seqlens_of(tokens, BOS), {"S": T})["S"]
    starts = torch.zeros(T, dtype=torch.bool)
    got = block(x, x0, ve, rotary.tables(), mask, bigram, starts, attn_input=source)

    def attention(inp):
        return block.attn(tg.rms_norm(inp), ve, block.value_scales, rotary.tables(), mask, block.attend, starts)
    if sublayer_scales:
        r, o, (a, b) = block.residual_scales, block.output_scales, block.injection
        mid = r[0] * x + o[0] * attention(source) + a * x0 + b * bigram
        want = r[1] * mid + o[1] * block.mlp(tg.rms_norm(mid))
    else:
        r, a, b = block.lambdas
        mid = r * x + a * x0 + b * bigram
        mid = mid + attention(source)
        want = mid + block.mlp(tg.rms_norm(mid))
    torch.testing.assert_close(got, want)
    if sublayer_scales:
        model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
        groups = tg.build_optimizers(model, cfg)[1].param_groups
        residual = [g for g in groups if any(p is model.blocks[0].residual_scales for p in g["params"])]
        mixing = [g for g in groups if any(p is model.blocks[0].injection for p in g["params"])]
        assert residual[0]["betas"] == mixing[0]["betas"] == (0.9, 0.95)
        assert residual[0]["lr"] == cfg.adam_lr * cfg.scalar_lr_mul and mixing[0]["lr"] == cfg.adam_lr


def test_yarn_keeps_fast_frequencies_and_slows_slow_ones():
    freqs = torch.tensor([10.0, 1.0, 0.01])
    scaled = tg.yarn_rescale(freqs, old_window=384, new_window=896)
    assert scaled[0] == freqs[0]  # turns many times across the window: kept
    assert math.isclose(scaled[2].item(), 0.01 * 384 / 896, rel_tol=1e-6)  # slow: interpolated


def test_rotary_tables_follow_window_history():
    rotary = tg.Rotary(head_dim=16, max_len=64)
    fresh = rotary.cos.clone(), rotary.attn_scale.item()
    rotary.set_window_history([8, 32])
    assert rotary.attn_scale.item() > fresh[1] and not torch.equal(rotary.cos, fresh[0])
    rotary.set_window_history([8])
    assert torch.equal(rotary.cos, fresh[0]) and rotary.attn_scale.item() == fresh[1]


def test_rotary_rotates_half_pairs_and_keeps_relative_positions():
    rotary = tg.Rotary(head_dim=16, max_len=64)
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
    cfg = tg.Config(num_iterations=90, extension_steps=0, muon_momentum_warmup=10, muon_momentum_cooldown=5)
    s = tg.Schedule(cfg)
    assert [s.micro_batches(i) for i in (0, 29, 30, 89)] == [8, 8, 16, 24]
    assert s.windows(0) == (128, 384) and s.windows(60) == (640, 1408) and s.windows(90) == (768, 2560)
    assert s.long_window_history(45) == [384, 896] and s.long_window_history(90) == [384, 896, 1408, 2560]
    assert s.lr_multiplier(0) == 1.0 and math.isclose(s.lr_multiplier(90), cfg.final_lr_frac)
    assert s.muon_momentum(0) == 0.85 and s.muon_momentum(50) == 0.95 and s.muon_momentum(89) < 0.95


def test_the_lr_cools_down_linearly():
    """Cooldown over steps 40 .. 100 of 100, from 1.0 to 0.1: a quarter of the way through it (step 55) the lr has
    gone a quarter of the way down (0.775); the extension keeps 0.1."""
    s = tg.Schedule(tg.Config(num_iterations=100, extension_steps=5, batch_schedule="8", lr_schedule="1.0",
                              window_schedule="1:3", cooldown_frac=0.6, final_lr_frac=0.1))
    assert math.isclose(s.lr_multiplier(55), 0.775)
    for step in (0, 40, 41, 55, 70, 99, 100, 104):
        t = min(max((step - 40) / 60, 0.0), 1.0)
        assert math.isclose(s.lr_multiplier(step), 1.0 - 0.9 * t)


def test_the_final_validation_may_keep_the_last_rotary_tables():
    """--final_yarn=0: the final validation reads the final windows with the rotary tables (and attention scale) the
    extension trained with, as the speedrun's code does; by default YaRN rescales them to the final long window."""
    cfg = tg.Config(num_iterations=480, extension_steps=40)
    for final_yarn, history in ((True, [384, 896, 1408, 1664, 2560]), (False, [384, 896, 1408, 1664])):
        s = tg.Schedule(dataclasses.replace(cfg, final_yarn=final_yarn))
        assert s.windows(520) == (768, 2560) and s.long_window_history(520) == history
        assert s.long_window_history(519) == [384, 896, 1408, 1664]
    rotary = [tg.Rotary(128, 64, period=64, attn_scale=0.1) for _ in range(2)]
    rotary[0].set_window_history([384, 896, 1408, 1664, 2560])
    rotary[1].set_window_history([384, 896, 1408, 1664])
    assert rotary[0].attn_scale.item() > rotary[1].attn_scale.item() and not torch.equal(rotary[0].cos, rotary[1].cos)


def test_scheduled_steps_then_extension_steps():
    """480 scheduled steps in three stages and 40 extension steps: the stages split the scheduled steps, the lr
    reaches final_lr_frac at their end and stays there, the extension keeps the last batch with its own windows
    (YaRN replays them), the momentum cools down over the last steps of all, and the run validates at its end."""
    cfg = tg.Config(num_iterations=480, extension_steps=40, val_loss_every=160, muon_momentum_cooldown=50)
    s = tg.Schedule(cfg)
    assert s.total_steps == 520
    assert [s.stage(i) for i in (0, 159, 160, 320, 479, 480, 519)] == [0, 0, 1, 2, 2, 3, 3]
    assert [s.micro_batches(i) for i in (0, 160, 479, 480, 519)] == [8, 16, 24, 24, 24]
    assert s.micro_batches_before(0) == 0 and s.micro_batches_before(162) == 160 * 8 + 2 * 16
    assert s.lr_multiplier(144) == 1.0 and s.lr_multiplier(145) < 1.0  # cooldown from 480 * 0.3 = 144
    assert math.isclose(s.lr_multiplier(480), cfg.final_lr_frac) and math.isclose(s.lr_multiplier(519), cfg.final_lr_frac)
    assert s.windows(479) == (640, 1408) and s.windows(480) == (768, 1664) and s.windows(520) == (768, 2560)
    assert s.long_window_history(500) == [384, 896, 1408, 1664]
    assert s.muon_momentum(470) == 0.95 and s.muon_momentum(471) < 0.95 and s.muon_momentum(519) < 0.86
    assert [step for step in range(600) if s.validates(step)] == [0, 160, 320, 480, 520]
    # validation scores the model with the windows it was trained with up to then; the last with final_windows
    assert [s.windows(s.validation_step(step)) for step in (0, 160, 480, 520)] == [(128, 384), (128, 384),
                                                                                  (640, 1408), (768, 2560)]
    # the warm-up runs each pair of windows at each forward size the timed region meets: one size on one GPU, and
    # at 8 ranks 1, 2, 3 micro-batches per forward by stage and 2 in validation, each twice under CUDA graphs
    assert tg.warm_up_forwards(s, tg.Packing((8, 8, 8), 8), 1, cuda_graphs=False) == {
        ((128, 384), 8): 1, ((384, 896), 8): 1, ((640, 1408), 8): 1, ((768, 1664), 8): 1, ((768, 2560), 8): 1}
    assert tg.warm_up_forwards(s, tg.Packing((1, 2, 3), 2), 8, cuda_graphs=True) == {
        ((128, 384), 1): 2, ((128, 384), 2): 2, ((384, 896), 2): 2, ((640, 1408), 2): 2, ((640, 1408), 3): 2,
        ((768, 1664), 3): 2, ((768, 2560), 2): 2}
    assert tg.warm_up_forwards(s, tg.Packing((1, 1, 1), 1), 8, cuda_graphs=True)[(640, 1408), 1] == 3
    with pytest.raises(tg.UserError, match="--extension_steps=-1 must be 0 or more"):
        tg.parse_cli(["--preset=tiny", "--extension_steps=-1"])


@pytest.mark.parametrize("adam_period, want", [(1, [True, True, False, False]),
                                               (2, [True, True, True, False])])  # step 2 only adds gradients up
def test_tied_embedding_follows_the_head_until_the_untie_step(tiny_data, adam_period, want):
    cfg = tiny_config(*tiny_data, num_iterations=4, tie_embed=1, untie_frac=0.5, adam_period=adam_period)
    schedule = tg.Schedule(cfg)
    assert schedule.untie_step == 2
    torch.manual_seed(0)
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    assert torch.equal(model.embed.weight, model.lm_head.weight) and model.lm_head.weight.std() < 0.01
    optimizers = tg.build_optimizers(model, cfg)
    same = []
    train_scheduled_steps(model, optimizers, cfg, 4,
                          after_step=lambda step: same.append(torch.equal(model.embed.weight, model.lm_head.weight)))
    assert same == want


def test_an_untie_before_adams_first_update_starts_both_states_fresh(tiny_data):
    """Untied at step 1, before Adam's first update (it steps on odd steps): the embedding gets a state of its own."""
    cfg = tiny_config(*tiny_data, num_iterations=2, tie_embed=1, untie_frac=0.5, adam_period=2)
    torch.manual_seed(0)
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    optimizers = tg.build_optimizers(model, cfg)
    train_scheduled_steps(model, optimizers, cfg, 2)
    adam = optimizers[1]
    assert adam.state[model.embed.weight]["step"].item() == 1 and adam.state[model.lm_head.weight]["step"].item() == 1
    assert not torch.equal(model.embed.weight, model.lm_head.weight)


def test_multi_token_weights_follow_the_stages():
    cfg = tg.Config(num_iterations=480, extension_steps=40, mtp_schedule="1,0.5,0.25>0/1,0.5>0/1")
    s = tg.Schedule(cfg)
    assert s.mtp_offsets == 3
    got = {step: s.mtp_weights(step) for step in (0, 80, 159, 160, 240, 320, 519)}
    assert got[0] == [1, 0.5, 0.25] and got[80] == [1, 0.5, 0.125] and 0 < got[159][2] < 0.002
    assert got[160] == [1, 0.5, 0] and got[240] == [1, 0.25, 0] and got[320] == [1, 0, 0] and got[519] == [1, 0, 0]
    assert tg.Schedule(tg.Config(mtp_schedule="")).mtp_weights(0) == [1.0]
    for bad, message in (("1,0.5/1", "one entry per stage"), ("1,x/1/1", "bad --mtp_schedule"),
                         ("0,1/1/1", "the next token's above 0")):
        with pytest.raises(tg.UserError, match=message):
            tg.parse_cli(["--preset=tiny", f"--mtp_schedule={bad}"])


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
    schedule, packing = tg.Schedule(cfg), tg.Packing((1, 1, 1), 1)
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


# ------------------------------------------------------------------------------------------ whole runs

def test_two_process_gloo_smoke_run(tiny_data, tmp_path):
    train, val = tiny_data
    result = run_cli(["--device=cpu", *TINY, f"--train_files={train}", f"--val_files={val}",
                      "--num_iterations=4", "--extension_steps=2", "--extension_windows=3:6", "--val_loss_every=2",
                      "--run_id=smoke"], cwd=tmp_path, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (tmp_path / "logs" / "smoke.txt").read_text()
    lines = log.splitlines()
    source = (REPO / "train_gpt.py").read_bytes()
    assert lines[1] == (f"==== code train_gpt.py sha256={hashlib.sha256(source).hexdigest()} "
                        f"lines={len(source.decode().splitlines())} ====")
    assert source.decode() in log
    assert "world_size: 2" in log and "==== config ====" in log and lines[-1] == "==== end ===="
    steps = [STEP_LINE.match(line) for line in lines if line.startswith("step:")]
    assert all(steps), [line for line in lines if line.startswith("step:")]
    assert [int(m.group(1)) for m in steps if m.group(3) is None] == [1, 2, 3, 4, 5, 6]
    val = {int(m.group(1)): float(m.group(4)) for m in steps if m.group(3)}
    assert sorted(val) == [0, 2, 4, 6] and all(math.isfinite(x) for x in val.values())
    assert val[6] < val[0] - 0.3  # it trained (Adam stepped on 3 of the 6 steps)
    assert re.search(r"^compile_time:[\d.]+s graphs:\d+ cache_hits:\d+ cache_misses:\d+ cache_bypasses:\d+"
                     r"( since_process_start:[\d.]+s)?$", log, re.M)
    assert "\ngraphs compiled in the timed region: 0\n" in log
    # 4 scheduled steps over the tiny preset's 3 stages, steps 1-2, 3 and 4, then the 2 extension steps
    counts = re.findall(r"^step times, stage (\d): (\d) steps, wall median [\d.]+ ms, slowest [\d.]+ ms at step \d", log, re.M)
    assert counts == [("0", "2"), ("1", "1"), ("2", "1"), ("3", "2")]
    assert re.findall(r"^rank 1: step times, stage (\d): (\d) steps, wall median", log, re.M) == counts


def test_step_times_flag_slow_steps_per_stage_and_time_garbage_collections():
    cfg = tg.Config(num_iterations=30, batch_schedule="8,16,24")  # stages: steps 1-10, 11-20, 21-30
    times = tg.StepTimes(tg.Schedule(cfg))
    try:
        for step in range(1, 31):
            stage = (step - 1) // 10
            times.add(step, 100.0 * (stage + 1) + (50.0 * (stage + 1) if step in (7, 25) else 0.0),
                      launch_ms=40.0 if step == 25 else 10.0)
        gc.collect()
        gc.collect(0)
    finally:
        times.close()
    gc.collect()  # after close(): not counted
    gpu_ms = {step: 90.0 * ((step - 1) // 10 + 1) + (45.0 if step == 7 else 0.0) for step in range(2, 31)}
    wall_lines = times.summary({})  # no GPU: judged by wall time
    assert wall_lines[0] == ("step times, stage 0: 10 steps, wall median 100.0 ms, slowest 150.0 ms at step 7 (1.50x); "
                             "1 over 1.2x the median; median launch 10.0 ms")
    assert wall_lines[1] == ("step times, stage 1: 10 steps, wall median 200.0 ms, slowest 200.0 ms at step 11 "
                             "(1.00x); 0 over 1.2x the median; median launch 10.0 ms")
    assert wall_lines[3] == "slow step 25: 1.50x its stage's wall median; wall 450.0 ms, launch 40.0 ms"
    lines = times.summary(gpu_ms)  # judged by GPU time: step 25's long wall time was the host's, step 7's the GPU's
    assert lines[0] == ("step times, stage 0: 10 steps, GPU median 90.0 ms, slowest 135.0 ms at step 7 (1.50x); "
                        "1 over 1.2x the median; wall median 100.0 ms, slowest 1.50x; median launch 10.0 ms")
    assert lines[2].startswith("step times, stage 2: 10 steps, GPU median 270.0 ms, slowest 270.0 ms at step 21 "
                               "(1.00x); 0 over 1.2x the median; wall median 300.0 ms, slowest 1.50x")
    assert lines[3] == "slow step 7: 1.50x its stage's GPU median; wall 150.0 ms, launch 10.0 ms, GPU 135.0 ms"
    collections = re.fullmatch(r"garbage collections after the warm-up: (\d+), [\d.]+ ms in all; longest [\d.]+ ms "
                               r"\(generation [012], step 31\)", lines[4])
    assert collections and int(collections.group(1)) >= 2, lines[4]  # two explicit ones, maybe automatic ones


def _train_on_rank(rank, world_size, cfg):
    comm = tg.Comm(rank, world_size)
    return tg.train(cfg, comm, tg.RunLog(cfg, comm)).train_losses


# The tiny model's defaults are compared at 1, 2, 4 and 8 processes below; these options at 1 and 2 (the later
# records' ideas, defaults of the full model, among them)
@pytest.mark.parametrize("extras", [tg.PLAIN, dict(adam_period=3, num_iterations=4, muon_slow_momentum=0.98),
                                    dict(paired_head_layers="0,1"),
                                    dict(xsa_layers="1,3", value_gate_reads_embed=1, doc_len_schedule="32,64,128"),
                                    dict(sublayer_scales=1, attn_input_from=1, muon_qk_blocks=2, mudd=1, token_gates=1,
                                         xsa_layers="1,3", bigram_dims=24, bigram_signs=16),
                                    dict(copy_pointer=1, copy_band=128, fp8_head=1, copy_sink_key=1, longest_match=1,
                                         head_wgrad_rows=4),
                                    # the gradients' dtype on the wire, not the fetched tables' rows (fp32)
                                    dict(bf16_grad_comms=1, table_row_fetch=0),
                                    dict(sparse_value_comms=1, num_iterations=4)],
                         ids=["plain", "adam_period_3_slow_momentum", "paired_short_and_long", "xsa_ve_gate_doc_lens",
                              "sublayer_scales_mudd_token_gates_bigram_signs",
                              "copy_pointer_fp8_head_longest_match_head_wgrad_rows",
                              "bf16_grad_comms", "sparse_value_comms"])
def test_world_size_1_and_2_give_the_same_losses(tiny_data, tmp_path, extras):
    """Also what the gradients travel as: fp32, or bf16 with --bf16_grad_comms (the reduce-scatters, and the bigram
    rows in the sparse exchange), where gloo sums the two ranks' bf16 gradients in bf16: 7e-6 apart from one rank's
    losses, within the same rtol."""
    cfg = tiny_config(*tiny_data, **{**dict(num_iterations=3), **extras}, val_loss_every=0, log_dir=str(tmp_path),
                      run_id="w1", micro_batch_tokens=128)
    single = tg.train(cfg, tg.Comm(), tg.RunLog(cfg, tg.Comm())).train_losses
    (two, sent), (two_again, _) = run_on_ranks(_train_noting_gradient_dtypes_on_rank, 2,
                                               dataclasses.replace(cfg, run_id="w2"))
    assert len(single) == cfg.num_iterations and two == two_again
    assert sent == {torch.bfloat16 if cfg.bf16_grad_comms else torch.float32}, sent
    assert single[0] > single[-1]  # it trained
    np.testing.assert_allclose(two, single, rtol=1e-5)


def test_one_rank_rounds_its_gradients_as_they_would_travel():
    """--bf16_grad_comms at world size 1: Muon's and Adam's updates start from the bf16-rounded gradients, as on
    several ranks, so a one-GPU run learns as a multi-GPU one."""
    grad = torch.full((4, 8), 1 + 2 ** -10)  # between two bf16 values
    rounded = grad.to(torch.bfloat16).float()
    assert not torch.equal(rounded, grad)
    for grad_dtype, want in ((None, grad), (torch.bfloat16, rounded)):
        matrix, table = torch.nn.Parameter(torch.zeros(4, 8)), torch.nn.Parameter(torch.zeros(4, 8))
        matrix.grad, table.grad = grad.clone(), grad.clone()
        muon = tg.Muon([dict(params=[matrix])], lr=0.01, momentum=0.9, grad_dtype=grad_dtype)
        adam = tg.DistAdam([dict(params=[table])], lr=0.01, grad_dtype=grad_dtype)
        muon._launch_reduce(muon.groups[0])
        adam._launch_reduce(adam.units[0])
        assert torch.equal(muon.groups[0].pending[1].float()[0], want)
        assert torch.equal(adam.units[0].pending().view(4, 8), want)


def _table_gather_dtypes_on_rank(rank, world_size, cfg, compute_dtype):
    model = tg.GPT(cfg, tg.SdpaAttention(), compute_dtype)
    _, adam = tg.build_optimizers(model, cfg)
    names = {p: name for name, p in model.named_parameters()}
    return {names[b.params[0]]: b.gather_dtype for b in adam.buckets if b.gather_dtype is not None}


def test_bf16_table_gathers_send_the_value_and_bigram_tables_in_the_compute_dtype(tiny_data, tmp_path):
    """Only the tables the forward reads as rows cast to the compute dtype, and only where that is narrower than
    their fp32 (a GPU's bf16; on the CPU's fp32 nothing changes)."""
    cfg = tiny_config(*tiny_data, bf16_table_gathers=1, log_dir=str(tmp_path))
    assert cfg.bigram_rows and cfg.value_embed_layout.strip(".")
    tables = {f"value_embeds.{i}.weight" for i in range(len(tg.GPT(cfg, tg.SdpaAttention(), torch.float32).value_embeds))}
    for compute_dtype, want in ((torch.bfloat16, tables | {"bigram_embed.weight"}), (torch.float32, set())):
        for gathered in run_on_ranks(_table_gather_dtypes_on_rank, 2, cfg, compute_dtype):
            assert gathered == dict.fromkeys(want, compute_dtype)
    assert _table_gather_dtypes_on_rank(0, 1, cfg, torch.bfloat16) == {}  # one rank gathers nothing
    for refused in (dict(diloco=1), dict(tail_ema_from=0.5, tail_ema_all=1)):
        with pytest.raises(tg.UserError, match="--bf16_table_gathers"):
            tg.validate_config(dataclasses.replace(cfg, **refused))


def _train_noting_row_fetches_on_rank(rank, world_size, cfg):
    """Train and validate with every DistAdam bucket updated alone (MERGE 0: the tiny tables are under MERGE, and a
    table fetched by rows stays out of the merged buckets, whose multi-tensor update rounds otherwise), noting each
    fetch's (table rows, rows asked of their owners)."""
    tg.DistAdam.MERGE = 0
    fetches = []
    ask = tg._RowFetch.ask

    def noted(self):
        fetches.append((self.tables[0].size(0), len(self.send_rows)))
        return ask(self)
    tg._RowFetch.ask = noted
    comm = tg.Comm(rank, world_size)
    result = tg.train(cfg, comm, tg.RunLog(cfg, comm))
    return result.train_losses, result.val_losses, fetches


def test_tables_fetched_by_rows_train_as_tables_gathered_whole(tiny_data, tmp_path):
    """--table_row_fetch (a default, so the runs at 1, 2, 4 and 8 processes above fetch too) against the dense
    all-gathers at 2 gloo processes: after each Adam update a rank fetches the value and bigram table rows its forwards
    read until the next one, and nothing else of them. Every forward reads the owners' values, so the losses and the
    final weights are bit-equal; a validation between two updates reads the tables gathered whole (Adam updates after
    steps 1, 3 and 5; validation after step 3). The last update, with no forward after it, fetches nothing."""
    cfg = tiny_config(*tiny_data, num_iterations=6, val_loss_every=3, log_dir=str(tmp_path), micro_batch_tokens=128)
    runs = {fetch: run_on_ranks(_train_noting_row_fetches_on_rank, 2, dataclasses.replace(
        cfg, table_row_fetch=fetch, run_id=f"f{fetch}", save_checkpoint=str(tmp_path / f"f{fetch}.pt")))
        for fetch in (0, 1)}
    dense_losses, dense_val, no_fetches = runs[0][0]
    assert not no_fetches and dense_losses[-1] < dense_losses[0]
    for rank, (losses, val, fetches) in enumerate(runs[1]):
        assert (losses, val) == (dense_losses, dense_val), rank
        # two updates fetch (after steps 1 and 3), each for two groups: the value tables' rows and the bigram table's
        assert sorted({rows for rows, _ in fetches}) == sorted({VOCAB, cfg.bigram_rows}) and len(fetches) == 4, fetches
        # the tiny vocabulary's other ranks' rows are all read in two steps; most of the bigram table's are not
        assert all(0 < asked <= rows // 2 and (rows == VOCAB or asked < rows // 4) for rows, asked in fetches), (
            rank, fetches)
    weights = [torch.load(tmp_path / f"f{fetch}.pt", weights_only=True)["model"] for fetch in (0, 1)]
    assert sorted(weights[0]) == sorted(weights[1])
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    # runs that read whole tables between updates gather them whole
    assert tg.fetches_table_rows(dataclasses.replace(cfg, table_row_fetch=1))
    for whole in (dict(diloco=1), dict(tail_ema_from=0.5, tail_ema_all=1), dict(tail_ema_from=0.5, tail_ema_kinds=1)):
        assert not tg.fetches_table_rows(dataclasses.replace(cfg, table_row_fetch=1, **whole)), whole


def _train_noting_gradient_dtypes_on_rank(rank, world_size, cfg):
    """Train, noting the dtypes of the floating-point tensors this rank sent in reduce-scatters and all-to-alls."""
    sent = set()

    def noting(collective):
        def noted(output, tensor, *args, **kwargs):
            if tensor.is_floating_point():
                sent.add(tensor.dtype)
            return collective(output, tensor, *args, **kwargs)
        return noted
    tg.dist.reduce_scatter_tensor = noting(tg.dist.reduce_scatter_tensor)
    tg.dist.all_to_all_single = noting(tg.dist.all_to_all_single)
    return _train_on_rank(rank, world_size, cfg), sent


def assert_same_tensors(got, want, rtol: float, where: str, looser: dict | None = None):
    """Nested dicts of tensors (and plain values) with the same keys: each tensor within rtol of its counterpart
    in norm (||got - want|| <= rtol ||want||), each plain value equal. looser: {key: rtol} for what is under those
    keys."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), (where, sorted(got), sorted(want))
        for key in want:
            assert_same_tensors(got[key], want[key], (looser or {}).get(key, rtol), f"{where}, {key}", looser)
    elif isinstance(want, torch.Tensor):
        assert got.shape == want.shape and got.dtype == want.dtype, where
        error = (got.double() - want.double()).norm().item()
        assert error <= rtol * want.double().norm().item(), (where, error, want.double().norm().item())
    else:
        assert got == want, (where, got, want)


def _train_and_note_ownership_on_rank(rank, world_size, cfg):
    """Train and validate, noting what this rank owned in the optimizers' steps (the warm-up's included): the
    bigram rows it received in each sparse exchange, and the real (not padding) Muon matrices it orthogonalised in
    each group's step."""
    owned = dict(bigram_rows=[], muon_matrices=[])
    launch, owned_updates = tg._RowExchange.launch, tg.Muon._owned_updates

    def noted_launch(self, grad, *args):
        finish = launch(self, grad, *args)  # it waited for the row counts
        owned["bigram_rows"].append(int(self.recv_counts.sum()))
        return finish

    def noted_owned_updates(self, group, grads):
        owned["muon_matrices"].append(len(group.params[self.rank * group.per_rank: (self.rank + 1) * group.per_rank]))
        return owned_updates(self, group, grads)
    tg._RowExchange.launch, tg.Muon._owned_updates = noted_launch, noted_owned_updates
    return _train_and_validate_on_rank(rank, world_size, cfg), owned


def test_world_sizes_1_2_4_and_8_give_the_same_losses_and_states(tiny_data, tmp_path):
    """The tiny model's defaults at 1, 2, 4 and 8 gloo processes in fp32 (one micro-batch per forward at 1 and 2,
    auto's packing by stage at 4 and 8): the same training loss at every step,
    the same final validation loss, and the same weights and optimizer states at the end. Each step's micro-batches
    are split over the ranks, and every optimizer averages its gradients over them (train_step), so the updates are
    the same math at any world size, up to summation order. 4 steps (0-3) of 8, 8, 8 and 16 micro-batches: 1 or 2
    a rank at 8 processes; Adam (period 2) adds steps 0 and 2 to steps 1 and 3, their sparse bigram rows too, and
    the embedding unties at step 3.
    The states are compared in the end's checkpoints (gathered from the shards, so the same at every world size).
    The losses alone would miss a lost average: Adam's and Muon's updates do not change when every gradient of a
    tensor is scaled alike (up to their epsilons), but its moments do, by the world size.

    At 8 ranks every distributed piece has something to do on every rank: DistAdam's reduce-scatters and
    all-gathers (each table 1/8 a rank, the scalars' bucket padded), the bigram table's sparse exchange (each
    rank owns 512 of its 4096 rows and receives some in every exchange), and Muon's sharding, whose 12 matrices of one
    shape make one group padded to 16 at 8 ranks: ranks 0-5 own 2 each, ranks 6 and 7 only padding (they
    orthogonalise nothing and still join the all-gather)."""
    cfg = tiny_config(*tiny_data, num_iterations=4, val_loss_every=0, log_dir=str(tmp_path), run_id="w1",
                      micro_batch_tokens=128, save_checkpoint=tmp_path / "w1.pt")
    single = tg.train(cfg, tg.Comm(), tg.RunLog(cfg, tg.Comm()))
    reference = torch.load(tmp_path / "w1.pt", weights_only=True)
    assert len(single.train_losses) == 4 and [step for step, _ in single.val_losses] == [4]
    assert single.train_losses[0] > single.train_losses[-1]  # it trained
    # rtol 1e-5, as at 1 and 2 processes: the world sizes differ only in the order of fp32 sums (a step's gradient
    # summed over micro-batches in one process's backward, or over ranks in the reduce-scatters; validation's
    # total over ranks in the all-reduce), up to 1.1e-7 here at 8 processes. A lost average or a rank's data
    # missing is off by orders of magnitude more.
    # At 4 and 8 processes the ranks pack their micro-batches as auto does, by stage: 2, 2, 4 at 4 (4 in validation);
    # 1, 1, 2 at 8 (2 in validation), as 1, 2, 3 at 8 GPUs with the default schedule. At 2 one a forward: auto's 4
    # there left block 0's MLP weights 1.3e-5 apart (its momentum 7.4e-6, every other matrix's under 2e-6), a
    # summation order's difference grown in one matrix; test_packed_forwards_train_as_separate_ones packs at 2.
    packing = {2: "1 micro-batch(es)", 4: "2, 2, 4 micro-batches by stage (4 in validation)",
               8: "1, 1, 2 micro-batches by stage (2 in validation)"}
    for world_size in (2, 4, 8):
        ranks = run_on_ranks(_train_and_note_ownership_on_rank, world_size, dataclasses.replace(
            cfg, run_id=f"w{world_size}", save_checkpoint=str(tmp_path / f"w{world_size}.pt"),
            forward_micro_batches=0 if world_size > 2 else 1))
        log = (tmp_path / f"w{world_size}.txt").read_text()
        assert f"world size {world_size}, {packing[world_size]} of 128 tokens" in log
        (train_losses, val_losses), _ = ranks[0]
        assert all(losses == (train_losses, val_losses) for losses, _ in ranks)
        np.testing.assert_allclose(train_losses, single.train_losses, rtol=1e-5, err_msg=f"world size {world_size}")
        assert [step for step, _ in val_losses] == [4]
        np.testing.assert_allclose(val_losses[0][1], single.val_losses[0][1], rtol=1e-5,
                                   err_msg=f"world size {world_size}")
        # Weights and states per tensor at 1e-5 too (measured up to 2.2e-6), but the smear gate's 12 weights: they
        # start at zero, and one's gradient is far below Adam's eps (root of exp_avg_sq 5e-11, eps 1e-8), where the
        # update is proportional to the gradient itself, a sum that cancels down to 1e-11 and whose last digits
        # follow the summation order (measured 1.4e-5 at 2 processes, 7e-6 at 4 and 8).
        checkpoint = torch.load(tmp_path / f"w{world_size}.pt", weights_only=True)
        for part in ("adam", "muon", "model"):  # the moments first: they name the tensor a lost average scaled
            assert_same_tensors(checkpoint[part], reference[part], 1e-5, f"world size {world_size}, {part}",
                                looser={"smear_gate_w": 1e-4})
        for rank, (_, owned) in enumerate(ranks):
            assert owned["bigram_rows"] and min(owned["bigram_rows"]) > 0, (world_size, rank, owned)
        if world_size == 8:
            assert [set(owned["muon_matrices"]) for _, owned in ranks] == [{2}] * 6 + [{0}] * 2


def _launched_before_step_on_rank(rank, world_size, cfg):
    """For every optimizer step of a run (launch_step, which Optimizers.step calls): had all of that optimizer's
    reduce-scatters been launched?"""
    launched = []
    for cls, units in ((tg.DistAdam, "units"), (tg.Muon, "groups")):
        def checked(self, _launch=cls.launch_step, _units=units):
            if not getattr(self, "accumulating", False):  # an accumulating Adam step sends nothing
                launched.append((type(self).__name__, all(unit.pending is not None for unit in getattr(self, _units))))
            return _launch(self)
        cls.launch_step = checked
    _train_on_rank(rank, world_size, cfg)
    return launched


def test_every_reduce_scatter_is_on_the_wire_before_the_optimizers_step(tiny_data, tmp_path):
    """The embedding tables' row gradients are written into .grad by _RowLookup, which hands autograd none: their
    post-accumulate hooks must still fire, launching the reduce-scatter from the backward instead of leaving it
    to DistAdam.step() (Muon steps first, and the largest transfer would not overlap its Newton-Schulz)."""
    cfg = tiny_config(*tiny_data, num_iterations=2, val_loss_every=0, log_dir=str(tmp_path), micro_batch_tokens=128)
    for launched in run_on_ranks(_launched_before_step_on_rank, 2, cfg):
        assert {name for name, _ in launched} == {"DistAdam", "Muon"}
        assert all(everything for _, everything in launched), launched


def test_packed_forwards_train_as_separate_ones(tiny_data, tmp_path):
    """Micro-batches packed into one forward (--forward_micro_batches; auto packs up to 4, or 8 on a large GPU,
    per stage as the counts allow) give the training and validation losses of one forward each, at 1 process, at 2
    and at 4 with a different size by stage, and the logs say how many were packed. Validation chunks do not start at a BOS: packed, each must still see only its own
    tokens."""
    cfg = tiny_config(*tiny_data, num_iterations=3, val_loss_every=3, log_dir=str(tmp_path), micro_batch_tokens=128)
    results = {}
    for packed in (1, 2, 4):
        run_cfg = dataclasses.replace(cfg, forward_micro_batches=packed, run_id=f"packed{packed}")
        results[packed] = tg.train(run_cfg, tg.Comm(), tg.RunLog(run_cfg, tg.Comm()))
        log = (tmp_path / f"packed{packed}.txt").read_text()
        assert f"{packed} micro-batch(es) of 128 tokens per forward" in log
    two = run_on_ranks(_train_and_validate_on_rank, 2, dataclasses.replace(cfg, forward_micro_batches=0, run_id="two"))
    assert "world size 2, 4 micro-batch(es) of 128 tokens per forward" in (tmp_path / "two.txt").read_text()
    # at 4 ranks auto packs each stage as its micro-batches per rank allow, 2, 2 and 3 (of 2, 2 and 6), and the
    # validation's 4 at 2, a training size
    mixed = dataclasses.replace(cfg, batch_schedule="8,8,24")
    one_each = tg.train(dataclasses.replace(mixed, run_id="one_each"), tg.Comm(), tg.RunLog(mixed, tg.Comm()))
    four = run_on_ranks(_train_and_validate_on_rank, 4, dataclasses.replace(mixed, forward_micro_batches=0,
                                                                             run_id="four"))
    assert ("world size 4, 2, 2, 3 micro-batches by stage (2 in validation) of 128 tokens per forward"
            in (tmp_path / "four.txt").read_text())
    runs = [(results[1], [(r.train_losses, r.val_losses) for r in (results[2], results[4])] + [two[0]]),
            (one_each, [four[0]])]
    for separate, packed_runs in runs:
        assert len(separate.train_losses) == 3 and len(separate.val_losses) == 2
        for train_losses, val_losses in packed_runs:
            np.testing.assert_allclose(train_losses, separate.train_losses, rtol=1e-5)
            assert [step for step, _ in val_losses] == [step for step, _ in separate.val_losses]
            np.testing.assert_allclose([v for _, v in val_losses], [v for _, v in separate.val_losses], rtol=1e-5)


@pytest.mark.parametrize("extras", [{}, tg.PLAIN, dict(paired_head_layers="0,1"),
                                    dict(sublayer_scales=1, attn_input_from=1, xsa_layers="1,3", mudd=1, bigram_dims=24,
                                         bigram_signs=16)],
                         ids=["defaults", "plain", "paired_heads", "sublayer_scales_xsa_mudd_bigram_signs"])
def test_a_packed_forward_computes_the_losses_of_separate_ones(tiny_data, extras):
    """Two validation chunks (the second starts mid-document) in one forward against one forward each, with random
    weights so that attention carries signal: the same mean loss. A packed forward must not let the second
    chunk attend to the first."""
    cfg = tiny_config(*tiny_data, micro_batch_tokens=128, **extras)
    torch.manual_seed(0)
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32, forward_micro_batches=2)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:  # matrices, tables and gate weights
                p.normal_(0, 0.1)
        if model.smear_scale is not None:  # the smear on, so that a packed forward could leak through it
            model.smear_scale.fill_(1.0)
        if model.mtp_weights.numel() > 1:  # predictions of later tokens too, which must stay in their micro-batch
            model.set_mtp_weights([1.0, 0.5, 0.25])
    windows = list(tg.val_batches_for_rank(tg.shard_paths(cfg.val_files, "val_files"), cfg, tg.Comm()))[:2]
    assert windows[1][0] != BOS  # the second chunk starts mid-document
    losses = {}
    for packed in (1, 2):
        batches = tg.Prefetcher(iter(windows), 128, torch.device("cpu"), bigram_rows=cfg.bigram_rows, packed=packed,
                                 bos=BOS)
        try:
            with torch.no_grad():
                losses[packed] = sum(tg.forward_loss(model, batches.next(), (64, 128)).item()
                                     for _ in range(2 // packed)) / (2 // packed)
        finally:
            batches.close()
    assert losses[2] == pytest.approx(losses[1], rel=1e-6)


def _train_and_validate_on_rank(rank, world_size, cfg):
    comm = tg.Comm(rank, world_size)
    result = tg.train(cfg, comm, tg.RunLog(cfg, comm))
    return result.train_losses, result.val_losses


def test_forward_micro_batches_must_divide_the_counts_and_auto_packs_each_stage(tiny_data):
    cfg = tiny_config(*tiny_data, forward_micro_batches=3)
    with pytest.raises(tg.UserError, match=r"--forward_micro_batches=3 must divide the micro-batches per rank at 1 "
                                           r"process\(es\) \(stage 0: 8, stage 1: 8, stage 2: 16, validation: 8\)"):
        tg.resolve_packing(cfg, 1)
    assert tg.resolve_packing(dataclasses.replace(cfg, forward_micro_batches=2), 2) == tg.Packing((2, 2, 2), 2)
    auto = dataclasses.replace(cfg, forward_micro_batches=0)
    assert tg.resolve_packing(auto, 1) == tg.Packing((4, 4, 4), 4)  # no GPU memory known: up to 4
    assert tg.resolve_packing(auto, 1, device_memory_gib=40.0) == tg.Packing((4, 4, 4), 4)
    assert tg.resolve_packing(auto, 1, device_memory_gib=79.6) == tg.Packing((8, 8, 8), 8)  # an 80 GB H100
    assert tg.resolve_packing(auto, 2, device_memory_gib=79.6) == tg.Packing((4, 4, 8), 4)  # 4, 4, 8 per rank
    # the default schedule (8, 16, 24) on 4 and on 8 GPUs: each stage in one forward; validation (bench2's 128
    # micro-batches) at the largest stage size that divides its share, so it runs a training graph
    default = dataclasses.replace(auto, batch_schedule="8,16,24", val_tokens=128 * auto.micro_batch_tokens)
    assert tg.resolve_packing(default, 4, device_memory_gib=79.6) == tg.Packing((2, 4, 6), 4)
    assert tg.resolve_packing(default, 8, device_memory_gib=79.6) == tg.Packing((1, 2, 3), 2)
    assert tg.resolve_packing(default, 8, device_memory_gib=79.6).describe() == (
        "1, 2, 3 micro-batches by stage (2 in validation)")
    # no stage size divides the validation's 5 per rank: its own, the most that does
    odd = dataclasses.replace(default, val_tokens=20 * auto.micro_batch_tokens)
    assert tg.resolve_packing(odd, 4, device_memory_gib=79.6) == tg.Packing((2, 4, 6), 5)
    assert tg.resolve_packing(odd, 4) == tg.Packing((2, 4, 3), 1)


def test_out_of_memory_in_the_warm_up_names_the_flags(tiny_data, tmp_path, monkeypatch, capsys):
    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    monkeypatch.setattr(tg, "warm_up", out_of_memory)
    train, val = tiny_data
    assert tg.main(["--device=cpu", *TINY, f"--train_files={train}", f"--val_files={val}",
                    f"--log_dir={tmp_path}", "--forward_micro_batches=0"]) == 1
    assert capsys.readouterr().err.strip() == (
        "error: out of GPU memory in the warm-up, with up to 4 micro-batch(es) of 256 tokens per forward (CUDA out of "
        "memory. Tried to allocate 2.00 GiB): lower --forward_micro_batches or --micro_batch_tokens")


def table_grads_after_two_forwards(cfg, device, dtype, windows):
    """Losses of two forwards (each followed by its backward) of a model whose matrices are random, and the
    embedding tables' gradients accumulated over both."""
    torch.manual_seed(0)
    model = tg.GPT(cfg, tg.SdpaAttention(), dtype, kernels=tg.choose_kernels(cfg, device)).to(device)
    with torch.no_grad():  # leave the zero init, so that gradients reach the tables
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.02)
    batches = tg.prefetch(tg.dummy_batches(cfg, seed=1), cfg, device, packed=1)
    model.prepare_grads()
    losses = []
    try:
        for _ in range(2):
            loss = tg.forward_loss(model, batches.next(), windows)
            loss.backward()
            losses.append(loss.item())
    finally:
        batches.close()
    return losses, [p.grad.clone() for p in model.embedding_tables()]


def test_row_embedding_grads_equal_dense_ones(tiny_data, tmp_path):
    """--row_embedding_grads=1 (looked-up rows' gradients added into a kept dense .grad) against the dense
    gradients: the same table gradients after two forwards, and the same losses over three steps at world
    size 2."""
    cfg = tiny_config(*tiny_data, num_iterations=3, val_loss_every=0, log_dir=str(tmp_path), micro_batch_tokens=128)
    grads, losses = {}, {}
    for rows in (False, True):
        run_cfg = dataclasses.replace(cfg, row_embedding_grads=rows, run_id=f"rows{int(rows)}")
        _, grads[rows] = table_grads_after_two_forwards(run_cfg, torch.device("cpu"), torch.float32, (32, 64))
        assert all(not g.is_sparse for g in grads[rows])
        losses[rows] = run_on_ranks(_train_on_rank, 2, run_cfg)[0]
    assert any(g.abs().sum() > 0 for g in grads[False])
    for dense, rows in zip(grads[False], grads[True]):
        torch.testing.assert_close(rows, dense, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)


def test_check_and_help_flags(tiny_data, tmp_path, monkeypatch, capsys):
    train, val = tiny_data
    monkeypatch.chdir(tmp_path)
    code = tg.main(["--device=cpu", *TINY, f"--train_files={train}", f"--val_files={val}", "--check"])
    assert code == 0 and capsys.readouterr().out.startswith("ok:") and not (tmp_path / "logs").exists()
    code = tg.main(["--device=cpu", *TINY, f"--train_files={train}", f"--val_files={val}", "--val_tokens=1048576",
                    "--check"])
    assert code == 1 and "fewer than --val_tokens=1,048,576" in capsys.readouterr().err
    code = tg.main(["--help"])
    usage = capsys.readouterr().out
    assert code == 0 and "--num_iterations=1270" in usage and "--compile_cache=" in usage


def test_every_config_field_has_a_group_and_one_line_of_help_that_help_prints():
    fields = dataclasses.fields(tg.Config)
    for f in fields:
        text = f.metadata.get("help", "")
        assert text.strip() and "\n" not in text and len(text) <= 100, f"--{f.name} needs one line of help"
        assert f.metadata.get("group") in tg.CONFIG_GROUPS, f"--{f.name} needs a group of {tg.CONFIG_GROUPS}"
    order = [tg.CONFIG_GROUPS.index(f.metadata["group"]) for f in fields]
    assert order == sorted(order), "a group's fields stand together, the groups in CONFIG_GROUPS' order"
    # --help: a header per group, then each of its fields as --name=default and its help (on the next line after a
    # long flag)
    listed, group, lines = {}, None, tg.config_help().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(":") and not line.startswith(" "):
            group = line[:-1]
        elif line.startswith("  --"):
            flag, _, text = line.strip().partition("  ")
            listed[flag[2:].partition("=")[0]] = (group, (text or lines[i + 1]).strip(), flag)
    assert {name: entry[:2] for name, entry in listed.items()} == {
        f.name: (f.metadata["group"], f.metadata["help"]) for f in fields}
    # every printed default is a valid flag value
    assert tg.parse_cli([flag for _, _, flag in listed.values()])[0] == tg.Config()


def _main_then_imported(argv, modules):
    assert tg.main(argv) == 0
    return [name for name in modules if name in sys.modules]


def test_torchft_is_not_imported_without_diloco(tiny_data, tmp_path):
    """torchft is an optional dependency: a run without --diloco never imports it."""
    train, val = tiny_data
    argv = ["--device=cpu", *TINY, "--num_iterations=1", "--val_loss_every=0", f"--train_files={train}",
            f"--val_files={val}", f"--log_dir={tmp_path}"]
    assert run_forked(_main_then_imported, argv, ["torchft", "train_gpt"]) == ["train_gpt"]


def test_run_sh_checks_before_launching(tmp_path, tiny_data):
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine run.sh would launch a real run")
    (tmp_path / "notes.bin").write_bytes(b"not tokens" * 200)
    train, val = tiny_data
    cases = {  # started together: each is mostly a Python start and torch's import
        "no_cuda": ([], {}),
        "missing": (["--device=cpu", "--train_files=nowhere/*.bin"], {}),
        "bad": (["--device=cpu", "--preset=tiny", f"--train_files={tmp_path / '*.bin'}"], {}),
        "three": (["--device=cpu", *TINY, f"--train_files={train}", f"--val_files={val}"], {"NPROC": "3"}),
    }
    procs = {name: subprocess.Popen(["bash", str(REPO / "run.sh"), *args], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=dict(os.environ, **env))
             for name, (args, env) in cases.items()}
    outputs = {name: proc.communicate(timeout=120) for name, proc in procs.items()}
    done = {name: (procs[name].returncode, *outputs[name]) for name in procs}
    code, _, err = done["no_cuda"]
    assert code == 1 and err.strip() == ("error: --device=cuda, but torch sees no CUDA GPU; pass --device=cpu to run on "
                                         "the CPU")
    code, _, err = done["missing"]
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "matches no files" in err and "data/cached_fineweb10B.py 9" in err
    code, _, err = done["bad"]
    assert code == 1 and "notes.bin: not a token shard" in err  # rejected before any launch
    code, out, err = done["three"]
    assert code == 1 and "launching" not in out and err.strip() == (
        "error: NPROC=3: use 1, 2, 4 or 8 (every stage's batch splits evenly over those)")


def test_cuda_graph_modes_give_every_parameter_a_kept_gradient_and_mark_each_forward(tiny_data, monkeypatch):
    """Under CUDA graphs (compile_mode reduce-overhead or max-autotune) a first micro-batch's gradient must not
    become .grad itself (the next replay would overwrite it): every parameter starts the step with zeros. Each
    forward marks a new step for the graphs there, and only there (elsewhere the mark would import inductor's graph
    trees into a CPU run)."""
    cfg = tiny_config(*tiny_data, row_embedding_grads=1)
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    batches = tg.prefetch(tg.dummy_batches(cfg, seed=1), cfg, torch.device("cpu"), packed=1)
    for replays, expected in ((True, "all"), (False, "tables")):
        model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
        model.replays_cuda_graphs = replays
        model.prepare_grads()
        tables = {id(p) for p in model.embedding_tables()}
        for p in model.parameters():
            has_zeros = p.grad is not None and not p.grad.any()
            assert has_zeros == (expected == "all" or id(p) in tables), (replays, p.shape)
        marks.clear()
        with torch.no_grad():
            tg.forward_loss(model, batches.next(), (64, 128))
        assert len(marks) == replays, (replays, marks)
    batches.close()


def test_every_parameter_reaches_the_loss(tiny_data):
    """One forward and backward give every parameter a gradient (the tables get theirs from prepare_grads, which
    the row gradients add into), in the tiny model with a layer without attention, MUDD's last layer and the token
    gates: a parameter the loss never reads would only weigh on the optimizers, their communication and the
    checkpoints. Its gradient is not None, not necessarily non-zero: at the first step some factor of it is zero."""
    cfg = tiny_config(*tiny_data, attn_layout="S-SL", sublayer_scales=1, attn_input_from=1, mudd=1, token_gates=1,
                      xsa_layers="0,3")
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    batches = tg.prefetch(tg.dummy_batches(cfg, seed=1), cfg, torch.device("cpu"), packed=1)
    model.prepare_grads()
    tables = {id(p) for p in model.embedding_tables()}
    assert all(p.grad is None for p in model.parameters() if id(p) not in tables)
    tg.forward_loss(model, batches.next(), (64, 128)).backward()
    batches.close()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []


def test_auto_compile_mode_uses_cuda_graphs_where_they_paid(tiny_data):
    """CUDA graphs on a GPU where a stage runs one micro-batch per forward (all of the run then), with any attention;
    never where every forward is bigger, on a CPU or under DiLoCo; an explicit mode as asked."""
    cfg = tiny_config(*tiny_data)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert cfg.compile_mode == "auto"

    def mode(packed, config=cfg, device=cuda):
        return tg.resolve_compile_mode(config, device, tg.Packing((packed,) * 3, packed))

    assert mode(1) == "reduce-overhead"
    assert tg.resolve_compile_mode(cfg, cuda, tg.Packing((1, 2, 3), 2)) == "reduce-overhead"  # 8 GPUs' stages
    assert mode(2) == mode(8) == "default"
    assert tg.resolve_compile_mode(cfg, cuda, tg.Packing((2, 4, 6), 4)) == "default"  # 4 GPUs' stages
    assert mode(1, device=cpu) == "default"
    assert mode(1, config=dataclasses.replace(cfg, diloco=True)) == "default"
    assert mode(1, config=dataclasses.replace(cfg, attn_backend="fa3")) == "reduce-overhead"
    explicit = dataclasses.replace(cfg, compile_mode="max-autotune-no-cudagraphs")
    assert mode(1, config=explicit) == "max-autotune-no-cudagraphs"
    for asked in tg.CUDA_GRAPH_MODES:
        graphs = dataclasses.replace(cfg, compile=True, compile_mode=asked)
        assert mode(8, config=graphs) == asked


@pytest.mark.parametrize("mode", tg.CUDA_GRAPH_MODES)
def test_fa3_under_cuda_graphs_is_taken_and_auto_takes_graphs_with_fa3_at_one_micro_batch_per_forward(tiny_data, mode):
    """An explicit CUDA-graph --compile_mode with --attn_backend=fa3 is taken as asked (FA3 takes its window and
    lengths as ints); auto takes graphs with FA3 as with flex: at one micro-batch per forward, not at two."""
    train, val = tiny_data
    cfg, _ = tg.parse_cli([*TINY, f"--train_files={train}", f"--val_files={val}", "--compile=1", "--attn_backend=fa3",
                           f"--compile_mode={mode}"])
    cuda = torch.device("cuda", 0)

    def replays(config, device, packed):  # as compile_model marks the model
        packing = tg.Packing((packed,) * 3, packed)
        return config.compile and tg.resolve_compile_mode(config, device, packing) in tg.CUDA_GRAPH_MODES

    assert replays(cfg, cuda, 2)
    auto = dataclasses.replace(cfg, compile_mode="auto")
    assert replays(auto, cuda, 1)
    assert not replays(auto, cuda, 2)
    assert not replays(auto, torch.device("cpu"), 1)


def test_muon_graphs_on_a_cpu_is_refused_in_one_line_and_auto_takes_them_on_several_cuda_ranks(tiny_data):
    """--muon_graphs=1 needs CUDA graphs: on a CPU one line names the flag and the device; on CUDA it is taken.
    auto, the default, takes them on CUDA at more than one rank only; an unknown value is refused in one line."""
    train, val = tiny_data
    args = [*TINY, f"--train_files={train}", f"--val_files={val}"]
    with pytest.raises(tg.UserError, match=r"^--muon_graphs=1 needs --device=cuda .*on cpu pass --muon_graphs=0"):
        tg.parse_cli([*args, "--muon_graphs=1", "--device=cpu"])
    with pytest.raises(tg.UserError, match=r"^--muon_graphs=yes: use auto, 1 or 0$"):
        tg.parse_cli([*args, "--muon_graphs=yes", "--device=cpu"])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for flag, device, world_size, want in [("auto", cpu, 8, False), ("auto", cuda, 1, False), ("auto", cuda, 2, True),
                                           ("auto", cuda, 8, True), ("0", cuda, 8, False), ("1", cuda, 1, True)]:
        cfg, _ = tg.parse_cli([*args, f"--muon_graphs={flag}", f"--device={device.type}"])
        assert tg.uses_muon_graphs(cfg, device, world_size) == want, (flag, device, world_size)


def test_auto_attention_takes_fa3_where_it_imports_else_flex_on_cuda_and_sdpa_on_a_cpu(tiny_data, monkeypatch):
    """--attn_backend=auto takes FA3 on CUDA when it imports (with or without CUDA graphs: make_attention is not
    told), flex on CUDA when it does not, SDPA on a CPU; an explicit FA3 that does not import is one line."""
    monkeypatch.setattr(tg, "FlexAttention", lambda seq_len, device: "flex")  # builds on the GPU: a stand-in
    cfg = tiny_config(*tiny_data)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # None in sys.modules: the import fails
    assert tg.make_attention(cfg, cuda, 128) == "flex"
    with pytest.raises(tg.UserError, match=r"^--attn_backend=fa3 but flash_attn_interface does not import"):
        tg.make_attention(dataclasses.replace(cfg, attn_backend="fa3"), cuda, 128)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", types.ModuleType("flash_attn_interface"))
    assert tg.make_attention(cfg, cuda, 128).name == "fa3"
    assert tg.make_attention(dataclasses.replace(cfg, attn_backend="fa3"), cuda, 128).name == "fa3"
    assert isinstance(tg.make_attention(cfg, cpu, 128), tg.SdpaAttention)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_cpu_runs_take_large_buffers_from_the_heap_which_keeps_them_for_reuse():
    code = """
import ctypes, torch, train_gpt as tg
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def mapped_bytes_with_a_64mb_buffer():
    buffer = torch.ones(16 * 2**20)
    return libc.mallinfo2().hblkhd
before = mapped_bytes_with_a_64mb_buffer()
assert tg.keep_freed_cpu_memory()
print(before, mapped_bytes_with_a_64mb_buffer())
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    assert before >= 64 * 2**20 > after  # glibc mapped the buffer by itself (freed: unmapped), then no longer


def test_triton_jit_watch_times_first_launch_compiles_and_keeps_other_hooks():
    """TritonJitWatch counts what Triton's JIT hooks report (a compile between the hook before and the hook after),
    passes each call on to hooks set before it, and puts those back when closed."""
    knobs = pytest.importorskip("triton").knobs
    seen = []
    before = lambda **info: seen.append(("before", info["repr"]))  # noqa: E731
    after = lambda **info: seen.append(("after", info["repr"]))  # noqa: E731
    was = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
    try:
        watch = tg.TritonJitWatch()
        for name, qualified in (("rows[num_warps=4]", "rows"), ("newton_schulz[num_warps=8]", "kernels.<locals>.ns")):
            fn = types.SimpleNamespace(name=qualified)  # Triton passes the kernel's qualified name so
            assert not knobs.runtime.jit_cache_hook(key=name, repr=name, fn=fn, compile={}, is_manual_warmup=False,
                                                    already_compiled=False)
            time.sleep(0.05)
            knobs.runtime.jit_post_compile_hook(key=name, repr=name, fn=fn, compile={}, is_manual_warmup=False,
                                                already_compiled=False)
        assert watch.kernels == 2 and 0.1 <= watch.seconds < 5
        assert watch.names == {"rows", "ns"}  # as Triton's cache names them
        assert watch.summary() == f"Triton JIT outside the graphs: 2 kernels, {watch.seconds:.1f}s"
        assert [which for which, _ in seen] == ["before", "after"] * 2
        watch.close()
        assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == (before, after)
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = was


def test_compile_cache_file_carries_our_triton_kernels_and_launchers_into_an_empty_triton_cache(tmp_path):
    """Of Triton's cache, the file keeps the entries of the kernels named and those holding a launcher (.so), not
    inductor's (its artifacts hold those); loading writes each missing entry whole and leaves present ones alone."""
    source = tmp_path / "source"
    entries = {"aa": {"__grp__rows.json": b"{}", "rows.cubin": b"\x01rows"},
               "bb": {"__grp__triton_poi_fused_add_0.json": b"{}", "triton_poi_fused_add_0.cubin": b"\x02"},
               "cc": {"__triton_launcher.cpython-312-x86_64-linux-gnu.so": b"\x7fELF"},
               "dd": {"__grp__ns.json": b"{}", "ns.cubin": b"\x03ns", "ns.json": b"{\"name\": \"ns\"}"}}
    for entry, files in entries.items():
        (source / entry).mkdir(parents=True)
        for name, data in files.items():
            (source / entry / name).write_bytes(data)
    bundle_path = tmp_path / "cache.zip"
    with zipfile.ZipFile(bundle_path, "w") as bundle:
        assert tg.CompileCache.add_triton_entries(bundle, source, {"rows", "ns"}) == 3
        bundle.writestr("triton/../escape/x", b"not a cache entry")  # never written outside the cache
    target = tmp_path / "target"
    (target / "dd").mkdir(parents=True)  # present already: left as it is
    (target / "dd" / "ns.cubin").write_bytes(b"mine")
    with zipfile.ZipFile(bundle_path) as bundle:
        assert tg.CompileCache.restore_triton_entries(bundle, target) == 2
    assert sorted(p.name for p in target.iterdir()) == ["aa", "cc", "dd"]
    for entry in ("aa", "cc"):
        assert {f.name: f.read_bytes() for f in (target / entry).iterdir()} == entries[entry]
    assert [f.name for f in (target / "dd").iterdir()] == ["ns.cubin"]
    assert (target / "dd" / "ns.cubin").read_bytes() == b"mine"
    assert not (tmp_path / "escape").exists()
    with zipfile.ZipFile(bundle_path) as bundle:  # a second load finds everything in place
        assert tg.CompileCache.restore_triton_entries(bundle, target) == 0
    with zipfile.ZipFile(tmp_path / "none.zip", "w") as bundle:  # no Triton cache yet: nothing to add
        assert tg.CompileCache.add_triton_entries(bundle, tmp_path / "absent", {"rows"}) == 0
    with zipfile.ZipFile(tmp_path / "tuned.zip", "w") as bundle:  # an entry named (a tuned config's): kept whole
        assert tg.CompileCache.add_triton_entries(bundle, source, set(), {"bb", "zz"}) == 2  # bb, and cc's launcher
        assert {"triton/bb/triton_poi_fused_add_0.cubin", "triton/bb/__grp__triton_poi_fused_add_0.json"} <= set(
            bundle.namelist())


def test_a_triton_entry_from_the_file_is_found_where_the_writers_cache_folder_is_not(tmp_path, monkeypatch):
    """Triton's group file names the entry's files by the writing machine's paths, and Triton's lookup misses where
    one does not exist (the kernel then compiles again). Restored, it names the files in the entry's folder here, and
    Triton's own cache manager finds the group; a group file of another shape is written as it is."""
    writer = tmp_path / "writer" / "aa"  # the writing run's Triton cache entry; gone by the time the file loads
    child_paths = {name: str(writer / name) for name in ("ns.cubin", "ns.json")}
    bundle_path = tmp_path / "cache.zip"
    with zipfile.ZipFile(bundle_path, "w") as bundle:
        bundle.writestr("triton/aa/__grp__ns.json", json.dumps({"child_paths": child_paths}))
        bundle.writestr("triton/aa/ns.cubin", b"\x01ns")
        bundle.writestr("triton/aa/ns.json", b'{"name": "ns"}')
        bundle.writestr("triton/bb/__grp__rows.json", b"{}")
    target = tmp_path / "target"
    with zipfile.ZipFile(bundle_path) as bundle:
        assert tg.CompileCache.restore_triton_entries(bundle, target) == 2
    group = json.loads((target / "aa" / "__grp__ns.json").read_text())
    assert group == {"child_paths": {name: str(target / "aa" / name) for name in child_paths}}
    assert (target / "bb" / "__grp__rows.json").read_bytes() == b"{}"
    cache = pytest.importorskip("triton.runtime.cache")
    from triton import knobs
    monkeypatch.setattr(knobs.cache, "dir", str(target))
    assert cache.FileCacheManager("aa").get_group("ns.json") == group["child_paths"]


def test_tuned_kernel_entries_are_the_binaries_that_coordinate_descent_chose():
    """Of the process's autotuners, the launchers whose config coordinate descent found name their binaries' Triton
    cache entries (as torch names them from the hash); launchers of untuned configs, and objects that merely look
    like launchers, do not."""
    heuristics = pytest.importorskip("torch._inductor.runtime.triton_heuristics")
    from torch._inductor.runtime.runtime_utils import triton_hash_to_path_key

    def launcher(binary_hash, tuned, static=False):  # a static launcher keeps no binary, only its entry's name
        config = types.SimpleNamespace(found_by_coordesc=tuned)
        if static:
            return types.SimpleNamespace(cache_hash=triton_hash_to_path_key(binary_hash), config=config)
        return types.SimpleNamespace(bin=types.SimpleNamespace(hash=binary_hash), config=config)
    tuned = object.__new__(heuristics.CachingAutotuner)  # the attributes the search reads, nothing compiled
    tuned.launchers = [launcher("aa11" * 16, True)]
    tuned_static = object.__new__(heuristics.CachingAutotuner)
    tuned_static.launchers = [launcher("dd44" * 16, True, static=True)]
    untuned = object.__new__(heuristics.CachingAutotuner)
    untuned.launchers = [launcher("bb22" * 16, False), launcher("ee55" * 16, False, static=True)]
    not_an_autotuner = types.SimpleNamespace(launchers=[launcher("cc33" * 16, True)])
    entries = tg.tuned_kernel_entries()
    assert {triton_hash_to_path_key(h * 16) for h in ("aa11", "dd44")} <= entries
    assert not {triton_hash_to_path_key(h * 16) for h in ("bb22", "cc33", "ee55")} & entries
    del tuned, tuned_static, untuned, not_an_autotuner


def test_optimizers_stepped_together_give_one_after_the_other_and_run_their_hooks_once():
    """Optimizers.step launches Muon's and Adam's updates and then finishes each (so Adam's updates need not wait for
    Muon's all-gathers): the weights are those of Muon's step() and then Adam's, exactly. Its pre-step hook runs
    before any weight moves and its post-step hook after all have (torchft's DiLoCo reads the weights there)."""
    import copy
    cfg, _ = tg.parse_cli(["--device=cpu", *TINY])
    models = [random_tiny_model(cfg) for _ in range(2)]
    torch.manual_seed(1)
    grads = {name: torch.randn_like(p) * 1e-2 for name, p in models[0].named_parameters()}
    for model in models:
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
    together, apart = (tg.build_optimizers(model, cfg) for model in models)
    initial = copy.deepcopy(models[0].state_dict())
    seen = []
    together.register_step_pre_hook(lambda *_: seen.append(("pre", all(
        torch.equal(p, initial[name]) for name, p in models[0].state_dict().items()))))
    together.register_step_post_hook(lambda *_: seen.append(("post", sum(
        not torch.equal(p, initial[name]) for name, p in models[0].state_dict().items()))))
    together.step()
    for opt in apart:
        opt.step()
    moved = sum(not torch.equal(p, initial[name]) for name, p in models[1].state_dict().items())
    assert seen == [("pre", True), ("post", moved)] and moved > 10
    for (name, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        assert torch.equal(a, b), name
