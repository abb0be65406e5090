"""Instrument for bench/startup_bench.sh (AUTOTUNE_PROBE=1 puts this folder on PYTHONPATH): every lookup of a kernel's
tuned config in inductor's autotune cache, for kernels that coordinate descent tunes, prints one line to stderr:
'autotune-probe KERNEL configs=N state=hit|miss|... tuned=True|False' (tuned: the config found carries coordinate
descent's mark, so the kernel is not tuned again). On a miss it adds what the cache file holds for that kernel, if
anything: the configs hash stored against the one asked for, and whether coordinate descent found the stored config.
Every coordinate-descent run of a kernel torch tunes prints 'autotune-probe-tuning KERNEL ...': the config it starts
from, the kernel's lookup state and compiled configs, and its seconds. So a start from a --compile_cache file names
each kernel that is tuned again, and why.
Every graph cache key computed (AOTAutograd's and inductor's FX graph key) prints 'autotune-probe-graph KIND N KEY', and
with AUTOTUNE_PROBE_KEYS=DIR its hash details go to DIR/KIND_N.json: compare_keys.py names what two runs' keys differ
in."""
import itertools
import json
import os
import sys
import time

if os.environ.get("AUTOTUNE_PROBE") == "1":
    try:
        from torch._inductor.runtime import triton_heuristics
    except ImportError as e:
        print(f"autotune-probe: off ({e})", file=sys.stderr)
    else:
        lookup = triton_heuristics.check_autotune_cache

        def stored_entry(cache) -> str:
            local = getattr(cache, "local_cache", None)
            path = local[1] if local else None
            if not path or not os.path.exists(path):
                return "file=absent"
            try:
                with open(path) as f:
                    stored = json.load(f)
            except (OSError, ValueError) as e:
                return f"file=unreadable({type(e).__name__})"
            return (f"stored_hash={stored.get('configs_hash', '')[:12]} asked_hash={cache.configs_hash[:12]} "
                    f"stored_by_coordesc={stored.get('found_by_coordesc')}")

        keys_printed = []

        def print_keys_once(inductor_meta) -> None:
            """What the cache paths hang on: torch's source hash (in every entry's path), Triton's (in every kernel's
            source), and the folder the trainer runs in."""
            if keys_printed:
                return
            keys_printed.append(True)
            from torch._inductor.codecache import torch_key
            print(f"autotune-probe-keys torch_key={torch_key().hex()[:12]} "
                  f"backend_hash={str(inductor_meta.get('backend_hash'))[:12]} cwd={os.getcwd()}",
                  file=sys.stderr, flush=True)

        def check_autotune_cache(configs, filename, inductor_meta):
            result = lookup(configs, filename, inductor_meta)
            if inductor_meta.get("coordinate_descent_tuning"):
                print_keys_once(inductor_meta)
                chosen, cache, info = result
                state = info.get("autotune_cache_state")
                detail = f" {stored_entry(cache)}" if state == "miss" and cache is not None else ""
                tuned = len(chosen) == 1 and getattr(chosen[0], "found_by_coordesc", False)
                # src: the kernel's source hash (its file's name); entry: the tuned config's file, which hashes src
                # with torch's source hash. A write and a load that differ in src compiled different kernel text.
                local = getattr(cache, "local_cache", None) if cache is not None else None
                entry = os.path.basename(local[1])[:12] if local else "none"
                src = os.path.basename(filename).split(".")[0][:12] if filename else "none"  # templates: no file
                print(f"autotune-probe {inductor_meta.get('kernel_name')} configs={len(configs)} state={state} "
                      f"tuned={tuned} src={src} entry={entry}{detail}",
                      file=sys.stderr, flush=True)
            return result

        triton_heuristics.check_autotune_cache = check_autotune_cache
        autotuner = triton_heuristics.CachingAutotuner
        tune = autotuner.coordinate_descent_tuning

        def coordinate_descent_tuning(self, launcher, *args, **kwargs):
            start = time.perf_counter()
            result = tune(self, launcher, *args, **kwargs)
            if getattr(self.heuristic_type, "name", "") in ("TEMPLATE", "USER_AUTOTUNE", "FIXED"):
                return result  # torch never tunes these (our own kernels): it returns at once, at every launch
            info = getattr(self, "autotune_cache_info", None) or {}
            print(f"autotune-probe-tuning {self.inductor_meta.get('kernel_name')} from={launcher.config} "
                  f"state={info.get('autotune_cache_state')} compiled={len(getattr(self, 'compile_results', []))} "
                  f"to={result.config} {time.perf_counter() - start:.2f}s", file=sys.stderr, flush=True)
            return result

        autotuner.coordinate_descent_tuning = coordinate_descent_tuning

        def record_graph_keys(module, name: str, kind: str) -> None:
            """Wrap MODULE.NAME, which returns (key, debug lines): print each key, and keep its lines in a file."""
            compute, ranks = getattr(module, name), itertools.count(1)

            def keyed(*args, **kwargs):
                key, details = compute(*args, **kwargs)
                rank = next(ranks)
                print(f"autotune-probe-graph {kind} {rank} {key[:13]}", file=sys.stderr, flush=True)
                if keys_dir := os.environ.get("AUTOTUNE_PROBE_KEYS"):
                    os.makedirs(keys_dir, exist_ok=True)
                    with open(os.path.join(keys_dir, f"{kind}_{rank:03d}.json"), "w") as f:
                        json.dump({"key": key, "details": list(details)}, f)
                return key, details

            setattr(module, name, keyed)

        from torch._functorch._aot_autograd import autograd_cache
        from torch._inductor import codecache
        record_graph_keys(autograd_cache, "autograd_cache_key", "aot")
        record_graph_keys(codecache, "compiled_fx_graph_hash", "fx")
