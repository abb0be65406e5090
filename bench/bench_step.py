"""Step benchmark of the full config on random tokens (no data files), run on the device, not in CI:

    python bench/bench_step.py [--bench_steps=N] [train_gpt.py flags...]
    torchrun --nproc_per_node=8 bench/bench_step.py ...

After the trainer's own warm-up it runs, for every stage of the schedule (its micro-batch count and
attention windows), a few untimed steps and then N timed ones, each step with the settings training gives it (Adam
updates on every --adam_period'th step), and prints per stage: the mean step ms (of both kinds of step), tokens/s,
MFU, the slowest step against its kind's median, the per-phase split from CUDA events (forward,
backward, each optimizer; comm waits sit inside the optimizers), the same for the steps where Adam updates and for
the others, the host's time to issue a step and each
phase (where it nears the GPU's, the GPU waits on the host), then the host's own cost of each phase, issued to an
idle GPU over four more steps, two of each kind (HostCost: without the waits for a full launch queue that the first
split holds),
on several GPUs each rank's own forward and backward and host cost (a rank that holds the others back shows there),
and graphs compiled in the timed region.
BENCH_SYNC_DEBUG=1 turns on torch's sync debug mode there: a warning at every host sync.
FLEX_KERNEL_OPTIONS='{"bwd_num_stages":2,...}' passes flex attention these kernel_options (an A/B of flex's tiles in
the whole model; 1xH100, 2026-11-24: torch's defaults were fastest, 651.9 ms per last-stage step against 655.0 with
2 backward stages and 657.4 with backward tiles of 32 x 128 and 128 x 32).
BENCH_ADAM_MERGE=N sets DistAdam.MERGE (buckets under N values share their collectives on several ranks; 0: a
collective per bucket), for an A/B of that merging in one call.
BENCH_SAME_DATA=1 gives every rank rank 0's micro-batches: against the usual run, what the ranks' different documents
(their attention work) cost in waits at the collectives.
BENCH_INDUCTOR='{"combo_kernels": true}' sets those keys of torch._inductor.config before the compile (dotted keys,
e.g. "triton.cudagraphs", name a sub-config's): an A/B of inductor's settings in the whole model.
BENCH_PROFILE_STAGES="0 1" also profiles two steps at the end of each of those stages (GPU only, the summary below):
what a stage's step spends its GPU time on, where the last stage is not the one in question.
Then two torch.profiler windows over the last stage (GPU only, then host and GPU): GPU time by kind of
kernel, idle gaps split into host-late and not, the host ops the GPU waited on, the longest kernels, and (with host
ops) each launching thread's time in ops and the ops with the most host self time (host_time); on several
GPUs also one line per rank: its NCCL kernel time by collective and kernel name, and its idle GPU time
(collectives that take one rank far longer than another are mostly spent waiting for the late ranks) and, from the
GPU-only profile, its Adam step's tail from its first collective to its last (optimizer_tail: whether the wire or the
rank's own compute sets it, and which rank starts it late) and each rank's compute kernels side by side, with the
kernels that differ most between ranks (ranks_kernels), and the order
rank 0 launched its collectives in, with what each carried and when its kernel ran (collective_order). Last, the
optimizers' steps alone, every rank starting together (optimizers_alone): the floor of their phases.
Real text from --train_files when it matches, else random tokens.

MFU counts 6 FLOPs per parameter per token for the matrices the tokens pass through (blocks and the
head; embedding lookups excluded) plus the attention scores as if every key in the window were
attended (12 * layers * window * dim per token): an upper bound on useful attention work.
"""
import bisect
import dataclasses
import functools
import gc
import glob
import itertools
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


# Kernel name patterns, first match wins: what each kind of GPU time is spent on.
KERNEL_KINDS = [
    ("attention (FA3)", r"flash::|FlashAttn"),  # CUTLASS kernels too: before the matmuls
    ("matmul (cuBLAS)", r"gemm|nvjet|cutlass|xmma|sm90_|cublas"),
    ("attention (flex)", r"flex_attention|triton_tem_fused_flex"),
    ("loss (Triton CE)", r"_softcapped_ce"),
    ("MLP matmuls + ReLU^2 (Triton)", r"_relu2_matmul"),
    ("Newton-Schulz (Triton)", r"_symmetric_matmul"),
    ("row gradients (Triton)", r"_sorted_rows_add"),
    ("Adam", r"adam"),
    ("communication", r"nccl"),
    ("inductor fused", r"^triton_"),
    ("index/scatter/gather", r"index|scatter|gather|embedding"),
    ("eager elementwise/reduce", r"elementwise|vectorized|reduce_kernel|CatArray|fill|copy|unrolled"),
    ("memcpy/memset", r"[Mm]emcpy|[Mm]emset"),
]


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, name)), "other")


def gpu_activity(trace: dict) -> list[dict]:
    """A torch.profiler chrome trace's GPU kernels, copies and sets, in the order they started."""
    return sorted((e for e in trace["traceEvents"]
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])


def idle_gaps(gpu: list[dict]):
    """(event, when the GPU went idle before it) for each event of gpu_activity that found nothing running."""
    busy_until = gpu[0]["ts"]
    for e in gpu:
        if e["ts"] > busy_until:
            yield e, busy_until
        busy_until = max(busy_until, e["ts"] + e["dur"])


