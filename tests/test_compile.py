"""Compilation on the CPU (whole-model and regional): same losses as eager, and --compile_cache reused across
fresh runs."""
import contextlib
import inspect
import json
import os
import random
import re
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from helpers import REPO, TINY, Trainer, load_script, run_on_ranks

VAL = re.compile(r"^step:1/1 val_loss:(\S+)", re.M)
CHECKSUM = re.compile(r"^final weights: float64 sum (\S+), sum of squares (\S+)$", re.M)


def copy_kernels(src, dst):
    """Inductor's compiled C++ kernels (<cache>/<2 characters>/<hash>.main.cpp and .so) that dst lacks, copied from
    src. Each is named by the hash of its source and compile command, so a run loads one only for the very kernel it
    generated (g++ takes about a third of a cold compile of the tiny model on 2 cores); the graph caches (fxgraph/,
    aotautograd/) are not copied, so every graph is still traced, lowered and generated, or served by
    --compile_cache."""
    for path in src.glob("??/*.main.*"):
        if path.suffix in (".cpp", ".so") and not (dst / path.parent.name / path.name).exists():
            (dst / path.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dst / path.parent.name / path.name)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The C++ kernels compiled so far by this module's runs (see copy_kernels)."""
    return tmp_path_factory.mktemp("kernels")


@contextlib.contextmanager
def inductor_cache(path, kernels):
    """A fresh local inductor cache for the runs inside the with: no graphs, so any graph hit must come from
    --compile_cache, but the module's kernels so far; the kernels they compile go back to the module's at the end
    (after the runs: a library still being written must not be copied)."""
    path.mkdir()
    copy_kernels(kernels, path)
    yield path
    copy_kernels(path, kernels)


# Inductor's C++ without SIMD, for every inductor compile here: a CPU compile is mostly g++, which builds scalar loops
# about a fifth faster (the graphs, caches and scopes under test are the same), and one compile command lets the
# tests' own processes share the runs' precompiled header (a cold one is about 10 s of g++) and skip the SIMD probe.
SCALAR_CPP = {"cpp.vec_isa_ok": False}

# The tiny model at two layers, each feature placed where it still applies: half a cold CPU compile is g++, about 1.4 s
# a kernel on 2 cores, and two layers make two thirds of four layers' kernels (36 against 55).
TWO_LAYERS = ["--num_layers=2", "--attn_layout=SL", "--value_embed_layout=01", "--skip_from=0", "--skip_to=1",
              "--backout_from=1", "--paired_head_layers=0"]


