"""The bigram hash embedding: the loader's hash, and the sparse gradient exchange against the dense one."""
import numpy as np
import pytest
import torch
import torch.distributed as dist

import train_gpt as tg
from helpers import BOS, TINY, VOCAB, cu_seqlens_of, run_on_ranks

ROWS, DIM, STEPS = 64, 128, 3


def reference_hash(tokens, rows):
    """Plain-Python statement of the hash: (previous, current) -> Fibonacci hash mod rows-1; no
    previous token of the same document (first position, BOS) -> the reserved last row."""
    out = []
    for i, token in enumerate(tokens):
        if i == 0 or token == BOS:
            out.append(rows - 1)
        else:
            pair = int(tokens[i - 1]) * 65536 + int(token)
            out.append(((pair * 0x9E3779B97F4A7C15) % 2**64 >> 32) % (rows - 1))
    return out


def test_loader_bigram_rows_equal_the_reference_hash():
    rng = np.random.default_rng(0)
    window = rng.integers(0, 50257, 257).astype(np.uint16)
    window[[0, 17, 18, 100]] = BOS  # document starts, two in a row
    batches = tg.Prefetcher(iter([window]), 256, torch.device("cpu"), bigram_rows=4096, bos=BOS)
    batch = batches.next()
    batches.close()
    want = reference_hash(window[:-1].tolist(), 4096)
    assert batch.bigrams.tolist() == want
    assert batch.rows["bigrams"].tolist() == sorted(set(want))
    assert want[17] == want[18] == want[100] == 4095 and len(set(want)) > 200


def test_tiny_model_uses_the_bigram_table():
    cfg, _ = tg.parse_cli(TINY)
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    model.lm_head.weight.data.normal_()  # a zero head would give every earlier weight zero gradient
    tokens = torch.randint(0, VOCAB, (256,), dtype=torch.int32)
    bigrams = torch.from_numpy(tg.bigram_hash(tokens.numpy(), cfg.bigram_rows, cfg.bos_token))
    masks = model.prepare_masks(tokens, cu_seqlens_of(tokens, cfg.bos_token), (16, 32))
    model.prepare_grads()  # the tables' row gradients are added into these dense zeros
    model(tokens, tokens.long(), masks, bigrams).backward()
    grad_rows = model.bigram_embed.weight.grad.abs().sum(1).nonzero().flatten()
    assert set(grad_rows.tolist()) <= set(bigrams.tolist()) and len(grad_rows) > 0


def test_union_of_rows_equals_numpy_unique_of_the_concatenation():
    rng = np.random.default_rng(5)
    parts = [np.unique(rng.integers(0, 1000, size)) for size in (0, 1, 300, 300, 999)]
    parts.append(np.array([0, 999]))  # both ends of the table
    got = tg.union_of_rows(parts, 1000)
    assert got.dtype.kind == "i" and np.array_equal(got, np.unique(np.concatenate(parts)))
    assert len(tg.union_of_rows([], 1000)) == 0


def touched_rows(rank, step):
    """Random touched rows per rank; row 0 is touched by every rank, rows ROWS-8.. by none."""
    rng = np.random.default_rng(100 * step + rank)
    rows = rng.choice(np.arange(1, ROWS - 8), size=20, replace=False)
    return np.unique(np.append(rows, 0))