def trace_summary(trace: dict, steps: int) -> list[str]:
    """Read a torch.profiler chrome trace: GPU time per kind of kernel, and the idle time between kernels,
    split into gaps where the next kernel was launched only after the GPU had gone idle (the host was late;
    attributed to the host op that launched it, inside its outermost op) and gaps the GPU left on its own."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = gpu_activity(trace)
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops_by_thread: dict = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation"):
            ops_by_thread.setdefault(e.get("tid"), []).append(e)
    parents: dict = {}  # thread -> index of each op's enclosing op (-1 at the top)
    for tid, ops in ops_by_thread.items():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack, parents[tid] = [], []
        for i, e in enumerate(ops):
            while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] < e["ts"]:
                stack.pop()
            parents[tid].append(stack[-1] if stack else -1)
            stack.append(i)
    starts = {tid: [e["ts"] for e in ops] for tid, ops in ops_by_thread.items()}

    def host_context(launch: dict) -> str:
        """'outermost op > innermost op' around a launch on its thread."""
        tid, t = launch.get("tid"), launch["ts"]
        ops = ops_by_thread.get(tid, [])
        i = bisect.bisect_right(starts.get(tid, []), t) - 1
        while i >= 0 and ops[i]["ts"] + ops[i]["dur"] < t:
            i = parents[tid][i]
        if i < 0:
            return "(no host op)"
        inner = i
        while parents[tid][i] >= 0:
            i = parents[tid][i]
        return f"{ops[i]['name'][:60]} > {ops[inner]['name'][:60]}"

    by_kind: dict = {}
    for e in gpu:
        by_kind[kernel_kind(e["name"])] = by_kind.get(kernel_kind(e["name"]), 0.0) + e["dur"]
    begin, end = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
    idle_late, idle_gpu, late_by_context, gaps = 0.0, 0.0, {}, 0
    for e, idle_since in idle_gaps(gpu):
        gap = e["ts"] - idle_since
        gaps += 1
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is not None and launch["ts"] + launch["dur"] > idle_since:
            idle_late += gap
            context = host_context(launch)
            late_by_context[context] = late_by_context.get(context, 0.0) + gap
        else:
            idle_gpu += gap
    span = end - begin
    per_step = lambda us: us / 1000 / steps
    lines = [f"GPU span {per_step(span):.1f} ms per step: busy {per_step(span - idle_late - idle_gpu):.1f}, "
             f"idle {per_step(idle_late + idle_gpu):.1f} ({100 * (idle_late + idle_gpu) / span:.1f}%) in "
             f"{gaps // steps} gaps per step: {per_step(idle_late):.1f} ms waiting for the host to launch, "
             f"{per_step(idle_gpu):.1f} ms with the next kernel already launched; {len(gpu) // steps} kernels per step"]
    lines.append("GPU time by kind of kernel (ms per step; overlapping streams count twice):")
    for kind, us in sorted(by_kind.items(), key=lambda item: -item[1]):
        lines.append(f"  {per_step(us):8.2f}  {100 * us / span:5.1f}%  {kind}")
    lines.append("host ops the GPU waited on (ms idle per step):")
    for context, us in sorted(late_by_context.items(), key=lambda item: -item[1])[:12]:
        lines.append(f"  {per_step(us):8.2f}  {context}")
    kernels: dict = {}
    launched_from: dict = {}  # kernel name -> {host context: GPU us}, when host ops were recorded
    for e in gpu:
        total, count = kernels.get(e["name"], (0.0, 0))
        kernels[e["name"]] = (total + e["dur"], count + 1)
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is not None and ops_by_thread:
            contexts = launched_from.setdefault(e["name"], {})
            context = host_context(launch)
            contexts[context] = contexts.get(context, 0.0) + e["dur"]
    def main_context(name: str) -> tuple[str, float]:
        """The host op behind most of a kernel's GPU time, and that time."""
        return max(launched_from[name].items(), key=lambda item: item[1])

    lines.append("longest kernels (ms per step, launches per step" + (", and the host op that launched most of "
                 "the time)" if launched_from else "):"))
    for name, (us, count) in sorted(kernels.items(), key=lambda item: -item[1][0])[:40]:
        lines.append(f"  {per_step(us):8.2f} {count // steps:6d}x  {name[:100]}")
        if name in launched_from:
            context, context_us = main_context(name)
            lines.append(f"  {'':16}<- {context} ({100 * context_us / us:.0f}%)")
    small = [(us, name) for name, (us, _) in kernels.items() if kernel_kind(name) in ("other", "memcpy/memset")]
    lines.append("kernels of kind 'other' and memcpy/memset (ms per step):")
    for us, name in sorted(small, reverse=True)[:12]:
        lines.append(f"  {per_step(us):8.2f}  {name[:100]}" + (f"  <- {main_context(name)[0]}" if name in launched_from else ""))
    return lines


