"""Device benchmark of FlexAttention's kernel options on the trainer's masks (not part of the tests).

    python bench/bench_flex.py [OPTIONS_JSON ...]

One micro-batch of the last training stage: q, k, v of [16384 tokens, 6 heads, 128], the short and the long
window's block masks built by the trainer's FlexAttention from real document boundaries (/tmp/bench2, as
unpacked by bench/unpack_bench.py) or random ones. For each option set (a JSON dict of flex
kernel_options; default: a built-in list) prints median ms of forward and of forward + backward for both
windows, and the largest difference from the default options' output and gradients.

1xH100, torch 2.11 (2026-11-23): the defaults were fastest (short window 0.78 ms forward + backward, long 0.88).
ROWS_GUARANTEED_SAFE gave NaN: it requires every row to keep a key in every block it visits, and a partial block
at a document start or window edge has rows with none, though each row keeps itself.
1xH100, 2026-11-23: the backward with 8 warps and 2 stages (the second set below) measured 0.98 / 1.07 ms
forward + backward (short / long window) against 1.13 / 1.22 for the defaults here, with the same bits; but in the
trainer (bench/bench_step.py, last stage) flex's backward kernels took 81.2 ms per step against 77.1, so it
stays out. This benchmark's compiled function alone does not predict the whole-model graph.
"""
import functools
import glob
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import train_gpt as tg  # noqa: E402
from timing import kernel_median_ms as median_ms  # noqa: E402
from helpers import cu_seqlens_of  # noqa: E402

OPTION_SETS = [
    {},
    {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64, "bwd_num_warps": 8,
     "bwd_num_stages": 2},
    {"ROWS_GUARANTEED_SAFE": True},
    {"ROWS_GUARANTEED_SAFE": True, "USE_TMA": True},
    {"ROWS_GUARANTEED_SAFE": True, "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
     "bwd_num_warps": 4, "bwd_num_stages": 3},
]


def micro_batch_tokens(cfg: tg.Config) -> torch.Tensor:
    """The first training micro-batch the trainer would read from /tmp/bench2, else its warm-up's random one."""
    files = sorted(glob.glob("/tmp/bench2/docs_train_*.bin"))
    if files:
        window = next(tg.train_batches_for_rank(files, cfg, tg.Comm()))
        print(f"documents from {files[0]}")
    else:
        window = next(tg.dummy_batches(cfg, seed=0))
        print("random documents")
    return torch.from_numpy(window[:-1].astype(np.int64)).cuda()


def main():
    option_sets = [json.loads(arg) for arg in sys.argv[1:]] or OPTION_SETS
    cfg = tg.Config()
    T, heads, head_dim = cfg.micro_batch_tokens, cfg.num_heads, cfg.head_dim
    attend = tg.FlexAttention(T, torch.device("cuda"))
    tokens = micro_batch_tokens(cfg)
    schedule = tg.Schedule(cfg)
    windows = schedule.stage_windows[-1]
    masks = attend.prepare(tokens.numel(), cu_seqlens_of(tokens, cfg.bos_token), {"S": windows[0], "L": windows[1]})
    torch.manual_seed(0)
    q, k, v = (tg.rms_norm(torch.randn(1, heads, T, head_dim, device="cuda")).to(torch.bfloat16) for _ in range(3))
    q = (q * 0.12).requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    grad_out = torch.randn(1, heads, T, head_dim, device="cuda", dtype=torch.bfloat16)
    reference = {}
    for options in option_sets:
        torch._dynamo.reset()
        flex = torch.compile(functools.partial(attend.flex_attention, scale=1.0, kernel_options=options or None),
                             dynamic=False, fullgraph=True)
        line = []
        for kind in "SL":
            def forward():
                with torch.no_grad():
                    return flex(q, k, v, block_mask=masks[kind])

            def forward_backward():
                q.grad = k.grad = v.grad = None
                out = flex(q, k, v, block_mask=masks[kind])
                out.backward(grad_out)
                return out
            out = forward_backward()
            results = [out.detach(), q.grad, k.grad, v.grad]
            if kind not in reference:
                reference[kind] = [t.clone() for t in results]
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(results, reference[kind]))
            line.append(f"{kind} fwd {median_ms(forward):.3f} fwd+bwd {median_ms(forward_backward):.3f} "
                        f"maxdiff {diff:.2e}")
        print(f"{json.dumps(options) or '{}'}: " + "; ".join(line), flush=True)


if __name__ == "__main__":
    main()
