"""DistAdam on one process and on two gloo processes, against a plain Adam with cautious weight decay on the full
gradient."""
import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist

import train_gpt as tg
from helpers import RecordOps, count_collectives, run_on_ranks

# Shapes like the model's: large matrices (divisible and not by the world size) and small scalars
# that get packed into one bucket.
SHAPES = [(128, 96), (97, 89), (4,), (1,), (5, 3)]
STEPS = 4
HYPER = dict(betas=(0.8, 0.95), eps=1e-10, weight_decay=50.0)  # decays by lr^2 * 50: 0.5% a step at lr 0.01


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).requires_grad_() for shape in SHAPES]


def rank_grads(rank, step):
    """The gradient rank `rank` computes at `step`: different on every rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(*shape, generator=g) for shape in SHAPES]


def groups(params):
    # two param groups with different lrs; the first holds a packed small parameter too
    return [dict(params=[params[0], params[2]], lr=0.01), dict(params=[params[1], params[3], params[4]], lr=0.003)]


def reference_params(world_size, period=1):
    """Adam written plainly in float64, one parameter at a time, then cautious weight decay: where the Adam
    update and the weight share a sign the weight also loses lr^2 * weight_decay of itself. With period p,
    Adam updates at steps p-1, 2p-1, ... on the gradients summed since its last update."""
    params = [p.detach().double() for p in make_params()]
    lrs = [group["lr"] for group in groups(params) for _ in group["params"]]
    order = [id(p) for group in groups(params) for p in group["params"]]
    lr_of = {i: lrs[order.index(id(p))] for i, p in enumerate(params)}
    beta1, beta2 = HYPER["betas"]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for update in range(1, STEPS // period + 1):
        steps = range((update - 1) * period, update * period)
        per_rank = [[sum(gs) for gs in zip(*(rank_grads(r, s) for s in steps))] for r in range(world_size)]
        step = update
        for i, p in enumerate(params):
            grad = sum(g[i] for g in per_rank).double() / world_size
            m[i] = beta1 * m[i] + (1 - beta1) * grad
            v[i] = beta2 * v[i] + (1 - beta2) * grad ** 2
            update = lr_of[i] * (m[i] / (1 - beta1 ** step)) / ((v[i] / (1 - beta2 ** step)).sqrt() + HYPER["eps"])
            decay = lr_of[i] ** 2 * HYPER["weight_decay"] * (update * p > 0)
            params[i] = p - update - decay * p
    return [p.float() for p in params]


def dist_adam_params(rank, world_size, period=1):
    params = make_params()
    opt = tg.DistAdam(groups(params), lr=0.01, **HYPER)
    for step in range(STEPS):
        opt.accumulating = (step + 1) % period != 0
        for p, g in zip(params, rank_grads(rank, step)):
            p.grad = g if p.grad is None else p.grad + g
        opt.step()
        opt.zero_grad()
    state_numel = sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in opt.state.values())
    return [p.detach() for p in params], state_numel


def assert_close(got, want):
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6, atol=1e-7)


def test_single_process_equals_the_reference(monkeypatch):
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("world size 1 must not communicate"))
    for name in ("reduce_scatter_single", "all_gather_single"):
        monkeypatch.setattr(tg, name, lambda *a, **k: pytest.fail("world size 1 must not communicate"))
    got, state_numel = dist_adam_params(0, 1)
    assert_close(got, reference_params(1))
    assert state_numel == 2 * sum(torch.Size(s).numel() for s in SHAPES)


def _two_rank_run(rank, world_size, period=1):
    calls = count_collectives()
    params, state_numel = dist_adam_params(rank, world_size, period)
    return params, state_numel, calls


# Buckets: (128, 96) and (97, 89) alone; per group the small ones packed: [(4,)] and [(1,), (5, 3)]
BUCKETS = 4


def test_two_ranks_equal_the_reference_on_the_full_gradient():
    results = run_on_ranks(_two_rank_run, 2, 1)
    want = reference_params(2)
    full_state = 2 * sum(torch.Size(s).numel() for s in SHAPES)
    for params, state_numel, calls in results:
        assert_close(params, want)
        # each rank holds half the state, plus padding where a size is odd (97*89 = 8633 -> 8634)
        assert state_numel == 2 * (12288 // 2 + 8634 // 2 + 4 // 2 + 16 // 2)
        assert state_numel < 0.51 * full_state
        assert calls["all_reduce"] == 0
        assert calls["reduce_scatter_single"] == calls["all_gather_single"] == BUCKETS * STEPS


def _hook_run(rank, world_size):
    """A real backward with the hooks armed: reduce-scatters start before step() is called."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = tg.DistAdam([dict(params=list(model.parameters()), lr=0.01)], lr=0.01)
    launched = []
    original = tg.reduce_scatter_single

    def counted(*args, **kwargs):
        launched.append(1)
        return original(*args, **kwargs)
    tg.reduce_scatter_single = counted
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    opt.before_last_backward()
    model(x).square().mean().backward()
    during_backward = len(launched)
    opt.step()
    return during_backward, len(launched), [p.detach().clone() for p in model.parameters()]