def host_time(trace: dict, steps: int, top: int = 15) -> list[str]:
    """Where the host's time goes, from a trace with host ops: for each thread that launched GPU work (the training
    loop's, and the autograd engine's, which runs a CUDA backward), its time inside ops against the span from its
    first op to its last; then the ops with the most self time (an op's time less its child ops', so the Python an op
    runs around its children, e.g. inductor's wrapper launching a compiled graph's kernels, counts as the op's).
    Host time outside any op (the training loop's own Python) shows as the thread's time not in ops."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    launching = {e.get("tid") for e in events if e.get("cat") == "cuda_runtime"}
    ops_by_thread: dict = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and e.get("tid") in launching:
            ops_by_thread.setdefault(e.get("tid"), []).append(e)
    per_step = lambda us: us / 1000 / steps
    lines, self_time = [], {}
    for tid, ops in sorted(ops_by_thread.items(), key=lambda item: -len(item[1])):
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack, in_ops = [], 0.0  # stack: [op, its children's time]
        for e in ops + [None]:
            while stack and (e is None or stack[-1][0]["ts"] + stack[-1][0]["dur"] < e["ts"] + e["dur"]):
                op, children = stack.pop()
                self_time[op["name"]] = self_time.get(op["name"], 0.0) + max(op["dur"] - children, 0.0)
                if stack:
                    stack[-1][1] += op["dur"]
                else:
                    in_ops += op["dur"]
            if e is not None:
                stack.append([e, 0.0])
        span = max(e["ts"] + e["dur"] for e in ops) - ops[0]["ts"]
        lines.append(f"host thread {tid}: {per_step(in_ops):.1f} ms per step inside ops, {per_step(span):.1f} ms from "
                     f"its first op to its last ({len(ops) // steps} ops per step)")
    lines.append("host ops with the most self time (ms per step):")
    for name, us in sorted(self_time.items(), key=lambda item: (-item[1], item[0]))[:top]:
        lines.append(f"  {per_step(us):8.2f}  {name[:100]}")
    return lines


NCCL_COLLECTIVES = ("ReduceScatter", "AllGather", "AllReduce", "SendRecv", "Broadcast")


def rank_communication(trace: dict, steps: int) -> str:
    """One rank's NCCL kernel time per step by collective, with the algorithm and protocol its kernel's name carries,
    and its idle GPU time: a rank whose collectives take far longer than another's is mostly waiting in them for the
    ranks that come late. The name is the kernel NCCL built for that pair, not always the protocol that ran: with
    NCCL_PROTO=Simple the reduce-scatters' kernels were still named RING_LL (4xH200, docs/performance.md)."""
    gpu = gpu_activity(trace)
    by_collective: dict = {}
    for e in gpu:
        if "nccl" in e["name"]:
            collective = next((c for c in NCCL_COLLECTIVES if c in e["name"]), "other")
            algorithm = re.search(r"_([A-Z]+)_(LL128|LL|SIMPLE)\b", e["name"])  # e.g. ..._f32_RING_LL(...)
            key = f"{collective} {' '.join(algorithm.groups()) if algorithm else 'generic'}"
            total, count = by_collective.get(key, (0.0, 0))
            by_collective[key] = (total + e["dur"], count + 1)
    idle = sum(e["ts"] - idle_since for e, idle_since in idle_gaps(gpu))
    parts = ", ".join(f"{key} {us / 1000 / steps:.2f} ms ({count // steps}x)"
                      for key, (us, count) in sorted(by_collective.items(), key=lambda item: -item[1][0]))
    return (f"NCCL {sum(us for us, _ in by_collective.values()) / 1000 / steps:.2f} ms per step ({parts or 'none'}); "
            f"GPU idle {idle / 1000 / steps:.2f} ms")


def ranks_kernels(traces: list[dict], steps: int, top: int = 5) -> list[str]:
    """Each rank's compute kernels (all but NCCL's) per step, by kind, then the kernels whose time differs most
    between ranks: whether a rank's slower forward and backward is every kind of kernel running slower (its clock) or
    some kernels only (its documents' attention work, or a kernel config tuned differently on that rank)."""
    lines, by_name = [], []  # by_name: each rank's {kernel name: ms per step}
    for rank, trace in enumerate(traces):
        names, kinds = {}, {}
        for e in gpu_activity(trace):
            if "nccl" not in e["name"]:
                name, kind, ms = kernel_name(e["name"]), kernel_kind(e["name"]), e["dur"] / 1000 / steps
                names[name] = names.get(name, 0.0) + ms
                kinds[kind] = kinds.get(kind, 0.0) + ms
        by_name.append(names)
        largest = ", ".join(f"{kind} {ms:.2f}" for kind, ms in sorted(kinds.items(), key=lambda item: -item[1])[:4])
        lines.append(f"rank {rank}: compute kernels {sum(names.values()):.2f} ms per step ({largest})")
    times = {name: [names.get(name, 0.0) for names in by_name] for name in set().union(*by_name)}
    for name, ms in sorted(times.items(), key=lambda item: min(item[1]) - max(item[1]))[:top]:
        lines.append(f"  {max(ms) - min(ms):.2f} ms apart: {name[:60]} ({' / '.join(f'{t:.2f}' for t in ms)} by rank)")
    return lines


