"""Test helpers: token shards in the trainer's format and learnable synthetic documents."""
import gc
import importlib.util
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent

# The tests' vocabulary: 128 tokens, BOS the last. The learnable documents use tokens below 97, and the tiny model's
# embedding tables and head at GPT-2's 50,257 tokens took most of a CPU step (the tiny preset keeps GPT-2's
# vocabulary, for real data).
VOCAB, BOS = 128, 127
TINY = ["--preset=tiny", f"--vocab_size={VOCAB}", f"--bos_token={BOS}"]
TOKENS = dict(vocab_size=VOCAB, bos_token=BOS)  # the same, as Config fields


class RecordOps(TorchDispatchMode):
    """The aten ops dispatched inside `with RecordOps() as record:`, in order (record.ops): on the CPU, the count of
    the kernel launches the same code makes on a GPU."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def write_shard(path: Path, tokens) -> Path:
    tokens = np.asarray(tokens, dtype="<u2")
    header = np.zeros(256, dtype="<i4")
    header[:3] = (20240520, 1, len(tokens))
    path.write_bytes(header.tobytes() + tokens.tobytes())
    return path


def learnable_documents(num_tokens: int, seed: int) -> np.ndarray:
    """BOS-prefixed documents that follow a simple rule (each token = previous + a small step, mod 97),
    so a tiny model's loss falls well below chance within a few steps."""
    rng = np.random.default_rng(seed)
    out = []
    while sum(len(d) for d in out) < num_tokens:
        length = int(rng.integers(20, 120))
        start = int(rng.integers(0, 97))
        steps = rng.choice([1, 2], size=length - 1, p=[0.9, 0.1])
        doc = np.concatenate([[start], (start + np.cumsum(steps)) % 97])
        out.append(np.concatenate([[BOS], doc]))
    return np.concatenate(out)[:num_tokens]


def count_collectives() -> dict:
    """From now on in this process, counts of all_reduce and of the trainer's tensor collectives (its names)."""
    import train_gpt as tg
    calls = {"all_reduce": 0, "reduce_scatter_single": 0, "all_gather_single": 0}
    for name in calls:
        module = dist if name == "all_reduce" else tg
        original = getattr(module, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)
        setattr(module, name, counted)
    return calls


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(target, rank, world_size, port, args, results):
    gc.freeze()  # see RANK_PRELOAD
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:  # pickled by value: tensors sent as shared memory would die with this process
        results.put((rank, pickle.dumps(target(rank, world_size, *args))))
    except BaseException as e:
        results.put((rank, pickle.dumps(e)))
        raise
    finally:
        dist.destroy_process_group()


# Ranks, run_forked's processes and Trainer's runs fork from a server process that imported these once (at the first
# of them): each would otherwise spend seconds importing torch, and dynamo, which torch.optim pulls in. Unlike a fork of
# the test process, each starts from a clean state: no tensors, threads or process groups of earlier tests. Each forked
# process first freezes the objects it inherited (gc.freeze): the trainer's full collections then skip the imports'
# 300,000 objects (0.25 s a collection here), and their pages stay shared with the server.
RANK_PRELOAD = ["train_gpt", "torch._dynamo", "helpers"]


