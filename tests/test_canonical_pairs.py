"""data/canonical_pairs.py on a small byte-pair vocabulary trained here, with GPT-2's pre-tokenizer: its pairs are
exactly those that merge across their boundary inside an always-joined boundary, and no encoding has one."""
import collections

import numpy as np
import pytest
import regex

from helpers import load_script

tiktoken = pytest.importorskip("tiktoken")
cp = load_script("data/canonical_pairs.py")
GPT2_SPLIT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
TEXT = ("The cat's 12 hats, and 345 dogs' toys: don't they'll re-read it?  Yes... \"Quoted.\" (parens) x=y+1;\n"
        "\tTabs and  two  spaces, café naïve 東京 日本語 ünïcödé -- em—dash; ab12cd 3.14 e-mail@x.org\n\n")


def train_ranks(text: str, merges: int) -> dict[bytes, int]:
    """Byte-pair merges learnt on text's pre-tokenizer chunks, ranked in the order learnt (bytes first)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = collections.Counter(tuple(bytes([b]) for b in chunk.encode()) for chunk in regex.findall(GPT2_SPLIT, text))
    while len(ranks) < 256 + merges:
        pairs = collections.Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        ranks.setdefault(a + b, len(ranks))
        merged = collections.Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return ranks


def merge_bytes(text: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """Byte-pair merging of one chunk (lowest rank first, the leftmost of equals), as tiktoken does it."""
    parts = [text[i:i + 1] for i in range(len(text))]
    while len(parts) > 1:
        rank, i = min((ranks.get(a + b, 1 << 62), i) for i, (a, b) in enumerate(zip(parts, parts[1:])))
        if rank == 1 << 62:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


@pytest.fixture(scope="module")
def vocabulary():
    ranks = train_ranks(TEXT * 3, 300)
    return ranks, cp.noncanonical_pairs(ranks, len(ranks))


def test_the_pairs_are_those_that_merge_across_an_always_joined_boundary(vocabulary):
    ranks, mask = vocabulary
    tokens = {rank: token for token, rank in ranks.items()}
    usable = [cp.merge_history(tokens[t], ranks)[2] for t in range(len(ranks))]
    assert sum(usable) > len(ranks) - 5  # nearly every token merges in rising ranks
    got = np.unpackbits(mask, axis=1, bitorder="little")[:, :len(ranks)].astype(bool)
    want = np.zeros_like(got)
    tails = {ranks[merge_bytes(c.encode(), ranks)[-1]] for c in cp.CONTRACTIONS}
    for p in range(len(ranks)):
        left = cp.boundary_class(tokens[p], True)
        if not usable[p] or p in tails:
            continue
        for x in range(len(ranks)):
            if usable[x] and cp.always_joined(left, cp.boundary_class(tokens[x], False)):
                want[p, x] = merge_bytes(tokens[p] + tokens[x], ranks) != [tokens[p], tokens[x]]
    assert got.sum() > 200 and np.array_equal(got, want), (got.sum(), want.sum(), np.argwhere(got != want)[:5])


def test_no_encoding_puts_a_pair_side_by_side(vocabulary):
    """Texts of the training text's pieces and of the tokens' own bytes, cut and glued at random, through tiktoken
    with the same pre-tokenizer and ranks: no adjacent pair of any encoding is in the mask."""
    ranks, mask = vocabulary
    encoding = tiktoken.Encoding("small", pat_str=GPT2_SPLIT, mergeable_ranks=ranks, special_tokens={})
    tokens = [token.decode() for token in ranks if _is_text(token)]
    rng = np.random.default_rng(0)
    texts = []
    for _ in range(3000):
        start = rng.integers(0, len(TEXT) - 40)
        texts.append(TEXT[start: start + rng.integers(1, 40)] + "".join(rng.choice(tokens, rng.integers(1, 5))))
    pairs = 0
    for ids in encoding.encode_ordinary_batch(texts):
        p, x = np.array(ids[:-1]), np.array(ids[1:])
        assert not ((mask[p, x // 8] >> (x % 8)) & 1).any()
        pairs += len(p)
    assert pairs > 20000


def _is_text(token: bytes) -> bool:
    try:
        token.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_a_missing_folder_is_one_line(tmp_path, capsys):
    assert cp.main([str(tmp_path / "nowhere" / "mask.npy")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nowhere is not a folder" in err and err.count("\n") == 1
