"""Compilation on the CPU: the whole-model graph gives eager's losses, inductor's cache serves a second start, and the
recompile watch names what compiled after the warm-up."""
import re
import types

import torch

import train_gpt as tg
from helpers import TINY, Trainer

VAL = re.compile(r"^step:1/1 val_loss:(\S+)", re.M)
CHECKSUM = re.compile(r"^final weights: float64 sum (\S+), sum of squares (\S+)$", re.M)


# Inductor's C++ without SIMD: a CPU compile is mostly g++, which builds scalar loops faster, and one command lets
# the runs share a precompiled header and skip the SIMD probe
SCALAR_CPP = {"cpp.vec_isa_ok": False}
# the tiny model at three layers, each part placed where it still applies: fewer kernels for g++
THREE_LAYERS = ["--num_layers=3", "--attn_layout=SLL", "--value_embed_layout=0.1", "--skip_from=0", "--skip_to=1",
                "--attn_input_from=0", "--backout_from=1", "--paired_head_layers=0", "--xsa_layers=1"]


def run_tiny(tmp_path, train, val, run_id, *extra, inductor_dir=None) -> str:
    env = {} if inductor_dir is None else {"TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
    args = ["--device=cpu", *TINY, *THREE_LAYERS, f"--train_files={train}", f"--val_files={val}", "--num_iterations=1",
            "--val_loss_every=0", "--micro_batch_tokens=128", *extra]
    return Trainer(run_id, args, tmp_path, env, inductor=SCALAR_CPP).log(timeout=900)


def test_compiled_runs_match_eager_and_a_second_start_takes_its_graphs_from_the_cache(tiny_data, tmp_path):
    train, val = tiny_data
    eager = run_tiny(tmp_path, train, val, "eager", "--compile=0")
    first, second = (run_tiny(tmp_path, train, val, run_id, "--compile=1", inductor_dir=tmp_path / "inductor")
                     for run_id in ("first", "second"))
    assert "CUDA graphs: model 0, Muon 0" in first  # none on a CPU
    hits = [int(re.search(r"graphs:\d+ cache_hits:(\d+)", log).group(1)) for log in (first, second)]
    graphs = [int(re.search(r"graphs:(\d+)", log).group(1)) for log in (first, second)]
    assert hits[0] == 0 and hits[1] >= graphs[1] > 0  # the second run's graphs all came from the cache
    assert re.search(r" cache_misses:0[ ;]", second)
    assert all("\ngraphs compiled in the timed region: 0\n" in log for log in (first, second))
    losses = [float(VAL.search(log).group(1)) for log in (first, second, eager)]
    assert losses[0] == losses[1] and abs(losses[0] - losses[2]) < 1e-3 * losses[2]
    # the weights after the step: the two compiled runs (same kernels) bit for bit, eager closely
    checksums = [tuple(map(float, CHECKSUM.search(log).groups())) for log in (first, second, eager)]
    assert checksums[0] == checksums[1]
    assert abs(checksums[0][1] - checksums[2][1]) < 1e-5 * checksums[2][1]


def test_recompile_watch_reports_a_new_graph():
    def scale(x, n):
        return x * n

    compiled = torch.compile(scale, dynamic=False, backend="eager")  # dynamo's guards are the same on any backend
    compiled(torch.randn(3), 2)
    watch = tg.RecompileWatch()
    compiled(torch.randn(3), 2)
    assert watch.new_reasons() == []  # same guards: no new graph
    compiled(torch.randn(3), 3)
    reasons = watch.new_reasons()
    assert reasons == ["1 new graph(s); TORCH_LOGS=recompiles names the failed guard"]
    assert watch.new_reasons() == []


def test_recompile_watch_reports_a_backward_compiled_at_its_first_call():
    def loss(x):
        return (x.sin() * 2).sum()

    compiled = torch.compile(loss, dynamic=False, backend="aot_eager")
    x = torch.randn(8, requires_grad=True)
    y = compiled(x)  # AOTAutograd compiles the forward here and the backward at its first call
    watch = tg.RecompileWatch()
    try:
        y.backward()
        first = watch.new_reasons()
        compiled(x).backward()
        second = watch.new_reasons()
    finally:
        watch.close()
    assert len(first) == 1 and first[0].startswith("backward compiled lazily for compiled graph "), first
    assert second == [] and watch.since_warm_up() == 1


def test_graphs_with_custom_autograd_functions_are_cached_as_compile_model_sets_it():
    """The FP8 head, the pointer and the fused MLP are autograd Functions, which AOTAutograd's cache refuses unless
    told: compile_model tells it, and a second compile of such a graph then comes from the cache."""
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    def loss(x):
        return Double.apply(x.sin()).sum()

    x = torch.randn(8, requires_grad=True)
    with torch._inductor.config.patch(**SCALAR_CPP), torch._functorch.config.patch(
            autograd_cache_allow_custom_autograd_functions=False):
        stand_in = types.SimpleNamespace(attend=None, trunk=lambda: None, find_matches=lambda: None)
        tg.compile_model(stand_in, tg.parse_cli(["--device=cpu", *TINY, "--compile=1"])[0], model_graphs=False)
        assert torch._functorch.config.autograd_cache_allow_custom_autograd_functions
        counts = []
        for _ in range(2):  # the second compile, after dynamo forgets the first, comes from the cache
            torch._dynamo.reset()
            before = tg.cache_counts()
            torch.compile(loss, dynamic=False)(x).backward()
            counts.append([after - was for after, was in zip(tg.cache_counts(), before)])
    assert counts[1][0] > 0 and counts[1][1] == 0, counts
