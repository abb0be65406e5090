"""Communication model of the default training step at world sizes 1, 2, 4 and 8 (CPU only, nothing is sent).

    python bench/comm_model.py ['TRAIN_SHARDS' [ADAM_UPDATES]] [--busbw=GB/s ...] [train_gpt.py flags]

Builds the default Config's model (or the flags' one) on the meta device and the trainer's own optimizers
(build_optimizers), then counts, per rank, the bytes each collective of DistAdam and Muon sends, from their own
bucketing (DistAdam's _AdamBucket rules, plan_muon_groups). A reduce-scatter or
all-gather of an N-byte buffer sends (W-1)/W * N bytes from each rank (ring); an all-to-all sends what each rank
holds for the other owners. With shards, the bigram rows each rank touches per Adam update (its micro-batches of
adam_period steps, unioned, as DistAdam does) are replayed from the trainer's loader and hash, and with
them the rows of the value and bigram tables its forwards read before the next
update: what fetching only those rows from their owners would receive, against the dense all-gathers of those
tables (printed only, the totals count the all-gathers); without shards the sparse exchanges are left out. Times are bytes per rank / busbw, an assumed NCCL bus
bandwidth (default: 360 and 450 GB/s), with no latency term. train_gpt.py flags (e.g. --adam_period=1) change the
config the model is built from. The step-time model divides ONE_GPU_MS by 8 and adds the per-step average
communication.
"""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_gpt as tg  # noqa: E402

WORLDS = (1, 2, 4, 8)
MB = 1e6


def model_and_optimizers(cfg):
    with torch.device("meta"):
        model = tg.GPT(cfg, tg.SdpaAttention(), torch.bfloat16)  # a GPU's compute dtype
    muon, adam = tg.build_optimizers(model, cfg)  # world size 1 here; the buckets are recomputed per W below
    return model, muon, adam