def start_tiny(tmp_path, train, val, run_id, *extra, inductor_dir=None, aot_eager=False):
    """Start a one-step run of the tiny model at two layers, compiled by inductor or, with aot_eager, on the aot_eager
    backend: dynamo's capture, its guards and graph counts, and AOT autograd's forward and backward, as in an inductor
    compile, with the graphs' ops run eagerly instead of generated and built (about a minute of g++ a run here; the
    trainer still does what its --compile_mode asks of it: under a CUDA-graph mode, .grad zeroed each step). Returns a
    function that waits for it and returns its log."""
    env = {} if inductor_dir is None else {"TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
    args = ["--device=cpu", *TINY, *TWO_LAYERS, f"--train_files={train}", f"--val_files={val}", "--num_iterations=1",
            "--val_loss_every=0", "--micro_batch_tokens=128", *extra]
    run = Trainer(run_id, args, tmp_path, env, inductor=SCALAR_CPP,
                  compile_backend="aot_eager" if aot_eager else None)
    return lambda: run.log(timeout=900)


def run_tiny(*args, **kwargs) -> str:
    return start_tiny(*args, **kwargs)()


def finish_all(runs) -> list[str]:
    """The logs of runs started together; every run is waited for before the first failure is raised."""
    logs, failures = [], []
    for finish in runs:
        try:
            logs.append(finish())
        except Exception as e:
            failures.append(e)
    if failures:
        raise failures[0]
    return logs


@pytest.fixture(scope="module")
def eager(module_tiny_data, tmp_path_factory):
    """The eager run both compiled tests compare with: its log."""
    return run_tiny(tmp_path_factory.mktemp("eager"), *module_tiny_data, "eager", "--compile=0")


def test_compiled_runs_match_eager_and_reuse_the_cache_file(module_tiny_data, eager, kernels, tmp_path):
    train, val = module_tiny_data
    cache = tmp_path / "compile_cache.bin"
    cache.write_bytes(b"this is not a compile cache")
    compiled = ["--compile=1", f"--compile_cache={cache}"]
    with inductor_cache(tmp_path / "inductor1", kernels) as inductor:
        first = run_tiny(tmp_path, train, val, "first", *compiled, inductor_dir=inductor)
    with inductor_cache(tmp_path / "inductor2", kernels) as inductor:
        second = run_tiny(tmp_path, train, val, "second", *compiled, inductor_dir=inductor)

    assert re.search(rf"^warning: compile cache {re.escape(str(cache))} ignored", first, re.M)
    # what the file holds, by kind, when written and when read back
    saved = re.search(r"^compile cache .*: saved [\d,]+ bytes, (\d+) artifacts \((.*)\), \d+ Triton cache entries$",
                      first, re.M)
    loaded = re.search(r"^compile cache .*: loaded (\d+) artifacts \((.*)\); \d+ Triton cache entries put back$",
                       second, re.M)
    assert saved and loaded and "inductor " in loaded.group(2) and int(loaded.group(1)) > 0
    assert re.search(rf"^compile cache {re.escape(str(cache))}: it served this run .* left as it is", second, re.M)
    # auto picks one whole-model graph where windows are tensors, and no CUDA graphs on a CPU
    assert "compile scope: whole, mode: default (auto);" in first
    hits = [int(re.search(r"graphs:\d+ cache_hits:(\d+)", log).group(1)) for log in (first, second)]
    graphs = [int(re.search(r"graphs:(\d+)", log).group(1)) for log in (first, second)]
    assert hits[0] == 0 and hits[1] >= graphs[1] > 0  # the second run's graphs all came from the file
    assert re.search(r" cache_misses:0 cache_bypasses:0 ", second)
    assert all("\ngraphs compiled in the timed region: 0\n" in log for log in (first, second))
    losses = [float(VAL.search(log).group(1)) for log in (first, second, eager)]
    assert losses[0] == losses[1]
    assert abs(losses[0] - losses[2]) < 1e-3 * losses[2]
    # the weights after the step: the two compiled runs (same kernels) bit for bit, eager closely
    checksums = [tuple(map(float, CHECKSUM.search(log).groups())) for log in (first, second, eager)]
    assert checksums[0] == checksums[1]
    assert abs(checksums[0][1] - checksums[2][1]) < 1e-5 * checksums[2][1]


def test_regional_and_split_compile_and_dense_embedding_grads_match_eager(module_tiny_data, eager, tmp_path):
    """Each block and the loss head compiled on its own (here in the CUDA-graph mode, which zeroes every .grad
    before a step), the model in two graphs (--compile_scope=split), and --row_embedding_grads=0 (the lookups and
    their dense gradients inside the one graph), give eager's losses. On aot_eager (start_tiny): these test what is
    captured and where the graphs break; inductor's kernels of the model are the test above's."""
    train, val = module_tiny_data
    regional, split, rows = finish_all([
        start_tiny(tmp_path, train, val, "regional", "--compile=1", "--compile_scope=regional",
                   "--compile_mode=reduce-overhead", aot_eager=True),
        start_tiny(tmp_path, train, val, "split", "--compile=1", "--compile_scope=split", aot_eager=True),
        start_tiny(tmp_path, train, val, "rows", "--compile=1", "--row_embedding_grads=0", aot_eager=True)])
    assert "compile scope: regional, mode: reduce-overhead;" in regional  # no graphs on a CPU, same losses
    assert "compile scope: split, mode: default (auto);" in split and re.search(r"graphs:2 ", split)
    assert "compile scope: whole, mode: default (auto);" in rows
    assert all("\ngraphs compiled in the timed region: 0\n" in log for log in (split, rows))
    losses = [float(VAL.search(log).group(1)) for log in (regional, split, rows, eager)]
    assert all(abs(loss - losses[-1]) < 1e-3 * losses[-1] for loss in losses[:-1])


def test_recompile_watch_reports_the_failed_guard():
    import torch
    import train_gpt as tg

    def scale(x, n):
        return x * n

    compiled = torch.compile(scale, dynamic=False, backend="eager")  # dynamo's guards are the same on any backend
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

    compiled = torch.compile(loss, dynamic=False, backend="aot_eager")  # AOTAutograd's, with no kernels to build
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


def test_kernel_tuning_is_for_gpus_and_by_default_only_where_a_compile_cache_keeps_it():
    import dataclasses

    import torch
    import train_gpt as tg

    with torch._inductor.config.patch(coordinate_descent_tuning=False), torch._functorch.config.patch(
            autograd_cache_allow_custom_autograd_functions=False):
        for tune, cache, device, want in (("1", "", "cuda", True), ("1", "", "cpu", False), ("0", "f.bin", "cuda", False),
                                          ("auto", "", "cuda", False), ("auto", "f.bin", "cuda", True),
                                          ("auto", "f.bin", "cpu", False)):
            cfg = dataclasses.replace(tg.Config(), tune_kernels=tune, compile_cache=cache)
            tg.configure_inductor(cfg, torch.device(device))
            assert torch._inductor.config.coordinate_descent_tuning is want, (tune, cache, device)
    with pytest.raises(tg.UserError, match=r"^--tune_kernels=yes: use auto, 1 or 0$"):
        tg.validate_config(dataclasses.replace(tg.Config(), tune_kernels="yes"))


def test_compile_cache_watch_counts_a_bypass_with_its_reason_and_stays_quiet(capfd):
    import logging

    import torch
    import train_gpt as tg

    def loss(x):
        return (x.sin() * 2).sum()

    levels = [logging.getLogger(name).level for name in tg.CompileCacheWatch.LOGGERS]
    watch = tg.CompileCacheWatch()
    try:  # AOTAutograd's cache refuses graphs compiled with freezing
        with torch._inductor.config.patch(freezing=True, **SCALAR_CPP), torch.no_grad():
            torch.compile(loss, dynamic=False)(torch.randn(8))
    finally:
        watch.close()
    assert re.fullmatch(r"cache_hits:\d+ cache_misses:\d+ cache_bypasses:1", watch.summary()), watch.summary()
    assert watch.bypass_lines() == ["compile cache bypassed 1x: Bypassing autograd cache due to: "
                                    "Cannot cache a graph with freezing enabled"]
    assert "Bypassing" not in capfd.readouterr().err  # torch's INFO lines stay as quiet as before
    assert [logging.getLogger(name).level for name in tg.CompileCacheWatch.LOGGERS] == levels


def test_graphs_with_custom_autograd_functions_are_cached():
    import dataclasses

    import torch
    import train_gpt as tg

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
    with torch._inductor.config.patch(coordinate_descent_tuning=False, **SCALAR_CPP), \
            torch._functorch.config.patch(autograd_cache_allow_custom_autograd_functions=False):
        tg.configure_inductor(dataclasses.replace(tg.Config(), compile=True), torch.device("cpu"))
        summaries = []
        for _ in range(2):  # the second compile, after dynamo forgets the first, comes from the cache
            torch._dynamo.reset()
            watch = tg.CompileCacheWatch()
            try:
                torch.compile(loss, dynamic=False)(x).backward()
            finally:
                watch.close()
            summaries.append(watch.summary())
    # The first compile may find some of its pieces in the inductor cache that earlier tests filled.
    assert re.fullmatch(r"cache_hits:\d+ cache_misses:\d+ cache_bypasses:0", summaries[0]), summaries
    assert re.fullmatch(r"cache_hits:[1-9]\d* cache_misses:0 cache_bypasses:0", summaries[1]), summaries


def test_kernels_loaded_from_a_cache_run_their_tuned_config_without_tuning_again(monkeypatch):
    """recheck_tuned_config (torch's fix of pytorch#172819, put in where the installed torch lacks it): a kernel
    compiled with the config coordinate descent chose, even its only one, is marked as tuned so it is not tuned again;
    one whose tuned config was never compiled compiles it; a cache miss leaves the compiled configs as they are."""
    import train_gpt as tg
    triton = pytest.importorskip("triton")
    heuristics = pytest.importorskip("torch._inductor.runtime.triton_heuristics")
    tuned = triton.Config({"XBLOCK": 256}, num_warps=8)
    tuned.found_by_coordesc = True
    cached, cache = [], None
    monkeypatch.setattr(heuristics, "check_autotune_cache", lambda configs, filename, meta: (cached, cache, {"hit": 1}))

    def kernel(*configs):
        autotuner = types.SimpleNamespace(filename="k.py", inductor_meta={"coordinate_descent_tuning": True},
                                          fn=types.SimpleNamespace(fn=None),
                                          compile_results=[types.SimpleNamespace(config=c) for c in configs])
        autotuner._precompile_config = lambda config: types.SimpleNamespace(config=config, fresh=True)
        return autotuner

    only = kernel(triton.Config({"XBLOCK": 256}, num_warps=8))
    cached[:] = [tuned]
    tg.recheck_tuned_config(only, reload_kernel_from_src=None)
    assert len(only.compile_results) == 1 and only.compile_results[0].config.found_by_coordesc
    assert not hasattr(only.compile_results[0], "fresh") and only.autotune_cache_info == {"hit": 1}

    two = kernel(triton.Config({"XBLOCK": 64}, num_warps=4), triton.Config({"XBLOCK": 128}, num_warps=4))
    reloaded = types.SimpleNamespace(fn="source")
    tg.recheck_tuned_config(two, reload_kernel_from_src=lambda: reloaded)
    assert [r.config for r in two.compile_results] == [tuned] and two.compile_results[0].fresh and two.fn == "source"

    missed = kernel(triton.Config({"XBLOCK": 64}, num_warps=4), triton.Config({"XBLOCK": 128}, num_warps=4))
    before = list(missed.compile_results)
    cached[:] = []
    tg.recheck_tuned_config(missed, reload_kernel_from_src=None)
    assert missed.compile_results == before


def torch_autotune_cache(monkeypatch) -> None:
    """The autotune cache's lookup and save as torch has them, put back after the test: an earlier test's
    configure_inductor, with tuning on, may have put prefer_tuned_cache_entries's in."""
    autotune_cache = pytest.importorskip("torch._inductor.runtime.autotune_cache")
    for name in ("read_best", "save"):
        installed = autotune_cache.AutotuneCache.__dict__[name]
        monkeypatch.setattr(autotune_cache.AutotuneCache, name, getattr(installed, "plain", installed))
    create = autotune_cache.AutotuneCache.__dict__["create"].__func__  # a staticmethod
    monkeypatch.setattr(autotune_cache.AutotuneCache, "create", staticmethod(getattr(create, "plain", create)))


def test_a_kernel_from_another_runs_cache_folder_finds_its_tuned_config_in_this_one(monkeypatch, tmp_path):
    """find_tuned_configs_in_this_cache_folder: a kernel loaded from a cache keeps the path its writing run compiled
    it to, and --compile_cache puts the tuned configs back in this run's inductor cache folder, under the kernel
    file's last folder and name. Torch alone looks beside the writer's path, which an emptied cache or another
    machine lacks, and misses; with it in place the lookup finds the tuned config here, and a save lands here."""
    import train_gpt as tg
    triton = pytest.importorskip("triton")
    heuristics = pytest.importorskip("torch._inductor.runtime.triton_heuristics")
    torch_autotune_cache(monkeypatch)
    here = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(here))
    meta = {"coordinate_descent_tuning": True}
    one = [triton.Config({"XBLOCK": 64}, num_warps=4)]
    tuned = triton.Config({"XBLOCK": 256}, num_warps=8)
    mine = here / "ab" / "cabcdef.py"  # where this run compiles the kernel; the file put its tuned config beside it
    _, cache, _ = heuristics.check_autotune_cache(one, str(mine), meta)
    cache.save(tuned, 1_000_000, found_by_coordesc=True)
    own_entry = cache.local_cache[1]
    writers = tmp_path / "gone" / "ab" / "cabcdef.py"  # the same kernel, named by the writing run's path

    def lookup(kernel):
        (config, *_), cache, info = heuristics.check_autotune_cache(one, str(kernel), meta)
        return config, cache.local_cache[1], info["autotune_cache_state"]

    assert lookup(writers)[2] == "miss"
    assert tg.find_tuned_configs_in_this_cache_folder() and tg.find_tuned_configs_in_this_cache_folder()
    config, entry, state = lookup(writers)
    assert (state, entry) == ("hit", own_entry)
    assert config.kwargs == {"XBLOCK": 256} and config.num_warps == 8 and config.found_by_coordesc
    assert lookup(mine)[1:] == (own_entry, "hit")  # this run's own kernels keep their paths
    other = tmp_path / "gone" / "cd" / "cfedcba.py"  # a kernel with nothing stored: tuned, and saved here
    assert lookup(other)[2] == "miss"
    heuristics.check_autotune_cache(one, str(other), meta)[1].save(tuned, 1_000_000, found_by_coordesc=True)
    assert lookup(other)[2] == "hit" and not (tmp_path / "gone").exists()
    assert lookup(other)[1].startswith(str(here / "cd"))


