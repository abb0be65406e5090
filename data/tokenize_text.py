"""Turn your own text into token shards that train_gpt.py reads (GPT-2 BPE via tiktoken).

    python data/tokenize_text.py DOCS_DIR/ notes.txt --out data/mytext          # every file is one document
    python data/tokenize_text.py dump.jsonl --jsonl_field text --out data/mytext

Every document is encoded with tiktoken's `gpt2` encoding and prefixed by BOS (50256). Documents are
shuffled (--seed), the first ones fill the validation shard ({name}_val_000000.bin) up to --val_tokens or
--val_fraction of all tokens, whichever is fewer (never past half: the document that crosses the mark is cut
there, so a single document is split in two), the rest the train shards ({name}_train_000001.bin, ...) of
--shard_tokens each. Files that are not UTF-8 text (a NUL byte, or bytes UTF-8 cannot decode) are skipped, each
named in one line. Offline, tiktoken reads the BPE files from TIKTOKEN_CACHE_DIR.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

BOS = 50256
MAGIC, VERSION = 20240520, 1


class TokenizeError(Exception):
    pass


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """The trainer's shard format, written to a temporary name first so no half shard is left behind."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = (MAGIC, VERSION, len(tokens))
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())
    os.replace(tmp, path)


def input_files(inputs: list[str]) -> list[Path]:
    """The files named, and every file under the directories named (sorted)."""
    files = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise TokenizeError(f"{path}: no such file or directory")
    return files


def is_text(data: bytes, complete: bool = True) -> bool:
    """No NUL byte, and UTF-8 decodes it (a sniffed head may end inside a character: complete=False)."""
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return not complete and e.start >= len(data) - 3 and e.reason == "unexpected end of data"
    return True


def read_documents(files: list[Path], jsonl_field: str | None, skipped=None):
    """Yield (source, text): one per file, or one per JSONL line with --jsonl_field (read as a stream, its first
    64 KB checked). A file that is not text goes to skipped(path) (default: one line on stderr) and is left out."""
    skipped = skipped or (lambda path: print(f"skipped {path}: not UTF-8 text", file=sys.stderr))
    for path in files:
        if jsonl_field is None:
            data = path.read_bytes()
            if is_text(data):
                yield str(path), data.decode("utf-8")
            else:
                skipped(path)
            continue
        with open(path, "rb") as f:
            if not is_text(f.read(1 << 16), complete=False):
                skipped(path)
                continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[jsonl_field]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise TokenizeError(f"{path}:{number}: not a JSON object with a {jsonl_field!r} field") from None
                yield f"{path}:{number}", str(text)


def tokenize_documents(documents, encode, out: Path, name: str, val_tokens: int, shard_tokens: int,
                       seed: int, progress: bool = True, val_fraction: float = 0.5) -> list[Path]:
    """Encode, shuffle, split and write; returns the shards written (val first). Validation takes up to
    min(val_tokens, val_fraction of all tokens, half of them)."""
    from tqdm import tqdm
    docs = [np.concatenate([[BOS], encode(text)]).astype(np.uint16)
            for _, text in tqdm(list(documents), desc="documents", unit="doc", disable=not progress)]
    if not docs:
        raise TokenizeError("no text documents found in the inputs")
    np.random.default_rng(seed).shuffle(docs)
    total = sum(len(d) for d in docs)
    if total < 4:
        raise TokenizeError(f"the inputs hold {total} tokens: too few for a validation and a train shard")
    half = min(total // 2, max(int(total * val_fraction), 2))
    target = min(val_tokens, half)
    val, index, taken = [], 0, 0
    while index < len(docs) - 1 and taken < target:
        val.append(docs[index])
        taken += len(docs[index])
        index += 1
    cut = None
    if not val:  # a single document: its head is the validation
        cut, index = docs[0], 1
    elif taken > half:  # the last document taken crosses half of all tokens: cut it there
        cut = val.pop()
        taken -= len(cut)
    rest = []
    if cut is not None:
        keep = max(target - taken, 2)
        val.append(cut[:keep])
        rest = [np.concatenate([[BOS], cut[keep:]]).astype(np.uint16)]
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{name}_val_000000.bin"]
    write_shard(written[-1], np.concatenate(val))
    train = np.concatenate(rest + docs[index:])
    for number, start in enumerate(range(0, len(train), shard_tokens), start=1):
        written.append(out / f"{name}_train_{number:06d}.bin")
        write_shard(written[-1], train[start: start + shard_tokens])
    return written


def gpt2_encoder():
    try:
        import tiktoken
        encoding = tiktoken.get_encoding("gpt2")
    except Exception as e:  # no package, no network, no cached files: all end the same way for the user
        raise TokenizeError(
            f"could not load tiktoken's gpt2 encoding ({type(e).__name__}). Install tiktoken; offline, tiktoken needs "
            "GPT-2's vocab.bpe and encoder.json in the folder TIKTOKEN_CACHE_DIR names, under the names "
            "6d1cbeee0f20b3d9449abfede4726ed8212e3aee and 6c7ea1a7e38e3a7f062df639a5b80947f075ffe6") from None
    return lambda text: encoding.encode_ordinary(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="text files, directories (recursively), or JSONL files")
    parser.add_argument("--out", required=True, type=Path, help="folder for the shards")
    parser.add_argument("--name", default="local", help="shard name prefix")
    parser.add_argument("--jsonl_field", help="read JSONL files, one document per line, from this field")
    parser.add_argument("--val_tokens", type=int, default=10_485_760,
                        help="validation tokens at most (the trainer's --val_tokens default)")
    parser.add_argument("--val_fraction", type=float, default=0.05,
                        help="fraction of all tokens validation takes at most (0 < f <= 0.5)")
    parser.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per train shard")
    parser.add_argument("--seed", type=int, default=1234, help="document shuffle seed")
    parser.add_argument("--force", action="store_true", help="overwrite existing shards of this name")
    args = parser.parse_args(argv)
    try:
        if not 0 < args.val_fraction <= 0.5:
            raise TokenizeError(f"--val_fraction={args.val_fraction}: give a fraction above 0 and at most 0.5")
        existing = sorted(args.out.glob(f"{args.name}_*.bin")) if args.out.exists() else []
        if existing and not args.force:
            raise TokenizeError(f"{existing[0]} already exists; pass --force to overwrite shards named {args.name}_*")
        files = input_files(args.inputs)
        written = tokenize_documents(read_documents(files, args.jsonl_field), gpt2_encoder(), args.out,
                                     args.name, args.val_tokens, args.shard_tokens, args.seed,
                                     val_fraction=args.val_fraction)
    except TokenizeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(f"{path}: {(path.stat().st_size - 1024) // 2:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
