"""Device benchmark of the embedding tables' row gradients (not part of the tests): one packed forward's
65,536 positions added into the token table and the five value-embedding tables (shared token indices) and
into the bigram table, with torch's index_add_ (what a sparse embedding gradient added into a dense .grad
runs) against train_gpt.add_rows_ (sorted runs summed before one atomic add) over a sweep of its launch shape.
Tokens from /tmp/bench2 (bench/unpack_bench.py) when present, else Zipf-like random ones. Prints median
ms per forward and the largest error against a float64 index_add; and the value tables' lookups in float32
against bf16 (train_gpt.gather_rows).

    python bench/bench_rows.py
"""
import glob
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402
from timing import kernel_median_ms as median_ms  # noqa: E402


def tokens_of_one_forward(cfg: tg.Config, count: int) -> np.ndarray:
    files = sorted(glob.glob("/tmp/bench2/docs_train_*.bin"))
    if files:
        print(f"tokens from {files[0]}")
        return tg.read_shard(files[0])[:count].astype(np.int64)
    print("Zipf-like random tokens")
    rng = np.random.default_rng(0)
    return np.minimum(rng.zipf(1.2, count), cfg.vocab_size) - 1


def main():
    cfg = tg.Config()
    T, dim = 4 * cfg.micro_batch_tokens, cfg.model_dim
    tokens = tokens_of_one_forward(cfg, T)
    bigrams = np.concatenate([tg.bigram_hash(tokens[i: i + cfg.micro_batch_tokens], cfg.bigram_rows, cfg.bos_token)
                              for i in range(0, T, cfg.micro_batch_tokens)])
    print(f"{T} positions: {len(np.unique(tokens))} distinct tokens, {len(np.unique(bigrams))} distinct bigram rows")
    vocab = tg.next_multiple_of(cfg.vocab_size, 128)
    token_idx, bigram_idx = torch.from_numpy(tokens).cuda(), torch.from_numpy(bigrams.astype(np.int64)).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    token_grads = [torch.zeros(vocab, dim, device="cuda") for _ in range(6)]
    bigram_grad = torch.zeros(cfg.bigram_rows, dim, device="cuda")
    token_rows = [torch.randn(T, dim, device="cuda", generator=g) for _ in range(6)]
    bigram_rows = torch.randn(T, dim, device="cuda", generator=g)

    def index_add():
        for grad, rows in zip(token_grads, token_rows):
            grad.index_add_(0, token_idx, rows)
        bigram_grad.index_add_(0, bigram_idx, bigram_rows)

    def sorted_runs():
        tg.add_rows_(token_grads, token_idx, token_rows, use_triton=True)
        tg.add_rows_([bigram_grad], bigram_idx, [bigram_rows], use_triton=True)

    def error() -> float:
        """Largest error of one token table's and the bigram table's gradient against float64."""
        for grad in token_grads + [bigram_grad]:
            grad.zero_()
        sorted_runs()
        worst = 0.0
        for grad, idx, rows in ((token_grads[0], token_idx, token_rows[0]), (bigram_grad, bigram_idx, bigram_rows)):
            ref = torch.zeros(grad.shape, dtype=torch.float64, device="cuda").index_add_(0, idx, rows.double())
            worst = max(worst, ((grad.double() - ref).abs().max() / ref.abs().max()).item())
        return worst

    tables = [torch.randn(vocab, dim, device="cuda", generator=g) for _ in range(5)]
    for name, dtype in (("float32 (F.embedding)", torch.float32), ("bf16 (the gather kernel)", torch.bfloat16)):
        ms = median_ms(lambda: [tg.gather_rows(t, token_idx, dtype, use_triton=True) for t in tables])
        print(f"lookup of the 5 value tables' rows in {name}: {ms:.3f} ms per forward")
    chosen = (tg.ROWS_CHUNK, tg.ROWS_BLOCK_D, tg.ROWS_WARPS)
    print(f"index_add_ (the sparse-gradient path): {median_ms(index_add):.3f} ms per forward (7 tables)")
    for chunk in (16, 32, 64):
        for block_d, warps in ((256, 2), (256, 4), (128, 1), (512, 4), (1024, 4)):
            tg.ROWS_CHUNK, tg.ROWS_BLOCK_D, tg.ROWS_WARPS = chunk, block_d, warps
            print(f"add_rows_ chunk={chunk:3d} block_d={block_d:4d} warps={warps}: {median_ms(sorted_runs):.3f} ms, "
                  f"max error {error():.1e}")

    tg.ROWS_CHUNK, tg.ROWS_BLOCK_D, tg.ROWS_WARPS = chosen
    token_rows[1:] = [rows.to(torch.bfloat16) for rows in token_rows[1:]]
    bigram_rows = bigram_rows.to(torch.bfloat16)
    print(f"add_rows_ {chosen}, the value and bigram row gradients in bf16 (as the trainer looks them up): "
          f"{median_ms(sorted_runs):.3f} ms, max error {error():.1e}")


if __name__ == "__main__":
    main()
