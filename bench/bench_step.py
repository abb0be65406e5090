"""Step benchmark: the trainer's own warm-up, then every stage's steps timed apart, on the device (not in CI).

    python bench/bench_step.py [--bench_steps=N] [train_gpt.py flags...]
    torchrun --nproc_per_node=8 bench/bench_step.py ...

Per stage (its micro-batches, windows and packing): 3 untimed steps, then N timed ones back to back as in training,
each with the settings training gives it (Adam updates on every --adam_period'th step), timed by CUDA events at
each step's start and phase ends. Prints per stage the mean step ms (a run's time is the sum of its steps, and the
two kinds of step alternate), the slowest step over its kind's median, tokens/s, MFU, the phase split (forward,
backward, Muon, DistAdam; communication waits sit inside the optimizers), the same for Adam's steps and the others,
and the host's time to issue a step (where it nears the GPU's, the GPU waits on the host); on several GPUs each
rank's forward + backward (a rank that holds the others back shows there). Then graphs compiled in the timed region,
peak memory, and whether the loss fell. BENCH_PROFILE=1 adds a torch.profiler window of two last-stage steps: GPU
time by kind of kernel, idle time, the longest kernels.
Real text from --train_files when it matches (document lengths shape attention and the bigram rows touched), else
random tokens. The CPU runs it too, as a smoke test.

MFU counts 6 FLOPs per parameter per token for the matrices the tokens pass through (blocks and head; lookups
excluded) plus attention scores as if every key in the window were attended (12 * window * heads * head_dim per
layer and token): an upper bound on useful attention work. Peak: dense bf16 of the SXM datasheets.
"""
import dataclasses
import glob
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402

BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def flops_per_token(model: tg.GPT, cfg: tg.Config, windows: tuple[int, int]) -> float:
    matrices = sum(p.numel() for p in model.blocks.parameters() if p.dim() == 2) + model.lm_head.weight.numel()
    span = {"S": windows[0], "L": windows[1]}
    attention = sum(12 * span[k] * cfg.num_heads * cfg.head_dim for k in cfg.attn_layout if k in span)
    return 6 * matrices + attention


def peak_flops(device: torch.device) -> float | None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((tflops * 1e12 for key, tflops in BF16_PEAK_TFLOPS.items() if key in name), None)


class EventMarks:
    """CUDA events and the host's clock at a step's start and each phase's end (train_step's `mark`)."""

    def __init__(self):
        self.marks = [("start", torch.cuda.Event(enable_timing=True), time.perf_counter())]
        self.marks[0][1].record()

    def __call__(self, phase: str):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks.append((phase, event, time.perf_counter()))

    def split(self, gpu: bool = True) -> dict[str, float]:
        """Each phase's ms summed over its spans, by the GPU's events or the host's clock."""
        totals = {}
        for before, after in zip(self.marks, self.marks[1:]):
            ms = before[1].elapsed_time(after[1]) if gpu else 1000 * (after[2] - before[2])
            totals[after[0]] = totals.get(after[0], 0.0) + ms
        return totals


def phases(splits: list[dict[str, float]]) -> str:
    return " ".join(f"{k} {statistics.fmean(s[k] for s in splits):.1f}" for k in splits[0]) if splits[0] else ""


# Kernel name patterns, first match wins: what the GPU's time goes to.
KERNEL_KINDS = [
    ("attention (FA3)", r"flash::|FlashAttn"), ("matmul", r"gemm|nvjet|cutlass|xmma|sm90_|cublas"),
    ("attention (flex)", r"flex_attention|triton_tem_fused_flex"), ("loss (Triton)", r"_ce_|softcap"),
    ("MLP (Triton)", r"relu2"), ("Newton-Schulz (Triton)", r"symmetric|_ns_"), ("communication", r"nccl"),
    ("inductor fused", r"^triton_"), ("index/scatter/gather", r"index|scatter|gather|embedding"),
    ("memcpy/memset", r"[Mm]emcpy|[Mm]emset"), ("eager elementwise", r"elementwise|vectorized|reduce|CatArray|fill"),
]


