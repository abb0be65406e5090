"""Pairs of tokens that GPT-2's encoder never writes side by side, for validation over canonical tokens only
(`--val_mask`; the idea is the speedrun's pull request #350):

    python data/canonical_pairs.py [OUT]      # default data/gpt2_noncanonical.npy (316 MB), about 10 seconds

Row p of the result holds, bit x % 8 of byte x // 8, whether token x can never follow token p in an encoding. A
bit is set only where that holds in every text: where the boundary between p and x always falls inside one
pre-tokenizer chunk and byte-pair merging of p's bytes followed by x's would merge across the boundary.

Why the merge test is exact: while no merge crosses the boundary, merging p + x runs p's own merges and x's own
merges, interleaved by rank. GPT-2's merges of a token's bytes come in rising rank order (checked here), so "time"
is a rank: p's last piece L is current from its birth (rank(L); a byte: from the start) until the merge that
absorbs it. A cross merge needs a token T = L + R whose rank falls where both pieces are current: the merge then
happens at max(birth(L), birth(R), rank(T)), before either side's next merge (of equal ranks the leftmost pair
merges first: p's before the cross pair, the cross pair before x's). Anything else keeps [p, x]. Tokens whose own
merges do not rise in rank get no row and no column.
"""
import sys
import unicodedata
from pathlib import Path

import numpy as np

CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")  # GPT-2's pre-tokenizer splits these off


def merge_history(token: bytes, ranks: dict[bytes, int]) -> tuple[list, list, bool]:
    """Byte-pair merging of token's bytes alone (lowest rank first, the leftmost of equals): the last piece's and the
    first piece's spans, each (piece, birth, end) with end the rank of the merge that absorbs it (None: never), and
    whether the merges rose in rank and ended in the token itself."""
    parts = [(token[i:i + 1], -1) for i in range(len(token))]  # (piece, birth)
    last, first, previous, rising = [], [], -1, True
    while len(parts) > 1:
        rank, i = min((ranks.get(a + b, 1 << 62), i) for i, ((a, _), (b, _)) in enumerate(zip(parts, parts[1:])))
        if rank == 1 << 62:
            break
        rising &= rank > previous
        previous = rank
        if i + 2 == len(parts):
            last.append((*parts[-1], rank))
        if i == 0:
            first.append((*parts[0], rank))
        parts[i:i + 2] = [(parts[i][0] + parts[i + 1][0], rank)]
    last.append((*parts[-1], None))
    first.append((*parts[0], None))
    return last, first, rising and len(parts) == 1 and parts[0][0] == token


def char_class(char: str) -> str:
    if char == " ":
        return "S"
    if char.isspace():
        return "W"
    return {"L": "L", "N": "N"}.get(unicodedata.category(char)[0], "O")


def utf8_length(lead: int) -> int:
    return 1 if lead < 0x80 else 2 if lead >> 5 == 6 else 3 if lead >> 4 == 14 else 4 if lead >> 3 == 30 else 0


def boundary_class(text: bytes, at_end: bool) -> str:
    """The pre-tokenizer's class of the character at a token's end (or start): L letter, N number, S the space,
    W other whitespace, O other; M where the boundary cuts a character; ? where the token does not tell."""
    if at_end:
        i = len(text) - 1
        while i >= 0 and text[i] & 0xC0 == 0x80:  # back to the last character's first byte
            i -= 1
        n = utf8_length(text[i]) if i >= 0 else 0
        if i < 0 or n == 0 or len(text) - i > n:
            return "?"
        if len(text) - i < n:
            return "M"  # the character goes on in the next token
        char = text[i:]
    else:
        if text[0] & 0xC0 == 0x80:
            return "M"
        n = utf8_length(text[0])
        if n == 0 or len(text) < n:
            return "?"
        char = text[:n]
    try:
        return char_class(char.decode())
    except UnicodeDecodeError:
        return "?"


def always_joined(left: str, right: str) -> bool:
    """Whether GPT-2's pre-tokenizer keeps the boundary inside one chunk in every text: inside a character, inside a
    run of letters, of numbers or of other symbols (each run greedy), or a space before a non-space (` ?X+`)."""
    if "?" in (left, right):
        return False
    return "M" in (left, right) or (left == right and left in "LNO") or (left == "S" and right in "LNO")