def test_the_autotune_cache_keeps_and_finds_the_configs_coordinate_descent_found(monkeypatch, tmp_path):
    """prefer_tuned_cache_entries, on a real autotune cache: an entry coordinate descent stored against the hash of
    other candidate configs is found (as tuned, so it is not tuned again), at the lookup when a kernel is made
    (check_autotune_cache) and at the one of a kernel loaded from a cache (recheck_tuned_config); an unmarked save
    (plain autotuning's winner) does not replace it. Torch alone does neither."""
    import train_gpt as tg
    triton = pytest.importorskip("triton")
    heuristics = pytest.importorskip("torch._inductor.runtime.triton_heuristics")
    torch_autotune_cache(monkeypatch)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    kernel = tmp_path / "cabcdef.py"  # the autotune cache keys a kernel by its file's name, a hash of its source
    kernel.write_text("# a kernel's source")
    meta = {"coordinate_descent_tuning": True}
    one = [triton.Config({"XBLOCK": 64}, num_warps=4)]
    two = one + [triton.Config({"XBLOCK": 128}, num_warps=4)]
    tuned = triton.Config({"XBLOCK": 256}, num_warps=8, num_stages=1)

    def lookup(configs, inductor_meta=meta):
        return heuristics.check_autotune_cache(configs, str(kernel), inductor_meta)

    def store(config, by_coordesc):  # saved as tuned from `one`, the way the writing run's kernel was
        lookup(one)[1].save(config, 1_000_000, found_by_coordesc=by_coordesc)

    def stored():
        return lookup(one)[1]._read()

    store(tuned, True)
    assert lookup(two)[0] == two  # torch's own lookup misses on the configs hash
    store(two[1], False)
    assert not stored()["found_by_coordesc"]  # and its save puts an untuned winner over the tuned config

    assert tg.prefer_tuned_cache_entries() and tg.prefer_tuned_cache_entries()  # once in place, it stays as it is
    store(tuned, True)
    (made,), _, info = lookup(two)
    assert made.kwargs == {"XBLOCK": 256} and made.num_warps == 8 and made.found_by_coordesc
    assert info["autotune_cache_state"] == "hit"
    assert lookup(two, {})[0] == two  # coordinate descent off: no fallback
    store(two[1], False)
    assert stored()["found_by_coordesc"] and stored()["XBLOCK"] == 256  # the unmarked save left it
    store(triton.Config({"XBLOCK": 512}, num_warps=8), True)
    assert stored()["XBLOCK"] == 512  # a marked save replaces it

    # a kernel loaded from a cache, compiled with the candidates: the stored config is compiled (it is not among them)
    loaded = types.SimpleNamespace(filename=str(kernel), inductor_meta=meta, fn=types.SimpleNamespace(fn="source"),
                                   compile_results=[types.SimpleNamespace(config=c) for c in two])
    loaded._precompile_config = lambda config: types.SimpleNamespace(config=config, fresh=True)
    tg.recheck_tuned_config(loaded, reload_kernel_from_src=None)
    (result,) = loaded.compile_results
    assert result.fresh and result.config.kwargs == {"XBLOCK": 512} and result.config.found_by_coordesc

    # an entry only plain autotuning stored is not taken
    kernel.write_text("# another kernel's source")
    kernel = kernel.rename(tmp_path / "cfedcba.py")
    store(two[1], False)
    assert lookup(two)[0] == two