def profile_summary(run_step, steps: int, trace_path: Path) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run_step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace_path))
    gpu = sorted((e for e in json.loads(trace_path.read_text())["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    if not gpu:
        return ["profile: no GPU activity recorded"]
    span = max(e["ts"] + e["dur"] for e in gpu) - gpu[0]["ts"]
    idle, busy_until = 0.0, gpu[0]["ts"]
    by_kind, by_name = {}, {}
    for e in gpu:
        idle += max(0.0, e["ts"] - busy_until)
        busy_until = max(busy_until, e["ts"] + e["dur"])
        kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, e["name"])), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + e["dur"]
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"]
    ms = lambda us: us / 1000 / steps
    lines = [f"profile, {steps} last-stage steps: GPU span {ms(span):.1f} ms per step, idle {ms(idle):.1f} ms, "
             f"{len(gpu) // steps} kernels per step; by kind (ms per step, overlapping streams count twice):"]
    lines += [f"  {ms(us):8.2f} {100 * us / span:5.1f}%  {kind}" for kind, us in sorted(by_kind.items(), key=lambda i: -i[1])]
    lines.append("longest kernels (ms per step):")
    lines += [f"  {ms(us):8.2f}  {name[:110]}" for name, us in sorted(by_name.items(), key=lambda i: -i[1])[:15]]
    return lines


def seconds_since_process_start() -> float | None:
    """Since this process began (Linux): the whole cold start."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in clock ticks
    except (OSError, ValueError, IndexError, AttributeError):
        return None



def bench(cfg: tg.Config, comm: tg.Comm, steps: int, say) -> None:
    trainer = tg.build_and_warm_up(cfg, comm, say)
    if (since := seconds_since_process_start()) is not None:
        say(f"cold start: {since:.1f}s from the process's start to the first timed step")
    model, optimizers, schedule, device = trainer.model, trainer.optimizers, trainer.schedule, trainer.device
    cuda, peak = device.type == "cuda", peak_flops(device)
    world = comm.world_size
    if glob.glob(cfg.train_files):
        source, data = cfg.train_files, tg.train_batches_for_rank(
            tg.shard_paths(cfg.train_files, "train_files"), dataclasses.replace(cfg, train_repeat=True), comm)
    else:
        source, data = "random tokens (no --train_files found)", tg.dummy_batches(cfg, seed=cfg.seed + 100 + comm.rank)
    say(f"data: {source}")
    say(f"{'stage':>5} {'micro':>5} {'windows':>11} {'step ms':>8} {'max/med':>7} {'tok/s':>10} {'MFU':>6}  "
        "phase split (ms per step)")
    losses, batches = [], None
    for stage in range(len(schedule.rows)):
        first, last = schedule.bounds(stage)
        if first == last:
            continue
        windows, micro = schedule.windows(first), schedule.micro_batches(first) // world
        forwards = trainer.forwards(first, world)
        if batches is not None:
            batches.close()
        batches = tg.prefetch((window for window in data), cfg, device, trainer.per_forward(first))
        step = first

        def run_step(mark=None) -> tuple[torch.Tensor, bool]:
            """The stage's next step as training sets it (cycling through the stage's steps)."""
            nonlocal step
            at, step = step, first + (step + 1 - first) % (last - first)
            tg.set_hyperparameters(optimizers, schedule, at)
            loss = tg.train_step(model, optimizers, batches, windows, forwards, mark=mark)
            return loss, schedule.adam_updates(at)

        for _ in range(3):
            losses.append(run_step()[0])
        if cuda:
            torch.cuda.synchronize()
        marks, host_ms, kinds = [], [], []
        for _ in range(steps):
            clock = time.perf_counter()
            marks.append(EventMarks() if cuda else None)
            loss, adam = run_step(marks[-1])
            losses.append(loss)
            kinds.append(adam)
            host_ms.append(1000 * (time.perf_counter() - clock))
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize()
            starts = [m.marks[0][1] for m in marks] + [end]
            times = [a.elapsed_time(b) for a, b in zip(starts, starts[1:])]
            splits = [m.split() for m in marks]
        else:
            times, splits = host_ms, [{}] * steps
        mean = statistics.fmean(times)
        medians = {k: statistics.median(t for t, kind in zip(times, kinds) if kind == k) for k in set(kinds)}
        slowest = max(t / medians[k] for t, k in zip(times, kinds))
        tokens_per_s = micro * world * cfg.micro_batch_tokens / (mean / 1000)
        mfu = tokens_per_s * flops_per_token(model, cfg, windows) / (peak * world) if peak else None
        say(f"{stage:>5} {micro:>5} {str(windows):>11} {mean:8.1f} {slowest:7.2f} {tokens_per_s:10,.0f} "
            f"{'' if mfu is None else f'{100 * mfu:5.1f}%'}  {phases(splits)}")
        by_kind = []
        for kind, name in ((True, "Adam steps"), (False, "the others")):
            chosen = [i for i, k in enumerate(kinds) if k == kind]
            if chosen:
                split = phases([splits[i] for i in chosen])
                by_kind.append(f"{name} {statistics.median(times[i] for i in chosen):.1f} ms" + (f" ({split})" if split else ""))
        say(" " * 31 + "; ".join(by_kind))
        if cuda:
            say(" " * 31 + f"host {statistics.median(host_ms):.1f} ms per step to issue: "
                + phases([m.split(gpu=False) for m in marks]))
            if comm.distributed:
                compute = torch.tensor([statistics.fmean(s.get("forward", 0) + s.get("backward", 0) for s in splits)],
                                       device=device)
                every = [torch.zeros_like(compute) for _ in range(world)]
                torch.distributed.all_gather(every, compute)
                say(" " * 31 + "forward + backward by rank (ms): " + " / ".join(f"{t.item():.1f}" for t in every))
    reasons = trainer.recompiles.new_reasons()
    say(f"graphs compiled in the timed region: {len(reasons)}"
        + (f"; peak memory {torch.cuda.max_memory_allocated() // 2**20} MiB" if cuda else ""))
    for reason in reasons[:8]:
        say(f"  recompiled: {reason[:300]}")
    values = [float(loss) for loss in losses]
    say(f"train loss over the {len(values)} steps (rank 0's micro-batches): first {values[0]:.4f}, last {values[-1]:.4f}")
    if not all(map(math.isfinite, values)):
        say("warning: a loss is not finite: these steps train wrong")
    if cuda and os.environ.get("BENCH_PROFILE") == "1":
        trace = Path(os.environ.get("BENCH_TRACE_DIR", "/tmp")) / f"bench_trace_{comm.rank}.json"
        lines = profile_summary(lambda: run_step(), 2, trace)
        for line in lines:
            say(line)
    batches.close()


def main() -> int:
    steps = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--bench_steps=")), 10)
    cfg, _ = tg.parse_cli([a for a in sys.argv[1:] if not a.startswith("--bench_steps=")])
    comm = tg.init_distributed(cfg)
    if cfg.device == "cpu":
        tg.keep_freed_cpu_memory()
    try:
        bench(cfg, comm, steps, lambda text: print(text, flush=True) if comm.rank == 0 else None)
        return 0
    except tg.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if comm.distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
