"""The sharded Muon: its group planner, and its updates on two gloo ranks against a plain one-process Muon."""
from unittest import mock

import numpy as np
import pytest
import torch

import train_gpt as tg
from helpers import count_collectives, run_on_ranks

# A QKVO-like stack (4 row blocks) and MLP-like matrices of the same shape, plus one other shape.
ATTN, MLP, OTHER = 3, 6, 2
STEPS = 3
LR, MOMENTUM, WD, BETA2, MLP_LR_MUL = 0.02, 0.9, 0.5, 0.95, 2.0


def normuon_reference(update, moment, beta2):
    """NorMuon's rescaling of one orthogonalised matrix, in float64: one running mean square per entry of the
    longer side, the update divided by its root, then brought back to its Frobenius norm."""
    dim = 1 if update.size(0) >= update.size(1) else 0
    moment = beta2 * moment + (1 - beta2) * update.square().mean(dim=dim, keepdim=True)
    scaled = update / moment.clamp_min(1e-10).sqrt()
    return scaled * update.norm() / scaled.norm(), moment


def default_model_shapes():
    with torch.device("meta"):  # shapes only: the 491M parameters are never allocated
        model = tg.GPT(tg.Config(), tg.SdpaAttention(), torch.float32)
    return [tuple(p.shape) for p in model.parameters() if p.opt.optimizer == "muon"]


def test_planner_needs_no_padding_for_the_default_model():
    shapes = default_model_shapes()
    assert len(shapes) == 32 and set(shapes) == {(3072, 768)}
    for world_size in (1, 2, 4, 8):
        groups = tg.plan_muon_groups(shapes, world_size)
        assert sorted(i for g in groups for i in g) == list(range(32))
        assert [len(g) for g in groups] == [16, 16]
        assert all(len(g) % world_size == 0 for g in groups)


def test_planner_puts_the_last_layers_first_when_given_layers():
    """The default model's matrices by layer (10 QKVO on the layers with attention, then 11 MLP inputs and 11
    outputs): the first group holds the 16 of the latest layers, those the backward finishes first."""
    cfg = tg.Config()
    layers = [i for i, kind in enumerate(cfg.attn_layout) if kind != "-"] + list(range(11)) * 2
    shapes = [(3072, 768)] * 32  # test_planner_needs_no_padding_for_the_default_model checks these
    for world_size in (1, 2, 4, 8):
        groups = tg.plan_muon_groups(shapes, world_size, layers)
        assert [len(g) for g in groups] == [16, 16] and sorted(i for g in groups for i in g) == list(range(32))
        first = sorted(layers[i] for i in groups[0])
        assert first == [5, 5, 6, 6, 7, 7, 7, 8, 8, 8, 9, 9, 9, 10, 10, 10]  # layer 6 has no attention


def test_planner_orders_small_shapes_first_and_pads_odd_worlds():
    shapes = [(8, 4)] * 5 + [(2, 2)] * 3
    groups = tg.plan_muon_groups(shapes, 2)
    assert groups[0] == [5, 6, 7]  # the smaller shape first, one padded group (3 -> 4)
    assert [len(g) for g in groups[1:]] == [2, 3]  # 5 matrices: a group of 2, then one padded to 4
    for world_size in (3, 4):
        groups = tg.plan_muon_groups([(4, 4)] * 10, world_size)
        assert sorted(i for g in groups for i in g) == list(range(10))
    # 3 ranks: a full group of 6 (2 per rank), then 4 matrices padded to 6
    assert tg.plan_muon_groups([(4, 4)] * 10, 3) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    attn = [torch.randn(32, 8, generator=g).requires_grad_() for _ in range(ATTN)]
    mlp = [torch.randn(32, 8, generator=g).requires_grad_() for _ in range(MLP)]
    other = [torch.randn(12, 20, generator=g).requires_grad_() for _ in range(OTHER)]
    return attn, mlp, other


def rank_grads(rank, step, params):
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(p.shape, generator=g) for p in params]


PAIRS = ((4, 4), (8, 2))  # the attention-like stack's Q and K in 2 blocks each, V and O whole


RAILS = (0.98, 2, 0.6, 0.85)  # slow beta, the step it joins in at, its share then, the usual buffer's beta then


def rails_at(step, rails):
    """(the usual buffer's beta, the slow buffer's share) at a step, as Schedule.muon_rails gives them."""
    slow, joins, share, fast = rails
    return (fast, share) if step >= joins else (MOMENTUM, 0.0)