def test_a_kernel_whose_tuned_config_is_stored_is_not_tuned_again_at_its_first_run(monkeypatch, tmp_path):
    """tune_only_kernels_without_stored_tuning, on a real autotune cache: coordinate descent at a kernel's first run
    takes the config it stored for that kernel (compiled now where the launcher runs another), marked as tuned; a
    kernel with none stored is tuned as before, and one torch never tunes (our own) never reads the cache. A
    reduction whose lookup hit adds no smaller-block variants. Torch 2.11 alone tunes again and adds them."""
    import threading
    import train_gpt as tg
    triton = pytest.importorskip("triton")
    heuristics = pytest.importorskip("torch._inductor.runtime.triton_heuristics")
    torch_autotune_cache(monkeypatch)
    autotuner = heuristics.CachingAutotuner
    tuned_by_torch, scaled_by_torch = [], []
    monkeypatch.setattr(autotuner, "coordinate_descent_tuning",  # torch's own needs a GPU; put back afterwards
                        lambda self, launcher, *args: tuned_by_torch.append(self) or launcher)
    monkeypatch.setattr(autotuner, "_dynamic_scale_rblock", lambda self: scaled_by_torch.append(self))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert tg.tune_only_kernels_without_stored_tuning() and tg.tune_only_kernels_without_stored_tuning()
    kernel = tmp_path / "cabcdef.py"  # the autotune cache keys a kernel by its file's name, a hash of its source
    kernel.write_text("# a kernel's source")
    meta = {"coordinate_descent_tuning": True}
    untuned = triton.Config({"XBLOCK": 4}, num_warps=2)
    tuned = triton.Config({"XBLOCK": 2}, num_warps=2, num_stages=1)
    _, cache, _ = heuristics.check_autotune_cache([untuned], str(kernel), meta)
    cache.save(tuned, 1_000_000, found_by_coordesc=True)

    def reduction(filename, kind=heuristics.HeuristicType.PERSISTENT_REDUCTION, state="hit"):
        compiled = lambda config: types.SimpleNamespace(make_launcher=lambda: types.SimpleNamespace(config=config))
        return types.SimpleNamespace(filename=str(filename), inductor_meta=meta, heuristic_type=kind,
                                     lock=threading.Lock(), fn=types.SimpleNamespace(fn="source"),
                                     _precompile_config=compiled, autotune_cache_info={"autotune_cache_state": state})

    def first_run(kernel_autotuner, config):
        return autotuner.coordinate_descent_tuning(kernel_autotuner, types.SimpleNamespace(config=config))

    launcher = first_run(reduction(kernel), untuned)
    assert launcher.config.kwargs == {"XBLOCK": 2} and launcher.config.num_stages == 1
    assert launcher.config.found_by_coordesc and not tuned_by_torch
    from_worker = reduction(kernel)  # compiled in a worker, which drops the source: reloaded to compile the config
    from_worker.fn, from_worker._reload_kernel = types.SimpleNamespace(fn=None), lambda: types.SimpleNamespace(
        fn=types.SimpleNamespace(fn="reloaded"))
    assert first_run(from_worker, untuned).config.kwargs == {"XBLOCK": 2} and from_worker.fn.fn == "reloaded"
    same = triton.Config({"XBLOCK": 2}, num_warps=2, num_stages=1)
    assert first_run(reduction(kernel), same).config is same and same.found_by_coordesc  # no compile needed
    noticed = []
    monkeypatch.setattr(tg.FirstTuningNotice, "armed", noticed.append)  # as a load from --compile_cache arms it
    other = reduction(tmp_path / "cfedcba.py")  # nothing stored for this one: tuned, and the log says so, once
    assert first_run(other, untuned).config is untuned and tuned_by_torch == [other]
    first_run(reduction(tmp_path / "c0123.py"), untuned)
    assert noticed == ["?"] and tg.FirstTuningNotice.armed is None  # (the kernel's name, where the meta has one)
    ours = reduction(kernel, kind=heuristics.HeuristicType.USER_AUTOTUNE)
    first_run(ours, untuned)
    assert tuned_by_torch[-1] is ours and not getattr(untuned, "found_by_coordesc", False)

    hit, missed = reduction(kernel), reduction(kernel, state="miss")
    autotuner._dynamic_scale_rblock(hit)
    autotuner._dynamic_scale_rblock(missed)
    assert scaled_by_torch == [missed]