def adam_buckets(adam, world):
    """(name, numel, padded numel) of each DistAdam collective's buffer at this world size, in the rules of
    DistAdam.__init__: a bucket per large parameter, and per group one for the small ones."""
    buckets = []
    for index, group in enumerate(adam.param_groups):
        small = [p for p in group["params"] if p.numel() < adam.SMALL]
        for p in group["params"]:
            if p.numel() >= adam.SMALL:
                buckets.append((p, p.numel(), -(-p.numel() // world) * world))
        if small:
            n = sum(p.numel() for p in small)
            buckets.append((f"group {index}: {len(small)} small", n, -(-n // world) * world))
    return buckets


def rows_per_update(cfg, pattern, updates, worlds, vocab_rows):
    """{(world, stage): mean rows a rank touches per Adam update, mean rows it sends to other owners, mean tokens
    (rows of the vocabulary tables) its forwards read of other owners' shards}. The bigram rows a rank's forwards
    read between two Adam updates are the ones they touch; vocab_rows is the vocabulary tables' (padded) row count."""
    paths = tg.shard_paths(pattern, "train_files")
    period = cfg.period
    rows_per_rank_block = {w: cfg.bigram_rows // w for w in worlds}
    out = {}
    for stage, micro in enumerate(s.batch for s in cfg.scheduled_stages):
        batches = tg.bos_aligned_batches(paths, cfg.micro_batch_tokens + 1, cfg.max_doc_len, repeat=True,
                                          bos=cfg.bos_token, vocab_size=cfg.vocab_size)
        per_update = micro * period  # the global micro-batches of one Adam update, in order
        stats = {w: ([], [], []) for w in worlds}
        for _ in range(updates):
            rows, tokens_read = [], []
            for _ in range(per_update):
                tokens, spans = next(batches)
                window = np.concatenate([tokens[a:b] for a, b in spans])
                rows.append(tg.bigram_hash(window[:-1], cfg.bigram_rows, cfg.bos_token))  # union_of_rows dedups
                tokens_read.append(window[:-1])
            for w in worlds:
                for rank in range(w):  # rank r reads every w-th micro-batch of the global sequence
                    touched = tg.union_of_rows(rows[rank::w], cfg.bigram_rows)
                    owner = touched // rows_per_rank_block[w]
                    stats[w][0].append(len(touched))
                    stats[w][1].append(int((owner != rank).sum()))
                    read = tg.union_of_rows(tokens_read[rank::w], vocab_rows)
                    stats[w][2].append(int((read // (vocab_rows // w) != rank).sum()))
        batches.close()
        for w in worlds:
            out[w, stage] = tuple(float(np.mean(values)) for values in stats[w])
    return out


# 1xH100, FA3, code of 2026-11-24's last commits, one device call (docs/performance.md, "Where the step time came
# from"): median ms per step of stages 0, 1, 2.
ONE_GPU_MS = (192.8, 389.2, 590.1)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    busbws = [float(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--busbw=")] or [360.0, 450.0]
    cfg, _ = tg.parse_cli([a for a in sys.argv[1:] if a.startswith("--") and not a.startswith("--busbw=")])
    period = cfg.period
    model, muon, adam = model_and_optimizers(cfg)
    follower = model.embed.weight
    bigram = model.bigram_embed.weight if model.bigram_embed is not None else None
    schedule = tg.Schedule(cfg)
    stages = schedule.scheduled
    tie = f"embedding tied to the head until step {schedule.untie_step} (stage {schedule.stage(schedule.untie_step)})"
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters; Adam every {period} steps; {tie}")
    vocab_rows = model.embed.weight.size(0)
    rows = rows_per_update(cfg, args[0], int(args[1]) if len(args) > 1 else 20, WORLDS, vocab_rows) if args else None
    names = {id(p): n for n, p in model.named_parameters()}
    matrices = [p for g in muon.param_groups for p in g["params"]]
    value_tables = [table.weight for table in model.value_embeds]

    def gather_bytes(p) -> int:
        """Bytes a value of parameter p travels as in its all-gather: its own dtype's."""
        return p.dtype.itemsize
    grad_bytes, grad_name = 4, "fp32"  # what a gradient value travels as
    per_step = {}  # (world, stage) -> MB per rank per step, averaged over Adam's period
    for w in WORLDS:
        f = (w - 1) / w
        print(f"\n=== world size {w}: MB each rank sends ((W-1)/W = {f:.4f} of each dense buffer)")
        # Muon: each group is a stack of same-shape gradients (reduce-scatter, fp32) and of bf16 updates on CUDA (all-gather: orthogonalize works in bf16 there), padded to a multiple of W.
        muon_rs = muon_ag = 0.0
        for group in tg.plan_muon_groups([tuple(p.shape) for p in matrices], w):
            count = -(-len(group) // w) * w
            numel = count * matrices[group[0]].numel()
            muon_rs, muon_ag = muon_rs + f * numel * grad_bytes, muon_ag + f * numel * 2
            print(f"  Muon group of {len(group)} x {tuple(matrices[group[0]].shape)} ({count // w} per rank), every "
                  f"step: reduce-scatter {grad_name} {f * numel * grad_bytes / MB:.1f}, all-gather bf16 "
                  f"{f * numel * 2 / MB:.1f}")
        rs_tied = rs_untied = ag_tied = ag_untied = 0.0
        sparse_params = [bigram] if bigram is not None else []
        for p, numel, padded in adam_buckets(adam, w):
            name = p if isinstance(p, str) else names[id(p)]
            item_bytes = 4 if isinstance(p, str) else gather_bytes(p)
            dense = f * padded * item_bytes
            sparse = any(p is q for q in sparse_params) and w > 1
            rs = 0.0 if sparse else f * padded * grad_bytes
            rs_untied, ag_untied = rs_untied + rs, ag_untied + dense
            # while tied, the follower's gradient travels inside the head's (DistAdam sums them first)
            rs_tied, ag_tied = rs_tied + (0.0 if p is follower else rs), ag_tied + (0.0 if p is follower else dense)
            print(f"  Adam bucket {name}: {numel:,} values (padded {padded:,}), every {period} steps: reduce-scatter "
                  f"{grad_name} {'sparse, below' if sparse else f'{rs / MB:.1f}'}, all-gather "
                  f"{'bf16' if item_bytes == 2 else 'fp32'} {dense / MB:.1f}"
                  + (" (neither while tied)" if p is follower else ""))
        print(f"  Muon per step: {muon_rs / MB:.1f} + {muon_ag / MB:.1f} = {(muon_rs + muon_ag) / MB:.1f}")
        print(f"  Adam per update, dense: reduce-scatter {rs_tied / MB:.1f} tied, {rs_untied / MB:.1f} untied; "
              f"all-gather {ag_tied / MB:.1f} tied, {ag_untied / MB:.1f} untied")
        for stage in range(stages):
            tied = (stage + 1) * cfg.num_iterations // stages <= schedule.untie_step
            adam_rs, ag = (rs_tied, ag_tied) if tied else (rs_untied, ag_untied)
            a2a = 0.0
            if rows is not None and w > 1 and bigram is not None:
                touched, sent, others_tokens = rows[w, stage]
                a2a = sent * (bigram.size(1) * grad_bytes + 8)  # an int64 index and a row each
                dense_rs = f * bigram.numel() * grad_bytes
                print(f"  stage {stage}: bigram rows per rank and Adam update: {touched:,.0f} touched, {sent:,.0f} "
                      f"owned by others; all-to-all {a2a / MB:.1f} (dense reduce-scatter {dense_rs / MB:.1f}, "
                      f"{dense_rs / a2a:.1f}x more)")
                # What the tables' all-gathers would receive if each rank fetched from their owners only the rows its
                # forwards read until the next update (an int64 index and a row each; the value tables and the
                # untied embedding share the token indices): the dense all-gathers receive as much as they send.
                def gathered(tables):  # what the tables' dense all-gathers send
                    return f * sum(t.numel() * gather_bytes(t) for t in tables)

                def fetched(tables):  # a fetch of these tables' rows read at the tokens, and of the bigram rows
                    return (others_tokens * (8 + sum(t.size(1) * gather_bytes(t) for t in tables))
                            + sent * (8 + bigram.size(1) * gather_bytes(bigram)))
                vocab_tables = value_tables + ([model.embed.weight] if follower is None or not tied else [])
                dense_ag, fetch = gathered(vocab_tables + [bigram]), fetched(vocab_tables)
                print(f"  stage {stage}: rows read until the next update, of other owners: {others_tokens:,.0f} of the "
                      f"vocabulary, {sent:,.0f} bigram rows; the value{'' if tied else ', embedding'} and bigram "
                      f"tables' all-gathers {dense_ag / MB:.1f}, a fetch of those rows {fetch / MB:.1f}")
            update = adam_rs + a2a + ag
            step = muon_rs + muon_ag + update / period
            per_step[w, stage] = step / MB
            print(f"  stage {stage} ({'tied' if tied else 'untied'}): Adam update {update / MB:.1f}; per step "
                  f"{(muon_rs + muon_ag) / MB:.1f} (Muon only) or {(muon_rs + muon_ag + update) / MB:.1f} (with Adam), "
                  f"averaged {step / MB:.1f}")
    print("\nMB per rank per step, averaged:", "  ".join(
        f"W={w}: " + " / ".join(f"{per_step[w, s]:.1f}" for s in range(stages)) for w in WORLDS))
    for busbw in busbws:
        print(f"\nmodel at W=8, bus bandwidth {busbw:.0f} GB/s, all communication exposed:")
        ideal_total = real_total = 0.0
        for s in range(stages):
            ideal = ONE_GPU_MS[s] / 8
            comm = per_step[8, s] * MB / (busbw * 1e9) * 1e3
            steps = cfg.num_iterations // stages + (cfg.extension_steps if s == stages - 1 else 0)
            ideal_total, real_total = ideal_total + steps * ideal, real_total + steps * (ideal + comm)
            print(f"  stage {s}: {ONE_GPU_MS[s]} / 8 = {ideal:.2f} ms + comm {comm:.2f} ms = {ideal + comm:.2f} ms, "
                  f"efficiency {ideal / (ideal + comm):.1%}; comm budget for 95%: {ideal * (1 / 0.95 - 1):.2f} ms")
        print(f"  whole run ({cfg.num_iterations} + {cfg.extension_steps} steps, the extension at stage {stages - 1}'s "
              f"cost): {ideal_total / 1e3:.1f} s ideal, {real_total / 1e3:.1f} s modelled, "
              f"efficiency {ideal_total / real_total:.1%}")


if __name__ == "__main__":
    main()
