"""Bytes each rank sends per bigram-gradient update, sparse vs dense, on a real token stream (CPU only).

    python bench/bench_bigram_bytes.py 'path/to/*_train_*.bin' [steps]

Replays the trainer's own loader (BOS-aligned micro-batches split over ranks, bigram hash) for the
default config at 8, 4 and 2 ranks and each stage of the batch schedule, and counts per rank and step:
sparse = touched rows x (row bytes + 8-byte index) sent to other owners; dense = the reduce-scatter's
(world-1)/world of the fp32 table.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_gpt as tg  # noqa: E402


def main():
    pattern, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20
    cfg = tg.Config(train_files=pattern)
    paths = tg.shard_paths(pattern, "train_files")
    row_bytes = cfg.model_dim * 4
    dense_table = cfg.bigram_rows * row_bytes
    print(f"table {cfg.bigram_rows:,} rows x {cfg.model_dim} fp32 = {dense_table / 2**20:.0f} MiB")
    print("world  micro/step  touched rows/rank  sparse MiB/rank  dense MiB/rank  ratio")
    for world in (8, 4, 2):
        for micro in cfg.stage_batches:
            batches = tg.bos_aligned_batches(paths, cfg.micro_batch_tokens + 1, cfg.max_doc_len, repeat=True,
                                              bos=cfg.bos_token, vocab_size=cfg.vocab_size)
            per_rank = micro // world
            touched, sent = [], []
            for _ in range(steps):
                for rank in range(world):
                    rows = np.unique(np.concatenate([
                        tg.bigram_hash(np.concatenate([t[a:b] for a, b in spans])[:-1], cfg.bigram_rows, cfg.bos_token)
                        for t, spans in (next(batches) for _ in range(per_rank))]))
                    owner = rows // (cfg.bigram_rows // world)
                    touched.append(len(rows))
                    sent.append(int((owner != rank).sum()) * (row_bytes + 8))
            sparse, dense = np.mean(sent) / 2**20, dense_table * (world - 1) / world / 2**20
            print(f"{world:5d}  {micro:10d}  {np.mean(touched):17,.0f}  {sparse:15.1f}  {dense:14.1f}  {dense / sparse:5.1f}x")


if __name__ == "__main__":
    main()