def test_the_tuned_config_fix_goes_in_only_where_torch_lacks_it(monkeypatch):
    import train_gpt as tg
    heuristics = pytest.importorskip("torch._inductor.runtime.triton_heuristics")
    autotuner = heuristics.CachingAutotuner
    installed = autotuner.__dict__.get("recheck_autotune_cache")
    assert installed is not None
    monkeypatch.setattr(autotuner, "recheck_autotune_cache", installed)  # put back after the test, whatever it does
    fixed_upstream = "len(configs) > 1" not in inspect.getsource(installed)
    assert tg.keep_tuned_configs_on_cache_hits() is not fixed_upstream
    assert (autotuner.recheck_autotune_cache is tg.recheck_tuned_config) is not fixed_upstream

    def guarded(self, reload_kernel_from_src):  # the shape of the method before the fix
        configs = self.compile_results
        if len(configs) > 1:
            pass

    monkeypatch.setattr(autotuner, "recheck_autotune_cache", guarded)
    assert tg.keep_tuned_configs_on_cache_hits() and autotuner.recheck_autotune_cache is tg.recheck_tuned_config


def test_compile_cache_file_is_rewritten_only_where_it_did_not_serve_the_run(tmp_path, monkeypatch):
    """A start from the file saves fewer artifacts than the run that compiled them, so a file that served the run
    stays as it is; one that did not load, or whose graphs mostly missed (other flags, other code), is written."""
    import collections

    import torch
    import train_gpt as tg
    info = types.SimpleNamespace(artifacts={"inductor": ["a", "b"]})
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"new artifacts", info))
    monkeypatch.setattr(tg, "triton_cache_dir", lambda: tmp_path / "no_triton_cache")
    path, lines = tmp_path / "cache.zip", []
    path.write_bytes(b"old")
    cache = tg.CompileCache(str(path), lines.append, tg.Comm())
    cache.loaded = True
    cache.save(set(), collections.Counter(hits=17, misses=1))
    assert path.read_bytes() == b"old" and "it served this run (17 cache hits, 1 misses)" in lines[-1]
    cache.save(set(), collections.Counter(hits=2, misses=12))
    with zipfile.ZipFile(path) as bundle:
        assert bundle.read(tg.CompileCache.TORCH_MEMBER) == b"new artifacts"
    assert lines[-1].endswith("2 artifacts (inductor 2), 0 Triton cache entries")
    path.unlink()
    tg.CompileCache(str(path), lines.append, tg.Comm()).save(set(), collections.Counter(hits=17))  # none loaded
    assert zipfile.is_zipfile(path)
    # the configs coordinate descent chose go in whole, and the line says how many of them Triton's cache held
    triton = tmp_path / "triton"
    (triton / "tuned").mkdir(parents=True)
    (triton / "tuned" / "triton_poi_fused_0.cubin").write_bytes(b"\x01")
    monkeypatch.setattr(tg, "triton_cache_dir", lambda: triton)
    monkeypatch.setattr(tg, "tuned_kernel_entries", lambda: {"tuned", "not_on_disk"})
    tg.CompileCache(str(path), lines.append, tg.Comm()).save(set(), collections.Counter())
    assert lines[-1].endswith(", 1 Triton cache entries, 1 of them tuned configs")
    with zipfile.ZipFile(path) as bundle:
        assert "triton/tuned/triton_poi_fused_0.cubin" in bundle.namelist()


def test_a_compile_cache_load_arms_the_first_tuning_notice(tmp_path, monkeypatch):
    """After a --compile_cache file loads, the first kernel that coordinate descent tunes gets one warning line: a
    start from a tuned file should tune nothing, and tuning all again takes minutes. An unusable file arms nothing."""
    import torch
    import train_gpt as tg
    monkeypatch.setattr(tg.FirstTuningNotice, "armed", None)
    monkeypatch.setattr(tg, "triton_cache_dir", lambda: tmp_path / "no_triton_cache")
    path, lines = tmp_path / "cache.zip", []
    with zipfile.ZipFile(path, "w") as bundle:
        bundle.writestr(tg.CompileCache.TORCH_MEMBER, b"artifacts")
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: None)  # torch: not for this version
    tg.CompileCache(str(path), lines.append, tg.Comm()).load()
    assert lines[-1].startswith("warning: compile cache") and tg.FirstTuningNotice.armed is None
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts",
                        lambda data: types.SimpleNamespace(artifacts={"autotune": ["a"], "inductor": ["b"]}))
    tg.CompileCache(str(path), lines.append, tg.Comm()).load()
    assert "loaded 2 artifacts (autotune 1, inductor 1)" in lines[-1]
    tg.FirstTuningNotice.say("triton_red_fused_0")
    tg.FirstTuningNotice.say("triton_red_fused_1")
    assert lines[-1] == (f"warning: compile cache {path} holds no tuned config for kernel triton_red_fused_0: "
                         "coordinate descent tunes it now, and each other kernel without one (minutes if many; "
                         "--tune_kernels=0 skips tuning)")


