"""Device benchmark of one rank's share of Muon's compute (not part of the tests).

    python bench/bench_muon_share.py

On several GPUs each rank orthogonalises 16 / W matrices of each of Muon's two groups (the default model: 32
matrices of 3072 x 768, attention and MLP). This times, on one GPU, the share a rank gets at world sizes 1, 2, 4 and
8: Muon._owned_updates (momentum, Newton-Schulz per kind of matrix, NorMuon), captured as a CUDA graph and replayed,
as --muon_graphs does on several GPUs. For each world size and group it prints the slowest and the mean rank's
share (median of the replays, CUDA events), with the kinds one after another on one stream and side by side on
their own streams (Muon.parallel_kinds), with the Triton and the plain-torch Newton-Schulz; then the updates'
application to a group with multi-tensor ops and fused (Muon.fused_apply, checked bit-equal and against float64); then
rank 0's Newton-Schulz alone per kind. It checks first that the side-by-side streams give bit-equal updates and states.
"""
import collections
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402
from timing import median_ms  # noqa: E402


def as_graph(fn):
    """(fn captured as a CUDA graph, what the capture returned), after three warm-up calls on a side stream (as
    capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def forget_tuning():
    """Triton's autotuner keys on the shapes, not the batch: each world size tunes for its own batch, as a run does."""
    if tg.triton is not None:
        tg._symmetric_matmul_kernel.cache.clear()


def share(muon, params, world_size: int, rank: int, grads):
    group = tg._MuonGroup(params, world_size)
    muon.rank = rank
    return lambda: muon._owned_updates(group, grads)


def copy_state(state) -> collections.defaultdict:
    """The optimizer's state with its buffers copied (its keys, the parameters, kept)."""
    return collections.defaultdict(dict, {p: copy.deepcopy(buffers) for p, buffers in state.items()})