def kernel_name(name: str) -> str:
    """A kernel's name without its return type, namespaces and template or call arguments; a CUTLASS device_kernel
    (FA3's, for one) by the kernel class it runs, its first template argument of another name, e.g.
    FlashAttnBwdSm90."""
    name = re.sub(r"^void ", "", name).split("(")[0]
    inner = re.findall(r"([A-Za-z_]\w*)<", name)  # the templates, outermost first: device_kernel, enable_sm90, ...
    if inner and inner[0] == "device_kernel":
        return next((n for n in inner[1:] if n not in ("enable_sm90", "enable_sm80_to_sm89")), inner[0])
    return name.split("<")[0].rsplit("::", 1)[-1]


def optimizer_tail(trace: dict, gap_ms: float = 3.0) -> tuple[str, float]:
    """The tail of the profiled step whose collectives are the most (Adam's update), from its first NCCL kernel's
    start to its last one's end: its length, the NCCL kernels' time in it (their waits for the other ranks included)
    and the other kernels' on every stream, with the three kernels that took most of it. A tail as long as its NCCL
    time is bound by the wire (or by the late ranks), one as long as its other kernels by this rank's own compute,
    which the collectives then wait for. Returns the line and the tail's start (the trace's clock, microseconds: the
    ranks of one host share it, so the starts say which rank came late)."""
    gpu = gpu_activity(trace)
    runs, run = [], []
    for e in (e for e in gpu if "nccl" in e["name"].lower()):  # collectives less than gap_ms apart: one step's
        if run and e["ts"] - (run[-1]["ts"] + run[-1]["dur"]) > gap_ms * 1000:
            runs.append(run)
            run = []
        run.append(e)
    runs.append(run)
    tail = max(runs, key=len)
    if not tail:
        return "no collectives", 0.0
    start, end = tail[0]["ts"], max(e["ts"] + e["dur"] for e in tail)
    others: dict = {}  # kernel name -> its time in the tail
    streams: dict = {}  # stream -> the other kernels' time on it
    for e in gpu:
        if start <= e["ts"] < end and "nccl" not in e["name"].lower():
            name, us = kernel_name(e["name"]), min(e["dur"], end - e["ts"])
            others[name] = others.get(name, 0.0) + us
            stream = e.get("args", {}).get("stream")
            streams[stream] = streams.get(stream, 0.0) + us
    top = ", ".join(f"{name} {us / 1000:.2f}" for name, us in sorted(others.items(), key=lambda item: -item[1])[:3])
    nccl_ms, busiest_ms = sum(e["dur"] for e in tail) / 1000, max(streams.values(), default=0.0) / 1000
    line = (f"{len(tail)} collectives over {(end - start) / 1000:.2f} ms, NCCL kernels {nccl_ms:.2f} ms, other kernels "
            f"{sum(others.values()) / 1000:.2f} ms, {busiest_ms:.2f} of them on the busiest stream ({top or 'none'})")
    return line, start


# torch.distributed's ops as the profiler names them (with record_shapes: their tensors' dims), short names
C10D_COLLECTIVES = {"c10d::_reduce_scatter_base_": "RS", "c10d::reduce_scatter_tensor_coalesced_": "RS",
                    "c10d::_allgather_base_": "AG", "c10d::allgather_into_tensor_coalesced_": "AG",
                    "c10d::alltoall_base_": "A2A", "c10d::allreduce_": "AR", "c10d::broadcast_": "BC"}


def collective_order(trace: dict, limit: int = 60) -> str:
    """The collectives a rank launched in the profiled steps, in launch order (NCCL runs one communicator's in that
    order): kind, the elements and dims of the larger tensor, its dtype; a Muon group is a 3-D stack of matrices,
    an Adam bucket or table a flat vector, the bigram table's rows 2-D, the row counts' exchange (gloo) a few
    elements. A long collective queued before a Muon group's reduce-scatter delays Muon's compute behind it.
    With GPU activity in the trace, each collective's NCCL kernel follows: when it started on the GPU, from the first
    one's start, and how long it ran (its wait for the other ranks included). Needs a trace recorded with
    record_shapes."""
    events = trace["traceEvents"]
    launches = sorted((e for e in events if e.get("name") in C10D_COLLECTIVES and e.get("ph") == "X"),
                      key=lambda e: e["ts"])
    nccl = {e["args"]["correlation"]: e for e in gpu_activity(trace)
            if "nccl" in e["name"].lower() and "correlation" in e.get("args", {})}
    calls_by_thread: dict = {}  # the host's launches of those kernels, by thread
    for e in events:
        # a host call that shares a kernel's correlation id launched it: through the runtime API, or the driver's
        # (cuLaunchKernelEx, NCCL's), which the profiler files under another category
        if e.get("cat") != "kernel" and e.get("args", {}).get("correlation") in nccl:
            calls_by_thread.setdefault(e.get("tid"), []).append(e)
    first_start = None
    parts = []
    for e in launches[:limit]:
        kernel = next((nccl[call["args"]["correlation"]] for call in calls_by_thread.get(e.get("tid"), [])
                       if e["ts"] <= call["ts"] <= e["ts"] + e["dur"]), None)
        timing = ""
        if kernel is not None:
            first_start = kernel["ts"] if first_start is None else first_start
            timing = f" @{(kernel['ts'] - first_start) / 1000:.1f} for {kernel['dur'] / 1000:.2f} ms"
        args = e.get("args", {})
        tensors = [(math.prod(dims), dims, dtype) for dims, dtype in zip(args.get("Input Dims", []),
                                                                          args.get("Input type", []))
                   if dims and all(isinstance(d, int) for d in dims)]
        if not tensors:
            parts.append(C10D_COLLECTIVES[e["name"]] + timing)
            continue
        count, dims, dtype = max(tensors, key=lambda t: t[0])
        size = f"{count / 1e6:.1f}M" if count >= 1e5 else f"{count}"
        shape = f" {'x'.join(map(str, dims))}" if len(dims) > 1 else ""
        parts.append(f"{C10D_COLLECTIVES[e['name']]} {size}{shape} {dtype}{timing}")
    more = f", and {len(launches) - limit} more" if len(launches) > limit else ""
    return f"collectives in launch order: {', '.join(parts) or 'none'}{more}"