def test_autotune_probe_names_each_lookup_and_why_a_miss_missed(monkeypatch, tmp_path, capsys):
    """bench/autotune_probe (AUTOTUNE_PROBE=1 in bench/startup_bench.sh) reports every autotune-cache lookup of a
    kernel that coordinate descent tunes, and whether the config found carries coordinate descent's mark; a miss
    against a stored entry shows the stored and the asked configs hash; each coordinate-descent run prints a line."""
    import importlib.util
    triton = pytest.importorskip("triton")
    heuristics = pytest.importorskip("torch._inductor.runtime.triton_heuristics")
    monkeypatch.setattr(heuristics, "check_autotune_cache", heuristics.check_autotune_cache)  # put back afterwards
    launcher = types.SimpleNamespace(config=triton.Config({"XBLOCK": 64}, num_warps=4))
    monkeypatch.setattr(heuristics.CachingAutotuner, "coordinate_descent_tuning",  # torch's own needs a GPU kernel
                        lambda self, start, *args: launcher)
    torch_autotune_cache(monkeypatch)
    monkeypatch.setenv("AUTOTUNE_PROBE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    spec = importlib.util.spec_from_file_location("autotune_probe", REPO / "bench/autotune_probe/sitecustomize.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    kernel = tmp_path / "cabcdef.py"  # the autotune cache keys a kernel by its file's name, a hash of its source
    kernel.write_text("# a kernel's source")
    one = [triton.Config({"XBLOCK": 64}, num_warps=4)]
    meta = {"coordinate_descent_tuning": True, "kernel_name": "triton_poi_k_0"}
    _, cache, _ = heuristics.check_autotune_cache(one, str(kernel), meta)
    cache.save(one[0], 1_000_000, found_by_coordesc=True)
    heuristics.check_autotune_cache(one, str(kernel), meta)
    heuristics.check_autotune_cache(one + [triton.Config({"XBLOCK": 128}, num_warps=4)], str(kernel), meta)
    heuristics.check_autotune_cache(one, str(kernel), {"kernel_name": "untuned"})  # not tuned: not reported
    keys, *lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("autotune-probe")]
    # once per process: torch's source hash (in each entry's path), Triton's (absent here), and the folder
    assert re.fullmatch(rf"autotune-probe-keys torch_key=[0-9a-f]{{12}} backend_hash=None cwd={re.escape(os.getcwd())}",
                        keys)
    # each lookup: the kernel's source hash (its file's name) and the tuned config's file, the same for one kernel
    where = re.search(r" src=cabcdef entry=([0-9a-f]{12})", lines[0])
    assert where and all(where.group(0) in line for line in lines)
    lines = [line.replace(where.group(0), "") for line in lines]
    assert lines[0] == "autotune-probe triton_poi_k_0 configs=1 state=miss tuned=False file=absent"
    assert lines[1] == "autotune-probe triton_poi_k_0 configs=1 state=hit tuned=True"
    stored, asked = re.search(r"state=miss tuned=False stored_hash=(\w+) asked_hash=(\w+) stored_by_coordesc=True$",
                              lines[2]).groups()
    assert stored != asked and len(lines) == 3
    # with the trainer's fallback in, that lookup takes the stored config coordinate descent found: a hit
    import train_gpt as tg
    assert tg.prefer_tuned_cache_entries()
    (best,), _, _ = heuristics.check_autotune_cache(one + [triton.Config({"XBLOCK": 128}, num_warps=4)],
                                                    str(kernel), meta)
    assert best.kwargs == {"XBLOCK": 64} and best.found_by_coordesc
    hit = "autotune-probe triton_poi_k_0 configs=2 state=hit tuned=True"
    assert capsys.readouterr().err.strip() == hit + where.group(0)
    autotuner = types.SimpleNamespace(inductor_meta=meta, autotune_cache_info={"autotune_cache_state": "hit"},
                                      compile_results=[None], heuristic_type=heuristics.HeuristicType.POINTWISE)
    heuristics.CachingAutotuner.coordinate_descent_tuning(autotuner, launcher)
    assert re.fullmatch(r"autotune-probe-tuning triton_poi_k_0 from=XBLOCK: 64.* state=hit compiled=1 to=XBLOCK: 64.* "
                        r"\d+\.\d\ds", capsys.readouterr().err.strip())


def test_graph_check_finds_no_difference_between_repeats_and_one_between_seeds(tiny_data, tmp_path):
    """bench/graph_check.py (gradients of the same steps under two compile settings, on a GPU): two dumps of one
    setting agree in every loss and gradient on the CPU; a dump from other initial weights differs in each."""
    graph_check = load_script("bench/graph_check.py")
    train, val = tiny_data
    flags = ["--device=cpu", *TINY, f"--train_files={train}", f"--val_files={val}", f"--log_dir={tmp_path}"]
    dumps = {}
    for name, extra in (("a", []), ("repeat", []), ("seed", ["--seed=1"])):
        graph_check.dump(str(tmp_path / f"{name}.pt"), flags + extra, steps=2)
        dumps[name] = torch.load(tmp_path / f"{name}.pt")
    same = graph_check.differences(dumps["a"], dumps["repeat"])
    assert len(same) == 2 and len(same[0]["loss_diffs"]) == 8  # the tiny schedule: 8 forwards of one micro-batch
    for step in same:
        assert step["only_one"] == [] and len(step["relative"]) > 30
        assert all(d == 0.0 for d in step["loss_diffs"]) and all(r == 0.0 for r in step["relative"].values())
    other = graph_check.differences(dumps["a"], dumps["seed"])
    assert all(min(abs(d) for d in step["loss_diffs"]) > 0 for step in other)
    assert sorted(other[0]["relative"].values())[len(other[0]["relative"]) // 2] > 1e-3  # the median parameter


def test_bench_step_names_the_rank_that_holds_the_others_back():
    """bench/bench_step.py on several GPUs prints what each rank spends on its own (its GPU's forward and backward,
    its host's cost with an idle GPU) and the slowest less the fastest of each: where one rank runs late, the others'
    wait is in the optimizers' phases of rank 0's split, not here."""
    bench_step = load_script("bench/bench_step.py")
    line = bench_step.ranks_alone([dict(gpu=50.4, host=46.0), dict(gpu=51.0, host=62.5), dict(gpu=50.1, host=47.25)])
    assert "rank 0 50.4 / 46.0, rank 1 51.0 / 62.5, rank 2 50.1 / 47.2;" in line
    assert line.endswith("slowest less fastest 0.9 / 16.5")


def test_bench_step_sums_the_adam_steps_tail_by_stream():
    """optimizer_tail reads the step with the most collectives (a run of NCCL kernels under 3 ms apart) from its first
    collective's start to its last one's end: the NCCL kernels' time, every other kernel's inside that span (cut at
    its end) and the busiest stream's share, and the kernels that took most of it, named without their arguments."""
    bench_step = load_script("bench/bench_step.py")

    def kernel(name, ts, dur, stream):
        return dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur, args=dict(stream=stream))
    events = [kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage)", 0.0, 500.0, 20),  # Muon
              kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage)", 10_000.0, 1000.0, 20),
              kernel("void at::native::elementwise_kernel<128, 4>(int, float)", 10_500.0, 2000.0, 7),
              kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage)", 12_000.0, 500.0, 20),
              kernel("triton_poi_fused_lerp_0", 11_000.0, 600.0, 30),
              kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage)", 14_000.0, 1000.0, 20),
              kernel("void at::native::elementwise_kernel<128, 4>(int, float)", 14_800.0, 700.0, 7),  # cut at 15 ms
              kernel("gemm_kernel", 16_000.0, 900.0, 7)]  # after the tail
    line, start = bench_step.optimizer_tail(dict(traceEvents=events))
    assert start == 10_000.0
    assert line == ("3 collectives over 5.00 ms, NCCL kernels 2.50 ms, other kernels 2.80 ms, 2.20 of them on the "
                    "busiest stream (elementwise_kernel 2.20, triton_poi_fused_lerp_0 0.60)")
    assert bench_step.optimizer_tail(dict(traceEvents=events[2:3])) == ("no collectives", 0.0)