def test_backward_hooks_launch_the_reduce_scatters():
    (early0, total0, params0), (early1, total1, params1) = run_on_ranks(_hook_run, 2)
    assert early0 == total0 > 0 and early1 == total1  # everything launched inside backward
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))  # ranks agree after the step


TIED_STEPS, UNTIE_AT = 5, 3


def _tied_run(rank, world_size):
    """Embedding-like follower tied to a head-like leader for UNTIE_AT steps, then untied."""
    g = torch.Generator().manual_seed(0)
    leader = torch.randn(64, 48, generator=g).requires_grad_()
    follower = leader.detach().clone().requires_grad_()
    opt = tg.DistAdam([dict(params=[follower]), dict(params=[leader])], lr=0.01, tied=(follower, leader), **HYPER)
    ties, weights, reduces, sent = [], [], [], []
    original = tg.reduce_scatter_single
    tg.reduce_scatter_single = lambda *a, **k: (sent.append(1), original(*a, **k))[1]  # counted
    try:
        for step in range(TIED_STEPS):
            if step == UNTIE_AT:
                opt.untie()
            ties.append(opt.is_tied())
            grads = torch.Generator().manual_seed(100 * step + rank)
            follower.grad, leader.grad = (torch.randn(64, 48, generator=grads) for _ in range(2))
            if step % 2:  # the hooks launch the reduce-scatters, the follower's gradient done first (as in training)
                opt.before_last_backward()
                for p in (follower, leader):
                    opt.grad_hooks._on_grad_ready(p)
            opt.step()
            weights.append((follower.detach().clone(), leader.detach().clone()))
            reduces.append(len(sent))
            sent.clear()
    finally:  # at world size 1 this runs in the test's own process
        tg.reduce_scatter_single = original
    return ties, weights, opt.state_dict(), reduces