def noncanonical_pairs(ranks: dict[bytes, int], vocab_size: int) -> np.ndarray:
    """[vocab_size, ceil(vocab_size / 8)] uint8, bit x % 8 of byte x // 8 of row p: x never follows p."""
    tokens = {rank: token for token, rank in ranks.items() if rank < vocab_size}
    birth = {token: (ranks[token] if len(token) > 1 else -1) for token in ranks}
    never = 1 << 62
    ends_as, starts_as = {}, {}  # piece -> [(token id, end of the piece's span)]
    usable = np.zeros(vocab_size, dtype=bool)
    for rank, token in tokens.items():
        last, first, ok = merge_history(token, ranks)
        if not ok:  # falling ranks or no single token: leave its row and column empty
            continue
        usable[rank] = True
        for spans, index in ((last, ends_as), (first, starts_as)):
            for piece, _, end in spans:
                index.setdefault(piece, []).append((rank, never if end is None else end))
    starts = {piece: (np.array([x for x, _ in v]), np.array([e for _, e in v])) for piece, v in starts_as.items()}
    splits = {}  # L -> [(when the cross merge would happen, R)]
    for token, rank in ranks.items():
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            if left in ends_as and right in starts:
                splits.setdefault(left, []).append((max(birth[left], birth[right], rank), right))
    mask = np.zeros((vocab_size, (vocab_size + 7) // 8), dtype=np.uint8)
    for left, candidates in splits.items():
        candidates.sort(key=lambda c: c[0])
        following = np.zeros(vocab_size, dtype=bool)  # the x that may not follow the p seen so far
        k, packed = 0, None
        for p, end in sorted(ends_as[left], key=lambda e: e[1]):
            changed = False
            while k < len(candidates) and candidates[k][0] < end:  # L is still p's last piece when it would merge
                when, right = candidates[k]
                xs, x_ends = starts[right]
                # and R still x's first piece (at a tie x's own merge is the same token, to the right: later)
                following[xs[x_ends >= when]] = True
                k, changed = k + 1, True
            if changed:
                packed = np.packbits(following, bitorder="little")
            if packed is not None:
                mask[p] |= packed
    # only boundaries that no text puts between two chunks
    ends = [boundary_class(tokens[t], True) if t in tokens else "?" for t in range(vocab_size)]
    begins = [boundary_class(tokens[t], False) if t in tokens else "?" for t in range(vocab_size)]
    for left in set(ends):
        keep = np.packbits([always_joined(left, right) for right in begins], bitorder="little")
        mask[[t for t in range(vocab_size) if ends[t] == left]] &= keep
    for text in CONTRACTIONS:  # a chunk of its own, whatever follows it: no row for its last token
        mask[ranks[merge_history(text.encode(), ranks)[0][-1][0]]] = 0
    mask[~usable] = 0
    return mask


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if len(args) > 1:
        print("error: one argument at most, the file to write (default data/gpt2_noncanonical.npy)", file=sys.stderr)
        return 1
    out = Path(args[0]) if args else Path(__file__).parent / "gpt2_noncanonical.npy"
    if not out.parent.is_dir():
        print(f"error: {out.parent} is not a folder; create it or name another file", file=sys.stderr)
        return 1
    try:
        import tiktoken
        encoding = tiktoken.get_encoding("gpt2")
    except Exception as e:  # no package, no network, no cached files
        print(f"error: tiktoken's gpt2 encoding did not load ({type(e).__name__}): pip install tiktoken; offline, see "
              "data/tokenize_text.py's help", file=sys.stderr)
        return 1
    mask = noncanonical_pairs(encoding._mergeable_ranks, encoding.n_vocab)
    temporary = out.with_name(f".{out.name}.tmp")
    with open(temporary, "wb") as f:
        np.save(f, mask)
    temporary.replace(out)
    print(f"{out}: {int(np.unpackbits(mask, bitorder='little').sum()):,} pairs never adjacent, "
          f"{mask.any(1).sum():,} tokens with some")
    return 0

if __name__ == "__main__":
    sys.exit(main())