def test_bench_step_puts_the_ranks_compute_kernels_side_by_side():
    """ranks_kernels: each rank's kernels other than NCCL's per step, by kind, then the kernels whose time differs most
    between ranks, named without their arguments (FA3's CUTLASS kernels by their class), with each rank's time."""
    bench_step = load_script("bench/bench_step.py")

    def kernel(name, ts, dur):
        return dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur, args=dict(stream=7))
    matmul = "_relu2_matmul_kernel(float*)"
    attention = ("void cutlass::device_kernel<flash::enable_sm90<flash::FlashAttnBwdSm90<"
                 "flash::CollectiveMainloopBwdSm90<2, cute::tuple<cute::C<64> > > > > >(flash::Params)")
    fast = [kernel(matmul, 0.0, 4000.0), kernel(attention, 5000.0, 2000.0),
            kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage)", 8000.0, 9000.0)]
    slow = [kernel(matmul, 0.0, 4200.0), kernel(attention, 5000.0, 3000.0),
            kernel("triton_poi_fused_add_0", 9000.0, 100.0),
            kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage)", 10000.0, 1000.0)]
    lines = bench_step.ranks_kernels([dict(traceEvents=fast), dict(traceEvents=slow)], steps=2, top=2)
    assert lines == [
        "rank 0: compute kernels 3.00 ms per step (MLP matmuls + ReLU^2 (Triton) 2.00, attention (FA3) 1.00)",
        "rank 1: compute kernels 3.65 ms per step (MLP matmuls + ReLU^2 (Triton) 2.10, attention (FA3) 1.50, "
        "inductor fused 0.05)",
        "  0.50 ms apart: FlashAttnBwdSm90 (1.00 / 1.50 by rank)",
        "  0.10 ms apart: _relu2_matmul_kernel (2.00 / 2.10 by rank)"]


def test_bench_step_profiles_the_stages_named_and_refuses_others():
    """BENCH_PROFILE_STAGES names the stages that end with a GPU-only profile: a list of stage numbers, checked before
    the minutes of compiling, with one line naming the variable when it is not one."""
    bench_step = load_script("bench/bench_step.py")
    assert bench_step.profile_stages("", 3) == set()
    assert bench_step.profile_stages("0 1", 3) == bench_step.profile_stages("1,0", 3) == {0, 1}
    for bad in ("3", "-1", "first"):
        with pytest.raises(bench_step.tg.UserError, match=r"^BENCH_PROFILE_STAGES='.*': give stage numbers from 0 to 2"):
            bench_step.profile_stages(bad, 3)
    # the script itself: one line, no traceback, before any model is built
    run = subprocess.run([sys.executable, str(REPO / "bench" / "bench_step.py"), "--device=cpu", *TINY],
                         env=dict(os.environ, BENCH_PROFILE_STAGES="5"), capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr == "error: BENCH_PROFILE_STAGES='5': give stage numbers from 0 to 2, e.g. '0 1'\n"


def test_bench_step_sets_the_inductor_settings_named_and_refuses_others():
    """BENCH_INDUCTOR sets keys of torch._inductor.config, dotted ones of its sub-configs; text that is not a JSON
    object, or a key inductor lacks, is one line naming the variable."""
    import torch._inductor.config as inductor_config
    bench_step = load_script("bench/bench_step.py")
    with inductor_config.patch({"combo_kernels": False, "triton.cudagraphs": False}):
        bench_step.inductor_settings('{"combo_kernels": true, "triton.cudagraphs": true}')
        assert inductor_config.combo_kernels is True and inductor_config.triton.cudagraphs is True
    before = inductor_config.get_config_copy()
    bench_step.inductor_settings("")  # unset: nothing changes
    assert inductor_config.get_config_copy() == before
    with pytest.raises(bench_step.tg.UserError, match=r"^BENCH_INDUCTOR='\[1\]': give a JSON object"):
        bench_step.inductor_settings("[1]")
    with pytest.raises(bench_step.tg.UserError, match=r"^BENCH_INDUCTOR: torch._inductor.config has no setting 'combo'"):
        bench_step.inductor_settings('{"combo": true}')


def test_bench_host_cost_needs_a_gpu_and_says_so_in_one_line():
    run = subprocess.run([sys.executable, str(REPO / "bench" / "bench_host_cost.py")], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr == "error: bench_host_cost.py needs a CUDA GPU and Triton\n"


def test_bench_step_splits_the_hosts_time_by_thread_and_op():
    """host_time reads a profiler trace's host ops: each launching thread's time inside ops against its span, and
    each op's self time (its time less its children's), summed over the ops of one name; threads that launch nothing
    on the GPU are left out."""
    bench_step = load_script("bench/bench_step.py")

    def op(name, start, end, tid=1):
        return dict(ph="X", cat="cpu_op", name=name, ts=start * 1000, dur=(end - start) * 1000, tid=tid)
    trace = {"traceEvents": [
        op("A", 0, 100), op("B", 10, 30), op("C", 40, 90), op("D", 50, 60), op("B", 120, 130),
        dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=55_000, dur=1, tid=1, args={}),
        op("F", 0, 50, tid=2), dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=5_000, dur=1, tid=2),
        op("G", 0, 1000, tid=3)]}
    lines = bench_step.host_time(trace, steps=2)
    assert lines[0] == "host thread 1: 55.0 ms per step inside ops, 65.0 ms from its first op to its last (2 ops per step)"
    assert lines[1] == "host thread 2: 25.0 ms per step inside ops, 25.0 ms from its first op to its last (0 ops per step)"
    assert lines[2] == "host ops with the most self time (ms per step):"
    # A 100 - 20 - 50, B 20 + 10, C 50 - 10, D 10, F 50; halved for two steps
    assert [line.split() for line in lines[3:]] == [
        ["25.00", "F"], ["20.00", "C"], ["15.00", "A"], ["15.00", "B"], ["5.00", "D"]]
    assert not any("G" in line for line in lines)


def test_bench_step_reports_adam_steps_and_the_others_apart():
    """bench/bench_step.py times steps with training's Adam cadence: the two kinds of step alternate, so each is
    reported on its own (median step and phases) and the slowest step is judged against its own kind."""
    bench_step = load_script("bench/bench_step.py")
    times = [70.0, 50.0, 72.0, 51.0, 71.0, 60.0]
    adam = [True, False, True, False, True, False]
    splits = [dict(forward=20.0, Muon=t - 40.0) for t in times]
    assert bench_step.steps_by_kind(times, splits, adam) == (
        "Adam steps 71.0 ms (forward 20.0 Muon 31.0); the others 51.0 ms (forward 20.0 Muon 11.0)")
    assert bench_step.slowest_of_kind(times, adam) == 60.0 / 51.0  # 72 is 1.014x the Adam steps' 71
    assert bench_step.steps_by_kind([5.0], [{}], [False]) == "the others 5.0 ms"


