"""The longest-match input (--longest_match, the speedrun's pull request #378): the sort-based search against a
search over every earlier position, and the feature in the model starting at zero and learning."""
import dataclasses

import torch

import train_gpt as tg
from helpers import BOS, TINY, random_tiny_model


def matches_by_search(tokens: list[int], starts: list[bool]) -> tuple[list[int], list[int]]:
    """(candidate, bucket) per position as longest_matches defines them, by comparing every earlier context."""
    candidates, buckets = [], []
    document_start = 0
    for t in range(len(tokens)):
        document_start = t if starts[t] else document_start
        candidate = bucket = 0
        for i, length in reversed(list(enumerate(tg.MATCH_LENGTHS))):
            first = t - length + 1
            if first < document_start:
                continue
            context = tokens[first: t + 1]
            earlier = [p for p in range(document_start + length - 1, t) if tokens[p - length + 1: p + 1] == context]
            if earlier:
                candidate, bucket = tokens[earlier[-1] + 1], 1 + 3 * i + min(len(earlier), 3) - 1
                break
        candidates.append(candidate)
        buckets.append(bucket)
    return candidates, buckets


def test_longest_matches_agree_with_a_search_over_every_earlier_position():
    """Text that repeats at many lengths (a small vocabulary, copied stretches of up to 40 tokens) in documents of
    several sizes: the same candidate and bucket at every position with a repeat, bucket 0 elsewhere; a repeat never
    reaches across a document start."""
    g = torch.Generator().manual_seed(0)
    T = 1024
    tokens = torch.randint(0, 5, (T,), generator=g)
    for start, source, length in ((300, 250, 40), (600, 520, 20), (900, 860, 33), (1000, 980, 9)):
        tokens[start: start + length] = tokens[source: source + length].clone()
    for first_start in (0, 40):  # from a document's start, and (a validation chunk) from inside one
        starts = torch.zeros(T, dtype=torch.bool)
        starts[[first_start, 200, 512, 513, 700]] = True
        candidates, buckets = tg.longest_matches(tokens, starts)
        want_candidates, want_buckets = matches_by_search(tokens.tolist(), starts.tolist())
        assert buckets.tolist() == want_buckets
        found = buckets > 0
        assert candidates[found].tolist() == [c for c, b in zip(want_candidates, want_buckets) if b > 0]
        assert set(want_buckets) >= {0, 1, 3, 3 * len(tg.MATCH_LENGTHS) - 2}  # none, once, 3+, the longest seen once
        assert buckets[[200, 512, 513, 700]].tolist() == [0] * 4  # a document's first token has nothing before it


def test_the_feature_starts_at_zero_and_learns():
    """With its scales and bucket vectors at zero the model's loss is the one without the feature; the gradient
    reaches both, and a nonzero scale changes the loss."""
    with_match, _ = tg.parse_cli(["--device=cpu", *TINY])
    plain, model = random_tiny_model(dataclasses.replace(with_match, longest_match=False)), random_tiny_model(with_match)
    match = model.longest_match
    with torch.no_grad():
        match.scale.zero_()
        match.bucket_embed.zero_()
    model.load_state_dict({**plain.state_dict(), **{f"longest_match.{k}": v for k, v in match.state_dict().items()}})
    g = torch.Generator().manual_seed(1)
    T = 256
    period = torch.randint(0, 96, (24,), generator=g)
    tokens = period.repeat(T // 24 + 1)[:T]
    tokens[0] = tokens[128] = BOS
    targets = torch.cat([tokens[1:], tokens[:1]])
    bigrams = torch.zeros(T, dtype=torch.long)
    masks = plain.prepare_masks(tokens, torch.tensor([0, 128, T], dtype=torch.int32), (32, 64))
    loss = model(tokens, targets, masks, bigrams)
    torch.testing.assert_close(loss, plain(tokens, targets, masks, bigrams))
    loss.backward()
    assert match.scale.grad.abs().sum() > 0 and match.bucket_embed.grad.abs().sum() > 0
    with torch.no_grad():
        match.scale.fill_(1.0)
    assert (model(tokens, targets, masks, bigrams) - loss).abs() > 1e-4
    adam = tg.build_optimizers(model, with_match)[1]
    lr_of = {id(p): group["lr"] for group in adam.param_groups for p in group["params"]}
    assert all(lr_of[id(p)] == with_match.adam_lr for p in match.parameters())


def test_the_search_traces_into_one_graph():
    """compile_model compiles longest_matches on its own, whole (fullgraph): it traces without a break and the traced
    graph gives the eager results (inductor's code for it runs in the GPU flag sets)."""
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 4, (512,), generator=g)
    starts = torch.rand(512, generator=g) < 0.01
    starts[0] = True
    traced = torch.compile(tg.longest_matches, backend="aot_eager", fullgraph=True, dynamic=False)
    for got, want in zip(traced(tokens, starts), tg.longest_matches(tokens, starts)):
        assert torch.equal(got, want)