def reference_params(world_size, attn_split=4, rails=None):
    """Muon written plainly, one matrix at a time, on the gradient averaged over all ranks; with rails, ANVIL2's
    slow second momentum buffer."""
    attn, mlp, other = make_params()
    params = attn + mlp + other
    buffers = [torch.zeros_like(p) for p in params]
    slow_buffers = [torch.zeros_like(p) for p in params]
    moments = {}  # (matrix, block) -> NorMuon's running mean square
    with torch.no_grad():
        for step in range(STEPS):
            per_rank = [rank_grads(r, step, params) for r in range(world_size)]
            for i, p in enumerate(params):
                grad = sum(g[i] for g in per_rank) / world_size
                if rails is None:
                    buffers[i] = MOMENTUM * buffers[i] + (1 - MOMENTUM) * grad
                    direction = (1 - MOMENTUM) * grad + MOMENTUM * buffers[i]
                else:
                    fast, share = rails_at(step, rails)
                    buffers[i] = fast * buffers[i] + (1 - fast) * grad
                    slow_buffers[i] = rails[0] * slow_buffers[i] + (1 - rails[0]) * grad
                    momentum = (1 - share) * buffers[i] + share * slow_buffers[i]
                    direction = (1 - MOMENTUM) * grad + MOMENTUM * momentum
                heights = [8] * 4 if attn_split == 4 else [h for h, count in attn_split for _ in range(count)]
                blocks = direction.split(heights) if i < ATTN else [direction]
                ortho = []
                for b, block in enumerate(blocks):
                    update = tg.orthogonalize(block, use_triton=False).double()
                    if (i, b) not in moments:
                        dim = 1 if update.size(0) >= update.size(1) else 0
                        moments[i, b] = torch.zeros_like(update.mean(dim=dim, keepdim=True))
                    update, moments[i, b] = normuon_reference(update, moments[i, b], BETA2)
                    ortho.append(update)
                ortho = torch.cat(ortho)
                rows, cols = blocks[0].shape
                lr = LR * max(1, rows / cols) ** 0.5 * (MLP_LR_MUL if ATTN <= i < ATTN + MLP else 1.0)
                cautious = (ortho * p.double() >= 0).double()
                p.copy_(p.double() - lr * WD * LR * cautious * p.double() - lr * ortho)
    return [p.detach() for p in params]


class ReplayedGraph:
    """A stand-in for a CUDA graph on the CPU: replaying it runs the captured Python again. The captured part's
    returned tensors stay those of its capture, as a graph's do, so a part that returned a new tensor at each run
    would hand out a stale one."""
    captures = replays = 0

    def __init__(self, compute):
        self.compute = compute

    @staticmethod
    def capture(compute):
        ReplayedGraph.captures += 1
        return ReplayedGraph(compute), compute()

    def replay(self):
        ReplayedGraph.replays += 1
        self.compute()


def muon_params(rank, world_size, from_backward=False, attn_split=4, rails=None, graphs=False):
    """from_backward: gradients come from a backward with the hooks armed, so the reduce-scatters are
    launched inside the backward instead of in step(). graphs: Muon's parts captured and replayed (cuda_graphs),
    by ReplayedGraph, for this run only (at one rank it runs in the test's own process)."""
    if not graphs:
        return _muon_params(rank, from_backward, attn_split, rails, graphs)
    ReplayedGraph.captures = ReplayedGraph.replays = 0
    with mock.patch.object(tg.CapturedSteps, "capture", staticmethod(ReplayedGraph.capture)):
        return _muon_params(rank, from_backward, attn_split, rails, graphs)


def _muon_params(rank, from_backward, attn_split, rails, graphs):
    attn, mlp, other = make_params()
    params = attn + mlp + other
    opt = tg.Muon([dict(params=attn, split=attn_split), dict(params=mlp, lr_mul=MLP_LR_MUL), dict(params=other)], lr=LR,
                  momentum=MOMENTUM, weight_decay=WD, beta2=BETA2, slow_momentum=rails[0] if rails else 0.0,
                  cuda_graphs=graphs)
    calls = count_collectives()
    for step in range(STEPS):
        if rails is not None:  # as set_hyperparameters writes them
            for group in opt.param_groups:
                group["fast_momentum"], group["slow_share"] = rails_at(step, rails)
        if from_backward:
            opt.before_last_backward()
            sum((p * g).sum() for p, g in zip(params, rank_grads(rank, step, params))).backward()
            launched_early = all(group.pending is not None for group in opt.groups)
        else:
            for p, g in zip(params, rank_grads(rank, step, params)):
                p.grad = g
            launched_early = False
        opt.step()
        for p in params:
            p.grad = None
        assert launched_early == from_backward
    buffers = sum(s["momentum_buffer"].numel() for s in opt.state.values())
    assert all("second_moment_0" in s for s in opt.state.values())
    if graphs:  # each group's two parts: run at the first step, captured at the second, replayed from the third
        assert (ReplayedGraph.captures, ReplayedGraph.replays) == (2 * len(opt.groups), 2 * len(opt.groups) * (STEPS - 2))
    return [p.detach() for p in params], buffers, calls, len(opt.groups)


def assert_close(got, want):
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attn_split", [4, PAIRS], ids=["qkvo", "qk_pairs"])
def test_single_process_matches_reference(attn_split):
    params, buffers, calls, _ = muon_params(0, 1, False, attn_split)
    assert_close(params, reference_params(1, attn_split))
    assert sum(calls.values()) == 0