def _adam_on_rank(rank, world_size, sparse):
    """Two tables read at the same rows, each with its own gradient, each updated alone."""
    torch.manual_seed(0)
    tables = [torch.randn(ROWS, DIM).requires_grad_() for _ in range(2)]
    opt = tg.DistAdam([dict(params=tables, lr=0.01)], lr=0.01, betas=(0.8, 0.95), eps=1e-10,
                      sparse_rows=dict.fromkeys(tables, "bigrams") if sparse else None)
    syncs = []
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "cpu", "tolist")}
    shards = []
    exchanges = []  # all_to_all_single calls per step
    all_to_all = dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **k: (exchanges.append(1), all_to_all(*a, **k))[1]  # this process only
    for step in range(STEPS):
        rows = touched_rows(rank, step)
        for index, table in enumerate(tables):
            grad = torch.zeros(ROWS, DIM)
            generator = torch.Generator().manual_seed(step * 10 + rank + 100 * index)
            grad[rows] = torch.randn(len(rows), DIM, generator=generator)
            table.grad = grad
        exchanges.clear()
        micro_batches = [rows[: 2 * len(rows) // 3], rows[len(rows) // 3:]]  # overlapping
        opt.before_last_backward([{"bigrams": rows} for rows in micro_batches])
        for name in originals:  # the step must not read device values back to the host
            setattr(torch.Tensor, name, lambda *a, _name=name, **k: syncs.append(_name) or originals[_name](*a, **k))
        try:
            for bucket in opt.buckets:
                opt._launch_reduce(bucket)
                shard = bucket.pending()
                bucket.pending = lambda shard=shard: shard
                shards.append(shard.clone())
            opt.step()
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)
        # per table: the counts (gloo), the row indices, the rows
        assert len(exchanges) == (6 if sparse else 0), len(exchanges)
    return [table.detach() for table in tables], shards, syncs


def test_sparse_exchange_equals_dense_reduce_scatter():
    dense = run_on_ranks(_adam_on_rank, 2, False)
    sparse = run_on_ranks(_adam_on_rank, 2, True)
    for (d_tables, d_shards, _), (s_tables, s_shards, syncs) in zip(dense, sparse):
        assert syncs == []
        assert len(s_shards) == len(d_shards) == 2 * STEPS
        for d, s in zip(d_shards, s_shards):
            torch.testing.assert_close(s, d, rtol=1e-6, atol=1e-7)
        for d, s in zip(d_tables, s_tables):
            torch.testing.assert_close(s, d, rtol=1e-6, atol=1e-7)
    for first, second in zip(sparse[0][0], sparse[1][0]):
        assert torch.equal(first, second)  # ranks agree after the dense all-gather


def test_bigram_rows_must_split_over_ranks():
    with pytest.raises(tg.UserError, match="--bigram_rows=1001"):
        tg.parse_cli(["--bigram_rows=1001"])


def test_signed_narrow_bigram_rows_enter_the_first_channels_times_their_sign_vector():
    """What the residual stream takes of the bigram table at each position is the looked-up row times the sign vector
    (previous token XOR token) mod the count, vector 0 where a document or micro-batch starts, in the first quarter of
    the channels and zero after; the sign vectors are fixed +-1 vectors, the same for any --seed. The table's row
    gradients carry the signs too."""
    cfg, _ = tg.parse_cli(TINY)
    dims, signs = cfg.model_dim // 4, tg.BIGRAM_SIGNS
    torch.manual_seed(0)
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    torch.manual_seed(1)
    assert torch.equal(tg.GPT(cfg, tg.SdpaAttention(), torch.float32).bigram_signs, model.bigram_signs)
    assert model.bigram_signs.shape == (signs, dims) and set(model.bigram_signs.unique().tolist()) == {-1.0, 1.0}
    assert model.bigram_embed.weight.shape == (cfg.bigram_rows, dims)
    with torch.no_grad():
        model.bigram_embed.weight.normal_()
        model.lm_head.weight.normal_()
    tokens = torch.randint(0, VOCAB, (256,), dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    tokens[[0, 40, 41]] = BOS
    bigrams = torch.from_numpy(tg.bigram_hash(tokens.numpy(), cfg.bigram_rows, cfg.bos_token))
    seen = []

    def keep(_, args):  # the bigram input of layer 1 (layer 0's enters before it), its gradient kept
        args[5].retain_grad()
        seen.append(args[5])
    model.blocks[1].register_forward_pre_hook(keep)
    masks = model.prepare_masks(tokens, cu_seqlens_of(tokens, cfg.bos_token), (16, 32))
    model.prepare_grads()
    model(tokens, tokens.long(), masks, bigrams).backward()
    index = [0 if i == 0 or t == BOS else (int(tokens[i - 1]) ^ int(t)) % signs for i, t in enumerate(tokens.tolist())]
    rows = model.bigram_embed.weight[bigrams.long()] * model.bigram_signs[index]
    torch.testing.assert_close(seen[0][:, :dims], rows)
    assert torch.equal(seen[0][:, dims:], torch.zeros(256, cfg.model_dim - dims))
    assert len(set(index)) > 8
    # each row's gradient: the sum over the positions that looked it up of their gradient times their signs (the
    # bigram input is one tensor, which every layer's use adds its gradient into)
    want = torch.zeros_like(model.bigram_embed.weight)
    want.index_add_(0, bigrams.long(), seen[0].grad[:, :dims] * model.bigram_signs[index])
    torch.testing.assert_close(model.bigram_embed.weight.grad, want)
    assert want.abs().sum() > 0
