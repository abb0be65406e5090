"""Why a run's CUDA graphs record again in the timed region (GPU machine, repo root):
    python3 bench/cudagraph_rerecords.py TRAIN_GPT_FLAGS...
runs train_gpt.py with those flags, counting every CUDA-graph recording by compiled function and by where in
inductor's cudagraph tree it happened (a new root: a fresh forward; a child: a function run after another in one
forward/backward), and every failed reuse check of a recorded graph by its reason; a failed check of a parameter or
buffer address also names the moved inputs' shapes. The counts print when the run ends (stop it with `timeout`:
they print then too). The log's "CUDA graph recorded" warnings say that graphs recorded, this says why.
"""
import atexit
import collections
import os
import runpy
import signal
import sys

import torch
from torch._inductor import cudagraph_trees as trees

recordings: collections.Counter = collections.Counter()
failed_checks: collections.Counter = collections.Counter()


def _moved_static_inputs(node, inputs) -> str:
    idxs, ptrs = getattr(node, "static_input_idxs", None), getattr(node, "static_input_data_ptrs", None)
    if idxs is None or ptrs is None:  # another torch's internals: the reason alone
        return ""
    moved = [i for i in idxs if isinstance(inputs[i], torch.Tensor) and inputs[i].data_ptr() != ptrs[i]]
    return ", ".join(f"input {i} {tuple(inputs[i].shape)}" for i in moved[:6]) + (" ..." if len(moved) > 6 else "")


SUCCESS = getattr(getattr(trees, "CheckInvariantStatus", None), "SUCCESS", True)  # older torch returns a bool


def _wrap_check(original):
    def check_invariants(node, inputs):
        result = original(node, inputs)
        status = result[0] if isinstance(result, tuple) else result
        if status is not SUCCESS and status is not True:
            name = getattr(status, "name", str(status))
            try:
                moved = _moved_static_inputs(node, inputs) if name == "StaticInputIdxMismatch" else ""
            except Exception as e:  # the count matters more than the detail
                moved = f"(inputs not read: {type(e).__name__})"
            failed_checks[(name, moved)] += 1
        return result
    return check_invariants


def _wrap_record(original):
    def record_function(manager, new_inputs, function_id):
        recordings[(function_id.id, "a new root" if manager.current_node is None else "a child")] += 1
        return original(manager, new_inputs, function_id)
    return record_function


def report():
    print(f"\n== CUDA-graph recordings by (function, place in the tree): {sum(recordings.values())}", flush=True)
    for key, count in recordings.most_common(20):
        print(f"  {count:6d}  function {key[0]}, {key[1]}", flush=True)
    print(f"== failed reuse checks: {sum(failed_checks.values())}", flush=True)
    for (status, moved), count in failed_checks.most_common(20):
        print(f"  {count:6d}  {status}{': ' + moved if moved else ''}", flush=True)


trees.CUDAGraphNode.check_invariants = _wrap_check(trees.CUDAGraphNode.check_invariants)
trees.CUDAGraphTreeManager.record_function = _wrap_record(trees.CUDAGraphTreeManager.record_function)
atexit.register(report)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` stops the run: report on the way out
sys.argv = ["train_gpt.py"] + sys.argv[1:]
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train_gpt.py"), run_name="__main__")