@pytest.mark.parametrize("from_backward, attn_split", [(False, 4), (True, 4), (False, PAIRS)])
def test_two_ranks_match_single_process_on_the_full_gradient(from_backward, attn_split):
    results = run_on_ranks(muon_params, 2, from_backward, attn_split)
    want = reference_params(2, attn_split)
    total = (ATTN + MLP) * 32 * 8 + OTHER * 12 * 20
    for params, buffers, calls, groups in results:
        assert_close(params, want)
        assert calls["all_reduce"] == 0
        assert calls["reduce_scatter_single"] == calls["all_gather_single"] == groups * STEPS
    assert sum(r[1] for r in results) == total  # each momentum buffer lives on exactly one rank


@pytest.mark.parametrize("world_size", [1, 2])
def test_two_momentum_rails_match_the_reference_at_one_and_two_ranks(world_size):
    """ANVIL2's two rails: the slow buffer runs from the first step and joins the momentum at its step, the usual buffer's beta changing then; one and two ranks give the plain reference's weights, and the
    slow buffers live with their matrices' owners."""
    results = run_on_ranks(muon_params, world_size, False, 4, RAILS) if world_size > 1 else [muon_params(0, 1, False, 4,
                                                                                                      RAILS)]
    want = reference_params(world_size, 4, RAILS)
    for params, *_ in results:
        assert_close(params, want)
    assert max(float((p - w).abs().max()) for p, w in zip(want, reference_params(world_size))) > 1e-3  # it matters


def test_the_schedule_brings_the_slow_rail_in_at_its_fraction():
    """The speedrun's 2026-08-30 record: from 0.43 of the scheduled steps on, the slow buffer's share is 0.56 and the
    usual buffer's beta 0.85; before, the scheduled momentum alone."""
    schedule = tg.Schedule(tg.Config(num_iterations=100))
    assert schedule.muon_rails(10) == (schedule.muon_momentum(10), 0.0) and schedule.muon_momentum(10) < 0.95
    assert schedule.muon_rails(42) == (schedule.muon_momentum(42), 0.0) and schedule.muon_rails(43) == (0.85, 0.56)


@pytest.mark.parametrize("world_size", [1, 2])
def test_captured_parts_replayed_give_the_steps_run_kernel_by_kernel(world_size):
    """cuda_graphs: Muon's compute between its collectives and its weight update, captured at the second step and
    replayed from then on (here by ReplayedGraph: CUDA graphs need a GPU; tests/gpu checks the real ones), give the
    reference's weights with the momentum's beta and the slow share changing mid-run, at one and two ranks."""
    args = (False, 4, RAILS, True)
    results = run_on_ranks(muon_params, world_size, *args) if world_size > 1 else [muon_params(0, 1, *args)]
    want = reference_params(world_size, 4, RAILS)
    for params, *_ in results:
        assert_close(params, want)


def test_zeroed_state_under_graphs_steps_as_a_new_optimizer_without_capturing_again(monkeypatch):
    """The warm-up's end (zero_state_): under cuda_graphs the state is zeroed where it is, so the graphs captured in
    the warm-up go on serving, and the steps after it are those of a new optimizer from the same weights."""
    monkeypatch.setattr(tg.CapturedSteps, "capture", staticmethod(ReplayedGraph.capture))
    attn, mlp, other = make_params()
    params = attn + mlp + other
    initial = [p.detach().clone() for p in params]
    opt = tg.Muon([dict(params=attn, split=4), dict(params=mlp), dict(params=other)], lr=LR, momentum=MOMENTUM,
                  weight_decay=WD, beta2=BETA2, cuda_graphs=True)

    def steps():
        for step in range(STEPS):
            for p, g in zip(params, rank_grads(0, step, params)):
                p.grad = g
            opt.step()
        return [p.detach().clone() for p in params]
    first = steps()
    captures = ReplayedGraph.captures
    opt.zero_state_()
    with torch.no_grad():
        for p, w in zip(params, initial):
            p.copy_(w)
    assert all(torch.equal(a, b) for a, b in zip(steps(), first))
    assert ReplayedGraph.captures == captures  # replayed only


@pytest.mark.parametrize("world_size", [1, 2])
def test_rank_without_work_gets_padding_only(world_size):
    """Fewer matrices than ranks: padding slots yield zero updates and nothing breaks."""
    p = torch.randn(6, 4).requires_grad_()
    if world_size == 1:
        opt = tg.Muon([dict(params=[p])], lr=0.1, momentum=0.9)
        p.grad = torch.randn(6, 4)
        opt.step()
        return
    run_on_ranks(_single_matrix_on_two_ranks, 2)


def _single_matrix_on_two_ranks(rank, world_size):
    p = torch.ones(6, 4).requires_grad_()
    opt = tg.Muon([dict(params=[p])], lr=0.1, momentum=0.9)
    p.grad = torch.full((6, 4), float(rank + 1))
    opt.step()
    assert not torch.equal(p.detach(), torch.ones(6, 4))
    return p.detach()