def ranks_alone(rows: list[dict[str, float]]) -> str:
    """Each rank's medians of what it spends on its own, one line: its GPU's forward and backward and its host's cost
    of a step issued to an idle GPU (HostCost), then the slowest rank less the fastest. The ranks meet at the
    optimizers' first collective, so the slowest rank's lead there is everyone else's wait, which rank 0's split
    counts in Muon's or DistAdam's phase. Mostly on its own: the reduce-scatters launched during the backward share
    its SMs, and the bigram exchange's host waits for the other ranks' row counts inside it."""
    gpu = [row["gpu"] for row in rows]
    host = [row["host"] for row in rows]
    ranks = ", ".join(f"rank {rank} {g:.1f} / {h:.1f}" for rank, (g, h) in enumerate(zip(gpu, host)))
    return (f"{'':>31}alone, forward+backward on the GPU / host with an idle GPU (ms): {ranks}; slowest less fastest "
            f"{max(gpu) - min(gpu):.1f} / {max(host) - min(host):.1f}")


def slowest_of_kind(times: list[float], adam_steps: list[bool]) -> float:
    """The slowest step over the median of its own kind (Adam updating or not): the kinds differ by the tables'
    communication, so a step is judged against its kind."""
    medians = {kind: statistics.median(t for t, k in zip(times, adam_steps) if k == kind) for kind in set(adam_steps)}
    return max(t / medians[kind] for t, kind in zip(times, adam_steps))


def steps_by_kind(times: list[float], splits: list[dict[str, float]], adam_steps: list[bool]) -> str:
    """One line: the median step and phase split of the steps where Adam updated and of the others (where it only
    adds up its gradients, and only Muon's collectives run)."""
    parts = []
    for kind, name in ((True, "Adam steps"), (False, "the others")):
        chosen = [i for i, k in enumerate(adam_steps) if k == kind]
        if not chosen:
            continue
        phases = " ".join(f"{k} {statistics.median(splits[i][k] for i in chosen):.1f}" for k in splits[chosen[0]])
        median = statistics.median(times[i] for i in chosen)
        parts.append(f"{name} {median:.1f} ms" + (f" ({phases})" if phases else ""))
    return "; ".join(parts)


def optimizers_alone(model, optimizers, batch, next_step_settings, repeats: int = 6) -> str:
    """The optimizers' steps with no forward or backward before them and every rank starting together (a barrier),
    for the steps where Adam updates and the others: the floor of the optimizers' phases when no rank comes late and
    nothing else runs. The gradients are the same random tensors at every step, the rows of the sparse exchanges (and
    of --table_row_fetch's fetches) those of `batch` (so they are as sparse as in training). It changes the weights:
    run it last."""
    grads = {p: torch.randn_like(p) * 1e-3 for p in model.parameters()}
    rows = {table: [rows] for table, rows in model.rows_read(batch).items()}
    splits, adam_steps = [], []
    for attempt in range(2 * repeats + 2):  # the first two (one of each kind) untimed
        adam = next_step_settings()
        for opt in optimizers:
            if hasattr(opt, "before_last_backward"):
                opt.before_last_backward(rows, rows)
        for p, grad in grads.items():
            p.grad = grad
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        torch.cuda.synchronize()
        marks = EventMarks()
        marks.start()
        optimizers.step(marks)
        torch.cuda.synchronize()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        if attempt >= 2:
            splits.append(marks.split_ms())
            adam_steps.append(adam)
    return (f"optimizers alone, every rank starting together (medians of {repeats}): "
            + steps_by_kind([sum(split.values()) for split in splits], splits, adam_steps))


