"""How unevenly the ranks' attention work falls at world sizes 2, 4 and 8 (CPU only, nothing is run on a GPU).

    python bench/attention_balance.py 'TRAIN_SHARDS' [STEPS_PER_STAGE] [train_gpt.py flags]

Every other part of a step costs the same on every rank: each rank's micro-batches hold the same number of tokens.
Attention does not: a document of L tokens under a window of w costs the query-key pairs sum(min(i + 1, w)), so a
rank whose micro-batches hold longer documents runs longer, and the others wait for it at the optimizers' first
collective. For each stage this reads the stream from its start, cut as that stage cuts documents, deals each step's
micro-batches to the ranks as the trainer does (micro-batch i to rank i mod W), and prints by how much the busiest
rank's attention pairs exceed the ranks' mean, as a median over steps. One GPU reads every micro-batch of a step and
waits for no one.
"""
import dataclasses
import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_gpt as tg  # noqa: E402

WORLDS = (2, 4, 8)


def attention_pairs(lengths: np.ndarray, window: int) -> float:
    """Query-key pairs of documents of these lengths under a causal sliding window."""
    lengths = lengths.astype(np.float64)
    inside = lengths * (lengths + 1) / 2
    beyond = window * (window + 1) / 2 + (lengths - window) * window
    return float(np.where(lengths <= window, inside, beyond).sum())


def document_lengths(tokens: np.ndarray, bos: int) -> np.ndarray:
    """Lengths of the documents of one micro-batch, where the loader starts them (micro_batch_document_starts)."""
    return np.diff(tg.micro_batch_document_starts(tokens, bos), append=len(tokens))


def busiest_rank_excess(work: np.ndarray, world: int) -> np.ndarray:
    """work: [steps, micro-batches per step]. Per step, the busiest rank's work over the ranks' mean, less 1."""
    per_rank = work.reshape(work.shape[0], -1, world).sum(axis=1)  # micro-batch i goes to rank i mod world
    return per_rank.max(axis=1) / per_rank.mean(axis=1) - 1


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if not args:
        sys.exit("usage: python bench/attention_balance.py 'TRAIN_SHARDS' [STEPS_PER_STAGE] [train_gpt.py flags]")
    steps = int(args[1]) if len(args) > 1 else 100
    cfg, _ = tg.parse_cli([a for a in sys.argv[1:] if a.startswith("--")])
    paths = tg.shard_paths(args[0], "TRAIN_SHARDS")
    schedule = tg.Schedule(cfg)
    kinds = {kind: cfg.attn_layout.count(kind) for kind in "SL"}
    print(f"{'stage':>5} {'micro':>5} {'windows':>11} {'doc cut':>7}  busiest rank's attention pairs over the mean "
          f"(median of {steps} steps)")
    for stage, (micro, cut) in enumerate(zip(cfg.stage_batches, cfg.stage_doc_lens)):
        short, long = schedule.stage_windows[stage]
        # the whole stream, as one rank of one reads it, each document cut as this stage cuts it
        stream = tg.train_batches_for_rank(paths, dataclasses.replace(cfg, max_doc_len=cut, doc_len_schedule="",
                                                                      train_repeat=False), tg.Comm())
        work = []
        try:
            for window in itertools.islice(stream, steps * micro):
                lengths = document_lengths(window[:-1], cfg.bos_token)  # the inputs: the last token is a target
                work.append(kinds["S"] * attention_pairs(lengths, short) + kinds["L"] * attention_pairs(lengths, long))
        finally:
            stream.close()
        if len(work) < steps * micro:
            sys.exit(f"TRAIN_SHARDS={args[0]}: {len(work) // micro} steps of stage {stage} in the shards, not {steps}")
        work = np.array(work).reshape(steps, micro)
        excess = "  ".join(f"{world} ranks +{100 * np.median(busiest_rank_excess(work, world)):.1f}%"
                           for world in WORLDS if micro % world == 0)
        print(f"{stage:>5} {micro:>5} {str((short, long)):>11} {cut:>7}  {excess}")


if __name__ == "__main__":
    main()
