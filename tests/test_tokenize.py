"""data/tokenize_text.py: text files and JSONL into shards, and back."""
import json
import subprocess
import sys

import numpy as np
import pytest

import train_gpt as tg
from helpers import REPO, load_script

tokenize = load_script("data/tokenize_text.py")
BOS = 50256


def byte_encoder(text):
    """A stand-in for GPT-2 BPE that needs no files: one token per UTF-8 byte."""
    return list(text.encode("utf-8"))


def documents_of(path):
    tokens = tg.read_shard(str(path))  # the trainer's own reader accepts the shard
    starts = list(np.flatnonzero(tokens == BOS)) + [len(tokens)]
    assert starts[0] == 0  # every document begins with BOS
    return [bytes(tokens[a + 1:b].astype(np.uint8)).decode("utf-8") for a, b in zip(starts, starts[1:])]


def make_corpus(tmp_path):
    texts = [f"document {i}: " + "words " * (i % 7 + 1) + "é✓" for i in range(30)]
    folder = tmp_path / "corpus" / "sub"
    folder.mkdir(parents=True)
    for i, text in enumerate(texts):
        (folder / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    return texts


def test_round_trip_split_and_shuffle(tmp_path):
    texts = make_corpus(tmp_path)
    written = tokenize.tokenize_documents(tokenize.read_documents(tokenize.input_files([str(tmp_path / "corpus")]), None), byte_encoder,
                                          tmp_path / "out", "t", val_tokens=100, shard_tokens=300, seed=7,
                                          progress=False)
    assert written[0].name == "t_val_000000.bin" and [p.name for p in written[1:3]] == ["t_train_000001.bin", "t_train_000002.bin"]
    val = documents_of(written[0])
    assert sum(len(t.encode()) + 1 for t in val) >= 100 > sum(len(t.encode()) + 1 for t in val[:-1])
    train_tokens = np.concatenate([tg.read_shard(str(p)) for p in written[1:]])
    assert all(len(tg.read_shard(str(p))) == 300 for p in written[1:-1])
    starts = list(np.flatnonzero(train_tokens == BOS)) + [len(train_tokens)]
    train = [bytes(train_tokens[a + 1:b].astype(np.uint8)).decode() for a, b in zip(starts, starts[1:])]
    assert sorted(val + train) == sorted(texts)  # every document exactly once, intact
    again = tokenize.tokenize_documents(tokenize.read_documents(tokenize.input_files([str(tmp_path / "corpus")]), None), byte_encoder,
                                        tmp_path / "out2", "t", val_tokens=100, shard_tokens=300, seed=7, progress=False)
    assert documents_of(again[0]) == val  # the shuffle follows the seed


def test_jsonl_field_and_bad_line(tmp_path):
    path = tmp_path / "dump.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"row {i}", "id": i}) for i in range(5)) + "\n\n")
    docs = list(tokenize.read_documents([path], "text"))
    assert [text for _, text in docs] == [f"row {i}" for i in range(5)] and docs[2][0].endswith("dump.jsonl:3")
    path.write_text(path.read_text() + '{"id": 9}\n')
    with pytest.raises(tokenize.TokenizeError, match=r"dump\.jsonl:7: not a JSON object with a 'text' field"):
        list(tokenize.read_documents([path], "text"))


def test_cli_refuses_to_overwrite_and_reports_missing_input(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "local_val_000000.bin").write_bytes(b"x")
    run = lambda *a: subprocess.run([sys.executable, str(REPO / "data" / "tokenize_text.py"), *map(str, a)],
                                    capture_output=True, text=True, timeout=120)
    result = run(tmp_path / "missing.txt", "--out", tmp_path / "new")
    assert result.returncode == 1 and "missing.txt: no such file or directory" in result.stderr
    (tmp_path / "a.txt").write_text("hi")
    result = run(tmp_path / "a.txt", "--out", tmp_path / "out")
    assert result.returncode == 1 and "already exists; pass --force" in result.stderr
    assert (tmp_path / "out" / "local_val_000000.bin").read_bytes() == b"x"


def test_real_gpt2_encoding_when_available(tmp_path):
    tiktoken = pytest.importorskip("tiktoken")
    try:
        tiktoken.get_encoding("gpt2")
    except Exception as e:
        pytest.skip(f"tiktoken's gpt2 files are not available offline here ({type(e).__name__})")
    (tmp_path / "a.txt").write_text("Hello world")
    (tmp_path / "b.txt").write_text("Second document.")
    result = subprocess.run([sys.executable, str(REPO / "data" / "tokenize_text.py"), tmp_path / "a.txt", tmp_path / "b.txt",
                             "--out", tmp_path / "out", "--val_tokens", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    shards = sorted((tmp_path / "out").glob("*.bin"))
    tokens = np.concatenate([tg.read_shard(str(p)) for p in shards]).tolist()
    assert [50256, 15496, 995] in [tokens[i:i + 3] for i in range(len(tokens))]  # "Hello world"


def test_validation_never_takes_more_than_half_and_one_document_works(tmp_path):
    """A corpus smaller than --val_tokens: validation gets at most half of all tokens, the document that crosses
    half cut there (its rest, after a BOS, opens the train shard); a single document is split the same way."""
    texts = ["a" * 50, "b" * 400, "c" * 30]  # shuffled order decides which one crosses half
    for case, docs in (("three", texts), ("one", ["only " * 40])):
        (tmp_path / case).mkdir()
        for i, text in enumerate(docs):
            (tmp_path / case / f"{i}.txt").write_text(text)
        written = tokenize.tokenize_documents(tokenize.read_documents(tokenize.input_files([str(tmp_path / case)]), None),
                                              byte_encoder, tmp_path / f"out_{case}", "t", val_tokens=10_000_000,
                                              shard_tokens=1000, seed=3, progress=False)
        val = tg.read_shard(str(written[0]))
        train = np.concatenate([tg.read_shard(str(p)) for p in written[1:]])
        total = sum(len(t) + 1 for t in docs)
        assert 0 < len(val) <= total // 2 and val[0] == BOS and train[0] == BOS
        assert len(val) == total // 2 or case == "three" and len(documents_of(written[0])) == 2
        text = "".join(documents_of(written[0])) + "".join(documents_of(written[1]))
        assert sorted(text) == sorted("".join(docs))  # every character once, in validation or in train


def test_offline_error_names_the_files_tiktoken_needs(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import fails as if not installed
    with pytest.raises(tokenize.TokenizeError, match=r"vocab\.bpe and encoder\.json .* TIKTOKEN_CACHE_DIR"):
        tokenize.gpt2_encoder()


def test_validation_takes_its_fraction_of_a_small_corpus(tmp_path):
    """--val_fraction (0.05 on the command line) caps validation below --val_tokens on a small corpus: the document
    that crosses the mark is cut there, its rest (after a BOS of its own) opening the train shard."""
    docs = [f"{i} " + "x" * 90 for i in range(40)]  # 3,640 tokens with their BOS
    for i, text in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(text)
    written = tokenize.tokenize_documents(tokenize.read_documents(tokenize.input_files([str(tmp_path)]), None),
                                          byte_encoder, tmp_path / "out", "t", val_tokens=10_000_000,
                                          shard_tokens=10_000, seed=3, progress=False, val_fraction=0.05)
    total = sum(len(t) + 1 for t in docs)
    val, train = (tg.read_shard(str(path)) for path in written)
    assert len(val) == int(total * 0.05) and val[0] == BOS and train[0] == BOS
    assert len(val) + len(train) in (total, total + 1)  # + 1: a cut document's rest


def test_files_that_are_not_text_are_skipped_and_named(tmp_path, monkeypatch, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "notes.txt").write_text("plain words " * 20)
    (tmp_path / "in" / "program").write_bytes(b"\x7fELF\x02\x01\x00\x00" + bytes(range(256)) * 4)
    (tmp_path / "in" / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 20)
    monkeypatch.setattr(tokenize, "gpt2_encoder", lambda: byte_encoder)
    assert tokenize.main([str(tmp_path / "in"), "--out", str(tmp_path / "out")]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("skipped")]  # not tqdm's
    assert sorted(err) == [f"skipped {tmp_path / 'in' / name}: not UTF-8 text" for name in ("latin1.txt", "program")]
    assert documents_of(tmp_path / "out" / "local_val_000000.bin")[0].startswith("plain")
    assert tokenize.main([str(tmp_path / "in" / "program"), "--out", str(tmp_path / "out2")]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "error: no text documents found in the inputs"
    assert tokenize.main([str(tmp_path / "in"), "--out", str(tmp_path / "out3"), "--val_fraction=0.9"]) == 1
    assert "--val_fraction=0.9" in capsys.readouterr().err