def test_bench_step_times_each_collective_from_its_kernel():
    """collective_order follows each collective with its NCCL kernel's start (from the first one's) and duration,
    matched through the host's launch inside the collective's op on the same thread."""
    bench_step = load_script("bench/bench_step.py")
    op = lambda name, ts, dims: dict(name=name, ph="X", ts=ts, dur=10, tid=1, args={"Input Dims": [dims],
                                                                                    "Input type": ["float"]})
    call = lambda ts, corr, tid=1: dict(name="cuLaunchKernelEx", ph="X", cat="cuda_driver", ts=ts, dur=1, tid=tid,
                                        args=dict(correlation=corr))
    kernel = lambda name, ts, dur, corr: dict(name=name, ph="X", cat="kernel", ts=ts, dur=dur, args=dict(correlation=corr))
    trace = {"traceEvents": [
        op("c10d::_reduce_scatter_base_", 100, [8]), call(105, 1), kernel("ncclDevKernel_ReduceScatter", 500, 1500, 1),
        op("c10d::_allgather_base_", 200, [4]), call(205, 2), kernel("ncclDevKernel_AllGather", 2400, 250, 2),
        call(206, 3, tid=2), kernel("ncclDevKernel_AllGather", 9000, 250, 3),  # another thread's: not this op's
        kernel("triton_poi_fused_add", 300, 50, 4)]}
    assert bench_step.collective_order(trace) == (
        "collectives in launch order: RS 8 float @0.0 for 1.50 ms, AG 4 float @1.9 for 0.25 ms")


def _profiled_collectives_on_rank(rank, world_size):
    """A profile (host, with record_shapes, as the bench's second) of the collectives a step of the optimizers
    launches: a Muon group's reduce-scatter (a 3-D stack), a bucket's, an all-to-all of rows and an all-gather."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        dist.reduce_scatter_tensor(torch.empty(2, 3, 4), torch.ones(4, 3, 4))
        dist.reduce_scatter_tensor(torch.empty(6), torch.ones(12))
        dist.all_to_all_single(torch.empty(4, 5), torch.ones(4, 5))
        dist.all_gather_into_tensor(torch.empty(12), torch.ones(6))
    path = f"{os.environ.get('TMPDIR', '/tmp')}/collective_order_{os.getpid()}.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.remove(path)
    return trace


def test_bench_step_lists_the_collectives_in_launch_order():
    """bench/bench_step.py prints the order rank 0 launched its collectives in, with what each carried (a Muon
    group's 3-D stack, a flat bucket), from a real profile of gloo collectives at two ranks."""
    bench_step = load_script("bench/bench_step.py")
    trace = run_on_ranks(_profiled_collectives_on_rank, 2)[0]
    assert bench_step.collective_order(trace) == (
        "collectives in launch order: RS 48 4x3x4 float, RS 12 float, A2A 20 4x5 float, AG 12 float")
    assert bench_step.collective_order(trace, limit=1) == "collectives in launch order: RS 48 4x3x4 float, and 3 more"


def test_attention_balance_counts_window_pairs_and_the_busiest_rank():
    """bench/attention_balance.py: a document's query-key pairs under a causal sliding window, a micro-batch's
    documents from its BOS tokens, and the busiest rank's excess when micro-batch i goes to rank i mod W."""
    import numpy as np
    balance = load_script("bench/attention_balance.py")
    assert balance.attention_pairs(np.array([3, 5]), 2) == (1 + 2 + 2) + (1 + 2 + 2 + 2 + 2)
    assert balance.attention_pairs(np.array([4]), 8) == 10
    assert balance.document_lengths(np.array([7, 1, 2, 7, 3, 7]), bos=7).tolist() == [3, 2, 1]
    assert balance.document_lengths(np.array([1, 2, 7, 3]), bos=7).tolist() == [2, 2]
    work = np.array([[1.0, 1.0, 3.0, 1.0], [2.0, 2.0, 2.0, 2.0]])  # 2 steps of 4 micro-batches
    np.testing.assert_allclose(balance.busiest_rank_excess(work, 2), [4 / 3 - 1, 0.0])  # ranks: (1 + 3, 1 + 1)
    np.testing.assert_allclose(balance.busiest_rank_excess(work, 4), [3 / 1.5 - 1, 0.0])


def test_the_inductor_cache_packs_a_near_copy_into_little_and_unpacks_whole(tmp_path):
    """bench/inductor_cache.sh: at several GPUs inductor writes each graph's entry once per rank, each a near-copy of
    the others (36 MB apiece at 4 GPUs). Packed, a second copy of 9 MiB must cost almost nothing (xz's default 8 MiB
    window would not reach back to the first), and the parts must unpack to the same files."""
    # 1 MiB of bytes that do not compress (as compiled kernels nearly do not), then 8 MiB that do: whatever the order
    # of the files, a copy's first MiB lies 9 MiB after the other's
    head = random.Random(0).randbytes(1 << 20)
    entry = head + bytes(8 << 20)
    cache = tmp_path / "written"
    files = {"a/entry": entry, "b/entry": entry[:-1] + b"!", "c/small.json": b"{}"}
    for path, data in files.items():
        (cache / path).parent.mkdir(parents=True, exist_ok=True)
        (cache / path).write_bytes(data)
    out, repo = tmp_path / "out", tmp_path / "next_call"

    def cache_script(function: str, cache_dir: Path, cwd: Path):
        subprocess.run(["bash", "-c", f"source {REPO / 'bench/inductor_cache.sh'} && {function}"], cwd=cwd, check=True,
                       env=dict(os.environ, OUT=str(out), TORCHINDUCTOR_CACHE_DIR=str(cache_dir)), capture_output=True)

    cache_script("pack_inductor_cache", cache, tmp_path)
    parts = sorted((out / "cache").glob("inductor.tar.xz.part*"))
    packed = sum(part.stat().st_size for part in parts)
    assert parts and packed < 1.2 * len(head), packed
    (repo / ".cache").mkdir(parents=True)
    for part in parts:
        shutil.copy(part, repo / ".cache" / part.name)
    cache_script("restore_inductor_cache", tmp_path / "restored", repo)  # from the carried .cache/ parts
    restored = {str(p.relative_to(tmp_path / "restored")): p.read_bytes()
                for p in (tmp_path / "restored").rglob("*") if p.is_file()}
    assert restored == files