def check_streams_equal(muon, params, world_size: int, grads) -> str:
    """The kinds in turn and side by side, from the same state: bit-equal updates and optimizer state after one eager
    step, and after four steps as a graph (three warm-ups, one replay)."""
    saved = copy_state(muon.state)
    lines = []
    for as_graphs in (False, True):
        results = []
        for parallel in (False, True):
            muon.state, muon.parallel_kinds = copy_state(saved), parallel
            run = share(muon, params, world_size, 0, grads)
            if as_graphs:
                graph, updates = as_graph(run)
                graph.replay()
            else:
                updates = run()
            torch.cuda.synchronize()
            results.append((updates.clone(), copy_state(muon.state)))
        (in_turn, in_turn_state), (side_by_side, side_by_side_state) = results
        same_state = in_turn_state.keys() == side_by_side_state.keys() and all(
            torch.equal(in_turn_state[p][k], side_by_side_state[p][k]) for p in in_turn_state for k in in_turn_state[p])
        lines.append(f"{'graphs' if as_graphs else 'eager '}, world size {world_size}: updates bit-equal "
                     f"{torch.equal(in_turn, side_by_side)}, state bit-equal {same_state}, updates' norm "
                     f"{in_turn.float().norm():.4f}")
    muon.state, muon.parallel_kinds = saved, False
    return "\n".join(lines)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    cfg = tg.Config()
    device = torch.device("cuda")
    kernels = tg.choose_kernels(cfg, device)
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.bfloat16, kernels=kernels).to(device)
    muon = tg.build_optimizers(model, cfg)[0]
    muon.fill_scalars()
    groups = [group.params for group in muon.groups]
    print(f"Muon groups: {[len(g) for g in groups]} matrices of {tuple(groups[0][0].shape)}; Triton Newton-Schulz "
          f"{muon.use_triton}; {torch.cuda.get_device_name()}")

    for world_size in (2, 4):
        grads = torch.randn(16 // world_size, *groups[0][0].shape, device=device, dtype=groups[0][0].dtype) * 1e-3
        print(check_streams_equal(muon, groups[0], world_size, grads))

    triton_on = muon.use_triton
    print("world size, group: ms per share, slowest rank / mean over ranks")
    for world_size in (1, 2, 4, 8):
        per_rank = 16 // world_size
        for use_triton in ((True, False) if triton_on else (False,)):
            muon.use_triton = use_triton
            forget_tuning()
            for parallel in (False, True):
                muon.parallel_kinds = parallel
                cells = []
                for index, params in enumerate(groups):
                    grads = torch.randn(per_rank, *params[0].shape, device=device, dtype=params[0].dtype) * 1e-3
                    times = [median_ms(as_graph(share(muon, params, world_size, rank, grads))[0].replay, repeats=50,
                                       warmup=5) for rank in range(world_size)]
                    cells.append(f"group {index} {max(times):.3f} / {statistics.mean(times):.3f}")
                label = f"{'Triton' if use_triton else 'torch '} NS, kinds {'side by side' if parallel else 'in turn'}"
                print(f"  W={world_size} {label:34s} " + "   ".join(cells))
    muon.use_triton, muon.parallel_kinds = triton_on, False

    print("applying a group's updates (16 matrices, as every rank does), as a graph: multi-tensor ops / fused")
    neg_lr, neg_decay = -0.03, -2e-4  # every param group's, in fill_scalars' columns while this part runs
    scheduled, fused_apply = muon.scalars, muon.fused_apply
    muon.scalars = torch.tensor([[0.0, 0.0, 0.0, neg_lr, neg_decay]] * len(muon.param_groups), device=device)
    for index, params in enumerate(groups):
        updates = (torch.randn(len(params), *params[0].shape, device=device) * 0.02).to(torch.bfloat16)
        before = [p.detach().clone() for p in params]
        results = []
        for fused in (False, True):
            for p, b in zip(params, before):
                p.data.copy_(b)
            muon.fused_apply = fused
            muon._apply(params, updates)
            torch.cuda.synchronize()
            results.append([p.detach().clone() for p in params])
            times = median_ms(as_graph(lambda: muon._apply(params, updates))[0].replay, repeats=50, warmup=5)
            print(f"  group {index} {'fused' if fused else 'multi-tensor ops'}: {times:.3f} ms")
        reference = []
        for p, b, u in zip(params, before, updates):
            w, u = b.double(), u.double()
            decay = muon.param_groups[muon.group_index_of[p]]["weight_decay"] != 0
            w = w + torch.where(u * w >= 0, w, 0.0) * neg_decay * decay
            reference.append(w + u * neg_lr)
        worst = max(((r.double() - ref).abs().max() / ref.abs().max()).item() for r, ref in zip(results[1], reference))
        same = all(torch.equal(a, b) for a, b in zip(*results))
        print(f"  group {index}: fused bit-equal to the multi-tensor ops {same}; largest error against float64 "
              f"{worst:.2e} of the largest weight")
        for p, b in zip(params, before):
            p.data.copy_(b)
    muon.fused_apply, muon.scalars = fused_apply, scheduled

    print("rank 0's Newton-Schulz alone per kind, as a graph (ms): Triton / torch")
    for world_size in (1, 2, 4, 8):
        forget_tuning()
        per_rank = 16 // world_size
        for index, params in enumerate(groups):
            owned = params[:per_rank]
            kinds = {}
            for p in owned:
                settings = muon.param_groups[muon.group_index_of[p]]
                for height, count in tg.row_blocks(p, settings):
                    kinds[(height, count)] = kinds.get((height, count), 0) + 1
            cells = []
            for (height, count), n in kinds.items():
                x = torch.randn(n * count, height, p.size(-1), device=device)
                times = [median_ms(as_graph(lambda: tg.orthogonalize(x, t))[0].replay, repeats=50, warmup=5)
                         for t in ((True, False) if triton_on else (False,))]
                cells.append(f"{n * count}x{height}x{p.size(-1)}: " + " / ".join(f"{t:.3f}" for t in times))
            print(f"  W={world_size} group {index}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
