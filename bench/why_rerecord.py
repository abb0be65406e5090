"""Diagnostic (device, not a test): run train_gpt.py's main with CUDA graph trees reporting, for every failed
replay check, which static inputs moved (index, placeholder name, shape, dtype), then a count of each kind.
A graph's inputs named primals_* are its forward's inputs (parameters, buffers, or tensors such as the
attention block masks); torch expects those kept for the backward at fixed addresses.

    python bench/why_rerecord.py [train_gpt.py flags...]
"""
import collections
import sys
from pathlib import Path

import torch
from torch._inductor import cudagraph_trees

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402

seen = collections.Counter()
original = cudagraph_trees.CUDAGraphNode.check_invariants


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


cudagraph_trees.CUDAGraphNode.check_invariants = check_invariants

if __name__ == "__main__":
    code = tg.main(sys.argv[1:])
    for (status, moved), count in seen.most_common():
        print(f"{count:4d} x {status}: {list(moved)}")
    sys.exit(code)
