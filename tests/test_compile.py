"""Compilation on the CPU (whole-model and regional): same losses as eager, and --compile_cache reused across
fresh runs."""
import os
import re
import subprocess
import sys

from helpers import REPO

VAL = re.compile(r"^step:1/1 val_loss:(\S+)", re.M)
CHECKSUM = re.compile(r"^final weights: float64 sum (\S+), sum of squares (\S+)$", re.M)


def run_tiny(tmp_path, train, val, run_id, *extra, inductor_dir=None):
    env = dict(os.environ)
    if inductor_dir is not None:  # an empty local inductor cache, so any hit must come from --compile_cache
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    args = ["--device=cpu", "--preset=tiny", f"--train_files={train}", f"--val_files={val}", "--num_iterations=1",
            "--val_loss_every=0", "--micro_batch_tokens=128", f"--run_id={run_id}", *extra]
    result = subprocess.run([sys.executable, str(REPO / "train_gpt.py"), *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return (tmp_path / "logs" / f"{run_id}.txt").read_text()


def test_compiled_runs_match_eager_and_reuse_the_cache_file(tiny_data, tmp_path):
    train, val = tiny_data
    cache = tmp_path / "compile_cache.bin"
    cache.write_bytes(b"this is not a compile cache")
    compiled = ["--compile=1", f"--compile_cache={cache}"]
    first = run_tiny(tmp_path, train, val, "first", *compiled, inductor_dir=tmp_path / "inductor1")
    second = run_tiny(tmp_path, train, val, "second", *compiled, inductor_dir=tmp_path / "inductor2")
    eager = run_tiny(tmp_path, train, val, "eager", "--compile=0")

    assert re.search(rf"^warning: compile cache {re.escape(str(cache))} ignored", first, re.M)
    # auto picks one whole-model graph where windows are tensors, and no CUDA graphs on a CPU
    assert "compile scope: whole, mode: default (auto);" in first
    hits = [int(re.search(r"graphs:\d+ cache_hits:(\d+)", log).group(1)) for log in (first, second)]
    graphs = [int(re.search(r"graphs:(\d+)", log).group(1)) for log in (first, second)]
    assert hits[0] == 0 and hits[1] >= graphs[1] > 0  # the second run's graphs all came from the file
    assert all("\ngraphs compiled in the timed region: 0\n" in log for log in (first, second))
    losses = [float(VAL.search(log).group(1)) for log in (first, second, eager)]
    assert losses[0] == losses[1]
    assert abs(losses[0] - losses[2]) < 1e-3 * losses[2]
    # the weights after the step: the two compiled runs (same kernels) bit for bit, eager closely
    checksums = [tuple(map(float, CHECKSUM.search(log).groups())) for log in (first, second, eager)]
    assert checksums[0] == checksums[1]
    assert abs(checksums[0][1] - checksums[2][1]) < 1e-5 * checksums[2][1]


def test_regional_compile_and_dense_embedding_grads_match_eager(tiny_data, tmp_path):
    """Each block and the loss head compiled on its own (the scope FA3 runs use; here in the CUDA-graph mode,
    which zeroes every .grad before a step), and --row_embedding_grads=0 (the lookups and their dense
    gradients inside the one graph), give eager's losses."""
    train, val = tiny_data
    regional = run_tiny(tmp_path, train, val, "regional", "--compile=1", "--compile_scope=regional",
                        "--compile_mode=reduce-overhead", inductor_dir=tmp_path / "inductor")
    rows = run_tiny(tmp_path, train, val, "rows", "--compile=1", "--row_embedding_grads=0",
                    inductor_dir=tmp_path / "inductor")
    eager = run_tiny(tmp_path, train, val, "eager", "--compile=0")
    assert "compile scope: regional, mode: reduce-overhead;" in regional  # no graphs on a CPU, same losses
    assert "compile scope: whole, mode: default (auto);" in rows and "\ngraphs compiled in the timed region: 0\n" in rows
    losses = [float(VAL.search(log).group(1)) for log in (regional, rows, eager)]
    assert abs(losses[0] - losses[2]) < 1e-3 * losses[2]
    assert abs(losses[1] - losses[2]) < 1e-3 * losses[2]


def test_recompile_watch_reports_the_failed_guard():
    import torch
    import train_gpt as tg

    def scale(x, n):
        return x * n

    compiled = torch.compile(scale, dynamic=False)
    compiled(torch.randn(3), 2)
    watch = tg.RecompileWatch()
    compiled(torch.randn(3), 2)
    assert watch.new_reasons() == []  # same guards: no new graph
    compiled(torch.randn(3), 3)
    reasons = watch.new_reasons()
    assert len(reasons) == 1 and reasons[0].startswith("scale (test_compile.py:") and "n == 2" in reasons[0]
    assert watch.new_reasons() == []


def test_recompile_watch_reports_a_backward_compiled_at_its_first_call():
    import torch
    import train_gpt as tg

    def loss(x):
        return (x.sin() * 2).sum()

    compiled = torch.compile(loss, dynamic=False)
    x = torch.randn(8, requires_grad=True)
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph brings its backward along
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


def test_kernel_tuning_is_for_gpus_and_can_be_turned_off():
    import dataclasses

    import torch
    import train_gpt as tg

    with torch._inductor.config.patch(coordinate_descent_tuning=False):
        for tune, device, want in ((True, "cuda", True), (True, "cpu", False), (False, "cuda", False)):
            tg.configure_inductor(dataclasses.replace(tg.Config(), tune_kernels=tune), torch.device(device))
            assert torch._inductor.config.coordinate_descent_tuning is want, (tune, device)