class EventMarks:
    """CUDA events recorded at one step's start and each phase end, read after the timed steps' synchronize, and
    the host's clock at the same points: what the host spends issuing each phase (it waits only where the launch
    queue is full or something synchronizes, so a host phase as long as the GPU's means the GPU may wait on it)."""

    def __init__(self):
        self.events = []

    def start(self):
        self.events = [("start", torch.cuda.Event(enable_timing=True), time.perf_counter())]
        self.events[0][1].record()

    def __call__(self, phase: str):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append((phase, event, time.perf_counter()))

    def split_ms(self) -> dict[str, float]:
        return self._totals(lambda before, after: before[1].elapsed_time(after[1]))

    def host_split_ms(self) -> dict[str, float]:
        return self._totals(lambda before, after: 1000 * (after[2] - before[2]))

    def _totals(self, ms) -> dict[str, float]:
        """Each phase's time summed over its spans; ms(earlier mark, later mark) measures one span."""
        totals = {}
        for before, after in zip(self.events, self.events[1:]):
            totals[after[0]] = totals.get(after[0], 0.0) + ms(before, after)
        return totals


class HostCost:
    """The host's own cost of issuing each phase, with the launch queue empty: the GPU is synchronized at the step's
    start and after each phase, and a phase's time runs from that synchronize to its end on the host. Unlike
    EventMarks' host split, which holds the host's waits wherever the queue filled up, this is what the host spends
    on the phase's Python and launches; where their sum nears the GPU's step, the host sets the step."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.since = 0.0

    def start(self):
        torch.cuda.synchronize()
        self.since = time.perf_counter()

    def __call__(self, phase: str):
        self.totals[phase] = self.totals.get(phase, 0.0) + 1000 * (time.perf_counter() - self.since)
        torch.cuda.synchronize()
        self.since = time.perf_counter()


def profile_stages(value: str, stages: int) -> set[int]:
    """BENCH_PROFILE_STAGES: the stages, as a space- or comma-separated list, that end with a GPU-only profile."""
    try:
        chosen = {int(item) for item in value.replace(",", " ").split()}
    except ValueError:
        chosen = {-1}
    if not chosen <= set(range(stages)):
        raise tg.UserError(f"BENCH_PROFILE_STAGES={value!r}: give stage numbers from 0 to {stages - 1}, e.g. '0 1'")
    return chosen


def inductor_settings(text: str) -> None:
    """BENCH_INDUCTOR: a JSON object of torch._inductor.config keys and the values to set them to."""
    if not text:
        return
    import torch._inductor.config as inductor_config
    try:
        settings = json.loads(text)
    except ValueError:
        settings = None
    if not isinstance(settings, dict):
        raise tg.UserError(f"BENCH_INDUCTOR={text!r}: give a JSON object, e.g. '{{\"combo_kernels\": true}}'")
    for key, value in settings.items():
        try:
            setattr(inductor_config, key, value)
        except AttributeError:
            raise tg.UserError(f"BENCH_INDUCTOR: torch._inductor.config has no setting {key!r}") from None


def profile_steps(run_step, steps: int, trace: Path, activities: list, record_shapes: bool = False) -> float:
    """Run steps training steps under torch.profiler with these activities and write its chrome trace to trace
    (every rank its own: the steps' collectives need every rank); returns the wall time per step, in ms."""
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        torch.cuda.synchronize()
        clock = time.perf_counter()
        for _ in range(steps):
            run_step()
        torch.cuda.synchronize()
        wall_ms = 1000 * (time.perf_counter() - clock)
    prof.export_chrome_trace(str(trace))
    return wall_ms / steps


def main() -> int:
    argv = [a for a in sys.argv[1:] if not a.startswith("--bench_steps=")]
    steps = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--bench_steps=")), 10)
    cfg, _ = tg.parse_cli(argv)
    if os.environ.get("FLEX_KERNEL_OPTIONS"):  # FlexAttention takes the function from this module when built
        import torch.nn.attention.flex_attention as flex_module
        flex_module.flex_attention = functools.partial(flex_module.flex_attention,
                                                       kernel_options=json.loads(os.environ["FLEX_KERNEL_OPTIONS"]))
    if os.environ.get("BENCH_ADAM_MERGE"):
        tg.DistAdam.MERGE = int(os.environ["BENCH_ADAM_MERGE"])
    comm = tg.init_distributed(cfg)

    def say(text: str):
        if comm.is_main:
            print(text, flush=True)

    try:
        profiled = profile_stages(os.environ.get("BENCH_PROFILE_STAGES", ""), len(cfg.stage_batches))
        inductor_settings(os.environ.get("BENCH_INDUCTOR", ""))
        trainer = tg.build_and_warm_up(cfg, comm, say)
        model, optimizers, schedule, device = trainer.model, trainer.optimizers, trainer.schedule, trainer.device
        gc.collect()
        gc.freeze()  # as train() does for its loop: collections then skip the compiled process's objects
        # Real text when --train_files matches (document lengths shape the attention masks' sparsity and
        # the bigram rows touched); random tokens with ~500-token documents otherwise.
        real_text = bool(glob.glob(cfg.train_files))
        # BENCH_SAME_DATA=1: every rank reads rank 0's micro-batches, so no rank has more attention work than another
        same_data = os.environ.get("BENCH_SAME_DATA") == "1"
        data_comm = dataclasses.replace(comm, rank=0) if same_data else comm
        if real_text:
            source, data = cfg.train_files, tg.train_batches_for_rank(tg.shard_paths(cfg.train_files, "train_files"),
                                                                      dataclasses.replace(cfg, train_repeat=True), data_comm)
        else:
            source, data = ("random tokens (no --train_files found)",
                            tg.dummy_batches(cfg, seed=cfg.seed + 100 + data_comm.rank))
        if same_data:
            source += ", every rank reading rank 0's micro-batches (BENCH_SAME_DATA)"
        say(f"data: {source}")
        batches = None  # each stage's own loader, at its micro-batches per forward, over the one stream of windows
        peak = peak_flops(device)
        cuda = device.type == "cuda"  # the CPU runs it too, as a smoke test of this script
        synchronize = torch.cuda.synchronize if cuda else (lambda: None)
        if cuda and os.environ.get("BENCH_SYNC_DEBUG") == "1":
            torch.cuda.set_sync_debug_mode("warn")
        say(f"{trainer.packing.describe()} of {cfg.micro_batch_tokens} tokens per forward")
        say(f"{'stage':>5} {'micro':>5} {'windows':>11} {'step ms':>8} {'max/med':>7} {'tok/s':>10} {'MFU':>6}  "
            "phase split (ms per step)")
        losses = []  # every step's loss (rank's own micro-batches): the bench times steps, the losses say they learn
        trace_dir = Path(os.environ.get("BENCH_TRACE_DIR", "/tmp"))
        try:
            for stage in range(len(schedule.batches)):
                step = next(s for s in range(cfg.num_iterations) if schedule.stage(s) == stage)  # its first step
                windows, micro = schedule.windows(step), schedule.micro_batches(step) // comm.world_size
                forwards = trainer.forwards(step, comm.world_size)
                if batches is not None:
                    batches.close()
                    optimizers[1].whole_tables()  # the rows fetched last were those of that loader's next forwards
                # a generator of its own over `data`, which closing this stage's loader leaves open (with the windows
                # its slots hold: as many slots with --table_row_fetch as without, so both read the same windows)
                batches = tg.prefetch((window for window in data), cfg, device, trainer.per_forward(step),
                                      ahead=forwards * schedule.adam_period)
                # The timed steps run back to back, as in training (the host queues step n + 1 while the GPU
                # runs step n), and are timed by CUDA events at each step's start: a step's time is the GPU's
                # from its start to the next one's, idle waiting for the host included. (Until 2026-11-24 each
                # step was timed alone between two synchronizes, which also counted the GPU waiting for the
                # host's first launches: on 1xH100 the last stage 629.8 / 631.8 against 625.3 / 629.1 ms.)
                # Each step's settings as in training, from the stage's first step on: Adam updates on every
                # --adam_period'th step only and adds up its gradients on the others, so the two kinds alternate
                # at the default period of 2.
                cadence = itertools.count(step)

                def next_step_settings() -> bool:
                    """Set the optimizers for the stage's next step; whether Adam updates at it."""
                    at = next(cadence)
                    tg.set_hyperparameters(optimizers, schedule, at)
                    return schedule.adam_updates(at)

                def train_step(adam: bool, mark=None):
                    """One step as set; at an Adam update under --table_row_fetch, with the rows of the stage's next
                    period's forwards fetched (the stage's loader goes on past its steps, so these are its forwards)."""
                    fetch = adam and tg.fetches_table_rows(cfg) and comm.world_size > 1
                    return tg.train_step(model, optimizers, batches, windows, forwards, mark=mark,
                                         ahead=forwards * schedule.adam_period if fetch else 0)

                def run_step():
                    """The stage's next step, set as in training, untimed."""
                    train_step(next_step_settings())

                for _ in range(3):
                    losses.append(train_step(next_step_settings()))
                synchronize()
                step_marks, wall_times, adam_steps = [], [], []
                for _ in range(steps):
                    adam_steps.append(next_step_settings())
                    clock = time.perf_counter()
                    step_marks.append(EventMarks() if cuda else None)
                    if cuda:
                        step_marks[-1].start()
                    losses.append(train_step(adam_steps[-1], mark=step_marks[-1]))
                    wall_times.append(1000 * (time.perf_counter() - clock))  # the CPU's: it runs synchronously
                if cuda:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    synchronize()
                    starts = [m.events[0][1] for m in step_marks] + [end]
                    host_splits = [m.host_split_ms() for m in step_marks]
                    host_phases = {k: statistics.median(split[k] for split in host_splits) for k in host_splits[0]}
                    times = [a.elapsed_time(b) for a, b in zip(starts, starts[1:])]
                    splits = [m.split_ms() for m in step_marks]
                else:
                    times, splits = wall_times, [{} for _ in wall_times]
                # The mean: a run's time is the sum of its steps, and the two kinds alternate (a median of both
                # would land on either kind, or between them)
                mean = statistics.fmean(times)
                tokens_per_s = micro * comm.world_size * cfg.micro_batch_tokens / (mean / 1000)
                mfu = tokens_per_s * flops_per_token(model, cfg, windows) / (peak * comm.world_size) if peak else None
                phases = {k: statistics.fmean(split[k] for split in splits) for k in splits[0]}
                say(f"{stage:>5} {micro:>5} {str(windows):>11} {mean:8.1f} {slowest_of_kind(times, adam_steps):7.2f} "
                    f"{tokens_per_s:10,.0f} {'' if mfu is None else f'{100 * mfu:5.1f}%'}  "
                    + " ".join(f"{k} {v:.1f}" for k, v in phases.items()))
                say(f"{'':>31}" + steps_by_kind(times, splits, adam_steps))
                if cuda:  # the host's time to issue a step, beside the GPU's to run it
                    say(f"{'':>31}host {statistics.median(wall_times):8.1f} ms per step to issue: "
                        + " ".join(f"{k} {v:.1f}" for k, v in host_phases.items()))
                    costs = []  # then the host's own cost of each phase, issued to an idle GPU (HostCost)
                    for _ in range(4):  # two of each kind
                        adam = next_step_settings()
                        costs.append(HostCost())
                        costs[-1].start()
                        losses.append(train_step(adam, mark=costs[-1]))
                    cost = {k: statistics.fmean(c.totals[k] for c in costs) for k in costs[0].totals}
                    say(f"{'':>31}host {sum(cost.values()):8.1f} ms per step with an idle GPU: "
                        + " ".join(f"{k} {v:.1f}" for k, v in cost.items()))
                    if comm.distributed:  # a rank whose GPU or host runs late holds every other one back
                        rows = [None] * comm.world_size
                        torch.distributed.all_gather_object(rows, dict(
                            gpu=phases.get("forward", 0.0) + phases.get("backward", 0.0), host=sum(cost.values())))
                        say(ranks_alone(rows))
                    if stage in profiled and stage < len(schedule.batches) - 1:  # the last one's profiles come below
                        trace = trace_dir / f"bench_trace_stage{stage}_{comm.rank}.json"
                        profile_steps(run_step, 2, trace, [ProfilerActivity.CUDA])
                        say(f"{'':>31}profile (GPU only), 2 steps of this stage:")
                        if comm.is_main:
                            for line in trace_summary(json.loads(trace.read_text()), 2):
                                say(f"{'':>33}{line}")
            reasons = trainer.recompiles.new_reasons()
            say(f"graphs compiled in the timed region: {len(reasons)}"
                + (f"; peak memory {torch.cuda.max_memory_allocated() // 2**20} MiB" if cuda else ""))
            for reason in reasons[:8]:
                say(f"  recompiled: {reason[:400]}")
            # FA3 between CUDA graphs once timed well here while its training went wrong (docs/performance.md)
            values = [float(loss) for loss in losses]
            say(f"train loss over the {len(values)} steps (rank 0's micro-batches): first {values[0]:.4f}, "
                f"last {values[-1]:.4f}")
            if not all(map(math.isfinite, values)) or (real_text and values[-1] >= values[0]):
                say("warning: the loss did not fall on real text: these steps may train wrong; compare the losses of "
                    "short train_gpt.py runs")
            if not cuda:
                return 0

            # Twice: GPU activity only (little host overhead, so the idle time is close to the real one), then
            # with host ops too, to name the host work the GPU waited on (the profiler slows the host down).
            # The second records the tensors' shapes too: collective_order names what each collective carries.
            # Two steps each, one of each kind.
            for activities, profiled_steps in (([ProfilerActivity.CUDA], 2),
                                               ([ProfilerActivity.CPU, ProfilerActivity.CUDA], 2)):
                with_host = len(activities) > 1
                trace = trace_dir / f"bench_trace_{comm.rank}.json"
                wall_ms = profile_steps(run_step, profiled_steps, trace, activities, record_shapes=with_host)
                say(f"profile ({'host and GPU' if with_host else 'GPU only'}), {profiled_steps} steps of the last "
                    f"stage, wall {wall_ms:.0f} ms per step with the profiler on:")
                if comm.is_main:
                    ours = json.loads(trace.read_text())
                    lines = trace_summary(ours, profiled_steps) + (host_time(ours, profiled_steps) if with_host else [])
                    for line in lines:
                        print("  " + line, flush=True)
                    if comm.distributed and with_host:
                        print(f"  rank 0's {collective_order(ours)}", flush=True)
                if comm.distributed:  # each rank's collectives, read from the traces every rank wrote beside rank 0's
                    torch.distributed.barrier()
                    if comm.is_main:
                        first = None
                        traces = [json.loads(trace.with_name(f"bench_trace_{rank}.json").read_text())
                                  for rank in range(comm.world_size)]
                        for rank, other in enumerate(traces):
                            print(f"  rank {rank}: {rank_communication(other, profiled_steps)}", flush=True)
                            if not with_host:  # the profiler's own host work would stretch the tail
                                tail, start = optimizer_tail(other)
                                first = start if first is None else first
                                print(f"  rank {rank}'s Adam step from its first collective, starting "
                                      f"{(start - first) / 1000:+.2f} ms after rank 0's: {tail}", flush=True)
                        if not with_host:  # the compute kernels side by side: what makes a rank slow
                            for line in ranks_kernels(traces, profiled_steps):
                                print("  " + line, flush=True)
            say(optimizers_alone(model, optimizers, batches.next(), next_step_settings))
        finally:
            if batches is not None:
                batches.close()
            if hasattr(data, "close"):
                data.close()
            gc.unfreeze()
        return 0
    except tg.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if comm.distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