def _forkserver():
    """The multiprocessing context whose processes fork from the preloaded server."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)  # once the server runs, later calls change nothing
    return ctx


def run_on_ranks(target, world_size: int, *args, timeout: float = 300) -> list:
    """Run target(rank, world_size, *args) in world_size processes joined by a gloo group; return the
    values they returned, by rank. target must be a module-level function (it is pickled). The processes
    fork from the forkserver (RANK_PRELOAD), with its environment and working directory."""
    ctx = _forkserver()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(target, r, world_size, port, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    by_rank = {rank: pickle.loads(value) for rank, value in (results.get(timeout=timeout) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    for rank, value in by_rank.items():
        if isinstance(value, BaseException):
            raise AssertionError(f"rank {rank} failed: {value!r}")
    return [by_rank[r] for r in range(world_size)]


def _forked_main(target, args, results):
    gc.freeze()  # see RANK_PRELOAD
    try:
        results.put(pickle.dumps(target(*args)))
    except BaseException as e:
        results.put(pickle.dumps(e))
        raise


def run_forked(target, *args, timeout: float = 300):
    """target(*args) in a process forked from the preloaded server (RANK_PRELOAD): a clean process that skips the
    seconds of imports a new Python spends. Returns its value; target must be a module-level function."""
    ctx = _forkserver()
    results = ctx.Queue()
    proc = ctx.Process(target=_forked_main, args=(target, args, results))
    proc.start()
    value = pickle.loads(results.get(timeout=timeout))
    proc.join(timeout=60)
    if isinstance(value, BaseException):
        raise AssertionError(f"the forked process failed: {value!r}")
    return value


def _trainer_main(args, cwd, env, out, inductor, compile_backend):
    gc.freeze()  # see RANK_PRELOAD
    os.setsid()  # a process group of its own, as subprocess's start_new_session: killpg ends it and all it started
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(cwd)
    os.environ.update(env)
    import torch
    import train_gpt
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    torch._inductor.config.load_config(inductor)  # inductor read its environment when the server imported it
    if compile_backend is not None:  # every torch.compile of the trainer on this backend, which takes no mode
        inductor_compile = torch.compile
        torch.compile = lambda *a, mode=None, **kw: inductor_compile(*a, backend=compile_backend, **kw)
    sys.argv = [str(REPO / "train_gpt.py"), *args]
    sys.exit(train_gpt.main(args))


class Trainer:
    """`python train_gpt.py --run_id=RUN_ID ARGS` in cwd, run in a process forked from the preloaded server
    (RANK_PRELOAD) instead of a new Python, which would spend seconds on imports: the same main() in a process of its
    own that leads its own process group, its output in cwd/RUN_ID.out, polled and waited for as a subprocess.Popen.
    env: variables to set; inductor: torch._inductor.config settings ({"cpp.vec_isa_ok": False, ...}); compile_backend:
    a torch.compile backend for every compile."""

    def __init__(self, run_id: str, args, cwd, env=None, inductor=None, compile_backend=None):
        self.run_id, self.cwd = run_id, Path(cwd)
        self.out = self.cwd / f"{run_id}.out"
        self.process = _forkserver().Process(target=_trainer_main, args=(
            [f"--run_id={run_id}", *map(str, args)], str(cwd), dict(env or {}), str(self.out), dict(inductor or {}),
            compile_backend))
        self.process.start()
        self.pid = self.process.pid

    def poll(self):
        return self.process.exitcode

    def wait(self, timeout=None):
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(["train_gpt.py"], timeout)
        return self.process.exitcode

    def log(self, timeout: float = 400) -> str:
        """Waits for the run (past timeout seconds its process group is killed), asserts that it exited with 0 (else
        the tail of its output), and returns its log, cwd/logs/RUN_ID.txt."""
        try:
            code = self.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            code = "timeout"
        assert code == 0, f"run {self.run_id} ended with {code}:\n{self.out.read_text()[-3000:]}"
        return (self.cwd / "logs" / f"{self.run_id}.txt").read_text()


def train_scheduled_steps(model, optimizers, cfg, steps: int, seed: int = 1, before_step=None, after_step=None):
    """Train on the warm-up's random batches (train_gpt.dummy_batches(cfg, seed)) as the training loop does, one
    forward a step: each step sets the schedule's hyperparameters and trains with its windows. before_step(step)
    and after_step(step), when given, run around each step; after_step may return the next step (a replica that
    healed from a peer goes on at the peer's step), else the loop goes on at step + 1."""
    import torch
    import train_gpt as tg
    schedule = tg.Schedule(cfg)
    batches = tg.prefetch(tg.dummy_batches(cfg, seed=seed), cfg, torch.device("cpu"), packed=1)
    try:
        step = 0
        while step < steps:
            if before_step is not None:
                before_step(step)
            tg.set_hyperparameters(optimizers, schedule, step)
            tg.train_step(model, optimizers, batches, schedule.windows(step), forwards=1)
            following = after_step(step) if after_step is not None else None
            step = step + 1 if following is None else following
    finally:
        batches.close()


def random_tiny_model(cfg, std: float = 0.1, seed: int = 0):
    """A CPU GPT of cfg whose matrices, tables and gate weights are drawn from N(0, std), so that every path carries
    signal (most start at zero)."""
    import torch
    import train_gpt as tg
    torch.manual_seed(seed)
    model = tg.GPT(cfg, tg.SdpaAttention(), torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, std)
    return model


def load_script(relative_path: str):
    """Import a script of the repository (a file, not a package module) under its own name."""
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(path.stem + "_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def fp8_head_reference(x, weight, targets, cap: float, grad_loss, offset=0.0, divisor=None, mtp=None, copy=None):
    """The FP8 lm_head's arithmetic (train_gpt._Fp8SoftcappedHead) in float64 on the CPU, with autograd for
    the softcapped cross-entropy, z = cap * sigmoid((logit + offset) / divisor) (divisor: cap / 4 unless given):
    (per-row losses, grad_x, grad_w) for the upstream gradient grad_loss. mtp = (weights, period): each row's loss is
    the weighted sum of its cross-entropies to the tokens 1, 2, ... ahead that lie in its micro-batch of period rows.
    copy = (the gate's column, log_copy, log_sink): the next token's term is the copy mixture's
    (train_gpt.copy_mixture_losses), and the gradients of log_copy and log_sink come last in the result."""
    import torch
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    x, weight, targets, grad_loss = (t.detach().cpu() for t in (x, weight, targets, grad_loss))
    x_scale = torch.tensor(x.size(1) ** 0.5 / 448, dtype=torch.float32)
    w_scale = (weight.float().abs().max() / 448).clamp(min=1e-30)
    x_q = (x.float() / x_scale).clamp(-448, 448).to(e4m3).double() * x_scale.double()
    w_q = (weight.float() / w_scale).clamp(-448, 448).to(e4m3).double() * w_scale.double()
    logits = (x_q @ w_q.T).requires_grad_()
    z = cap * torch.sigmoid((logits + offset) / (divisor or cap / 4))
    if copy is not None:
        import train_gpt as tg
        slot, log_copy, log_sink = copy
        log_copy, log_sink = (t.detach().double().requires_grad_() for t in (log_copy, log_sink))
        losses = tg.copy_mixture_losses(z, targets, slot, log_copy, log_sink,
                                        None if mtp is None else (mtp[0].double(), mtp[1]))
    elif mtp is None:
        losses = torch.logsumexp(z, dim=1) - z.gather(1, targets[:, None].long())[:, 0]
    else:
        weights, period = mtp
        losses = torch.zeros(len(targets), dtype=torch.float64)
        for i in range(len(targets)):
            for k, w in enumerate(weights.tolist()):
                if i % period + k < period:
                    losses[i] = losses[i] + w * (torch.logsumexp(z[i], 0) - z[i, targets[i + k]])
    losses.backward(grad_loss.double())
    grad_scale = (grad_loss.float().abs().max() / 2 ** 15).clamp(min=1e-30)
    grad = (logits.grad / grad_scale.double()).to(e5m2).double() * grad_scale.double()
    if copy is not None:
        return losses.detach(), grad @ w_q, grad.T @ x_q, log_copy.grad, log_sink.grad
    return losses.detach(), grad @ w_q, grad.T @ x_q


def pointer_log_masses(rows: int, generator, device="cpu"):
    """(log_copy, log_sink) per row for the copy mixture's tests: a sink mass below 0.6, a hit mass that fits beside
    it on about 70% of the rows, and no hit (-1e9) on the others."""
    import torch
    sink = torch.rand(rows, generator=generator, device=device) * 0.6
    hit = torch.rand(rows, generator=generator, device=device) < 0.7
    copy = torch.rand(rows, generator=generator, device=device) * (1 - sink)
    return torch.where(hit, copy.log(), torch.full_like(sink, -1e9)), sink.log()


def pointer_inputs(T=384, d=16, vocab=6, seed=0, device="cpu"):
    """(q, k, sink, tokens, targets, documents) for the copy pointer's tests: random queries and keys, a small
    vocabulary so that many queries find their target, documents from 2 to 254 tokens long (so that a band of 128
    cuts some), and the first 130."""
    import torch
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, d, generator=g), torch.randn(T, d, generator=g)
    tokens = torch.randint(0, vocab, (T,), generator=g)
    starts = torch.zeros(T, dtype=torch.bool)
    starts[[i for i in (0, 130, 132, 300) if i < T]] = True
    targets = torch.cat([tokens[1:], tokens[:1]])
    return tuple(t.to(device) for t in (q, k, torch.tensor([0.7]), tokens, targets, torch.cumsum(starts.long(), 0)))


def dense_pointer_reference(q, k, sink, tokens, targets, documents, band):
    """train_gpt.copy_log_probs from the whole [T, T] score matrix, in float64 with autograd: (log_copy, log_sink)."""
    import torch
    q, k, sink = q.double(), k.double(), sink.double()
    scores = q @ k.T / q.size(1) ** 0.5
    back = torch.arange(q.size(0), device=q.device)[:, None] - torch.arange(q.size(0), device=q.device)[None, :]
    seen = (back >= 0) & (back < band) & (documents[:, None] == documents[None, :])
    hits = seen & (targets[:, None] == tokens[None, :])
    log_z = torch.logaddexp(torch.logsumexp(scores.masked_fill(~seen, -1e9), 1), sink)
    return torch.logsumexp(scores.masked_fill(~hits, -1e9), 1) - log_z, sink - log_z


def copy_mixture_reference(logits, targets, cap: tuple, slot: int, log_copy, log_sink, mtp):
    """The copy mixture's losses of softcapped logits in float64 (train_gpt.copy_mixture_losses, autograd): (per-row
    losses, d sum / d logits, d sum / d log_copy, d sum / d log_sink), the loss kernel's outputs to check."""
    import torch
    import train_gpt as tg
    x, lc, ls = (t.double().requires_grad_() for t in (logits, log_copy, log_sink))
    z = cap[0] * torch.sigmoid((x + cap[1]) / cap[2])
    losses = tg.copy_mixture_losses(z, targets, slot, lc, ls, (mtp[0].double(), mtp[1]))
    losses.sum().backward()
    return losses.detach(), x.grad, lc.grad, ls.grad


def unquantised_head_reference(x, weight, targets, cap: float, grad_loss):
    """The head without FP8, in float64 on the CPU: (per-row losses, grad_x, grad_w) for grad_loss."""
    import torch
    x, weight = (t.detach().cpu().double().requires_grad_() for t in (x, weight))
    z = cap * torch.sigmoid(x @ weight.T * (4.0 / cap))
    losses = torch.logsumexp(z, dim=1) - z.gather(1, targets.cpu()[:, None].long())[:, 0]
    losses.backward(grad_loss.cpu().double())
    return losses.detach(), x.grad, weight.grad


def relative_error(got, ref) -> float:
    """||got - ref|| / ||ref||, in float64 (ref is a float64 reference)."""
    return ((got.double() - ref).norm() / ref.norm()).item()


def cu_seqlens_of(tokens, bos: int):
    """What the loader hands the attention backends for one micro-batch: its document starts followed by its
    length (unpadded)."""
    import torch
    import train_gpt as tg
    starts = tg.micro_batch_document_starts(tokens.cpu().numpy(), bos).tolist()
    return torch.tensor(starts + [len(tokens)], dtype=torch.int32, device=tokens.device)


# A step line of the trainer's log
STEP_LINE = re.compile(r"^step:(\d+)/(\d+)( val_loss:(\S+))? train_time:(\d+)ms step_avg:(\S+)ms( train_loss:\S+)?$")


def tiny_config(train, val, **overrides):
    """The tiny preset on the CPU over these shards, with overrides as flags."""
    import train_gpt as tg
    cfg, _ = tg.parse_cli(["--device=cpu", *TINY, f"--train_files={train}", f"--val_files={val}"]
                          + [f"--{k}={v}" for k, v in overrides.items()])
    return cfg


def run_cli(args, cwd, nproc=1, timeout=600):
    """train_gpt.py in a subprocess, under torchrun for nproc > 1."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    return subprocess.run(launcher + [str(REPO / "train_gpt.py")] + args, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def dense_lookup(indices, use_triton, dtypes, *tables):
    """What _RowLookup computes, through autograd's dense embedding gradients."""
    return tuple(torch.nn.functional.embedding(indices, table).to(dtype) for table, dtype in zip(tables, dtypes))