def test_tied_parameters_share_one_update_then_go_on_alone():
    """While tied: one Adam update of the leader from the sum of both gradients (averaged over ranks), copied into the
    follower. After untie(): each its own Adam, the follower starting from a copy of the shared state. At 1 and 2
    ranks, against a plain float64 Adam with cautious weight decay; the untied state survives a state dict. While tied,
    the pair sends one reduce-scatter a step, launched at step() or from the backward hooks."""
    beta1, beta2 = HYPER["betas"]
    lr, eps, wd = 0.01, HYPER["eps"], HYPER["weight_decay"]

    def adam(p, grad, state):
        state["t"] += 1
        state["m"] = beta1 * state["m"] + (1 - beta1) * grad
        state["v"] = beta2 * state["v"] + (1 - beta2) * grad ** 2
        update = lr * (state["m"] / (1 - beta1 ** state["t"])) / ((state["v"] / (1 - beta2 ** state["t"])).sqrt() + eps)
        return p - update - lr ** 2 * wd * (update * p > 0) * p

    for world_size in (1, 2):
        results = [_tied_run(0, 1)] if world_size == 1 else run_on_ranks(_tied_run, 2)
        leader = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).double()
        follower = leader.clone()
        zero = dict(t=0, m=torch.zeros_like(leader), v=torch.zeros_like(leader))
        shared = dict(zero)
        alone = None
        for step in range(TIED_STEPS):
            per_rank = [torch.Generator().manual_seed(100 * step + r) for r in range(world_size)]
            grads = [[torch.randn(64, 48, generator=g).double() for _ in range(2)] for g in per_rank]
            follower_grad = sum(g[0] for g in grads) / world_size
            leader_grad = sum(g[1] for g in grads) / world_size
            if step < UNTIE_AT:
                leader = adam(leader, follower_grad + leader_grad, shared)
                follower = leader.clone()
            else:
                alone = alone or dict(shared)
                leader = adam(leader, leader_grad, shared)
                follower = adam(follower, follower_grad, alone)
            for ties, weights, _, reduces in results:
                assert ties[step] == (step < UNTIE_AT)
                # while tied, the summed gradient travels in one reduce-scatter
                assert reduces[step] == (0 if world_size == 1 else 1 if step < UNTIE_AT else 2)
                np.testing.assert_allclose(weights[step][0].numpy(), follower.float().numpy(), rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(weights[step][1].numpy(), leader.float().numpy(), rtol=1e-5, atol=1e-6)
        assert not torch.equal(results[0][1][-1][0], results[0][1][-1][1])  # untied, they went apart

    # a state dict taken after the untie loads as untied (a DiLoCo heal)
    _, _, state, _ = results[0]
    p, q = torch.zeros(64, 48, requires_grad=True), torch.zeros(64, 48, requires_grad=True)
    opt = tg.DistAdam([dict(params=[p]), dict(params=[q])], lr=0.01, tied=(p, q), **HYPER)
    assert opt.is_tied()
    opt.load_state_dict(state)
    assert not opt.is_tied()


def test_with_period_2_adam_updates_every_other_step_on_two_steps_gradients():
    want = reference_params(2, period=2)
    assert not all(torch.equal(a, b) for a, b in zip(want, reference_params(2)))
    got, _ = dist_adam_params(0, 1, period=2)
    assert_close(got, reference_params(1, period=2))
    for params, _, calls in run_on_ranks(_two_rank_run, 2, 2):
        assert_close(params, want)
        # the accumulating steps send nothing
        assert calls["reduce_scatter_single"] == calls["all_gather_single"] == BUCKETS * STEPS // 2


def test_an_accumulating_step_keeps_rows_only_for_the_sparse_exchange():
    """At world size 1 nothing is exchanged sparsely: rows handed over while accumulating must not pile up."""
    params = make_params()
    opt = tg.DistAdam(groups(params), lr=0.01, sparse_rows={params[0]: "bigrams"}, **HYPER)
    opt.accumulating = True
    for _ in range(3):
        opt.before_last_backward([{"bigrams": np.arange(5)}])
    assert opt.deferred_rows == {}


def test_the_packed_parameters_take_their_new_values_in_one_copy():
    """On several GPUs the host's launches set the step (docs/performance.md): the parameters not updated in place
    (here the three small ones, packed) get their values back in one multi-tensor copy, not one copy each."""
    params = make_params()
    opt = tg.DistAdam(groups(params), lr=0.01, **HYPER)
    for p, g in zip(params, rank_grads(0, 0)):
        p.grad = g
    before = [p.detach().clone() for p in params]
    with RecordOps() as record:
        opt.step()
    assert [op.__name__ for op in record.ops if "copy_" in op.__name__] == ["_foreach_copy_.default"]
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))


def _resumed_run(rank, world_size):
    """Two steps, the state saved, two more; then a fresh optimizer loads that state and takes the same two."""

    def run(opt, params, steps):
        for step in steps:
            for p, g in zip(params, rank_grads(rank, step)):
                p.grad = g
            opt.step()
            opt.zero_grad()
    params = make_params()
    opt = tg.DistAdam(groups(params), lr=0.01, **HYPER)
    run(opt, params, range(2))
    saved = ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()))
    run(opt, params, range(2, 4))
    resumed = [p.detach().clone().requires_grad_() for p in saved[0]]
    again = tg.DistAdam(groups(resumed), lr=0.01, **HYPER)
    again.load_state_dict(saved[1])
    run(again, resumed, range(2, 4))
    return [p.detach() for p in params], [p.detach() for p in resumed]


def test_two_ranks_resume_from_a_loaded_state():
    for straight, resumed in run_on_ranks(_resumed_run, 2):
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
