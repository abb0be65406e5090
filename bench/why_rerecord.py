"""Diagnostic (device, not a test): run train_gpt.py's main with CUDA graph trees reporting, for every failed
replay check, which static inputs moved (index, placeholder name, shape, dtype), then a count of each kind, and a
count of the CUDA-graph recordings by compiled function and place in the tree (a new root: a forward after
cudagraph_mark_step_begin; a child: a graph run after another without one, e.g. a backward). A recording with no
failed check beside it is a new path through the tree, not a moved input.
A graph's inputs named primals_* are its forward's inputs (parameters, buffers, or tensors such as the
attention block masks); torch expects those kept for the backward at fixed addresses.

    python bench/why_rerecord.py [train_gpt.py flags...]

The counts print when the run ends, and as each count reaches a power of two.
"""
import collections
import signal
import sys
from pathlib import Path

import torch
from torch._inductor import cudagraph_trees

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402

seen = collections.Counter()
recordings = collections.Counter()
original = cudagraph_trees.CUDAGraphNode.check_invariants
original_record = cudagraph_trees.CUDAGraphTreeManager.record_function


def check_invariants(self, inputs):
    status, logger = original(self, inputs)
    if status != cudagraph_trees.CheckInvariantStatus.SUCCESS:
        moved = []
        for idx, ptr in enumerate(self.static_input_data_ptrs):
            t = inputs[idx]
            if ptr is not None and isinstance(t, torch.Tensor) and t.data_ptr() != ptr:
                placeholders = getattr(self.wrapped_function, "placeholders", None)
                name = placeholders[idx].name if placeholders else "?"
                moved.append(f"[{idx}] {name} {tuple(t.shape)} {t.dtype}")
        key = (str(status), tuple(moved))
        seen[key] += 1
        if seen[key] == 1:
            print(f"replay check failed: {status}; moved static inputs: {moved or 'none'}", flush=True)
    return status, logger


def record_function(self, new_inputs, function_id):
    key = (function_id.id, "a new root" if self.current_node is None else "a child")
    recordings[key] += 1
    if recordings[key] & (recordings[key] - 1) == 0:  # 1, 2, 4, 8...: the counts so far, in case the run never ends
        print(f"recording {recordings[key]} of function {key[0]} as {key[1]}", flush=True)
    return original_record(self, new_inputs, function_id)


cudagraph_trees.CUDAGraphNode.check_invariants = check_invariants
cudagraph_trees.CUDAGraphTreeManager.record_function = record_function

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` stops the run: count on the way out
    code = 143
    try:
        code = tg.main(sys.argv[1:])
    finally:
        for (status, moved), count in seen.most_common():
            print(f"{count:4d} x {status}: {list(moved)}")
        for (function, place), count in recordings.most_common():
            print(f"{count:4d} recordings of function {function} as {place}")
    sys.exit(code)
