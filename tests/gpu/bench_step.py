"""Step benchmark of the full config on random tokens (no data files), run on the device, not in CI:

    python tests/gpu/bench_step.py [--bench_steps=N] [train_gpt.py flags...]
    torchrun --nproc_per_node=8 tests/gpu/bench_step.py ...

After the trainer's own warm-up it runs, for every stage of the schedule (its micro-batch count and
attention windows), a few untimed steps and then N timed ones, and prints per stage: median step ms,
tokens/s, MFU, the slowest step against the median, the per-phase split from CUDA events (forward,
backward, each optimizer; comm waits sit inside the optimizers), and graphs compiled in the timed
region. BENCH_SYNC_DEBUG=1 turns on torch's sync debug mode there: a warning at every host sync.
Then a torch.profiler window of 3 steps of the last stage: GPU busy time against wall time and the
kernels that take the most time.

MFU counts 6 FLOPs per parameter per token for the matrices the tokens pass through (blocks and the
head; embedding lookups excluded) plus the attention scores as if every key in the window were
attended (12 * layers * window * dim per token): an upper bound on useful attention work.
"""
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402

BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, SXM datasheets


def flops_per_token(model: tg.GPT, cfg: tg.Config, windows: tuple[int, int]) -> float:
    matrices = sum(p.numel() for p in model.blocks.parameters() if p.dim() == 2) + model.lm_head.weight.numel()
    kinds = {"S": windows[0], "L": windows[1]}
    attention = sum(12 * kinds[k] * cfg.num_heads * cfg.head_dim for k in cfg.attn_layout if k in kinds)
    return 6 * matrices + attention


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in BF16_PEAK_TFLOPS.items() if key in name), None)


class EventMarks:
    """CUDA events recorded at each phase end; read once per step after the step's synchronize."""

    def __init__(self):
        self.events = []

    def start(self):
        self.events = [("start", torch.cuda.Event(enable_timing=True))]
        self.events[0][1].record()

    def __call__(self, phase: str):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append((phase, event))

    def split_ms(self) -> dict[str, float]:
        totals = {}
        for (_, before), (phase, after) in zip(self.events, self.events[1:]):
            totals[phase] = totals.get(phase, 0.0) + before.elapsed_time(after)
        return totals


def main() -> int:
    argv = [a for a in sys.argv[1:] if not a.startswith("--bench_steps=")]
    steps = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--bench_steps=")), 10)
    cfg, _ = tg.parse_cli(argv)
    comm = tg.init_distributed(cfg)

    def say(text: str):
        if comm.is_main:
            print(text, flush=True)

    try:
        trainer = tg.build_and_warm_up(cfg, comm, say)
        model, optimizers, schedule, device = trainer.model, trainer.optimizers, trainer.schedule, trainer.device
        batches = tg.Prefetcher(tg.dummy_batches(cfg, seed=cfg.seed + 100 + comm.rank), cfg.micro_batch_tokens,
                                device, bigram_rows=cfg.bigram_rows)
        peak = peak_flops(device)
        cuda = device.type == "cuda"  # the CPU runs it too, as a smoke test of this script
        synchronize = torch.cuda.synchronize if cuda else (lambda: None)
        marks = EventMarks() if cuda else None
        if cuda and os.environ.get("BENCH_SYNC_DEBUG") == "1":
            torch.cuda.set_sync_debug_mode("warn")
        say(f"{'stage':>5} {'micro':>5} {'windows':>11} {'step ms':>8} {'max/med':>7} {'tok/s':>10} {'MFU':>6}  "
            "phase split (ms per step)")
        try:
            for stage in range(len(schedule.batches)):
                step = next(s for s in range(cfg.num_iterations) if schedule.stage(s) == stage)  # its first step
                windows, micro = schedule.windows(step), schedule.micro_batches(step) // comm.world_size
                times, splits = [], []
                for i in range(3 + steps):
                    synchronize()
                    clock = time.perf_counter()
                    if marks:
                        marks.start()
                    tg.train_step(model, optimizers, batches, windows, micro, mark=marks)
                    synchronize()
                    if i >= 3:
                        times.append(1000 * (time.perf_counter() - clock))
                        splits.append(marks.split_ms() if marks else {})
                median = statistics.median(times)
                tokens_per_s = micro * comm.world_size * cfg.micro_batch_tokens / (median / 1000)
                mfu = tokens_per_s * flops_per_token(model, cfg, windows) / (peak * comm.world_size) if peak else None
                phases = {k: statistics.median(split[k] for split in splits) for k in splits[0]}
                say(f"{stage:>5} {micro:>5} {str(windows):>11} {median:8.1f} {max(times) / median:7.2f} "
                    f"{tokens_per_s:10,.0f} {'' if mfu is None else f'{100 * mfu:5.1f}%'}  "
                    + " ".join(f"{k} {v:.1f}" for k, v in phases.items()))
            say(f"graphs compiled in the timed region: {len(trainer.recompiles.new_reasons())}"
                + (f"; peak memory {torch.cuda.max_memory_allocated() // 2**20} MiB" if cuda else ""))
            if not cuda:
                return 0

            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                torch.cuda.synchronize()
                clock = time.perf_counter()
                for _ in range(3):
                    tg.train_step(model, optimizers, batches, windows, micro)
                torch.cuda.synchronize()
                wall_ms = 1000 * (time.perf_counter() - clock)
            kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            busy_ms = sum(e.self_device_time_total for e in kernels) / 1000
            say(f"profile, 3 steps of the last stage: wall {wall_ms:.0f} ms, GPU kernels {busy_ms:.0f} ms "
                f"({100 * busy_ms / wall_ms:.0f}% busy, kernels on overlapping streams count twice)")
            for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]:
                say(f"  {e.self_device_time_total / 1000:8.1f} ms {e.count:6d}x  {e.key[:110]}")
        finally:
            batches.close()
        return 0
    except tg.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if comm.distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
