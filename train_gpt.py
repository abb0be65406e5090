"""Train a GPT-2-small-class model to a target FineWeb validation loss, as fast as one node allows.

    torchrun --standalone --nproc_per_node=8 train_gpt.py  # a record attempt
    python train_gpt.py --device=cpu --preset=tiny         # a tiny run on the CPU
    python train_gpt.py --help                             # every config field

Importing it runs nothing. Ideas and constants are the NanoGPT speedrun's (github.com/KellerJordan/modded-nanogpt),
credited where used; docs/design.md explains the design.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import difflib
import functools
import gc
import glob
import hashlib
import itertools
import json
import math
import os
import platform
import queue
import sys
import threading
import time
import typing
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

try:
    import torch
except (ImportError, OSError) as e:  # one line, not a traceback (OSError: a shared library missing)
    sys.exit(f"error: torch is not importable ({e}); install the requirements: pip install -r requirements.txt")
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256
LOG_FORMAT_VERSION = 1


# --------------------
# Config

class UserError(Exception):
    """Bad input: main() prints it on one line and exits non-zero."""

class Stage(typing.NamedTuple):
    """A schedule row; mtp: (start, end) loss weight per token ahead, normalised."""
    batch: int  # micro-batches per step over all ranks, a multiple of 8
    lr: float  # lr multiplier; the extension row's ends the cooldown
    windows: tuple[int, int]  # short, long
    doc_len: int  # tokens kept per training document
    mtp: tuple[tuple[float, float], ...]

# The speedrun's stages (batch 2025-11, windows 2024-11, lr 2025-12, doc_len 2026-02-10, MTP 2025-12-22)
STAGES = (
    Stage(8, 1.0, (128, 384), 896, ((1, 1), (0.5, 0.5), (0.25, 0))),
    Stage(16, 1.52, (384, 896), 2048, ((1, 1), (0.5, 0))),
    Stage(24, 1.73, (640, 1408), 2048, ((1, 1),)),
    Stage(24, 0.15, (768, 1664), 2048, ((1, 1),)),  # the extension
)
CONFIG_GROUPS = ("data", "schedule", "run", "model", "optimizers", "speed", "DiLoCo")

def _field(group: str):
    return lambda default, help: dataclasses.field(default=default, metadata=dict(group=group, help=help))

_data, _schedule, _run, _model, _optim, _speed, _diloco = map(_field, CONFIG_GROUPS)

@dataclass(frozen=True)
class Config:
    """A run's settings, each a flag --name=value."""
    train_files: str = _data("data/fineweb10B/fineweb_train_*.bin", "training shards, a glob")
    val_files: str = _data("data/fineweb10B/fineweb_val_*.bin", "validation shards, a glob")
    val_tokens: int = _data(10_485_760, "tokens per validation, a multiple of micro_batch_tokens")
    train_repeat: bool = _data(False, "reuse the training shards when they run out")
    val_mask: str = _data("", "data/canonical_pairs.py's file: validation also gives the loss over canonical tokens")
    vocab_size: int = _data(50257, "vocabulary size (GPT-2's)")
    bos_token: int = _data(50256, "document-start token (GPT-2's <|endoftext|>)")
    num_iterations: int = _schedule(1270, "scheduled steps, split over the stages")
    extension_steps: int = _schedule(15, "steps after them, at the last row's settings")
    micro_batch_tokens: int = _schedule(16 * 1024, "tokens per micro-batch, a multiple of 128")
    stages: tuple = _schedule(STAGES, "rows 'batch lr short:long doc_len mtp;...', the last the extension; a>b ramps")
    final_windows: tuple[int, int] = _schedule((768, 2560), "short:long windows of the final validation")
    cooldown_frac: float = _schedule(0.7, "final fraction of scheduled steps with linear lr decay")
    val_loss_every: int = _run(250, "steps between validations; 0: only at the end")
    seed: int = _run(0, "seed of the init and warm-up batches, not the data order")
    run_id: str = _run("", "run name, logged to log_dir/<run_id>.txt; empty: a uuid")
    log_dir: str = _run("logs", "log folder")
    device: str = _run("cuda", "cuda | cpu (gloo, float32, no Triton)")
    save_checkpoint: str = _run("", "checkpoint written at the end; empty: none")
    checkpoint_every: int = _run(0, "steps between <name>_stepNNNNNN.pt checkpoints; 0: none")
    keep_checkpoints: int = _run(3, "the newest periodic checkpoints kept; 0: all")
    resume: str = _run("", "checkpoint to resume training from, as if never stopped")
    eval_only: bool = _run(False, "only validate --init_from's weights")
    init_from: str = _run("", "checkpoint for --eval_only (sample.py continues prompts with one)")
    num_layers: int = _model(11, "transformer blocks")
    model_dim: int = _model(768, "residual stream width")
    num_heads: int = _model(6, "attention heads, even; num_heads * head_dim = model_dim")
    head_dim: int = _model(128, "channels per head, a multiple of 4")
    attn_layout: str = _model("SSSLSS-SSSL", "per layer: S short window, L long, - no attention")
    value_embed_layout: str = _model(".01.....234", "per layer: its value-embedding table, . none")
    paired_head_layers: tuple = _model((0, 2, 5, 9), "layers whose heads attend in pairs")
    xsa_layers: tuple = _model((1, 3, 4, 7), "layers with learned exclusive self-attention")
    skip_from: int = _model(3, "layer whose output feeds skip_to, gated")
    skip_to: int = _model(6, "layer taking skip_from's output")
    attn_input_from: int = _model(7, "later layers attend to this layer's output")
    backout_from: int = _model(7, "middle source of the dense connections")
    bigram_rows: int = _model(15 * 50304, "hashed bigram table rows, a multiple of 8; 0: off")
    copy_pointer: bool = _model(True, "mix a pointer over earlier tokens into the prediction")
    longest_match: bool = _model(True, "also read the token after the longest earlier repeat")
    adam_lr: float = _optim(0.008, "Adam's base lr")
    muon_lr: float = _optim(0.023, "Muon's base lr")
    adam_period: int = _optim(0, "steps per Adam step, gradients summed; 0: 2, or 1 with DiLoCo")
    compile: bool = _speed(True, "torch.compile the model")
    cuda_graphs: str = _speed("auto", "CUDA graphs for the model and Muon: 1, 0, auto (where they pay)")
    attn_backend: str = _speed("auto", "auto (fa3, else flex on CUDA, sdpa on CPU) | fa3 | flex | sdpa")
    triton_kernels: bool = _speed(True, "Triton kernels (CUDA); 0: plain torch")
    fp8_head: bool = _speed(True, "FP8 head matmuls in Triton (compute capability 8.9+)")
    fused_mlp: bool = _speed(True, "ReLU^2-fused Triton MLP (compute capability 9.0+)")
    forward_micro_batches: int = _speed(0, "a rank's micro-batches per forward; 0: auto")
    diloco: bool = _diloco(False, "streaming DiLoCo on torchft: replica groups sync rarely")
    diloco_replicas: int = _diloco(2, "replica groups, each with its own data share")
    replica: int = _diloco(0, "this group's index, 0 .. diloco_replicas-1")
    sync_every: int = _diloco(8, "inner steps between a fragment's syncs; may differ per replica")
    num_fragments: int = _diloco(2, "contiguous groups of blocks, synced in turn")
    outer_lr: float = _diloco(0.7, "outer SGD lr on the averaged pseudogradient; 1: plain mean")
    min_replicas: int = _diloco(1, "fewest replicas in a quorum for a sync to commit")

    @property
    def scheduled_stages(self) -> tuple:
        return self.stages[:-1]

    @property
    def max_doc_len(self) -> int:
        return max(stage.doc_len for stage in self.stages)

    @property
    def period(self) -> int:
        """--adam_period, else 2 (speedrun 2025-09-30), or 1 under DiLoCo (a sync lands between any two steps)."""
        return self.adam_period or (1 if self.diloco else 2)

PRESETS = {
    # The default model shrunk for two CPU processes, every part kept
    "tiny": dict(
        num_layers=4, model_dim=64, num_heads=2, head_dim=32, attn_layout="SL-L", value_embed_layout="0..1",
        paired_head_layers=(0,), xsa_layers=(1,), skip_from=1, skip_to=2, attn_input_from=1, backout_from=1,
        bigram_rows=4096, micro_batch_tokens=256, num_iterations=24, extension_steps=0, val_loss_every=8,
        val_tokens=2048, final_windows=(64, 128), compile=False, fp8_head=False, forward_micro_batches=1,
        stages=(Stage(8, 1.0, (16, 32), 128, ((1, 1), (0.5, 0.5), (0.25, 0))),
                Stage(8, 1.52, (32, 64), 256, ((1, 1), (0.5, 0))),
                Stage(16, 1.73, (48, 96), 256, ((1, 1),)),
                Stage(16, 0.15, (48, 96), 256, ((1, 1),)))),
}
CLI_ONLY_FLAGS = ("preset", "check", "help")

def format_value(value, name: str = "") -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, tuple) and value and isinstance(value[0], Stage):
        return "; ".join(f"{s.batch} {s.lr:g} {s.windows[0]}:{s.windows[1]} {s.doc_len} "
                         + ",".join(f"{a:g}" if a == b else f"{a:g}>{b:g}" for a, b in s.mtp) for s in value)
    if isinstance(value, tuple):
        return (":" if name == "final_windows" else ",").join(map(str, value))
    return str(value)

def parse_stages(text: str) -> tuple:
    rows = []
    for row in text.split(";"):
        batch, lr, windows, doc_len, mtp = row.split()
        short, long = windows.split(":")
        weights = tuple((float(w.split(">")[0]), float(w.split(">")[-1])) for w in mtp.split(","))
        rows.append(Stage(int(batch), float(lr), (int(short), int(long)), int(doc_len), weights))
    return tuple(rows)

def parse_value(name: str, kind: str, text: str):
    if kind == "bool":
        if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError("expected 1 or 0")
        return text.lower() in ("1", "true", "yes", "on")
    if kind == "int":
        return int(text.replace("_", ""))
    if kind == "float":
        return float(text)
    if kind == "str":
        return text
    if name == "stages":
        return parse_stages(text)
    if name == "final_windows":
        short, long = text.split(":")
        return int(short), int(long)
    return tuple(int(item) for item in text.split(",")) if text else ()  # layer lists

def parse_cli(argv: list[str]) -> tuple[Config, dict]:
    """--name=value overrides on an optional --preset; returns (config, CLI-only flags)."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    overrides, flags = {}, {}
    for arg in argv:
        if arg == "-h":
            arg = "--help"
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument {arg!r}: arguments take the form --name=value")
        name, has_value, text = arg[2:].partition("=")
        if name in CLI_ONLY_FLAGS:
            flags[name] = text if has_value else "1"
            continue
        if name not in fields:
            names = [*fields, *CLI_ONLY_FLAGS]
            near = [*difflib.get_close_matches(name, names, 3, 0.6), *(n for n in names if name in n)]
            near = " or ".join(f"--{n}" for n in list(dict.fromkeys(near))[:3])
            raise UserError(f"unknown option --{name}{f' (did you mean {near}?)' if near else ''}; "
                            "`python train_gpt.py --help` lists them")
        if not has_value:
            raise UserError(f"--{name} needs a value: --{name}=VALUE")
        try:
            overrides[name] = parse_value(name, fields[name].type, text)
        except ValueError as e:
            raise UserError(f"bad value for --{name}: {text!r} ({e or 'see --help for its form'})") from None
    preset = flags.get("preset")
    if preset is not None and preset not in PRESETS:
        raise UserError(f"unknown --preset={preset}; presets: {', '.join(PRESETS)}")
    base = PRESETS.get(preset, {})
    if overrides.get("init_from") and overrides.get("eval_only"):
        saved = config_from_dict(read_checkpoint(overrides["init_from"], "init_from")["config"])
        base = {**base, **{f.name: getattr(saved, f.name) for f in fields.values()  # where no flag sets them
                           if f.metadata["group"] in ("data", "schedule", "model")}}
    cfg = Config(**{**base, **overrides})
    validate_config(cfg)
    return cfg, flags

def validate_config(cfg: Config):
    def need(ok: bool, message: str):
        if not ok:
            raise UserError(message)

    n, layout, ve = cfg.num_layers, cfg.attn_layout, cfg.value_embed_layout
    for name, value in vars(cfg).items():
        need(not isinstance(value, float) or math.isfinite(value), f"--{name}={value}: give a finite number")
    for name, (low, high) in dict(num_iterations=(1, 1e9), extension_steps=(0, 1e9), val_loss_every=(0, 1e9),
                                  keep_checkpoints=(0, 1e9), adam_lr=(0, 1), muon_lr=(0, 1), adam_period=(0, 99),
                                  cooldown_frac=(1e-6, 1), outer_lr=(1e-6, 9)).items():
        need(low <= getattr(cfg, name) <= high, f"--{name}={getattr(cfg, name)}: use {low:g} .. {high:g}")
    for name, choices in (("device", ("cuda", "cpu")), ("attn_backend", ("auto", "fa3", "flex", "sdpa")),
                          ("cuda_graphs", ("auto", "1", "0"))):
        need(getattr(cfg, name) in choices, f"--{name}={getattr(cfg, name)}: use one of {', '.join(choices)}")
    need(not (cfg.cuda_graphs == "1" and cfg.device != "cuda"), "--cuda_graphs=1 needs --device=cuda")
    need(n >= 3 and len(layout) == n and set(layout) <= set("SL-") and "-" not in (layout[0], layout[-1]),
         f"--attn_layout={layout!r}: one of S, L, - per layer ({n}, at least 3), attention in the first and last")
    need(len(ve) == n and all(c == "." or c.isdigit() and a != "-" for c, a in zip(ve, layout)) and ve != "." * n,
         f"--value_embed_layout={ve!r}: a digit or '.' per layer ({n}), digits only where a layer attends")
    for name in ("paired_head_layers", "xsa_layers"):
        layers = getattr(cfg, name)
        need(len(set(layers)) == len(layers) and all(0 <= i < n and layout[i] != "-" for i in layers),
             f"--{name}={format_value(layers)}: distinct layers with attention, 0 .. {n - 1}")
    need(cfg.num_heads % 2 == 0 and cfg.num_heads * cfg.head_dim == cfg.model_dim and cfg.head_dim % 4 == 0,
         f"--num_heads={cfg.num_heads} --head_dim={cfg.head_dim}: an even number of heads of a multiple of 4 "
         f"channels, model_dim={cfg.model_dim} in all")
    need(cfg.model_dim >= GATE_DIMS, f"--model_dim={cfg.model_dim}: at least {GATE_DIMS}")
    need(0 <= cfg.skip_from < cfg.skip_to < n,
         f"--skip_from={cfg.skip_from} --skip_to={cfg.skip_to}: need 0 <= skip_from < skip_to < num_layers")
    for name in ("skip_from", "attn_input_from", "backout_from"):
        need(0 <= getattr(cfg, name) < n - 1, f"--{name}={getattr(cfg, name)}: use a layer 0 .. {n - 2}")
    need(2 <= cfg.vocab_size <= 65536 and 0 <= cfg.bos_token < cfg.vocab_size,
         f"--vocab_size={cfg.vocab_size} --bos_token={cfg.bos_token}: shards hold 16-bit tokens, and BOS is one")
    need(cfg.bigram_rows == 0 or (cfg.bigram_rows >= 16 and cfg.bigram_rows % 8 == 0),
         f"--bigram_rows={cfg.bigram_rows}: 0 (off) or a multiple of 8 of at least 16")
    tokens = cfg.micro_batch_tokens
    need(tokens > 0 and tokens % 128 == 0 and cfg.val_tokens > 0 and cfg.val_tokens % tokens == 0,
         f"--micro_batch_tokens={tokens} --val_tokens={cfg.val_tokens}: a positive multiple of 128, and one of it")
    need(len(cfg.stages) >= 2 and all(s.batch > 0 and s.batch % 8 == 0 and s.doc_len >= 1 and 0 < s.lr < 99 and s.mtp
                                      and min(s.mtp[0]) > 0 and min(map(min, s.mtp)) >= 0 for s in cfg.stages),
         "--stages: a stage and the extension at least; batches positive multiples of 8, doc_len positive, lr in "
         "(0, 99), mtp weights not negative, the next token's above 0")
    need(all(0 < short <= long <= tokens for short, long in [s.windows for s in cfg.stages] + [cfg.final_windows]),
         f"--stages, --final_windows: windows 0 < short <= long <= --micro_batch_tokens={tokens}")
    need(cfg.checkpoint_every >= 0 and cfg.checkpoint_every % cfg.period == 0,
         f"--checkpoint_every={cfg.checkpoint_every}: 0 or a multiple of Adam's period ({cfg.period}), not mid-sum")
    need(not cfg.checkpoint_every or cfg.save_checkpoint, "--checkpoint_every needs --save_checkpoint=PATH")
    need(not cfg.eval_only or cfg.init_from, "--eval_only=1 needs --init_from=CHECKPOINT")
    need(not cfg.init_from or cfg.eval_only, "--init_from is read by --eval_only=1 (to train on, use --resume; to "
         "continue a prompt, sample.py)")
    if cfg.diloco:
        total, period = cfg.num_iterations + cfg.extension_steps, cfg.sync_every // max(cfg.num_fragments, 1)
        need(cfg.period == 1, f"--adam_period={cfg.adam_period}: DiLoCo needs 1")
        need(1 <= cfg.num_fragments <= n and cfg.sync_every > 0 and cfg.sync_every % cfg.num_fragments == 0,
             f"--num_fragments={cfg.num_fragments} --sync_every={cfg.sync_every}: 1 .. num_layers fragments, "
             "sync_every a multiple of num_fragments")
        need(total % cfg.sync_every == 0, f"--num_iterations + --extension_steps = {total} must be a multiple of "
                                          f"--sync_every={cfg.sync_every}, so replicas sync alike")
        need(cfg.checkpoint_every % period == 0,
             f"--checkpoint_every={cfg.checkpoint_every}: with --diloco=1 a multiple of sync_every/num_fragments")
        need(0 <= cfg.replica < cfg.diloco_replicas and cfg.min_replicas >= 1,
             f"--replica={cfg.replica} --min_replicas={cfg.min_replicas}: a replica 0 .. diloco_replicas-1, at least 1")

def config_help() -> str:
    fields = dataclasses.fields(Config)
    lines = [f"usage: train_gpt.py [--preset={'|'.join(PRESETS)}] [--check] [--name=value ...]"]
    for group in CONFIG_GROUPS:
        lines += ["", f"{group}:"]
        for f in fields:
            if f.metadata["group"] == group:
                flag = f"--{f.name}={format_value(f.default, f.name)}"
                gap = "  " if len(flag) <= 32 else "\n" + " " * 36
                lines.append(f"  {flag:32}{gap}{f.metadata['help']}")
    return "\n".join(lines)

# --------------------
# Model

GATE_DIMS = 12  # channels the per-token gates read (speedrun 2025-12-29)
BIGRAM_SIGNS = 8192  # random sign vectors of the bigram rows (speedrun 2026-05-20)
LOGIT_CAP = (23.0, 5.0, 7.5)  # z -> 23 sigmoid((z + 5) / 7.5) (speedrun 2025-12-26); cap <= 4 * divisor
COPY_BAND = 2048  # the copy pointer's reach, a multiple of COPY_BLOCK
UNTIE_FRAC = 0.667  # fraction of steps the embedding is tied to the head (speedrun 2025-12-22)
# Adam settings (speedrun 2025-12): multipliers of --adam_lr and ADAM_WD, betas
ADAM_BETAS, ADAM_EPS, ADAM_WD = (0.9, 0.99), 1e-10, 0.005
TABLE = dict(lr=75.0, wd=5.0, betas=(0.75, 0.95))  # the value and bigram tables
HEAD = dict(lr=1.0, wd=150.0, betas=(0.5, 0.95))  # the head and its tied embedding
SCALAR = dict(lr=5.0)
MUON_WD = 1.2  # cautious, times the lr (speedrun 2025-11-10)

@dataclass(frozen=True)
class Opt:
    """rows: key of the rows read (sparse gradients); tie: whose update it shares until untied; split: Muon's row
    blocks, a count or (height, count) runs."""
    optimizer: str = "adam"
    lr: float = 1.0
    wd: float = 0.0
    betas: tuple = ADAM_BETAS
    rows: str = ""
    tie: str = ""
    split: typing.Any = 1

def declare(p, **settings) -> nn.Parameter:
    p = p if isinstance(p, nn.Parameter) else nn.Parameter(p)
    p.opt = Opt(**settings)
    return p

Kernels = collections.namedtuple("Kernels", "triton fused_mlp fp8_head", defaults=(False, False, False))

def choose_kernels(cfg: Config, device: torch.device) -> Kernels:
    on = device.type == "cuda" and triton is not None and cfg.triton_kernels
    return Kernels(on, on and cfg.fused_mlp, on and cfg.fp8_head)

def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()

def rms_norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))

def next_multiple_of(n: int, k: int) -> int:
    return -(-n // k) * k

def yarn_rescale(freqs: Tensor, old_window: int, new_window: int, alpha: float = 1.0, beta: float = 32.0) -> Tensor:
    """YaRN (Peng et al. 2023; speedrun 2025-09-10): slow turns slow by old/new, fast stay, the rest blend."""
    turns = old_window * freqs / (2 * math.pi)
    keep = ((turns - alpha) / (beta - alpha)).clamp(0, 1)
    ratio = old_window / new_window
    return freqs * (ratio + keep * (1 - ratio))

class Rotary(nn.Module):
    """Rotary on half the dims, base 1024 (speedrun 2024-12); paired heads put token t at 2t, 2t + 1."""
    def __init__(self, head_dim: int, max_len: int, period: int, attn_scale: float, paired: bool):
        super().__init__()
        buffer = functools.partial(self.register_buffer, persistent=False)
        n = head_dim // 4
        buffer("base_freqs", torch.cat([(1 / 1024) ** torch.linspace(0, 1, n), torch.zeros(n)]))
        positions = torch.arange(max_len) % period
        sequences = [("", positions)]
        if paired:
            sequences.append(("paired_", 2 * positions.repeat_interleave(2) + torch.arange(2 * max_len) % 2))
        for prefix, sequence in sequences:
            buffer(prefix + "positions", sequence.to(torch.float32))
            buffer(prefix + "cos", torch.empty(len(sequence), head_dim // 2))
            buffer(prefix + "sin", torch.empty(len(sequence), 2, head_dim // 2))  # (sin, -sin)
        self.prefixes = [prefix for prefix, _ in sequences]
        buffer("attn_scale", torch.empty(()))
        self.base_attn_scale = attn_scale
        self.set_window_history([])

    @torch.no_grad()
    def set_window_history(self, windows: list[int]):
        freqs, scale = self.base_freqs, self.base_attn_scale
        for old, new in zip(windows, windows[1:]):
            if new != old:
                freqs = yarn_rescale(freqs, old, new)
                scale *= 1 + 0.2 * math.log(new / old)  # sharper attention over a longer window
        for prefix in self.prefixes:
            theta = torch.outer(getattr(self, prefix + "positions"), freqs)
            getattr(self, prefix + "cos").copy_(theta.cos())
            getattr(self, prefix + "sin").copy_(torch.stack([theta.sin(), -theta.sin()], dim=1))
        self.attn_scale.fill_(scale)

    def tables(self, paired: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        return (self.paired_cos, self.paired_sin, self.attn_scale) if paired else (self.cos, self.sin, self.attn_scale)

def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Halves swap by a flip on a view, so inductor fuses the QK-norm's backward."""
    T, heads, dim = x.shape
    halves = x.float().view(T, heads, 2, dim // 2)
    rotated = halves * cos[:T, None, None, :] + halves.flip(-2) * sin[:T, None]
    return rotated.view(T, heads, dim).type_as(x)

def document_ids(cu_seqlens: Tensor, length: int) -> Tensor:
    starts = torch.zeros(length + 1, dtype=torch.int32, device=cu_seqlens.device)
    starts.index_fill_(0, cu_seqlens.long(), 1)
    return torch.cumsum(starts[:length], dim=0, dtype=torch.int32)

# Attention backends: causal within documents over the last `window` positions

class SdpaAttention:
    """A dense mask: CPUs, small T."""
    name = "sdpa"

    def for_paired_heads(self):
        return self

    def prepare(self, length: int, cu_seqlens: Tensor, windows: dict, *_) -> dict:  # *_: FA3's hints
        doc = document_ids(cu_seqlens, length)
        pos = torch.arange(length, device=cu_seqlens.device)
        distance = pos[:, None] - pos[None, :]
        allowed = (distance >= 0) & (doc[:, None] == doc[None, :])
        return {kind: allowed & (distance < w) for kind, w in windows.items()}

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0).transpose(0, 1)

class FlexAttention:
    """Block masks (speedrun 2024-11) by eager ops, not create_block_mask (slow, pytorch#182060), kept in place."""
    name = "flex"
    block_size = 128

    def __init__(self, seq_len: int, device: torch.device):
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
        if seq_len % self.block_size:
            raise UserError(f"--micro_batch_tokens={seq_len}: flex attention needs a multiple of {self.block_size}")
        self.flex_attention, self.from_kv_blocks = flex_attention, BlockMask.from_kv_blocks
        self.seq_len = seq_len
        self.doc = torch.zeros(seq_len, dtype=torch.int32, device=device)
        self.window = {kind: torch.zeros((), dtype=torch.int32, device=device) for kind in "SL"}
        self.mask_mods = {kind: self._mask_mod(self.doc, self.window[kind]) for kind in "SL"}
        blocks = torch.arange(seq_len // self.block_size, device=device)
        self.block_offset = blocks[:, None] - blocks[None, :]
        self.masks = {}
        self.other_lengths: dict[int, FlexAttention] = {}

    @staticmethod
    def _mask_tensors(mask) -> list[Tensor]:
        return [t for t in mask.as_tuple() if isinstance(t, Tensor)]

    @staticmethod
    def _mask_mod(doc: Tensor, window: Tensor):
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx]) & (q_idx - kv_idx < window)
        return mask_mod

    def _block_lists(self, window: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Blocks share a document exactly when the query block's first is the key block's last."""
        size, offset = self.block_size, self.block_offset
        first, last = self.doc[::size], self.doc[size - 1::size]
        nearest = (offset * size - (size - 1)).clamp(min=0)  # smallest q_idx - kv_idx over the block pair
        farthest = offset * size + (size - 1)
        some = (offset >= 0) & (nearest < window) & (first[:, None] <= last[None, :])
        full = (offset > 0) & (farthest < window) & (last[:, None] == first[None, :])

        def as_lists(blocks: Tensor) -> tuple[Tensor, Tensor]:
            counts = blocks.sum(dim=-1, dtype=torch.int32)
            indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
            return counts[None, None], indices[None, None]
        return (*as_lists(some & ~full), *as_lists(full))

    def for_paired_heads(self):
        return FlexAttention(2 * self.seq_len, self.doc.device)

    def prepare(self, length: int, cu_seqlens: Tensor, windows: dict, *_) -> dict:
        if length != self.seq_len:
            if length not in self.other_lengths:
                self.other_lengths[length] = FlexAttention(length, self.doc.device)
            return self.other_lengths[length].prepare(length, cu_seqlens, windows)
        self.doc.copy_(document_ids(cu_seqlens, self.seq_len))
        for kind, w in windows.items():
            self.window[kind].fill_(w)
            mask = self.from_kv_blocks(*self._block_lists(w), BLOCK_SIZE=self.block_size,
                                       mask_mod=self.mask_mods[kind], seq_lengths=(self.seq_len, self.seq_len))
            if kind in self.masks:
                torch._foreach_copy_(self._mask_tensors(self.masks[kind]), self._mask_tensors(mask))
            else:
                self.masks[kind] = mask
        return {kind: self.masks[kind] for kind in windows}

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        return self.flex_attention(q, k, v, block_mask=mask, scale=1.0)[0].transpose(0, 1)

# FA3's host ints are symbolic (FA3_HOST_INT_SOURCES): one graph serves every value
_fa3_kernels = None  # set by FlashAttention3

def _fa3_arguments(cu_seqlens: Tensor, window: int, max_seqlen: int, entries: int) -> dict:
    cu_seqlens = cu_seqlens[:entries]
    return dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                softmax_scale=1.0, window_size_left=window - 1, window_size_right=0)

@torch.library.custom_op("gpt::fa3_varlen", mutates_args=())
def fa3_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int, max_seqlen: int,
               entries: int) -> tuple[Tensor, Tensor]:
    out, lse, *_ = _fa3_kernels._flash_attn_forward(q, k, v, causal=True,
                                                    **_fa3_arguments(cu_seqlens, window, max_seqlen, entries))
    return out, lse

@fa3_varlen.register_fake
def _(q, k, v, *_):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)

@torch.library.custom_op("gpt::fa3_varlen_backward", mutates_args=())
def fa3_varlen_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
                        window: int, max_seqlen: int, entries: int) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _fa3_kernels._flash_attn_backward(grad, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, is_causal=True,
                                      **_fa3_arguments(cu_seqlens, window, max_seqlen, entries))
    return dq, dk, dv

@fa3_varlen_backward.register_fake
def _(grad, q, k, v, *_):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

def _fa3_save(ctx, inputs, output):
    q, k, v, cu_seqlens, *ints = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)
    ctx.ints = ints

def _fa3_backward(ctx, grad, _lse_grad):
    return *fa3_varlen_backward(grad, *ctx.saved_tensors, *ctx.ints), None, None, None, None

fa3_varlen.register_autograd(_fa3_backward, setup_context=_fa3_save)

class FlashAttention3:
    """Its backward runs a block per (sequence, key tile), empty or not: one start per 256 tokens where allowed."""
    name = "fa3"

    def __init__(self, module, max_doc_len: int):
        global _fa3_kernels
        _fa3_kernels = self.module = module
        self.max_doc_len = max_doc_len

    def for_paired_heads(self):
        return FlashAttention3(self.module, 2 * self.max_doc_len)

    def prepare(self, length: int, cu_seqlens: Tensor, windows: dict, documents=None, longest=None) -> dict:
        entries = length // 256 + 1
        if documents is None or documents >= entries:  # the cut keeps a closing entry
            entries = len(cu_seqlens)
        max_seqlen = self.max_doc_len if longest is not None and longest <= self.max_doc_len else length
        return {kind: (cu_seqlens, w, max_seqlen, entries) for kind, w in windows.items()}

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
        return fa3_varlen(q, k, v, *mask)[0]

def make_attention(cfg: Config, device: torch.device, seq_len: int):
    choice, cuda = cfg.attn_backend, device.type == "cuda"
    if choice in ("fa3", "flex") and not cuda:
        raise UserError(f"--attn_backend={choice} needs --device=cuda; on a CPU use --attn_backend=sdpa or auto")
    if choice == "fa3" or (choice == "auto" and cuda):
        try:
            import flash_attn_interface
            return FlashAttention3(flash_attn_interface, cfg.max_doc_len)
        except ImportError:
            if choice == "fa3":
                raise UserError("--attn_backend=fa3 but flash_attn_interface does not import; install "
                                "FlashAttention-3 or use --attn_backend=auto") from None
    return FlexAttention(seq_len, device) if cuda and choice != "sdpa" else SdpaAttention()

# MUDD's inputs of the last layer
LayerMix = collections.namedtuple("LayerMix", "value value_gate scales")
# TokenGates' per-token inputs of a layer, None where absent
LayerGates = collections.namedtuple("LayerGates", "inject xsa out")

class CausalSelfAttention(nn.Module):
    """QKVO in one matrix (speedrun 2025-09), QK orthogonalised per head pair (2026-04-08); paired heads (2026-01-07);
    shifted keys (2026-01); value embedding (2024-12) gated per head (2026-02-03); XSA (Zhai 2025; 2026-04-29)."""
    def __init__(self, cfg: Config, i: int):
        super().__init__()
        dim, heads = cfg.model_dim, cfg.num_heads
        self.num_heads, self.head_dim = heads, cfg.head_dim
        self.paired, self.shift_keys = i in cfg.paired_head_layers, cfg.attn_layout[i] == "L"
        pairs = heads // 2
        self.qkvo_w = declare(torch.empty(4 * dim, dim), optimizer="muon", split=((dim // pairs, 2 * pairs), (dim, 2)))
        has_value_embed = cfg.value_embed_layout[i] != "."  # MUDD gates the last layer's
        self.gate_w = declare(torch.zeros(heads, GATE_DIMS)) if has_value_embed and i != cfg.num_layers - 1 else None
        self.out_scale = declare(torch.ones(1), **SCALAR)
        self.value_scales = declare(torch.tensor([0.5, 1.0] if has_value_embed else [0.5]), **SCALAR)  # v, embedding

    def forward(self, x: Tensor, value_embed: Tensor | None, rope, mask, attend, starts: Tensor,
                mix: LayerMix | None, token: LayerGates) -> Tensor:
        T, dim = x.shape
        cos, sin, scale = rope
        w = self.qkvo_w.to(x.dtype)
        q, k, v = (x @ w[: 3 * dim].T).view(T, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rms_norm(q), rms_norm(k)
        if self.paired:  # the offset moves unrotated dims only: it may precede the rotary
            k = self.offset_keys(k, starts) if self.shift_keys else k
            sequence = (2 * T, self.num_heads // 2, self.head_dim)
            q, k = apply_rotary(q.reshape(sequence), cos, sin), apply_rotary(k.reshape(sequence), cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            k = self.offset_keys(k, starts) if self.shift_keys else k
        scales = self.value_scales.to(x.dtype)
        v = scales[0] * v
        if value_embed is not None:
            if mix is not None:
                gate = mix.value_gate
            else:
                half = GATE_DIMS // 2
                gate = 2 * torch.sigmoid(torch.cat([x[:, :half], value_embed[:, : GATE_DIMS - half]], dim=-1)
                                         @ self.gate_w.to(x.dtype).T)[..., None]
            v = v + gate * (scales[1] * value_embed.view_as(v))
        v = v if mix is None else v + mix.value.view_as(v)
        q = (q * scale).type_as(k)
        y = attend(q, k, v.reshape(k.shape) if self.paired else v, mask).reshape(T, self.num_heads, self.head_dim)
        if token.xsa is not None:
            unit = F.normalize(v.float(), dim=-1).type_as(y)
            y = y - torch.tanh(token.xsa)[..., None] * (y * unit).sum(-1, keepdim=True) * unit
        y = y if token.out is None else token.out[..., None] * y
        return self.out_scale.to(y.dtype) * (y.reshape(T, dim) @ w[3 * dim:].T)

    def offset_keys(self, k: Tensor, starts: Tensor) -> Tensor:
        """Unrotated dims from the previous token, except at a document's start."""
        halves = k.view(k.size(0), self.num_heads, 2, self.head_dim // 2)
        still = halves[..., self.head_dim // 4:]
        still = torch.where(starts[:, None, None, None], still, torch.cat([still[:1], still[:-1]]))
        return torch.cat([halves[..., : self.head_dim // 4], still], dim=-1).view_as(k)

class MLP(nn.Module):
    def __init__(self, dim: int, fused: bool):
        super().__init__()
        self.fc_w = declare(torch.empty(4 * dim, dim), optimizer="muon")  # out x in
        # in x out, stored transposed; lr x2 (speedrun 2025-12-11)
        self.proj_w = declare(torch.empty(4 * dim, dim), optimizer="muon", lr=2.0)
        self.fused = fused

    def forward(self, x: Tensor) -> Tensor:
        fc_w, proj_w = self.fc_w.to(x.dtype), self.proj_w.to(x.dtype)
        if self.fused:
            return _FusedReLU2MLP.apply(x, fc_w, proj_w)
        return F.relu(x @ fc_w.T).square() @ proj_w  # ReLU^2 (So et al. 2021)

class Block(nn.Module):
    """Scaled residuals (speedrun 2026-02-12, 2026-03-06); TokenGates' scales, or MUDD's in the last layer."""
    def __init__(self, cfg: Config, i: int, fused_mlp: bool):
        super().__init__()
        self.attn = CausalSelfAttention(cfg, i) if cfg.attn_layout[i] != "-" else None
        self.paired = i in cfg.paired_head_layers
        self.mlp = MLP(cfg.model_dim, fused_mlp)
        self.residual_scales = self.output_scales = None  # the last layer's: MUDD's
        if i < cfg.num_layers - 1:  # (attention, MLP); 1.1 per layer, split (speedrun 2025-12)
            self.residual_scales = declare(torch.full((2,), 1.1 ** 0.5), **SCALAR, betas=(0.9, 0.95))
            self.output_scales = declare(torch.ones(2), betas=(0.9, 0.95))
        self.attend = None  # set by GPT

    def forward(self, x: Tensor, x0: Tensor, value_embed: Tensor | None, rope, mask, bigram: Tensor | None,
                starts: Tensor, attn_input: Tensor | None, mix: LayerMix | None, token: LayerGates) -> Tensor:
        if mix is not None:
            scales = mix.scales
        else:
            residual, output = self.residual_scales.to(x.dtype), self.output_scales.to(x.dtype)
            x0_scale, bigram_scale = token.inject if token.inject is not None else (None, None)
            scales = (residual[0], output[0], x0_scale, bigram_scale, residual[1], output[1])
        residual_attn, output_attn, x0_scale, bigram_scale, residual_mlp, output_mlp = scales
        if self.attn is not None:
            source = x if attn_input is None else attn_input
            y = self.attn(rms_norm(source), value_embed, rope, mask, self.attend, starts, mix, token)
            x = residual_attn * x + output_attn * y + x0_scale * x0
            if bigram is not None:
                x = x + bigram_scale * bigram
        return residual_mlp * x + output_mlp * self.mlp(rms_norm(x))

class DenseMix(nn.Module):
    """MUDD's mix (Xiao et al. 2025; speedrun 2026-04-22); W2 starts at zero: outputs start at `initial`."""
    HIDDEN, SCALE = 64, 0.1

    def __init__(self, dim: int, initial: list[float], lr: float):
        super().__init__()
        self.initial = initial
        self.w1 = declare(torch.empty(self.HIDDEN, dim), lr=lr, wd=1.0)
        self.w2 = declare(torch.empty(len(initial), self.HIDDEN), lr=lr, wd=1.0)
        self.bias = declare(torch.empty(len(initial)), lr=lr)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        bound = self.w1.size(1) ** -0.5  # nn.Linear's
        self.w1.uniform_(-bound, bound)
        self.w2.zero_()
        self.bias.copy_(torch.tensor(self.initial) / self.SCALE)

    def forward(self, x: Tensor) -> Tensor:
        return (F.gelu(x @ self.w1.to(x.dtype).T) @ self.w2.to(x.dtype).T + self.bias.to(x.dtype)) * self.SCALE

    def mix_into(self, x: Tensor, sources) -> Tensor:
        return x + sum(w * source for w, source in zip(self(x).split(1, dim=1), sources))

class TokenGates(nn.Module):
    """Per-token gates (speedrun 2026-05-27): DenseMix lanes of x0 (`pre`) and of skip_from's output (`post`)."""
    def __init__(self, cfg: Config):
        super().__init__()
        self.split = cfg.skip_from + 1
        last, heads = cfg.num_layers - 1, cfg.num_heads
        initial = ([], [])
        self.lanes = []  # per layer: {name: (from post?, first lane, lanes)}
        for i, kind in enumerate(cfg.attn_layout):
            lanes, side = {}, initial[i >= self.split]
            wanted = [("skip", [0.5])] if i == cfg.skip_to else []
            if kind != "-":
                wanted += [("inject", [0.0, 0.05])] if i != last else []
                wanted += [("xsa", [0.0] * heads)] if i in cfg.xsa_layers else []
                wanted += [("out", [0.25] * heads)] if i in (cfg.skip_from, last) else []
            for name, values in wanted:
                lanes[name] = (i >= self.split, len(side), len(values))
                side.extend(values)
            self.lanes.append(lanes)
        self.pre, self.post = (DenseMix(cfg.model_dim, side, 0.1) for side in initial)

    def lane(self, i: int, name: str, pre: Tensor, post: Tensor | None) -> Tensor | None:
        if name not in self.lanes[i]:
            return None
        after, first, count = self.lanes[i][name]
        return (post if after else pre)[:, first: first + count]

    def layer(self, i: int, pre: Tensor, post: Tensor | None) -> LayerGates:
        inject = self.lane(i, "inject", pre, post)
        return LayerGates(None if inject is None else tuple(inject.split(1, dim=1)),
                          self.lane(i, "xsa", pre, post), self.lane(i, "out", pre, post))

class CopyPointer(nn.Module):
    """CPLM's pointer (PR #379): a QK-normed head over the document's last `band` positions and a sink."""
    def __init__(self, dim: int, head_dim: int, band: int, use_triton: bool):
        super().__init__()
        self.band, self.use_triton = band, use_triton
        self.q_w, self.k_w = (declare(torch.empty(head_dim, dim), lr=0.25) for _ in "qk")
        self.q_gain = declare(torch.empty(head_dim), **SCALAR)
        self.sink = declare(torch.empty(1), **SCALAR)  # [1]: torchft's DiLoCo cannot back up 0-d parameters
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        bound = math.sqrt(3) * 0.5 * self.q_w.size(1) ** -0.5  # as attention's
        self.q_w.uniform_(-bound, bound)
        self.k_w.uniform_(-bound, bound)
        self.q_gain.fill_(1.0)
        self.sink.zero_()

    def forward(self, h: Tensor, tokens: Tensor, targets: Tensor, documents: Tensor) -> tuple[Tensor, Tensor]:
        q = rms_norm(h @ self.q_w.to(h.dtype).T) * self.q_gain.to(h.dtype)
        k = rms_norm(h @ self.k_w.to(h.dtype).T)
        return copy_log_probs(q, k, self.sink, tokens, targets, documents, self.band, self.use_triton)

MATCH_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # repeat lengths (PR #378)
MATCH_BUCKETS = 1 + 3 * len(MATCH_LENGTHS)  # none; per length: seen once, twice, 3+ times
# Two polynomial hashes modulo primes under 2**31 (no int64 overflow): a 62-bit key
_MATCH_PRIMES, _MATCH_MULTIPLIERS = (2147483629, 2147483587), (1000003, 999331)

def longest_matches(tokens: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
    """Per t, its longest MATCH_LENGTHS context seen earlier in the document, ending at p: (tokens[p + 1], bucket)."""
    T = tokens.numel()
    positions = torch.arange(T, device=tokens.device)
    documents = torch.cumsum(starts.long(), 0)
    document_start = torch.searchsorted(documents, documents)
    tokens = tokens.long()
    ids = tokens + 1
    hashes = [torch.zeros_like(ids), torch.zeros_like(ids)]
    keys = []
    for length in range(1, MATCH_LENGTHS[-1] + 1):
        entering = F.pad(ids, (length - 1, 0))[:T]  # the token length-1 back
        hashes = [(h * m + entering) % prime for h, m, prime in zip(hashes, _MATCH_MULTIPLIERS, _MATCH_PRIMES)]
        if length in MATCH_LENGTHS:
            mixed = [(h + (documents * 7919 + length) * (i + 1)) % prime
                     for i, (h, prime) in enumerate(zip(hashes, _MATCH_PRIMES))]
            key = mixed[0] * _MATCH_PRIMES[1] + mixed[1]
            # a context reaching before its document: a unique negative key
            keys.append(torch.where(positions - (length - 1) >= document_start, key, -1 - (len(keys) * T + positions)))
    flat = torch.stack(keys).view(-1)
    ordered, order = torch.sort(flat, stable=True)  # equal keys stay in position order
    index = torch.arange(flat.numel(), device=tokens.device)
    repeats = torch.cat([torch.zeros(1, dtype=torch.bool, device=tokens.device), ordered[1:] == ordered[:-1]])
    previous = torch.where(repeats, torch.cat([order[:1], order[:-1]]), -1)
    earlier = index - torch.searchsorted(ordered, ordered)  # earlier repeats of the key
    previous, earlier = (torch.empty_like(t).scatter_(0, order, t).view(len(MATCH_LENGTHS), T)
                         for t in (previous, earlier))
    candidates, buckets = torch.zeros_like(ids), torch.zeros_like(ids)
    for i in range(len(MATCH_LENGTHS)):  # the longest repeat wins
        found = previous[i] >= 0
        following = tokens[(previous[i] % T + 1).clamp(max=T - 1)]
        candidates = torch.where(found, following, candidates)
        buckets = torch.where(found, 1 + 3 * i + earlier[i].clamp(max=3) - 1, buckets)
    return candidates, buckets

class LongestMatch(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = declare(torch.zeros(MATCH_BUCKETS))
        self.bucket_embed = declare(torch.zeros(MATCH_BUCKETS, dim))
        self.gains = declare(torch.empty(2))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        self.scale.zero_()
        self.bucket_embed.zero_()
        self.gains.copy_(torch.tensor([0.5, 1.0]))

    def forward(self, rows: Tensor, buckets: Tensor) -> Tensor:
        scale = torch.where(buckets > 0, self.scale[buckets], 0.0).to(rows.dtype)
        return scale[:, None] * rows + self.bucket_embed[buckets].to(rows.dtype)

class _RowLookup(torch.autograd.Function):
    """The backward adds rows into .grad; AccumulateGrad still runs DistAdam's hooks."""
    @staticmethod
    def forward(ctx, indices: Tensor, use_triton: bool, dtypes: tuple, *tables: Tensor):
        ctx.save_for_backward(indices)
        ctx.tables, ctx.use_triton = tables, use_triton
        return tuple(gather_rows(table, indices, dtype, use_triton) for table, dtype in zip(tables, dtypes))

    @staticmethod
    def backward(ctx, *row_grads: Tensor):
        indices, = ctx.saved_tensors
        for table in ctx.tables:
            if table.grad is None:
                table.grad = torch.zeros_like(table)
        grads = [table.grad for table in ctx.tables]
        add_rows_(grads, indices, row_grads, ctx.use_triton and all(g.dtype == torch.float32 for g in grads))
        return (None, None, None) + (None,) * len(ctx.tables)

class GPT(nn.Module):
    """forward_micro_batches: the most a forward packs (the rotary tables' length)."""
    def __init__(self, cfg: Config, attend, compute_dtype: torch.dtype, forward_micro_batches: int = 1,
                 kernels: Kernels = Kernels()):
        super().__init__()
        self.cfg, self.attend, self.compute_dtype, self.kernels = cfg, attend, compute_dtype, kernels
        vocab = next_multiple_of(cfg.vocab_size + cfg.copy_pointer, 128)  # the pointer's gate: row vocab_size
        dim = cfg.model_dim
        self.embed = nn.Embedding(vocab, dim)
        declare(self.embed.weight, **HEAD, tie="lm_head.weight")
        tables = 1 + max(int(c) for c in cfg.value_embed_layout if c != ".")
        self.value_embeds = nn.ModuleList(nn.Embedding(vocab, dim) for _ in range(tables))
        for table in self.value_embeds:
            declare(table.weight, **TABLE)
        self.blocks = nn.ModuleList(Block(cfg, i, kernels.fused_mlp) for i in range(cfg.num_layers))
        self.attend_paired = attend.for_paired_heads() if cfg.paired_head_layers else None
        for block in self.blocks:
            block.attend = self.attend_paired if block.paired else attend
        self.skip_gate = declare(torch.tensor([-1.5]), **SCALAR)  # sigmoid(-1.5) ~ 0.18 (speedrun 2025-09)
        self.token_gates = TokenGates(cfg)
        # Smear (speedrun 2025-09): a gated copy of the previous token's embedding
        self.smear_gate_w = declare(torch.zeros(GATE_DIMS), lr=0.01)
        self.smear_scale = declare(torch.zeros(1), **SCALAR)
        # MUDD lanes: v's (x_in, mid, prev), input's ((1 + w) prev, x_in, mid), 2 value gates, 6 scales; the head's:
        # x_in, mid (-0.5: the backout), prev, value embed 0, skip
        half = 1.1 ** 0.5
        self.mudd_layer = DenseMix(dim, [0.0] * 6 + [2.0, 2.0] + [half, 1.0, 0.0, 0.05, half, 1.0], 0.25)
        self.mudd_head = DenseMix(dim, [0.0, -0.5, 0.0, 0.0, 0.0], 0.25)
        # Hashed (previous, token) rows (speedrun 2026-01-19)
        self.bigram_embed = nn.Embedding(cfg.bigram_rows, dim // 4) if cfg.bigram_rows else None
        if cfg.bigram_rows:
            declare(self.bigram_embed.weight, **TABLE, rows="bigrams")
            signs = torch.randint(0, 2, (BIGRAM_SIGNS, dim // 4), generator=torch.Generator().manual_seed(0),
                                  device="cpu")  # the same on every device
            self.register_buffer("bigram_signs", (2 * signs - 1).float().to(torch.get_default_device()),
                                 persistent=False)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        declare(self.lm_head.weight, **HEAD)
        self.copy_pointer = CopyPointer(dim, cfg.head_dim, COPY_BAND, kernels.triton) if cfg.copy_pointer else None
        self.longest_match = LongestMatch(dim) if cfg.longest_match else None
        self.find_matches = longest_matches  # compiled apart: the lookups around it stay eager
        self.rotary = Rotary(cfg.head_dim, forward_micro_batches * cfg.micro_batch_tokens, cfg.micro_batch_tokens,
                             attn_scale=0.1, paired=bool(cfg.paired_head_layers))
        self.replays_cuda_graphs = False  # set by compile_model
        self.register_buffer("mtp_weights", torch.zeros(max(len(s.mtp) for s in cfg.stages)), persistent=False)
        self.mtp_weights[0] = 1.0
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        bound = math.sqrt(3) * 0.5 * self.cfg.model_dim ** -0.5  # uniform with std 0.5/sqrt(dim)
        for block in self.blocks:
            if block.attn is not None:
                block.attn.qkvo_w.uniform_(-bound, bound)
            block.mlp.fc_w.uniform_(-bound, bound)
            block.mlp.proj_w.zero_()
        self.lm_head.weight.normal_(std=0.005)  # speedrun 2025-12-19
        self.embed.weight.copy_(self.lm_head.weight)
        if self.bigram_embed is not None:
            self.bigram_embed.weight.zero_()
        for table in self.value_embeds:
            table.weight.normal_(std=0.01)
        for part in (self.mudd_layer, self.mudd_head, self.copy_pointer, self.longest_match, self.token_gates.pre,
                     self.token_gates.post):
            if part is not None:
                part.reset_parameters()

    def prepare_masks(self, tokens: Tensor, cu_seqlens: Tensor, windows: tuple[int, int], documents=None,
                      longest=None) -> dict:
        sizes = {"S": windows[0], "L": windows[1]}
        masks = self.attend.prepare(tokens.numel(), cu_seqlens, sizes, documents, longest)
        if self.attend_paired is not None:
            kinds = {self.cfg.attn_layout[i] for i in self.cfg.paired_head_layers}
            doubled = self.attend_paired.prepare(2 * tokens.numel(), 2 * cu_seqlens, {k: sizes[k] for k in kinds},
                                                 documents, None if longest is None else 2 * longest)
            masks.update({"P" + kind: mask for kind, mask in doubled.items()})
        return masks

    def prepare_grads(self):
        """Zeroed .grads: the tables', and all under CUDA graphs (else .grad lives in the graph's pool)."""
        params = self.parameters() if self.replays_cuda_graphs else [self.embed.weight] + [
            t.weight for t in self.value_embeds] + ([self.bigram_embed.weight] if self.bigram_embed is not None else [])
        for p in params:
            if p.grad is None:  # else it holds gradients added up over steps
                p.grad = torch.zeros_like(p)

    def forward(self, tokens: Tensor, targets: Tensor | None, masks: dict, bigrams: Tensor | None = None) -> Tensor:
        """Mean loss (logits without targets); lookups eager, the rest in `trunk`."""
        use_triton, compute = self.kernels.triton, self.compute_dtype
        if self.longest_match is not None:
            candidates, buckets = self.find_matches(tokens, self.starts_of(tokens))
        dtypes = (self.embed.weight.dtype,) + (compute,) * len(self.value_embeds)  # token rows: normed in fp32
        token_rows, *value_rows = _RowLookup.apply(tokens, use_triton, dtypes, self.embed.weight,
                                                   *(t.weight for t in self.value_embeds))
        bigram_rows = match = None
        if self.bigram_embed is not None:
            bigram_rows, = _RowLookup.apply(bigrams, use_triton, (compute,), self.bigram_embed.weight)
        if self.longest_match is not None:
            match = _RowLookup.apply(candidates, use_triton, (compute,), self.embed.weight) + (buckets,)
        return self.trunk(tokens, token_rows, value_rows, bigram_rows, targets, masks, match)

    def starts_of(self, tokens: Tensor) -> Tensor:
        """Document and micro-batch starts: nothing reaches across."""
        positions = torch.arange(tokens.numel(), device=tokens.device)
        return (tokens == self.cfg.bos_token) | (positions % self.cfg.micro_batch_tokens == 0)

    def trunk(self, tokens: Tensor, token_rows: Tensor, value_rows: list[Tensor], bigram_rows: Tensor | None,
              targets: Tensor | None, masks: dict, match: tuple | None) -> Tensor:
        cfg, gates = self.cfg, self.token_gates
        starts = self.starts_of(tokens)
        previous = torch.cat([token_rows[:1] * 0, token_rows[:-1]])
        gate = self.smear_scale * torch.sigmoid(token_rows[:, :GATE_DIMS] @ self.smear_gate_w.to(token_rows.dtype))
        token_rows = token_rows + (gate * ~starts)[:, None] * previous
        matched = None
        if match is not None:  # after the smear, as in #378
            matched = self.longest_match(*match).float()
            token_rows = token_rows + self.longest_match.gains[0] * matched
        x = x0 = rms_norm(token_rows).to(self.compute_dtype)
        value_embeds = [rows.to(self.compute_dtype) for rows in value_rows]
        pre = gates.pre(x0)
        bigram = None
        if bigram_rows is not None:  # enters before layer 0, at its scale
            bigram = self.bigram_input(tokens, starts, bigram_rows)
            x = x0 + gates.lane(0, "inject", pre, None)[:, 1:] * bigram
        x_in, post, skip, attn_input, mid, previous = x, None, None, None, None, None
        for i, block in enumerate(self.blocks):
            if i == gates.split:
                post = gates.post(x)
            if i == cfg.skip_to:  # the skip (speedrun 2024-11), gated per token
                x = x + torch.sigmoid(self.skip_gate).to(x.dtype) * gates.lane(i, "skip", pre, post) * skip
            table, kind = cfg.value_embed_layout[i], cfg.attn_layout[i]
            value_embed = None if table == "." else value_embeds[int(table)]
            mask = masks["P" + kind] if block.paired else masks.get(kind)
            mix = None
            if i == cfg.num_layers - 1:
                previous = x
                x, mix = self.mix_into_last_layer(x, x_in, mid)
            x = block(x, x0, value_embed, self.rotary.tables(block.paired), mask, bigram if i else None, starts,
                      attn_input, mix, gates.layer(i, pre, post))
            attn_input = x if i == cfg.attn_input_from else attn_input  # speedrun 2026-03-06
            skip = x if i == cfg.skip_from else skip
            mid = x if i == cfg.backout_from else mid
        x = self.mudd_head.mix_into(x, (x_in, mid, previous, value_embeds[0], skip))
        if matched is not None:  # again before the head's norm
            x = x + (self.longest_match.gains[1] * matched).to(x.dtype)
        return self.loss_head(x, targets, tokens, starts)

    def bigram_input(self, tokens: Tensor, starts: Tensor, rows: Tensor) -> Tensor:
        """Rows times a random sign vector per (previous, token), padded to model_dim."""
        bigram = rows.to(self.compute_dtype)
        previous = torch.cat([tokens[:1], tokens[:-1]])
        index = torch.where(starts, 0, torch.bitwise_xor(previous, tokens) % BIGRAM_SIGNS)
        bigram = bigram * self.bigram_signs[index].to(bigram.dtype)
        return F.pad(bigram, (0, self.cfg.model_dim - bigram.size(1)))

    def mix_into_last_layer(self, x: Tensor, x_in: Tensor, mid: Tensor) -> tuple[Tensor, LayerMix]:
        w = self.mudd_layer(x)
        c = w[:, :6].split(1, dim=1)
        value = c[0] * x_in + c[1] * mid + c[2] * x
        x = (1 + c[5]) * x + c[3] * x_in + c[4] * mid
        value_gate = w[:, 6:8].repeat_interleave(self.cfg.num_heads // 2, dim=1)[..., None]
        return x, LayerMix(value, value_gate, tuple(w[:, 8:14].split(1, dim=1)))

    @torch.no_grad()
    def set_mtp_weights(self, weights: list[float]):
        """Normalised, by fills: no host-to-device copy."""
        total = sum(weights)
        for k in range(self.mtp_weights.numel()):
            self.mtp_weights[k].fill_(weights[k] / total if k < len(weights) else 0.0)

    def loss_head(self, x: Tensor, targets: Tensor | None, tokens: Tensor, starts: Tensor) -> Tensor:
        """Without targets: the LM's logits. Rows predict within their micro-batch."""
        mtp = (self.mtp_weights, self.cfg.micro_batch_tokens) if self.mtp_weights.numel() > 1 else None
        x = rms_norm(x)
        if targets is None:
            return softcap(x @ self.lm_head.weight.to(x.dtype).T, LOGIT_CAP)
        copy = None
        if self.copy_pointer is not None:
            copy = (self.cfg.vocab_size, *self.copy_pointer(x, tokens, targets, torch.cumsum(starts.long(), 0)))
        if self.kernels.fp8_head:  # copy: (gate column, log_copy, log_sink)
            return _Fp8SoftcappedHead.apply(x, self.lm_head.weight, targets, LOGIT_CAP, *(mtp or (None, 0)),
                                            *(copy or (0, None, None)))
        z = softcap(x @ self.lm_head.weight.to(x.dtype).T, LOGIT_CAP)
        if copy is not None:
            return copy_mixture_losses(z, targets, *copy, mtp).mean()
        return multi_token_losses(z, targets, mtp).mean()

# Loss: sigmoid softcap (after Gemma 2), multi-token prediction (speedrun 2025-12-22), copy mixture (#379)

def softcap(logits: Tensor, cap: tuple) -> Tensor:
    return cap[0] * torch.sigmoid((logits.float() + cap[1]) / cap[2])

def multi_token_targets(targets: Tensor, mtp: tuple | None) -> list[tuple[Tensor, Tensor]]:
    """Per offset k, (weight, target k + 1 ahead), weight 0 past the micro-batch."""
    if mtp is None:
        return [(torch.ones_like(targets, dtype=torch.float32), targets.long())]
    weights, period = mtp
    position = torch.arange(targets.numel(), device=targets.device) % period
    return [(weights[k] * (position + k < period), torch.cat([targets[k:], targets[:k]]).long())
            for k in range(weights.numel())]

def multi_token_losses(z: Tensor, targets: Tensor, mtp: tuple | None) -> Tensor:
    lse = torch.logsumexp(z, dim=1)
    return sum(w * (lse - z.gather(1, ahead[:, None])[:, 0]) for w, ahead in multi_token_targets(targets, mtp))

COPY_BLOCK = 128  # queries per block of the copy pointer's scores

def copy_log_probs(q: Tensor, k: Tensor, sink: Tensor, tokens: Tensor, targets: Tensor, documents: Tensor,
                   band: int, use_triton: bool = False) -> tuple[Tensor, Tensor]:
    """Softmax over the document's keys in (t - band, t] and a sink: log masses on targets[t] and the sink."""
    T, d = q.shape
    sink = sink.float().expand(T)
    if use_triton:
        return _CopyScores.apply(*(t.contiguous() for t in (q, k, sink, tokens, targets, documents)), band)
    sink = sink.reshape(T // COPY_BLOCK, COPY_BLOCK)
    blocks, width = T // COPY_BLOCK, band + COPY_BLOCK
    keys = F.pad(k, (0, 0, band, 0)).unfold(0, width, COPY_BLOCK)  # [blocks, d, width] from b*B - band
    scores = torch.bmm(q.view(blocks, COPY_BLOCK, d), keys).float() * d ** -0.5
    key_at = torch.arange(blocks, device=q.device)[:, None] * COPY_BLOCK - band + torch.arange(width, device=q.device)
    back = torch.arange(T, device=q.device).view(blocks, COPY_BLOCK, 1) - key_at[:, None, :]
    def at_keys(t: Tensor) -> Tensor:  # [blocks, 1, width], -1 before the start
        return F.pad(t, (band, 0), value=-1).unfold(0, width, COPY_BLOCK)[:, None, :]
    seen = (back >= 0) & (back < band) & (at_keys(documents) == documents.view(blocks, COPY_BLOCK, 1))
    hits = seen & (at_keys(tokens) == targets.view(blocks, COPY_BLOCK, 1))
    # -1e9, not -inf: finite gradients without a hit
    log_z = torch.logaddexp(torch.logsumexp(scores.masked_fill(~seen, -1e9), -1), sink)
    log_hits = torch.logsumexp(scores.masked_fill(~hits, -1e9), -1)
    return (log_hits - log_z).reshape(T), (sink - log_z).reshape(T)

def copy_mixture_losses(z: Tensor, targets: Tensor, slot: int, log_copy: Tensor, log_sink: Tensor,
                        mtp: tuple | None) -> Tensor:
    """Column `slot` the gate of share alpha, a the sink's: p(y) = p_lm(y) (1 - alpha (1 - a)) + alpha p_copy(y)."""
    lse = torch.logsumexp(z, dim=1)
    gate = z[:, slot]
    u = torch.minimum(gate - lse, torch.full_like(lse, -1e-7))  # the other columns' lse: log(1 - e^u), Maechler 2012
    lse_lm = lse + torch.where(u > -0.6931, torch.log(-torch.expm1(u)), torch.log1p(-torch.exp(u)))
    losses = []
    for k, (w, ahead) in enumerate(multi_token_targets(targets, mtp)):
        picked = z.gather(1, ahead[:, None])[:, 0]
        if k == 0:  # times exp(lse): p_lm(y) (exp(lse_lm) + exp(gate) a), exp(gate) p_copy(y)
            from_lm = picked - lse_lm + torch.logaddexp(lse_lm, gate + log_sink)
            losses.append(w * (lse - torch.logaddexp(from_lm, gate + log_copy)))
        else:
            losses.append(w * (lse_lm - picked))
    return sum(losses)

E4M3_MAX = 448.0
GRAD_E5M2_EXP = 15  # the largest |gradient| maps to at most 2**15, under e5m2's 57344
GRAD_E5M2_MAX = 2.0 ** GRAD_E5M2_EXP

class _Fp8SoftcappedHead(torch.autograd.Function):
    """Per-tensor scaled FP8 (speedrun 2024-12): x (|x| <= sqrt(dim)), weight in e4m3, the logits' gradient in e5m2."""
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, targets: Tensor, cap: tuple, mtp_weights: Tensor | None, period: int,
                slot: int = 0, log_copy: Tensor | None = None, log_sink: Tensor | None = None) -> Tensor:
        x_scale = x.new_full((), x.size(1) ** 0.5 / E4M3_MAX, dtype=torch.float32)
        w_scale = (weight.detach().abs().amax().float() / E4M3_MAX).clamp(min=1e-30)
        x_q = (x.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        w_q = (weight.detach().float() / w_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        logits = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16,
                                  use_fast_accum=True)
        losses = logits.new_empty(x.size(0), dtype=torch.float32)
        grad_q = logits.new_empty(logits.shape, dtype=torch.float8_e5m2)
        copy, pointer_grads = None, ()
        if log_copy is not None:
            pointer_grads = (torch.empty_like(losses), torch.empty_like(losses))
            copy = (slot, log_copy.float().contiguous(), log_sink.float().contiguous(), *pointer_grads)
        softcapped_ce_fp8(logits, targets, cap, losses, grad_q, None if mtp_weights is None else (mtp_weights, period),
                          copy)
        ctx.save_for_backward(x_q, w_q, x_scale, w_scale, grad_q, *pointer_grads)
        ctx.x_dtype, ctx.w_dtype, ctx.copy_dtype = x.dtype, weight.dtype, getattr(log_copy, "dtype", None)
        return losses.mean()

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        x_q, w_q, x_scale, w_scale, grad_q, *pointer_grads = ctx.saved_tensors
        grad_scale = grad_loss.float() / grad_q.size(0) / GRAD_E5M2_MAX
        # _scaled_mm's second operand is column-major
        grad_x = torch._scaled_mm(grad_q, w_q.t().contiguous().t(), scale_a=grad_scale, scale_b=w_scale,
                                  out_dtype=ctx.x_dtype)
        grad_w = torch._scaled_mm(transpose_fp8(grad_q), x_q.t().contiguous().t(), scale_a=grad_scale,
                                  scale_b=x_scale, out_dtype=torch.float32)
        grad_copy = grad_sink = None
        if pointer_grads:
            row_scale = grad_loss.float() / grad_q.size(0)
            grad_copy, grad_sink = ((g * row_scale).to(ctx.copy_dtype) for g in pointer_grads)
        return grad_x, grad_w.to(ctx.w_dtype), None, None, None, None, None, grad_copy, grad_sink


# --------------------
# Optimizers: sharded over the ranks; backward hooks launch a unit's reduce-scatter once its gradients are in, no
# all_reduce.

@dataclass(frozen=True)
class Comm:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

# torch 2.13's names of the tensor collectives; 2.11 has only the older ones (deprecated in 2.13)
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

def current_rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1

def grads_or_zeros(params: list[Tensor]) -> list[Tensor]:
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]

class _LaunchWhenGradsReady:
    """While armed, launch(unit) runs once a unit's gradients are all in, overlapping the backward."""

    def __init__(self, units: list, launch):
        self.unit_of = {p: unit for unit in units for p in unit.params}
        self.launch, self.armed, self.ready = launch, False, {}
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.unit_of]

    def _on_grad_ready(self, param: Tensor):
        if self.armed:
            unit = self.unit_of[param]
            self.ready[unit] = self.ready.get(unit, 0) + 1
            if self.ready[unit] == len(unit.params):
                self.launch(unit)

    def disarm(self):
        self.armed = False
        self.ready.clear()

    def remove(self):  # the cycle parameter -> hook -> optimizer keeps gloo alive into a risky teardown
        while self.handles:
            self.handles.pop().remove()

class _AdamBucket:
    """A group's parameters (one, or small ones packed) in one reduce-scatter; rank r owns shard r."""

    def __init__(self, params: list[Tensor], group_index: int, world_size: int):
        self.params, self.group_index = params, group_index
        self.numel = sum(p.numel() for p in params)
        self.shard = -(-self.numel // world_size)
        self.padded = self.shard * world_size
        self.in_place = len(params) == 1 and self.padded == self.numel  # else a zero-padded flat copy
        self.pending = None  # waits, then returns this rank's averaged gradient shard

    def flat(self, tensors: list[Tensor]) -> Tensor:
        if self.in_place:
            return tensors[0].view(-1)
        flat = tensors[0].new_zeros(self.padded)
        torch.cat([t.reshape(-1) for t in tensors], out=flat[: self.numel])
        return flat

    def owned(self, flat: Tensor, rank: int) -> Tensor:
        return flat[rank * self.shard: (rank + 1) * self.shard]

    def views(self, flat: Tensor) -> list[Tensor]:
        return [t.view_as(p) for p, t in zip(self.params, flat[: self.numel].split([p.numel() for p in self.params]))]

def union_of_rows(row_lists: list[np.ndarray], num_rows: int) -> np.ndarray:
    """Sorted union of row indices by a mask (much faster than np.unique)."""
    touched = np.zeros(num_rows, dtype=bool)
    for rows in row_lists:
        touched[rows] = True
    return np.flatnonzero(touched)

class _RowExchange:
    """Sparse gradients (speedrun 2026-02-06): touched rows go to their owners; the counts over gloo (host, not GPU)."""

    def __init__(self, rows: np.ndarray, table: Tensor, rank: int, world_size: int, cpu_group):
        self.rank, self.world_size, self.rows_per_rank = rank, world_size, table.size(0) // world_size
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        self.send_counts = np.diff(np.searchsorted(rows, np.arange(world_size + 1) * self.rows_per_rank))
        self.send_rows = torch.from_numpy(rows).pin_memory() if table.is_cuda else torch.from_numpy(rows)
        self.recv_counts = torch.empty(world_size, dtype=torch.int64)
        self.counts_sent = dist.all_to_all_single(self.recv_counts, torch.from_numpy(self.send_counts),
                                                  group=cpu_group, async_op=True)

    def launch(self, grad: Tensor):
        self.counts_sent.wait()
        send_splits, recv_splits = self.send_counts.tolist(), self.recv_counts.numpy().tolist()
        send_rows = self.send_rows.to(grad.device, non_blocking=True)
        recv_rows = torch.empty(sum(recv_splits), dtype=torch.int64, device=grad.device)
        rows_sent = dist.all_to_all_single(recv_rows, send_rows, recv_splits, send_splits, async_op=True)
        values = grad.index_select(0, send_rows)
        recv_values = values.new_empty(sum(recv_splits), grad.size(1))
        values_sent = dist.all_to_all_single(recv_values, values, recv_splits, send_splits, async_op=True)

        def finish() -> Tensor:
            rows_sent.wait()
            values_sent.wait()
            shard = grad.new_zeros(self.rows_per_rank, grad.size(1))
            shard.index_add_(0, recv_rows - self.rank * self.rows_per_rank, recv_values)
            return shard.div_(self.world_size).view(-1)
        return finish

class _ShardedOptimizer(torch.optim.Optimizer):
    """A step: launch_step() does steps 1 and 2 and returns step 3; grad_hooks launch step 1 within the backward."""

    def __init__(self, params, defaults: dict):
        super().__init__(params, defaults)
        self.rank, self.world_size = current_rank_and_world()
        self.distributed = self.world_size > 1

    @torch.no_grad()
    def step(self):
        self.launch_step()()

    def close(self):
        self.grad_hooks.remove()

class DistAdam(_ShardedOptimizer):
    """Adam with cautious weight decay, sharded over the ranks (ZeRO-1; speedrun 2025-05). A step: 1. per bucket a
    reduce-scatter (mean), a tied pair's sum in the leader's, a sparse table's touched rows; 2. update the owned slice,
    all-gather it; 3. write the parameters. `accumulating`: gradients add up unsent."""

    SMALL = 8192  # parameters below this many values share their group's bucket
    DYNAMIC = 1 << 20  # shards below this many values share one compiled update of dynamic shape

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, compiled: bool = False, tied: tuple | None = None,
                 sparse_rows: dict | None = None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        # compiled: lr and decay are tensors (no recompiles)
        untuned = {"coordinate_descent_tuning": False}
        self.update_, self.update_small_ = [
            torch.compile(adam_update_, dynamic=dynamic, fullgraph=True, options=untuned) if compiled else adam_update_
            for dynamic in (False, True)]
        self.scalars = {}  # group index -> [lr, decay] on the device
        # sparse_rows: table -> its rows' key in a forward's row lists
        self.sparse_rows = dict(sparse_rows or {}) if self.distributed else {}
        for p in self.sparse_rows:
            if p.ndim != 2 or p.size(0) % self.world_size or p.numel() < self.SMALL:
                raise ValueError(f"sparse parameter of shape {tuple(p.shape)}: needs rows divisible by the world size")
        self.cpu_group = dist.new_group(backend="gloo") if self.sparse_rows else None
        self.buckets: list[_AdamBucket] = []
        for index, group in enumerate(self.param_groups):
            large = [[p] for p in group["params"] if p.numel() >= self.SMALL]
            small = [p for p in group["params"] if p.numel() < self.SMALL]
            self.buckets += [_AdamBucket(params, index, self.world_size) for params in large + [small] if params]
        self.grad_hooks = _LaunchWhenGradsReady(self.buckets, self._launch_reduce)
        self.launched, self.row_exchanges, self.deferred_rows = [], {}, {}
        self.accumulating = False
        # tied = (follower, leader): until untie() the leader takes both gradients
        self.tied, self.tied_ready = tied, set()
        if tied is not None:
            self.tied_buckets = [next((b for b in self.buckets if len(b.params) == 1 and b.params[0] is p), None)
                                 for p in tied]
            if tied[0].shape != tied[1].shape or None in self.tied_buckets:
                raise ValueError("tied parameters need one shape and a bucket each")

    def before_last_backward(self, rows: list[dict] | None = None):
        """rows: per forward of the step, {key: rows read}."""
        row_lists = {p: [forward[key] for forward in rows or []] for p, key in self.sparse_rows.items()}
        if self.accumulating:
            for p, lists in row_lists.items():
                self.deferred_rows.setdefault(p, []).extend(lists)
            return
        self.grad_hooks.armed = True
        for p, lists in row_lists.items():
            touched = union_of_rows(self.deferred_rows.pop(p, []) + lists, p.size(0))
            self.row_exchanges[p] = _RowExchange(touched, p, self.rank, self.world_size, self.cpu_group)

    def _launch_reduce(self, bucket: _AdamBucket):
        grads = grads_or_zeros(bucket.params)
        if self.is_tied() and bucket in self.tied_buckets:
            self.tied_ready.add(bucket)
            if len(self.tied_ready) < 2:
                return
            follower, leader = self.tied_buckets
            grads = [grads_or_zeros(leader.params)[0] + grads_or_zeros(follower.params)[0]]
            follower.pending, bucket = (lambda: None), leader
        exchange = self.row_exchanges.pop(bucket.params[0], None)
        if exchange is not None:
            bucket.pending = exchange.launch(grads[0])
        elif self.distributed:
            flat = bucket.flat(grads)
            out = flat.new_empty(bucket.shard)
            work = reduce_scatter_single(out, flat, op=dist.ReduceOp.AVG, async_op=True)
            bucket.pending = lambda: (work.wait(), out)[1]
        else:
            flat = bucket.flat(grads)
            bucket.pending = lambda: flat
        self.launched.append(bucket)

    def zero_grad(self, set_to_none: bool = True):
        if not self.accumulating:
            super().zero_grad(set_to_none)

    @torch.no_grad()
    def launch_step(self):
        if self.accumulating:
            return lambda: None
        for bucket in self.buckets:
            if bucket.pending is None:
                self._launch_reduce(bucket)
        gathers, tied = [], self.is_tied()  # (bucket, flat form gathered into, wait or None)
        for index, group in enumerate(self.param_groups):  # fills: no host-to-device copy to wait for
            if index not in self.scalars:
                self.scalars[index] = torch.zeros(2, device=group["params"][0].device)
            self.scalars[index][0].fill_(group["lr"])
            self.scalars[index][1].fill_(group["lr"] ** 2 * group["weight_decay"])
        for bucket in self.launched:
            if tied and bucket is self.tied_buckets[0]:
                continue  # its gradient travelled in the leader's
            grad_shard = bucket.pending()
            flat = bucket.flat(bucket.params)
            owned = bucket.owned(flat, self.rank)
            self._update(bucket, owned, grad_shard)
            if self.distributed:
                gathers.append((bucket, flat, all_gather_single(flat, owned, async_op=True).wait))
            elif not bucket.in_place:
                gathers.append((bucket, flat, None))
        for bucket in self.buckets:
            bucket.pending = None
        self.launched, self.row_exchanges = [], {}
        self.tied_ready.clear()
        self.grad_hooks.disarm()

        @torch.no_grad()
        def finish():
            params, values = [], []
            for bucket, flat, wait in gathers:
                if wait is not None:
                    wait()
                if not bucket.in_place:
                    params += bucket.params
                    values += bucket.views(flat)
            if params:
                torch._foreach_copy_(params, values)
            if tied:
                self.tied[0].copy_(self.tied[1])
        return finish

    def is_tied(self) -> bool:
        return self.tied is not None and not self.state[self.tied[0]].get("untied", False)

    def untie(self):
        follower, leader = self.tied
        self.state[follower] = detached_copy(self.state[leader])
        self.state[follower]["untied"] = True

    def load_state_dict(self, state_dict: dict):
        super().load_state_dict(state_dict)
        for state in self.state.values():  # a loaded "step" stays where saved (torchft: the CPU)
            if "step" in state:
                state["step"] = state["step"].to(state["exp_avg"].device)

    def _update(self, bucket: _AdamBucket, owned: Tensor, grad_shard: Tensor):
        state = self.state[bucket.params[0]]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=owned.device)
            state["exp_avg"] = torch.zeros_like(owned)
            state["exp_avg_sq"] = torch.zeros_like(owned)
        state["step"] += 1
        group, scalars = self.param_groups[bucket.group_index], self.scalars[bucket.group_index]
        update_ = self.update_small_ if owned.numel() < self.DYNAMIC else self.update_
        update_(owned, grad_shard, state["exp_avg"], state["exp_avg_sq"], state["step"], scalars[0], scalars[1],
                *group["betas"], group["eps"])

def adam_update_(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor, lr: Tensor,
                 decay: Tensor, beta1: float, beta2: float, eps: float):
    """Adam on a flat slice; decay where update and weight agree in sign (cautious: Chen et al. 2025; speedrun
    2025-12-18)."""
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
    update = (lr / bias1) * exp_avg / (exp_avg_sq.sqrt() / bias2.sqrt() + eps)
    p.sub_(update + decay * (update * p > 0) * p)

# Polar Express (Amsel et al. 2025; speedrun 2025-09-29): X <- a X + (b A + c A^2) X, A = X X^T, safety 2e-2:
# singular values from (0, 1] into about [0.7, 1.1]
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

def orthogonalized_dtype(grads: Tensor) -> torch.dtype:
    return torch.bfloat16 if grads.is_cuda else torch.float32

def orthogonalize(grads: Tensor, use_triton: bool) -> Tensor:
    """About U V^T of each matrix's SVD, bf16 on a GPU; use_triton: symmetric products (speedrun 2025-07)."""
    X = grads.to(orthogonalized_dtype(grads))
    transposed = X.size(-2) > X.size(-1)
    if transposed:  # iterate on the smaller Gram matrix
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6)  # every singular value below 1
    if use_triton:
        X = X.reshape(-1, *X.shape[-2:]).contiguous()
        A = X.new_empty(X.size(0), X.size(1), X.size(1))
        B = torch.empty_like(A)
        for a, b, c in POLAR_EXPRESS_COEFFS:
            symmetric_matmul(X, out=A)
            symmetric_matmul(A, out=B, alpha=c, beta=b, Y=A)
            X = torch.baddbmm(X, B, X, beta=a)
        X = X.view(*grads.shape[:-2], *X.shape[-2:])
    else:
        for a, b, c in POLAR_EXPRESS_COEFFS:
            A = X @ X.mT
            B = b * A + c * (A @ A)
            X = a * X + B @ X
    return X.mT if transposed else X

def plan_muon_groups(shapes: list[tuple[int, ...]], world_size: int,
                     layers: list[int] | None = None) -> list[list[int]]:
    """Groups of one shape, small shapes and late layers first (the backward's order), a shape halved where it can
    (the second half's communication overlaps the first's compute)."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    order = range(len(shapes)) if layers is None else sorted(range(len(shapes)), key=lambda i: -layers[i])
    for index in order:
        by_shape.setdefault(tuple(shapes[index]), []).append(index)
    groups = []
    for shape in sorted(by_shape, key=math.prod):
        members = by_shape[shape]
        per_rank = len(members) // world_size
        split = world_size * ((per_rank + 1) // 2) if per_rank >= 2 else len(members)
        groups += [g for g in (members[:split], members[split:]) if g]
    return groups

class CapturedSteps:
    """Step parts as CUDA graphs, captured once their tensors repeat; no collectives, settings on the device."""

    def __init__(self):
        self.graphs = {}  # key -> (graph, tensors' signature, what the part returned)
        self.seen = {}  # key -> tensors' signature after the last eager run

    @staticmethod
    def signature(tensors: list) -> tuple:
        return tuple((t.data_ptr(), t.numel()) if t is not None else None for t in tensors)

    def run(self, key, compute, tensors):
        before = self.signature(tensors())
        entry = self.graphs.get(key)
        if entry is not None and entry[1] == before:
            entry[0].replay()
            return entry[2]
        if self.seen.get(key) != before:
            result = compute()
            self.seen[key] = self.signature(tensors())
            return result
        graph, result = self.capture(compute)
        self.graphs[key] = (graph, before, result)
        return result

    @staticmethod
    def capture(compute):
        graph = torch.cuda.CUDAGraph()
        # thread_local: the loader's thread may wait on its copies' events meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            result = compute()
        graph.replay()
        return graph, result

class _MuonGroup:
    def __init__(self, params: list[Tensor], world_size: int, keep: bool):
        self.params, self.keep = params, keep
        self.per_rank = -(-len(params) // world_size)
        self.padding = self.per_rank * world_size - len(params)
        self.pending = None  # (work or None, this rank's averaged gradients)
        self.inbox = self.outbox = self.gathered = None

    def owned(self, rank: int) -> list[Tensor]:
        return self.params[rank * self.per_rank: (rank + 1) * self.per_rank]

    def buffer(self, name: str, make) -> Tensor:
        if not self.keep:
            return make()
        if getattr(self, name) is None:
            setattr(self, name, make())
        return getattr(self, name)

class Muon(_ShardedOptimizer):
    """NorMuon (Jordan et al. 2024; Li et al. 2025; speedrun 2025-10-24): Nesterov momentum (and a slow buffer,
    2026-08-30), orthogonalised per row-block kind ("split"), rescaled per row/column; lr x lr_mul x shape_factor
    (2025-10-27); cautious decay. A step: 1. reduce-scatter per group; 2. owned updates, all-gathered; 3. apply."""

    def __init__(self, params, lr: float, momentum: float, weight_decay: float = 0.0, beta2: float = 0.9,
                 slow_momentum: float = 0.98, use_triton: bool = False, layers: list[int] | None = None,
                 cuda_graphs: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, split=1, lr_mul=1.0))
        self.beta2, self.slow_momentum, self.use_triton = beta2, slow_momentum, use_triton
        params = [p for group in self.param_groups for p in group["params"]]
        self.group_index_of = {p: i for i, group in enumerate(self.param_groups) for p in group["params"]}
        plan = plan_muon_groups([tuple(p.shape) for p in params], self.world_size, layers)
        self.groups = [_MuonGroup([params[i] for i in indices], self.world_size, cuda_graphs) for indices in plan]
        self.grad_hooks = _LaunchWhenGradsReady(self.groups, self._launch_reduce)
        for group in self.param_groups:
            if len({self.shape_factor(p, group) for p in group["params"]}) > 1:
                raise ValueError("Muon: the matrices of a param group need one shape factor (shape and split)")
        self.scalars = None  # groups' settings on the device (fill_scalars)
        self.cuda_graphs, self.graphs = cuda_graphs, CapturedSteps() if cuda_graphs else None
        self.fused_apply = use_triton and all(p.dtype == torch.float32 for p in params)

    def before_last_backward(self, rows=None):
        self.grad_hooks.armed = True

    def _launch_reduce(self, group: _MuonGroup):
        grads = grads_or_zeros(group.params)
        stacked = torch.stack(grads + [torch.zeros_like(grads[0])] * group.padding)
        if self.distributed:
            owned = group.buffer("inbox", lambda: stacked.new_empty(group.per_rank, *stacked.shape[1:]))
            group.pending = (reduce_scatter_single(owned, stacked, op=dist.ReduceOp.AVG, async_op=True), owned)
        elif self.cuda_graphs:  # the graph reads the same tensor every step
            group.pending = (None, group.buffer("inbox", lambda: torch.empty_like(stacked)).copy_(stacked))
        else:
            group.pending = (None, stacked)

    def _owned_updates(self, group: _MuonGroup, grads: Tensor) -> Tensor:
        owned = group.owned(self.rank)
        by_run = {}  # (first row, height, blocks, run) -> matrices
        directions = []
        for i, p in enumerate(owned):
            one_minus_fast, momentum, slow_share = self.scalars[self.group_index_of[p], :3].unbind(0)
            directions.append(muon_momentum_(grads[i], self.state[p], momentum, one_minus_fast, self.slow_momentum,
                                             slow_share))
            first_row = 0
            for run, (height, count) in enumerate(row_blocks(p, self.param_groups[self.group_index_of[p]])):
                by_run.setdefault((first_row, height, count, run), []).append(i)
                first_row += height * count
        updates = group.buffer("outbox", lambda: grads.new_empty(grads.shape, dtype=orthogonalized_dtype(grads)))
        updates.zero_()
        for (first_row, height, count, run), members in by_run.items():
            rows = slice(first_row, first_row + height * count)
            batch = torch.stack([directions[i][rows] for i in members])
            n, cols = len(members), batch.size(-1)
            ortho = orthogonalize(batch.view(n * count, height, cols), self.use_triton)
            states = [self.state[owned[i]] for i in members]
            ortho = normuon_(ortho, states, count, self.beta2, f"second_moment_{run}").view(n, height * count, cols)
            for slot, index in enumerate(members):  # indexing with a list would copy it to the GPU: a host sync
                updates[index, rows].copy_(ortho[slot])
        return updates

    def fill_scalars(self):
        """The groups' settings, in one copy from pinned memory."""
        rows = []
        for settings in self.param_groups:
            momentum, fast = settings["momentum"], settings.get("fast_momentum")
            lr = settings["lr"] * settings["lr_mul"] * self.shape_factor(settings["params"][0], settings)
            rows.append((1 - (momentum if fast is None else fast), momentum, settings.get("slow_share", 0.0), -lr,
                         -lr * settings["weight_decay"] * settings["lr"]))
        values = torch.tensor(rows, dtype=torch.float32)
        device = self.param_groups[0]["params"][0].device
        if device.type == "cuda":
            values = values.pin_memory()  # the pinned allocator keeps it until the copy has run
        if self.scalars is None:
            self.scalars = values.to(device, non_blocking=True)
        else:
            self.scalars.copy_(values, non_blocking=True)

    def zero_state_(self):
        """A new optimizer's state; under cuda_graphs zeroed in place (the graphs read it)."""
        if not self.cuda_graphs:
            self.state.clear()
        for state in self.state.values():
            for buffer in state.values():
                buffer.zero_()

    @torch.no_grad()
    def launch_step(self):
        for group in self.groups:
            if group.pending is None:
                self._launch_reduce(group)
        self.grad_hooks.disarm()
        self.fill_scalars()
        gathers = []
        for index, group in enumerate(self.groups):
            reduced, grads = group.pending
            if reduced is not None:
                reduced.wait()
            updates = self._run(("updates", index), lambda group=group, grads=grads: self._owned_updates(group, grads))
            work = None
            if self.distributed:
                gathered = group.buffer("gathered", lambda: updates.new_empty(group.per_rank * self.world_size,
                                                                              *updates.shape[1:]))
                updates, work = gathered, all_gather_single(gathered, updates, async_op=True)
            gathers.append((index, group, updates, work))
            group.pending = None

        @torch.no_grad()
        def finish():
            for index, group, updates, work in gathers:
                if work is not None:
                    work.wait()
                self._run(("apply", index),
                          lambda group=group, updates=updates: self._apply(group.params, updates[:len(group.params)]))
        return finish

    def _run(self, key, compute):
        if self.graphs is None:
            return compute()
        return self.graphs.run(key, compute, lambda: self._inputs_of(key))

    def _inputs_of(self, key) -> list[Tensor]:
        kind, index = key
        group = self.groups[index]
        tensors = [self.scalars] + list(group.params)
        if kind == "updates":
            states = [self.state[p] for p in group.owned(self.rank)]
            return tensors + [group.inbox, group.outbox] + [t for state in states for t in state.values()]
        return tensors + [group.gathered if self.distributed else group.outbox]

    def _apply(self, params: list[Tensor], updates: Tensor):
        for p, update in zip(params, updates):
            index = self.group_index_of[p]
            neg_lr_decay, decays = self.scalars[index, 3:], bool(self.param_groups[index]["weight_decay"])
            if self.fused_apply:
                muon_apply_(p, update, neg_lr_decay, decays)
                continue
            update = update.to(p.dtype)
            if decays:
                p.add_(torch.where(update * p >= 0, p, 0) * neg_lr_decay[1])
            p.add_(update * neg_lr_decay[0])

    @staticmethod
    def shape_factor(p: Tensor, settings: dict) -> float:
        rows, cols = row_blocks(p, settings)[0][0], p.size(-1)
        return max(1.0, rows / cols) ** 0.5

def row_blocks(p: Tensor, settings: dict) -> list[tuple[int, int]]:
    split = settings["split"]
    runs = [(p.size(-2) // split, split)] if isinstance(split, int) else [tuple(run) for run in split]
    if sum(height * count for height, count in runs) != p.size(-2):
        raise ValueError(f"Muon split {split} does not cover the {p.size(-2)} rows of a {tuple(p.shape)} matrix")
    return runs

def normuon_(ortho: Tensor, states: list[dict], split: int, beta2: float, key: str) -> Tensor:
    """NorMuon: updates [n * split, rows, cols] over the root of a running mean square on the short side, norm kept."""
    blocks, rows, cols = ortho.shape
    reduce_dim = -1 if rows >= cols else -2
    update = ortho.float()
    mean_square = update.square().mean(dim=reduce_dim, keepdim=True)
    for i, state in enumerate(states):
        if key not in state:
            state[key] = torch.zeros_like(mean_square[i * split: (i + 1) * split])
    moments = torch.stack([state[key] for state in states]).view_as(mean_square)
    moments.lerp_(mean_square, 1 - beta2)
    for i, state in enumerate(states):
        state[key].copy_(moments[i * split: (i + 1) * split])
    inverse_root = moments.clamp_min(1e-10).rsqrt()
    side = update.size(reduce_dim)
    norm = (side * mean_square.sum(dim=(-2, -1), keepdim=True)).sqrt()
    rescaled_norm = (side * (mean_square * inverse_root.square()).sum(dim=(-2, -1), keepdim=True)).sqrt()
    return (update * (inverse_root * (norm / rescaled_norm.clamp_min(1e-10)))).to(ortho.dtype)

def muon_momentum_(grad: Tensor, state: dict, momentum, one_minus_fast, slow: float, slow_share) -> Tensor:
    """Nesterov momentum over the usual and slow buffers mixed (slow_share; ANVIL2's two rails)."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad)
        state["slow_momentum_buffer"] = torch.zeros_like(grad)
    buf, slow_buf = state["momentum_buffer"], state["slow_momentum_buffer"]
    buf.lerp_(grad, one_minus_fast)
    slow_buf.lerp_(grad, 1 - slow)
    return grad.lerp(buf.lerp(slow_buf, slow_share), momentum)


# --------------------
# Data
#
# Shards in the llm.c layout: 256 int32 (magic, version, token count, ...), then uint16 tokens, each document after
# a BOS, little-endian.

class DataError(UserError):
    pass

def shard_tokens(path: str) -> int:
    """Token count, header and size checked."""
    size, header_bytes = os.path.getsize(path), SHARD_HEADER_INTS * 4
    if size < header_bytes:
        raise DataError(f"{path}: {size} bytes, too short for the {header_bytes}-byte shard header")
    magic, version, num_tokens = map(int, np.fromfile(path, dtype="<i4", count=SHARD_HEADER_INTS)[:3])
    if magic != SHARD_MAGIC:
        raise DataError(f"{path}: not a token shard (magic number {magic}, expected {SHARD_MAGIC})")
    if version != SHARD_VERSION:
        raise DataError(f"{path}: shard version {version} is not supported (expected {SHARD_VERSION})")
    if size != (expected := header_bytes + 2 * num_tokens):
        raise DataError(f"{path}: header says {num_tokens:,} tokens ({expected:,} bytes) but the file has {size:,} "
                        "bytes; the file is truncated or corrupt, download or build it again")
    return num_tokens

def read_shard(path: str) -> np.ndarray:
    """Read whole, not mapped: a file cut under a running job cannot kill it."""
    tokens = np.fromfile(path, dtype="<u2", count=(count := shard_tokens(path)), offset=SHARD_HEADER_INTS * 4)
    if len(tokens) != count:
        raise DataError(f"{path}: cut while being read ({len(tokens):,} of {count:,} tokens)")
    return tokens

def shard_paths(pattern: str, flag: str, vocab_size: int = 0) -> list[str]:
    """A glob's shards, headers (with vocab_size, tokens too) checked; all bad ones in one line."""
    paths, bad = sorted(glob.glob(pattern)), []
    if not paths:
        raise DataError(f"--{flag}={pattern!r} matches no files. Download FineWeb shards with "
                        f"`python data/cached_fineweb10B.py 9` or point --{flag} at your own shards")
    for path in paths:
        if os.path.isdir(path):
            raise DataError(f"--{flag}={pattern!r} matches the folder {path}: give the shard files, e.g. "
                            f"--{flag}='{os.path.join(path, '*.bin')}'")
        try:
            if vocab_size:
                check_vocabulary(read_shard(path), vocab_size, path)
            else:
                shard_tokens(path)
        except DataError as e:
            bad.append(str(e))
    if bad:
        raise DataError(bad[0] if len(bad) == 1 else f"{len(bad)} bad shards: " + " | ".join(bad))
    return paths

def check_vocabulary(tokens: np.ndarray, vocab_size: int, where: str):
    """A token past the tables is an error naming the data (the GPU's row gather does not check)."""
    if len(tokens) and int(tokens.max()) >= vocab_size:
        position = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"{where}: token {int(tokens[position])} at position {position:,} is not below "
                        f"--vocab_size={vocab_size}; the data comes from another tokenizer (set --vocab_size and "
                        "--bos_token to its own)")

def document_starts(path: str, bos: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = read_shard(path)
    check_vocabulary(tokens, vocab_size, path)
    return tokens, np.flatnonzero(tokens == bos)

def bos_aligned_batches(paths: list[str], length: int, max_doc_len, repeat: bool, on_new_pass=None, *,
                        bos: int, vocab_size: int):
    """(tokens, spans) of `length` tokens of whole documents from their BOS, each cut at max_doc_len(batch index), the
    last to fit (speedrun 2025-07); the rest dropped. The next shard is indexed on a thread (in line it stalls)."""
    order = ((number, path) for number in range(1, sys.maxsize if repeat else 2) for path in paths)
    current, produced, index = next(order), False, 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-index") as indexer:
        job = indexer.submit(document_starts, current[1], bos, vocab_size)
        while current is not None:
            following = next(order, None)
            tokens, starts = job.result()
            if following is not None:
                job = indexer.submit(document_starts, following[1], bos, vocab_size)
            ends, doc = np.append(starts[1:], len(tokens)), 0
            while True:
                spans, need = [], length
                cap = max_doc_len(index) if callable(max_doc_len) else max_doc_len
                while need > 0 and doc < len(starts):
                    start = int(starts[doc])
                    end = min(int(ends[doc]), start + cap, start + need)
                    spans.append((start, end))
                    need -= end - start
                    doc += 1
                if need > 0:
                    break
                produced, index = True, index + 1
                yield tokens, spans
            pass_ends = following is None or following[0] > current[0]
            if pass_ends and not produced:
                raise DataError(f"no batch of {length} tokens could be built from {paths[0]}...: the shards need "
                                f"documents that start with the BOS token {bos} (--bos_token)")
            if pass_ends and following is not None and on_new_pass is not None:
                on_new_pass(following[0])
            current = following

def train_batches_for_rank(paths: list[str], cfg: Config, comm: Comm, on_new_pass=None):
    """Every world_size-th micro-batch of one global sequence (DiLoCo's groups interleave too), cut at its stage's
    doc_len: any world size trains on the same ones."""
    replicas, replica = (cfg.diloco_replicas, cfg.replica) if cfg.diloco else (1, 0)
    stride, offset = replicas * comm.world_size, replica * comm.world_size + comm.rank
    stage_of, doc_lens = Schedule(cfg).stage_of_micro_batch, [stage.doc_len for stage in cfg.stages]

    def max_doc_len(index: int) -> int:
        return doc_lens[stage_of(index // stride * comm.world_size + index % stride % comm.world_size)]
    batches = bos_aligned_batches(paths, cfg.micro_batch_tokens + 1, max_doc_len, cfg.train_repeat, on_new_pass,
                                  bos=cfg.bos_token, vocab_size=cfg.vocab_size)
    try:
        for index, (tokens, spans) in enumerate(batches):
            if index % stride == offset:
                yield np.concatenate([tokens[start:end] for start, end in spans])
    finally:
        batches.close()  # stops its shard-indexing thread

def drop(count: int, batches):
    try:
        yield from itertools.islice(batches, count, None)
    finally:
        batches.close()

def val_batches_for_rank(paths: list[str], cfg: Config, comm: Comm):
    """The first val_tokens tokens in chunks, dealt to the ranks."""
    shards = [read_shard(path) for path in paths]
    if (available := sum(len(s) for s in shards)) < cfg.val_tokens + 1:
        raise DataError(f"--val_files={cfg.val_files!r} hold {available:,} tokens, fewer than "
                        f"--val_tokens={cfg.val_tokens:,} (+1); lower --val_tokens")
    stream = shards[0] if len(shards) == 1 else np.concatenate(shards)
    check_vocabulary(stream[: cfg.val_tokens + 1], cfg.vocab_size, f"--val_files={cfg.val_files!r}")
    T = cfg.micro_batch_tokens
    for index in range(comm.rank, cfg.val_tokens // T, comm.world_size):
        yield np.asarray(stream[index * T: index * T + T + 1])

def bigram_hash(tokens: np.ndarray, rows: int, bos: int) -> np.ndarray:
    """A Fibonacci hash of (previous token, token) into rows - 1 rows; the last row where no previous token is."""
    t = tokens.astype(np.uint64)
    mixed = ((t[:-1] * np.uint64(65536) + t[1:]) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)  # wraps mod 2**64
    out = np.empty(len(tokens), dtype=np.int32)
    out[0] = rows - 1
    out[1:] = mixed % np.uint64(rows - 1)
    out[tokens == bos] = rows - 1
    return out

def max_documents(seq_len: int) -> int:
    """cu_seqlens' fixed length (one shape for FA3): 16 tokens a document, far below text's."""
    return seq_len // 16 + 1

def micro_batch_document_starts(inputs: np.ndarray, bos: int) -> np.ndarray:
    """At every BOS, and at 0 (a validation chunk begins mid-document)."""
    starts = np.flatnonzero(inputs == bos)
    return starts if len(starts) and starts[0] == 0 else np.insert(starts, 0, 0)

@dataclass
class ForwardBatch:
    inputs: Tensor  # [T] int32
    targets: Tensor  # [T] int64
    cu_seqlens: Tensor  # [max_documents + 1] int32: the document starts, then T repeated
    bigrams: Tensor | None = None  # [T] int32 rows of the bigram table
    rows: dict | None = None  # {"bigrams": sorted rows read}, on the host
    documents: int | None = None  # how many documents cu_seqlens starts
    longest_document: int | None = None

class _Slot:

    def __init__(self, seq_len: int, pin: bool, bos: int, bigram_rows: int = 0, packed: int = 1):
        length = seq_len * packed
        self.bos, self.bigram_rows = bos, bigram_rows
        self.inputs = torch.empty(length, dtype=torch.int32, pin_memory=pin)
        self.targets = torch.empty(length, dtype=torch.int64, pin_memory=pin)
        self.cu_seqlens = torch.empty(max_documents(length) + 1, dtype=torch.int32, pin_memory=pin)
        self.bigrams = torch.empty(length, dtype=torch.int32, pin_memory=pin) if bigram_rows else None
        self.rows = self.documents = self.longest_document = None
        self.length, self.copied = 0, None  # copied: event of the copy out of this slot

    def fill(self, windows: list[np.ndarray]):
        starts, offset = [], 0
        for window in windows:
            inputs, end = window[:-1], offset + len(window) - 1
            self.inputs.numpy()[offset:end] = inputs
            self.targets.numpy()[offset:end] = window[1:]
            if self.bigram_rows:
                self.bigrams.numpy()[offset:end] = bigram_hash(inputs, self.bigram_rows, self.bos)
            starts.append(micro_batch_document_starts(inputs, self.bos) + offset)
            offset = end
        self.length = offset
        self.rows = {"bigrams": np.unique(self.bigrams.numpy()[:offset])} if self.bigram_rows else {}
        starts = np.concatenate(starts)
        cu = self.cu_seqlens.numpy()[: max_documents(offset) + 1]
        if len(starts) >= len(cu):
            raise DataError(f"{offset} tokens hold {len(starts)} documents, more than the {len(cu) - 1} supported; "
                            "the documents are implausibly short")
        cu[: len(starts)] = starts
        cu[len(starts):] = offset
        self.documents, self.longest_document = len(starts), int(np.diff(cu[: len(starts) + 1]).max())

class Prefetcher:
    """Forwards' inputs (`packed` windows, or `sizes` in turn) built on a thread into rotating pinned slots."""

    def __init__(self, batches, seq_len: int, device: torch.device, *, bos: int, slots: int = 4,
                 bigram_rows: int = 0, packed: int = 1, sizes=None):
        self.device, self.source, self.closed = device, batches, False
        self.free, self.ready = queue.Queue(), queue.Queue()
        for _ in range(slots):
            self.free.put(_Slot(seq_len, device.type == "cuda", bos, bigram_rows, packed))
        sizes = itertools.repeat(packed) if sizes is None else sizes
        self.thread = threading.Thread(target=self._fill, args=(batches, sizes), daemon=True)
        self.thread.start()

    def _fill(self, batches, sizes):
        try:
            windows = iter(batches)
            for size in sizes:
                group = list(itertools.islice(windows, size))
                if len(group) < size:  # a partial group at the end is left out
                    break
                slot = self.free.get()
                if slot is None or self.closed:
                    return
                if slot.copied is not None:
                    slot.copied.synchronize()
                slot.fill(group)
                self.ready.put(slot)
            self.ready.put(StopIteration())
        except BaseException as e:  # the training thread raises it
            self.ready.put(e)

    def next(self) -> ForwardBatch:
        item = self.ready.get()
        if isinstance(item, StopIteration):
            raise DataError("the training data ran out: add shards (python data/cached_fineweb10B.py N), "
                            "lower --num_iterations, or set --train_repeat=1")
        if isinstance(item, BaseException):
            raise item
        length = item.length
        tensors = (item.inputs[:length], item.targets[:length], item.cu_seqlens[: max_documents(length) + 1],
                   item.bigrams[:length] if item.bigrams is not None else None)
        cuda = self.device.type == "cuda"  # else copies: the slot is reused
        batch = ForwardBatch(*(t if t is None else t.to(self.device, non_blocking=True) if cuda else t.clone()
                               for t in tensors), item.rows, item.documents, item.longest_document)
        if cuda:
            item.copied = torch.cuda.Event()
            item.copied.record()
        self.free.put(item)
        return batch

    def close(self):
        """A thread still inside numpy or torch at the interpreter's exit aborts the process."""
        self.closed = True
        self.free.put(None)
        self.thread.join()
        if hasattr(self.source, "close"):
            self.source.close()

def prefetch(windows, cfg: Config, device: torch.device, packed: int, sizes=None) -> Prefetcher:
    return Prefetcher(windows, cfg.micro_batch_tokens, device, bos=cfg.bos_token, bigram_rows=cfg.bigram_rows,
                      packed=packed, sizes=sizes)


# --------------------
# Schedule

class Schedule:
    """Per-step settings: stages split the scheduled steps evenly; lr decays linearly over the last cooldown_frac to
    the last row's."""

    def __init__(self, cfg: Config):
        self.cfg, self.rows, self.scheduled = cfg, cfg.stages, len(cfg.stages) - 1
        self.num_iterations, self.total_steps = cfg.num_iterations, cfg.num_iterations + cfg.extension_steps
        self.untie_step = round(UNTIE_FRAC * cfg.num_iterations)
        self.mtp_offsets = max(len(stage.mtp) for stage in cfg.stages)
        firsts = [next(s for s in range(self.total_steps + 1) if s == self.total_steps or self.stage(s) >= k)
                  for k in range(1, self.scheduled + 1)]
        self.stage_starts = [self.micro_batches_before(s) for s in firsts]

    def stage(self, step: int) -> int:
        if step >= self.num_iterations and self.cfg.extension_steps:
            return self.scheduled
        return min(step * self.scheduled // self.num_iterations, self.scheduled - 1)

    def bounds(self, stage: int) -> tuple[int, int]:
        if stage == self.scheduled:
            return self.num_iterations, self.total_steps
        n, s = self.num_iterations, self.scheduled
        return -(-stage * n // s), -(-(stage + 1) * n // s)

    def validates(self, step: int) -> bool:
        return step == self.total_steps or (self.cfg.val_loss_every > 0 and step % self.cfg.val_loss_every == 0)

    def validation_step(self, step: int) -> int:
        """The step whose windows validation before `step` uses: the last trained, but at the end."""
        return step - 1 if 0 < step < self.total_steps else step

    def micro_batches(self, step: int) -> int:
        return self.rows[self.stage(step)].batch

    def micro_batches_before(self, step: int) -> int:
        return sum(self.micro_batches(s) for s in range(step))

    def stage_of_micro_batch(self, index: int) -> int:
        return sum(index >= start for start in self.stage_starts)

    def mtp_weights(self, step: int) -> list[float]:
        stage = self.stage(step)
        start, end = self.bounds(stage)
        t = (step - start) / max(end - start, 1)
        weights = [a + (b - a) * t for a, b in self.rows[stage].mtp]
        return weights + [0.0] * (self.mtp_offsets - len(weights))

    def lr_multiplier(self, step: int) -> float:
        lr = self.rows[min(self.stage(step), self.scheduled - 1)].lr
        cooldown_start = self.num_iterations * (1 - self.cfg.cooldown_frac)
        if step >= cooldown_start:
            t = min((step - cooldown_start) / max(self.num_iterations - cooldown_start, 1), 1.0)
            lr = lr * (1 - t) + self.rows[-1].lr * t
        return lr

    def adam_updates(self, step: int) -> bool:
        return (step + 1) % self.cfg.period == 0

    def muon_momentum(self, step: int) -> float:
        low, high, warmup, cooldown = 0.85, 0.95, 300, 50
        steps_left = self.total_steps - step
        if step < warmup:
            return low + (high - low) * step / warmup
        return low + (high - low) * steps_left / cooldown if steps_left < cooldown else high

    def muon_rails(self, step: int) -> tuple[float, float]:
        """(Muon buffer's beta, slow buffer's share)."""
        return (0.85, 0.56) if step >= round(0.43 * self.num_iterations) else (self.muon_momentum(step), 0.0)

    def windows(self, step: int) -> tuple[int, int]:
        return self.cfg.final_windows if step >= self.total_steps else self.rows[self.stage(step)].windows

    def long_window_history(self, step: int) -> list[int]:
        stages = [self.rows[s] for s in range(self.stage(step) + 1) if s < self.scheduled or self.cfg.extension_steps]
        final = [self.cfg.final_windows[1]] if step >= self.total_steps else []
        return [stage.windows[1] for stage in stages] + final


# --------------------
# The step and the loop

def build_optimizers(model: GPT, cfg: Config, cuda_graphs: bool = False) -> Optimizers:
    """Muon, then DistAdam (Muon computes while Adam's larger traffic is on the wire); a group per Opt."""
    named = dict(model.named_parameters())
    muon_groups, adam_groups = {}, {}
    for p in named.values():
        if p.opt.optimizer == "muon":
            muon_groups.setdefault((p.opt.lr, p.opt.split), []).append(p)
        else:
            adam_groups.setdefault((p.opt.lr, p.opt.wd, p.opt.betas), []).append(p)
    layer_of = {p: int(name.split(".")[1]) for name, p in named.items() if name.startswith("blocks.")}
    muon = Muon([dict(params=params, lr_mul=lr, split=split) for (lr, split), params in muon_groups.items()],
                lr=cfg.muon_lr, momentum=0.95, weight_decay=MUON_WD, use_triton=model.kernels.triton,
                layers=[layer_of[p] for params in muon_groups.values() for p in params], cuda_graphs=cuda_graphs)
    tied = [(p, named[p.opt.tie]) for p in named.values() if p.opt.tie]
    adam = DistAdam([dict(params=params, lr=cfg.adam_lr * lr, weight_decay=ADAM_WD * wd, betas=betas)
                     for (lr, wd, betas), params in adam_groups.items()],
                    lr=cfg.adam_lr, betas=ADAM_BETAS, eps=ADAM_EPS, compiled=cfg.compile and model.embed.weight.is_cuda,
                    tied=tied[0] if tied else None, sparse_rows={p: p.opt.rows for p in named.values() if p.opt.rows})
    optimizers = Optimizers([muon, adam])
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers

def set_hyperparameters(optimizers, schedule: Schedule, step: int):
    muon, adam = optimizers
    if adam.is_tied() and step >= schedule.untie_step:
        adam.untie()
    adam.accumulating = not schedule.adam_updates(step)
    lr_multiplier = schedule.lr_multiplier(step)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lr_multiplier
    for group in muon.param_groups:
        group["momentum"] = schedule.muon_momentum(step)
        group["fast_momentum"], group["slow_share"] = schedule.muon_rails(step)

class Optimizers(list):
    """[Muon, DistAdam]: launches, then finishes, so Adam updates while Muon's all-gathers wait behind Adam's
    reduce-scatters on the one NCCL stream. Step hooks serve torchft's DiLoCo."""

    def __init__(self, optimizers):
        super().__init__(optimizers)
        # OrderedDicts: a hook's handle keeps a weak reference, which a dict does not take
        self.pre_hooks, self.post_hooks = collections.OrderedDict(), collections.OrderedDict()

    def register_step_pre_hook(self, hook):
        return self._register(self.pre_hooks, hook)

    def register_step_post_hook(self, hook):
        return self._register(self.post_hooks, hook)

    def _register(self, hooks: dict, hook) -> torch.utils.hooks.RemovableHandle:
        handle = torch.utils.hooks.RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def step(self, mark=None):
        mark = mark or (lambda phase: None)
        for hook in list(self.pre_hooks.values()):
            hook(self, (), {})
        finishes = []
        for opt in self:
            finishes.append(opt.launch_step())
            mark(type(opt).__name__)
        for opt, finish in zip(self, finishes):
            finish()
            mark(type(opt).__name__)
        for hook in list(self.post_hooks.values()):
            hook(self, (), {})

def forward_loss(model: GPT, batch: ForwardBatch, windows: tuple[int, int]) -> Tensor:
    if model.replays_cuda_graphs:  # the last forward's outputs are used: the graphs may reuse their memory
        torch.compiler.cudagraph_mark_step_begin()
    masks = model.prepare_masks(batch.inputs, batch.cu_seqlens, windows, batch.documents, batch.longest_document)
    return model(batch.inputs, batch.targets, masks, batch.bigrams)

def train_step(model: GPT, optimizers: Optimizers, batches: Prefetcher, windows: tuple[int, int], forwards: int,
               mark=None) -> Tensor:
    """Forwards, backwards, optimizers; returns the mean loss. Each forward's loss over the forward count (and
    averaged over ranks): any world size and packing make the same update."""
    mark = mark or (lambda phase: None)
    model.prepare_grads()
    total, rows = None, []
    for index in range(forwards):
        batch = batches.next()
        rows.append(batch.rows)
        if index == forwards - 1:  # let gradient communication start inside the last backward
            for opt in optimizers:
                opt.before_last_backward(rows)
        loss = forward_loss(model, batch, windows)
        mark("forward")
        (loss / forwards).backward()
        mark("backward")
        # a copy: under CUDA graphs the next replay reuses loss's memory
        total = loss.detach().clone() if total is None else total + loss.detach()
    optimizers.step(mark)
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    return total / forwards

def evaluate(model: GPT, cfg: Config, comm: Comm, val_paths: list[str], windows: tuple[int, int],
             device: torch.device, packed: int) -> float:
    """Mean validation loss, autograd on: the training graphs serve, no extra compile."""
    batches = prefetch(val_batches_for_rank(val_paths, cfg, comm), cfg, device, packed)
    count = cfg.val_tokens // cfg.micro_batch_tokens // comm.world_size // packed
    total = torch.zeros((), device=device)
    try:
        for _ in range(count):
            total += forward_loss(model, batches.next(), windows).detach()
    finally:
        batches.close()
    if comm.distributed:
        dist.all_reduce(total)
    return total.item() / (count * comm.world_size)

def read_val_mask(cfg: Config) -> np.ndarray:
    """--val_mask's [vocab_size, vocab_size / 8] bits: row p, bit x, is 1 where x never follows p."""
    try:
        mask = np.load(cfg.val_mask, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise UserError(f"--val_mask={cfg.val_mask}: not readable ({e}); write it with data/canonical_pairs.py")
    if mask.dtype != np.uint8 or mask.shape != (cfg.vocab_size, (cfg.vocab_size + 7) // 8):
        raise UserError(f"--val_mask={cfg.val_mask}: {mask.dtype} {mask.shape}, not the bits of --vocab_size="
                        f"{cfg.vocab_size} tokens; write it with data/canonical_pairs.py")
    return mask

@torch.no_grad()
def canonical_gap(model: GPT, cfg: Config, comm: Comm, val_paths: list[str], windows: tuple[int, int],
                  device: torch.device, mask: Tensor) -> float:
    """Mean log(1 - m) over validation tokens, m the probability of tokens that never follow the input: added to the
    loss, the loss with their probability given to the others (speedrun #350); an upper bound with the copy pointer
    (its share on them stays). Eager: compiled graphs would compile outside the warm-up."""
    batches = prefetch(val_batches_for_rank(val_paths, cfg, comm), cfg, device, 1)
    count = cfg.val_tokens // cfg.micro_batch_tokens // comm.world_size
    total, bits = torch.zeros((), device=device), 1 << torch.arange(8, device=device, dtype=torch.uint8)
    compiled = {name: model.__dict__.get(name) for name in ("trunk", "find_matches")}
    model.trunk, model.find_matches = functools.partial(GPT.trunk, model), longest_matches
    try:
        for _ in range(count):
            batch = batches.next()
            masks = model.prepare_masks(batch.inputs, batch.cu_seqlens, windows, batch.documents,
                                        batch.longest_document)
            z = model(batch.inputs, None, masks, batch.bigrams).float()
            for rows in torch.arange(len(z), device=device).split(4096):
                lse = z[rows].logsumexp(-1)
                never = (mask[batch.inputs[rows].long()][..., None] & bits).bool().flatten(1)[:, : cfg.vocab_size]
                # over all columns, the pointer's gate too: m is (1 - its share) times the LM's own probability
                m = ((z[rows, : cfg.vocab_size] - lse[:, None]).exp() * never).sum(-1)
                total += torch.log1p(-m.clamp(max=1 - 1e-6)).sum()
    finally:
        batches.close()
        for name, value in compiled.items():
            delattr(model, name) if value is None else setattr(model, name, value)
    if comm.distributed:
        dist.all_reduce(total)
    return total.item() / (count * comm.world_size * cfg.micro_batch_tokens)

def canonical_text(model: GPT, cfg: Config, comm: Comm, val_paths, windows, device, val_loss: float) -> str:
    if not cfg.val_mask:
        return ""
    mask = torch.from_numpy(np.array(read_val_mask(cfg))).to(device)
    return f" val_loss_canonical:{val_loss + canonical_gap(model, cfg, comm, val_paths, windows, device, mask):.4f}"

def dummy_batches(cfg: Config, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        window = rng.integers(0, cfg.vocab_size - 1, cfg.micro_batch_tokens + 1)
        window += window >= cfg.bos_token  # any token but BOS, which marks the starts
        window[0] = cfg.bos_token
        window[rng.integers(1, cfg.micro_batch_tokens, cfg.micro_batch_tokens // 512 + 1)] = cfg.bos_token
        window[:: cfg.max_doc_len] = cfg.bos_token
        yield window.astype(np.uint16)

# Auto packs 8 micro-batches a forward from this many GiB on (the defaults' peak at 8: 64 GiB)
PACK_8_MIN_GIB = 72

@dataclass(frozen=True)
class Packing:
    """Micro-batches per forward by stage and in validation (a training size): each size is a graph."""
    stages: tuple[int, ...]
    validation: int

    @property
    def largest(self) -> int:
        return max(*self.stages, self.validation)

    @property
    def smallest(self) -> int:
        return min(*self.stages, self.validation)

def resolve_packing(cfg: Config, world_size: int, device_memory_gib: float | None = None) -> Packing:
    """--forward_micro_batches, or for 0 per stage the most up to 8 (4 under PACK_8_MIN_GIB) dividing its count per
    rank: fewer, larger forwards are faster."""
    per_rank = [stage.batch // world_size for stage in cfg.stages]
    validation = cfg.val_tokens // cfg.micro_batch_tokens // world_size
    fixed = cfg.forward_micro_batches
    if fixed:
        uneven = [f"stage {i}: {n}" for i, n in enumerate(per_rank) if n % fixed]
        uneven += [f"validation: {validation}"] if validation % fixed else []
        if fixed < 0 or uneven:
            raise UserError(f"--forward_micro_batches={fixed} must divide the micro-batches per rank at {world_size} "
                            f"process(es) ({', '.join(uneven or ['it must be positive'])}); use 0 (auto)")
        return Packing((fixed,) * len(per_rank), fixed)
    most = 8 if device_memory_gib is not None and device_memory_gib >= PACK_8_MIN_GIB else 4

    def most_that_divide(n: int) -> int:
        return max(k for k in range(1, most + 1) if n % k == 0)
    stages = tuple(most_that_divide(n) for n in per_rank)
    shared = [k for k in stages if validation % k == 0]
    return Packing(stages, max(shared) if shared else most_that_divide(validation))

def cuda_graphs_for(cfg: Config, device: torch.device, packing: Packing, world_size: int) -> tuple[bool, bool]:
    """(model, Muon) as CUDA graphs; auto: the model where a stage packs one micro-batch, Muon on several GPUs."""
    if device.type != "cuda" or cfg.cuda_graphs == "0":
        return False, False
    if cfg.cuda_graphs == "1":
        return cfg.compile, True
    return cfg.compile and packing.smallest == 1 and not cfg.diloco, world_size > 1

def check_gpu_features(cfg: Config, device: torch.device, kernels: Kernels):
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    for on, flag, need in ((kernels.fp8_head, "fp8_head", (8, 9)), (kernels.fused_mlp, "fused_mlp", (9, 0))):
        if on and capability < need:
            name, (major, minor) = torch.cuda.get_device_name(device), capability
            raise UserError(f"--{flag} (on by default) needs compute capability {need[0]}.{need[1]} or newer; "
                            f"{name} has {major}.{minor}: pass --{flag}=0")

def build_model(cfg: Config, comm: Comm, log) -> tuple[GPT, torch.device, Packing]:
    device = torch.device("cuda", comm.local_rank) if cfg.device == "cuda" else torch.device("cpu")
    torch.manual_seed(cfg.seed)
    memory_gib = torch.cuda.get_device_properties(device).total_memory / 2 ** 30 if device.type == "cuda" else None
    packing = resolve_packing(cfg, comm.world_size, memory_gib)
    attend = make_attention(cfg, device, packing.largest * cfg.micro_batch_tokens)
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernels = choose_kernels(cfg, device)
    check_gpu_features(cfg, device, kernels)
    with device:  # on its device: a CPU init of the tables is slow
        model = GPT(cfg, attend, compute_dtype, forward_micro_batches=packing.largest, kernels=kernels)
    if comm.distributed:  # the same seed gives the same init, but make certain
        for t in model.state_dict().values():
            dist.broadcast(t, 0)
    log(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, {attend.name} attention, {compute_dtype}, "
        f"world size {comm.world_size}; micro-batches of {cfg.micro_batch_tokens} tokens per forward: "
        f"{', '.join(map(str, packing.stages))} by stage, {packing.validation} in validation")
    return model, device, packing

# FA3 masks' ints among the compiled function's arguments
FA3_HOST_INT_SOURCES = r"L\['masks'\]\['P?[SL]'\]\[[123]\]"

def compile_model(model: GPT, cfg: Config, model_graphs: bool):
    """One graph of the trunk (faster than a graph per block), one of the longest-match search."""
    if not cfg.compile:
        return
    import torch._functorch.config as functorch
    # AOTAutograd caches graphs with our autograd Functions only so (dynamo traces them)
    functorch.autograd_cache_allow_custom_autograd_functions = True
    if isinstance(model.attend, FlashAttention3):
        torch.compiler.config.dynamic_sources = FA3_HOST_INT_SOURCES
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    model.replays_cuda_graphs = model_graphs
    model.trunk = torch.compile(model.trunk, dynamic=False, fullgraph=True,
                                mode="reduce-overhead" if model_graphs else None)
    model.find_matches = torch.compile(model.find_matches, dynamic=False, fullgraph=True)

def cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters
    inductor, aot = counters["inductor"], counters["aot_autograd"]
    return (inductor["fxgraph_cache_hit"] + aot["autograd_cache_hit"],
            inductor["fxgraph_cache_miss"] + aot["autograd_cache_miss"])

def warm_up_forwards(schedule: Schedule, packing: Packing, world_size: int, cuda_graphs: bool) -> dict:
    """(windows, micro-batches per forward) -> forwards the timed region meets; under CUDA graphs at least two."""
    runs = {}
    for stage in range(schedule.scheduled + 1):
        if stage == schedule.scheduled and not schedule.cfg.extension_steps:
            continue
        size, windows = packing.stages[stage], schedule.rows[stage].windows
        forwards = schedule.rows[stage].batch // world_size // size if cuda_graphs else 1
        runs[windows, size] = max(runs.get((windows, size), 1), forwards)
    for step in range(schedule.total_steps + 1):
        if schedule.validates(step):
            runs.setdefault((schedule.windows(schedule.validation_step(step)), packing.validation), 1)
    return {key: max(forwards, 2) if cuda_graphs else forwards for key, forwards in sorted(runs.items())}

def warm_up(model: GPT, optimizers, cfg: Config, comm: Comm, schedule: Schedule, device: torch.device,
            packing: Packing, log):
    """Every graph the timed region needs, on random data; then the initial weights and state again."""
    initial = detached_copy(model.state_dict())
    runs = warm_up_forwards(schedule, packing, comm.world_size, model.replays_cuda_graphs)
    sizes = [size for (_, size), forwards in runs.items() for _ in range(forwards)]
    batches = prefetch(dummy_batches(cfg, seed=cfg.seed + 1 + comm.rank), cfg, device, packing.largest, sizes)
    start = time.perf_counter()
    try:
        for number, ((windows, size), forwards) in enumerate(runs.items(), 1):
            train_step(model, optimizers, batches, windows, forwards=forwards)
            synchronize(device)
            log(f"warm-up {number}/{len(runs)}: windows {windows[0]}/{windows[1]}, {size} micro-batch(es) per "
                f"forward, {forwards} forward(s), done at {time.perf_counter() - start:.1f}s")
    finally:
        batches.close()
    model.load_state_dict(initial)
    optimizers[0].zero_state_()
    optimizers[1].state.clear()

@dataclass
class Trainer:
    model: GPT
    optimizers: Optimizers
    schedule: Schedule
    device: torch.device
    recompiles: RecompileWatch
    packing: Packing

    def per_forward(self, step: int) -> int:
        return self.packing.stages[self.schedule.stage(step)]

    def forwards(self, step: int, world_size: int) -> int:
        return self.schedule.micro_batches(step) // world_size // self.per_forward(step)

    def forward_sizes(self, start: int, world_size: int):
        for step in range(start, self.schedule.total_steps):
            yield from [self.per_forward(step)] * self.forwards(step, world_size)

def build_and_warm_up(cfg: Config, comm: Comm, log) -> Trainer:
    model, device, packing = build_model(cfg, comm, log)
    schedule, start = Schedule(cfg), time.perf_counter()
    model_graphs, muon_graphs = cuda_graphs_for(cfg, device, packing, comm.world_size)
    optimizers = build_optimizers(model, cfg, muon_graphs)
    compile_model(model, cfg, model_graphs)
    try:
        warm_up(model, optimizers, cfg, comm, schedule, device, packing, log)
    except torch.OutOfMemoryError as e:
        raise UserError(f"out of GPU memory in the warm-up, with up to {packing.largest} micro-batch(es) of "
                        f"{cfg.micro_batch_tokens} tokens per forward ({str(e).splitlines()[0]}): lower "
                        "--forward_micro_batches or --micro_batch_tokens") from None
    synchronize(device)
    recompiles, (hits, misses) = RecompileWatch(), cache_counts()
    if cfg.compile:
        log(f"compile_time:{time.perf_counter() - start:.1f}s graphs:{recompiles.graphs} cache_hits:{hits} "
            f"cache_misses:{misses}; CUDA graphs: model {int(model_graphs)}, Muon {int(muon_graphs)}")
    return Trainer(model, optimizers, schedule, device, recompiles, packing)

def train(cfg: Config, comm: Comm, log) -> TrainResult:
    """The warm-up, then the timed loop; validation and checkpoints pause the clock."""
    train_paths, val_paths = shard_paths(cfg.train_files, "train_files"), shard_paths(cfg.val_files, "val_files")
    checkpoint = read_checkpoint(cfg.resume, "resume") if cfg.resume else None  # a bad one fails before compiling
    if checkpoint is not None:
        check_resumable(checkpoint, cfg, train_paths)
    trainer = build_and_warm_up(cfg, comm, log)
    model, optimizers, schedule, device = trainer.model, trainer.optimizers, trainer.schedule, trainer.device
    packing, total, world = trainer.packing, schedule.total_steps, comm.world_size
    run = RunState(cfg, comm, log, trainer)
    diloco = StreamingDiLoCo(cfg, model, optimizers, device, log) if cfg.diloco else None
    start = 0
    if cfg.save_checkpoint and comm.rank == 0:
        tidy_checkpoints(cfg)
    if checkpoint is not None:
        start = run.restore(checkpoint, diloco)
        log(f"resumed from {cfg.resume} at step {start}")
        del checkpoint

    def batches_from(step: int) -> Prefetcher:
        windows = train_batches_for_rank(train_paths, cfg, comm, lambda number: log(
            f"note: the training data starts over (pass {number}); later losses are on repeated data"))
        windows = drop(schedule.micro_batches_before(step) // world, windows)
        return prefetch(windows, cfg, device, packing.largest, trainer.forward_sizes(step, world))

    batches = batches_from(start)
    freezes = gc.get_freeze_count() == 0  # compiling leaves objects that each full collection walks: frozen, skipped
    gc.collect()
    if freezes:
        gc.freeze()
    step_times = StepTimes(schedule)
    try:
        if diloco is not None:
            diloco.__enter__()
        run.start_clock()
        step = start
        while True:
            if step == total and diloco is not None:
                diloco.sync_every_fragment()
            if schedule.validates(step) and not (cfg.resume and step == start):  # a resumed step is logged
                run.validate(step, val_paths)
            periodic = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
            if cfg.save_checkpoint and step != start and (step == total or periodic):
                path = cfg.save_checkpoint if step == total else checkpoint_path_at(cfg.save_checkpoint, step)
                run.pause()
                save_checkpoint(path, model, optimizers, cfg, comm, device, step, run.progress(train_paths, diloco))
                log(f"checkpoint: {path} at step {step}")
                if comm.rank == 0:
                    tidy_checkpoints(cfg)
                run.start_clock()
            if step == total:
                break
            run.follow_window_history(step)
            set_hyperparameters(optimizers, schedule, step)
            if schedule.mtp_offsets > 1:
                model.set_mtp_weights(schedule.mtp_weights(step))
            if diloco is not None:
                diloco.step = step + 1  # what a peer healing from us during this step resumes at
            loss = train_step(model, optimizers, batches, schedule.windows(step), trainer.forwards(step, world))
            if diloco is not None and diloco.step != step + 1:  # healed from a peer inside this step
                skip = schedule.micro_batches_before(diloco.step) // world
                log(f"diloco: recovered weights and optimizer state from a peer; step {step + 1} -> {diloco.step}; "
                    f"the data goes on from this rank's micro-batch {skip}")
                step = diloco.step - 1
                batches.close()
                batches = batches_from(diloco.step)
            run.watch.push(step, loss)
            step += 1
            elapsed_ms = run.elapsed_ms()
            step_times[step] = elapsed_ms - run.previous_ms
            run.previous_ms = elapsed_ms
            log(f"step:{step}/{total} train_time:{elapsed_ms:.0f}ms step_avg:{elapsed_ms / step:.2f}ms")
            for reason in trainer.recompiles.new_reasons():
                log(f"warning: recompiled in the timed region at step {step}: {reason}")
        run.watch.flush()
    finally:
        batches.close()
        for optimizer in optimizers:
            optimizer.close()
        trainer.recompiles.close()
        if freezes:
            gc.unfreeze()
        if diloco is not None:
            diloco.close()
    return run.report(step_times)

# train_losses: per step, the mean over the ranks; val_losses: (step, loss)
TrainResult = collections.namedtuple("TrainResult", "train_losses val_losses train_time_ms")

class RunState:
    """The loop's state besides the model: clock, losses, window history."""

    def __init__(self, cfg: Config, comm: Comm, log, trainer: Trainer):
        self.cfg, self.comm, self.log, self.trainer, self.device = cfg, comm, log, trainer, trainer.device
        self.watch = LossWatch(comm, trainer.device)
        self.val_losses: list[tuple[int, float]] = []
        self.reported = 0  # training losses already averaged into a validation line
        self.history = self.clock = None  # history: the long windows the rotary tables follow
        self.train_time_ms = self.previous_ms = 0.0

    def pause(self):
        synchronize(self.device)
        self.train_time_ms += 1000 * (time.perf_counter() - self.clock)
        self.watch.flush()

    def start_clock(self):
        synchronize(self.device)
        self.clock = time.perf_counter()

    def elapsed_ms(self) -> float:
        return self.train_time_ms + 1000 * (time.perf_counter() - self.clock)

    def follow_window_history(self, step: int):
        history = self.trainer.schedule.long_window_history(step)
        if history != self.history:
            self.history = history
            self.trainer.model.rotary.set_window_history(history)

    def validate(self, step: int, val_paths: list[str]):
        model, schedule = self.trainer.model, self.trainer.schedule
        self.pause()
        seen = schedule.validation_step(step)
        if schedule.mtp_offsets > 1:
            model.set_mtp_weights([1.0])
        self.follow_window_history(seen)
        val_loss = evaluate(model, self.cfg, self.comm, val_paths, schedule.windows(seen), self.device,
                            self.trainer.packing.validation)
        self.val_losses.append((step, val_loss))
        recent = self.watch.losses[self.reported:]
        self.reported = len(self.watch.losses)
        canonical = canonical_text(model, self.cfg, self.comm, val_paths, schedule.windows(seen), self.device, val_loss)
        self.log(f"step:{step}/{schedule.total_steps} val_loss:{val_loss:.4f} train_time:{self.train_time_ms:.0f}ms "
                 f"step_avg:{self.train_time_ms / max(step, 1):.2f}ms"
                 + (f" train_loss:{sum(recent) / len(recent):.4f}" if recent else "") + canonical)
        self.start_clock()

    def progress(self, train_paths: list[str], diloco) -> dict:
        return dict(train_time_ms=self.train_time_ms, train_losses=self.watch.losses, reported=self.reported,
                    val_losses=self.val_losses, data=data_fingerprint(train_paths),
                    **({"diloco": diloco.state_dict()} if diloco is not None else {}))

    def restore(self, checkpoint: dict, diloco) -> int:
        model, optimizers = self.trainer.model, self.trainer.optimizers
        load_checkpoint_weights(model, checkpoint)
        scatter_optimizer_states(model, optimizers, checkpoint["muon"], checkpoint["adam"], self.comm, self.device)
        self.train_time_ms = self.previous_ms = checkpoint["train_time_ms"]
        self.watch.losses, self.reported = list(checkpoint["train_losses"]), checkpoint["reported"]
        self.val_losses = [tuple(entry) for entry in checkpoint["val_losses"]]
        if diloco is not None:
            diloco.load_state_dict(checkpoint["diloco"], checkpoint["step"])
        return checkpoint["step"]

    def report(self, step_times: StepTimes) -> TrainResult:
        log, comm, recompiles = self.log, self.comm, self.trainer.recompiles
        for reason in recompiles.new_reasons():
            log(f"warning: recompiled in the timed region: {reason}")
        log(f"graphs compiled in the timed region: {recompiles.since_warm_up()}")
        summaries = [step_times.summary()]
        if comm.distributed:  # a rank's pause shows on the others as waits
            own, summaries = summaries[0], [None] * comm.world_size
            dist.all_gather_object(summaries, own)
        for rank, lines in enumerate(summaries):
            for line in lines:
                log(line if rank == 0 else f"rank {rank}: {line}")
        if self.device.type == "cuda":
            log(f"peak memory allocated: {torch.cuda.max_memory_allocated() // 2**20} MiB "
                f"reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB")
        if bad := not_finite(self.trainer.model.state_dict()):
            raise TrainingDiverged(f"the final weights are not finite ({', '.join(bad[:3])})")
        log(weights_checksum(self.trainer.model))
        return TrainResult(self.watch.losses, self.val_losses, self.train_time_ms)

def evaluate_checkpoint(cfg: Config, comm: Comm, log) -> float:
    """--eval_only: --init_from's validation loss, as its run validated at its step."""
    checkpoint = read_checkpoint(cfg.init_from, "init_from")
    check_same_model(checkpoint, cfg, "init_from")
    val_paths = shard_paths(cfg.val_files, "val_files")
    model, device, packing = build_model(cfg, comm, log)
    load_checkpoint_weights(model, checkpoint)
    compile_model(model, cfg, model_graphs=False)
    windows = set_up_as_validated(model, checkpoint)
    val_loss = evaluate(model, cfg, comm, val_paths, windows, device, packing.validation)
    canonical = canonical_text(model, cfg, comm, val_paths, windows, device, val_loss)
    log(f"eval_only: {cfg.init_from} at step {checkpoint['step']} val_loss:{val_loss:.4f}{canonical} "
        f"({cfg.val_tokens} tokens of {cfg.val_files})")
    return val_loss

def set_up_as_validated(model: GPT, checkpoint: dict) -> tuple[int, int]:
    """Rotary tables and loss as validated at the checkpoint's step; returns its windows."""
    schedule = Schedule(config_from_dict(checkpoint["config"]))
    seen = schedule.validation_step(checkpoint["step"])
    model.rotary.set_window_history(schedule.long_window_history(seen))
    model.set_mtp_weights([1.0])
    return schedule.windows(seen)


# --------------------
# Checkpoints
#
# One torch.save file of whole tensors (it resumes at any world size), written by rank 0 through a rename. No random
# state: training draws none after the init. Loaded with weights_only=True: nothing in it runs code.

CHECKPOINT_KIND, CHECKPOINT_FORMAT = "train_gpt.py checkpoint", 3

class CheckpointError(UserError):
    pass

def model_fields(cfg: Config) -> dict:
    return {"vocab_size": cfg.vocab_size, **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                                             if f.metadata["group"] == "model"}}

def config_to_dict(cfg: Config) -> dict:
    return {f.name: format_value(getattr(cfg, f.name), f.name) if isinstance(getattr(cfg, f.name), tuple)
            else getattr(cfg, f.name) for f in dataclasses.fields(cfg)}

def config_from_dict(values: dict) -> Config:
    fields = {f.name: f for f in dataclasses.fields(Config)}
    return Config(**{name: parse_value(name, fields[name].type, value)
                     if isinstance(value, str) and fields[name].type != "str" else value
                     for name, value in values.items() if name in fields})

def checkpoint_path_at(path: str, step: int) -> str:
    base = Path(path)
    return str(base.with_name(f"{base.stem}_step{step:06d}{base.suffix or '.pt'}"))

def tidy_checkpoints(cfg: Config):
    """The newest keep_checkpoints periodic checkpoints stay, and one resumed; dead writers' temporaries go."""
    base = Path(cfg.save_checkpoint)
    periodic = sorted((p for p in base.parent.glob(f"{base.stem}_step{'[0-9]' * 6}{base.suffix or '.pt'}")
                       if not (cfg.resume and p.samefile(cfg.resume))), key=os.path.getmtime)
    for old in periodic[:-cfg.keep_checkpoints] if cfg.keep_checkpoints else []:
        old.unlink()
    for temporary in base.parent.glob(f".{base.stem}*.tmp"):  # write_atomically's .NAME.PID.tmp
        try:
            os.kill(int(temporary.name.split(".")[-2]), 0)  # its writer lives
        except ProcessLookupError:
            temporary.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            pass

def data_fingerprint(paths: list[str]) -> list[tuple[str, int]]:
    return [(os.path.basename(path), os.path.getsize(path)) for path in paths]

def _owner_state_everywhere(state: dict | None, owner: int, comm: Comm, device: torch.device) -> dict:
    if not comm.distributed:
        return detached_copy(state, "cpu")
    layout = [[(key, tuple(value.shape), value.dtype) for key, value in state.items()] if comm.rank == owner else None]
    dist.broadcast_object_list(layout, src=owner)
    full = {}
    for key, shape, dtype in layout[0]:
        tensor = state[key].contiguous() if comm.rank == owner else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=owner)
        full[key] = tensor.cpu().clone()
    return full

def gather_optimizer_states(model: GPT, optimizers, comm: Comm, device: torch.device) -> tuple[dict, dict]:
    """(Muon's, DistAdam's) whole state by parameter name, as at any world size."""
    names = {p: name for name, p in model.named_parameters()}
    muon, adam = optimizers
    muon_state = {}
    for group in muon.groups:
        for i, p in enumerate(group.params):
            owner = i // group.per_rank
            muon_state[names[p]] = _owner_state_everywhere(muon.state.get(p, {}) if comm.rank == owner else None,
                                                           owner, comm, device)
    adam_state = {}
    for bucket in adam.buckets:
        state = adam.state.get(bucket.params[0], {})
        first = {key: value for key, value in state.items() if not isinstance(value, Tensor)}  # "untied"
        if "step" in state:
            first["step"] = state["step"].item()
        adam_state[names[bucket.params[0]]] = first
        for key in (key for key in ("exp_avg", "exp_avg_sq") if key in state):
            flat = state[key]
            if comm.distributed:
                flat = state[key].new_empty(bucket.padded)
                all_gather_single(flat, state[key])
            for p, view in zip(bucket.params, bucket.views(flat)):
                adam_state.setdefault(names[p], {})[key] = view.cpu().clone()
    return muon_state, adam_state

def scatter_optimizer_states(model: GPT, optimizers, muon_state: dict, adam_state: dict, comm: Comm,
                             device: torch.device):
    names = {p: name for name, p in model.named_parameters()}
    muon, adam = optimizers
    muon.state.clear()
    for group in muon.groups:
        for p in group.owned(comm.rank):
            muon.state[p] = {key: value.to(device) for key, value in muon_state[names[p]].items()}
    adam.state.clear()
    for bucket in adam.buckets:
        saved = adam_state.get(names[bucket.params[0]], {})
        state = {key: value for key, value in saved.items() if key not in ("step", "exp_avg", "exp_avg_sq")}
        if "step" in saved:
            state["step"] = torch.tensor(float(saved["step"]), dtype=torch.float32, device=device)
            for key in ("exp_avg", "exp_avg_sq"):
                flat = bucket.flat([adam_state[names[p]][key].to(device) for p in bucket.params])
                state[key] = bucket.owned(flat, comm.rank).clone()
        if state:
            adam.state[bucket.params[0]] = state

def write_atomically(target: Path, write):
    """write(temporary), then a rename onto target: readers see the old file or the new."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        result = write(temporary)
        os.replace(temporary, target)
        return result
    finally:
        temporary.unlink(missing_ok=True)

def not_finite(tree: dict, prefix: str = "") -> list[str]:
    """Names of the tensors holding NaN or inf."""
    return [name for key, value in tree.items() for name in (
        not_finite(value, f"{prefix}{key}.") if isinstance(value, dict) else [prefix + key] if isinstance(value, Tensor)
        and value.is_floating_point() and not torch.isfinite(value).all() else [])]

def save_checkpoint(path: str, model: GPT, optimizers, cfg: Config, comm: Comm, device: torch.device, step: int,
                    progress: dict):
    muon_state, adam_state = gather_optimizer_states(model, optimizers, comm, device)
    if bad := not_finite(dict(model=model.state_dict(), muon=muon_state, adam=adam_state)):  # alike on every rank
        raise TrainingDiverged(f"at step {step} weights or optimizer state are not finite ({', '.join(bad[:3])}): "
                               f"{path} is not written, earlier checkpoints stay")
    if comm.rank == 0:
        checkpoint = dict(kind=CHECKPOINT_KIND, format=CHECKPOINT_FORMAT, step=step, config=config_to_dict(cfg),
                          model_settings=sorted(model_fields(cfg)), model=detached_copy(model.state_dict(), "cpu"),
                          muon=muon_state, adam=adam_state, **progress)
        write_atomically(Path(path), lambda temporary: torch.save(checkpoint, temporary))
    if comm.distributed:
        dist.barrier()

_scanned_checkpoints = set()  # (path, size, mtime): CRCs and values passed

def read_checkpoint(path: str, flag: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"--{flag}={path}: no such file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # mmap: ranks share pages
    except Exception as e:  # truncated, not torch, or refused by weights_only
        raise CheckpointError(f"--{flag}={path}: unreadable ({type(e).__name__}): truncated, damaged or not a "
                              "checkpoint of train_gpt.py; write it again or give another") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("kind") != CHECKPOINT_KIND:
        raise CheckpointError(f"--{flag}={path}: not a checkpoint of train_gpt.py")
    if checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"--{flag}={path}: checkpoint format {checkpoint.get('format')}, this code reads "
                              f"{CHECKPOINT_FORMAT}")
    key = (os.path.realpath(path), (stat := os.stat(path)).st_size, stat.st_mtime_ns)
    if key in _scanned_checkpoints:
        return checkpoint
    with zipfile.ZipFile(path) as archive:  # torch.save's zip: a CRC-32 for every record
        damaged = archive.testzip()
    if damaged:
        raise CheckpointError(f"--{flag}={path}: damaged ({damaged} fails its CRC-32); take an earlier checkpoint")
    if bad := not_finite({part: checkpoint[part] for part in ("model", "muon", "adam")}):
        raise CheckpointError(f"--{flag}={path}: holds values that are not finite ({', '.join(bad[:3])}); take an "
                              "earlier checkpoint")
    _scanned_checkpoints.add(key)
    return checkpoint

def check_same_model(checkpoint: dict, cfg: Config, flag: str):
    here = model_fields(cfg)
    # a model setting this code no longer has would be dropped by config_from_dict, its math silently lost
    gone = [f"{name}={checkpoint['config'][name]}" for name in checkpoint.get("model_settings", ()) if name not in here]
    if gone:
        raise CheckpointError(f"--{flag}={getattr(cfg, flag)}: the checkpoint's model has settings this train_gpt.py "
                              f"lacks ({', '.join(gone)}); use the code it was trained with (its log holds it)")
    saved = model_fields(config_from_dict(checkpoint["config"]))
    differing = [f"{name}={format_value(saved[name], name)} (here {format_value(value, name)})"
                 for name, value in here.items() if saved[name] != value]
    if differing:
        raise CheckpointError(f"--{flag}={getattr(cfg, flag)}: the checkpoint's model differs: "
                              + ", ".join(differing) + ("; pass the model flags it was trained with" if flag == "resume"
                                                        else "; leave those flags out: the checkpoint gives them"))

def check_resumable(checkpoint: dict, cfg: Config, train_paths: list[str]):
    check_same_model(checkpoint, cfg, "resume")
    here = data_fingerprint(train_paths)
    if [tuple(entry) for entry in checkpoint["data"]] != here:
        raise CheckpointError(f"--resume={cfg.resume}: it was trained on other data files ({len(checkpoint['data'])} "
                              f"shards, the first {tuple(checkpoint['data'][0])}) than --train_files ({len(here)}, "
                              f"the first {here[0]}); resume with the same shards")
    saved = checkpoint["config"]
    if cfg.diloco != ("diloco" in checkpoint):
        was = "with" if "diloco" in checkpoint else "without"
        raise CheckpointError(f"--resume={cfg.resume}: the checkpoint was written {was} --diloco=1; resume it {was} it")
    if cfg.diloco and (saved["sync_every"], saved["num_fragments"]) != (cfg.sync_every, cfg.num_fragments):
        raise CheckpointError(f"--resume={cfg.resume}: the checkpoint's DiLoCo replica synced with "
                              f"--sync_every={saved['sync_every']} --num_fragments={saved['num_fragments']} (here "
                              f"{cfg.sync_every} and {cfg.num_fragments}); resume with those")
    if checkpoint["step"] > (total := Schedule(cfg).total_steps):
        raise CheckpointError(f"--resume={cfg.resume}: the checkpoint is at step {checkpoint['step']}, past this "
                              f"run's {total} steps")

@torch.no_grad()
def load_checkpoint_weights(model: GPT, checkpoint: dict):
    """Into the existing tensors: graphs keep their addresses."""
    for name, tensor in model.state_dict().items():
        tensor.copy_(checkpoint["model"][name])


# --------------------
# Across nodes: streaming DiLoCo on torchft

LIGHTHOUSE_MISSING = "--diloco=1 needs TORCHFT_LIGHTHOUSE=http://host:port of a running torchft_lighthouse"
NO_CUDA = "--device=cuda, but torch sees no CUDA GPU; pass --device=cpu to run on the CPU"

def import_torchft():
    try:
        import torchft
        import torchft.local_sgd
    except ImportError as e:
        raise UserError(f"--diloco=1 needs torchft, which did not import ({e}): pip install torchft") from None
    return torchft

def diloco_fragments(model: GPT, count: int) -> list[nn.Module]:
    """`count` contiguous groups of blocks, input-side parts in the first, output-side in the last."""
    bounds = [round(i * len(model.blocks) / count) for i in range(count + 1)]
    fragments = [nn.Module() for _ in range(count)]
    for fragment, lo, hi in zip(fragments, bounds, bounds[1:]):
        fragment.blocks = nn.ModuleList(model.blocks[lo:hi])
    first, last = fragments[0], fragments[-1]
    for fragment, names in ((first, ("embed", "value_embeds", "longest_match", "bigram_embed")),
                            (last, ("lm_head", "mudd_layer", "mudd_head", "token_gates", "copy_pointer"))):
        for name in names:
            if getattr(model, name) is not None:
                fragment.add_module(name, getattr(model, name))
    for fragment, name in ((first, "smear_gate_w"), (first, "smear_scale"), (last, "skip_gate")):
        fragment.register_parameter(name, getattr(model, name))
    if sorted(id(p) for f in fragments for p in f.parameters()) != sorted(id(p) for p in model.parameters()):
        raise RuntimeError("DiLoCo fragments do not hold each model parameter exactly once")
    return fragments

def detached_copy(tree, device: torch.device | str | None = None):
    """Tensors cloned (to device), the rest as is; torchft may serve a checkpoint while training goes on."""
    if isinstance(tree, Tensor):
        return tree.detach().to(device, copy=True)  # device None: where it is
    if isinstance(tree, dict):
        return {key: detached_copy(value, device) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(detached_copy(value, device) for value in tree)
    return tree

class StreamingDiLoCo:
    """Streaming DiLoCo (Douillard et al., 2025) across torchrun jobs: every sync_every/num_fragments steps a
    fragment's quorum (a restarted replica heals), pseudogradient all-reduce and outer step."""

    def __init__(self, cfg: Config, model: GPT, optimizers: Optimizers, device: torch.device, log, manager=None):
        torchft = import_torchft()
        self.model, self.optimizers, self.log, self.sync_every = model, optimizers, log, cfg.sync_every
        self.step = 0  # the loop's position, sent to a healing peer
        self.manager = manager or self._manager(torchft, cfg, device)  # tests pass their own
        self.manager.register_state_dict_fn("default", self._load, self._save)
        self.heals = self.syncs = self.committed = 0
        self.fragments = diloco_fragments(model, cfg.num_fragments)
        self.outer = [torch.optim.SGD(f.parameters(), lr=cfg.outer_lr) for f in self.fragments]
        for index, opt in enumerate(self.outer):
            opt.register_step_post_hook(functools.partial(self._outer_step_hook, index))
        self.diloco = torchft.local_sgd.DiLoCo(
            self.manager, self.fragments, optimizers, self.outer, sync_every=cfg.sync_every, backup_device=device)
        self.outer_stepped, self.handles = None, []

    def _manager(self, torchft, cfg: Config, device: torch.device):
        from datetime import timedelta
        if not os.environ.get("TORCHFT_LIGHTHOUSE"):
            raise UserError(LIGHTHOUSE_MISSING)
        pg = torchft.ProcessGroupNCCL() if device.type == "cuda" else torchft.ProcessGroupGloo()
        connect = timedelta(seconds=float(os.environ.get("TORCHFT_CONNECT_TIMEOUT_SEC", 60)))
        try:
            return torchft.Manager(
                pg=pg, load_state_dict=None, state_dict=None, init_sync=False, min_replica_size=cfg.min_replicas,
                use_async_quorum=False, replica_id=f"train_gpt_{cfg.replica}", timeout=timedelta(seconds=60),
                quorum_timeout=timedelta(seconds=900), connect_timeout=connect)
        except RuntimeError as e:
            raise UserError(f"--diloco=1: no torchft lighthouse answered at TORCHFT_LIGHTHOUSE="
                            f"{os.environ['TORCHFT_LIGHTHOUSE']} ({str(e).splitlines()[0][:200]}); start "
                            "torchft_lighthouse there or fix the address") from None

    def _save(self) -> dict:
        return detached_copy({"model": self.model.state_dict(), "step": self.step, "sync_every": self.sync_every,
                              "optimizers": [opt.state_dict() for opt in self.optimizers]})

    def _load(self, state: dict):
        self.heals += 1
        self.model.load_state_dict(state["model"])
        for opt, opt_state in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(opt_state)
        self.step = state["step"] * self.sync_every // state["sync_every"]  # a peer's sync_every may differ

    def state_dict(self) -> dict:
        """What only this replica holds; taken with no all-reduce in flight (validate_config's checkpoint_every)."""
        return detached_copy({
            "manager": self.manager.state_dict(), "local_step": self.diloco._local_step,
            "fragments": [{"global_weights": f.original_parameters, "outer_optimizer": opt.state_dict()}
                          for f, opt in zip(self.diloco._fragments, self.outer)]}, "cpu")

    def load_state_dict(self, state: dict, step: int):
        self.manager.load_state_dict(state["manager"])
        self.diloco._local_step = state["local_step"]
        for fragment, opt, saved in zip(self.diloco._fragments, self.outer, state["fragments"]):
            for name, tensor in fragment.original_parameters.items():
                tensor.copy_(saved["global_weights"][name])
            opt.load_state_dict(saved["outer_optimizer"])
        self.step = step

    def __enter__(self):
        # ours run just before and after torchft's
        self.handles.append(self.optimizers.register_step_post_hook(self._before_sync_hook))
        self.diloco.__enter__()
        self.handles.append(self.optimizers.register_step_post_hook(self._after_sync_hook))
        return self

    def _outer_step_hook(self, fragment: int, *_):
        self.outer_stepped = fragment

    def _before_sync_hook(self, *_):
        self.outer_stepped = None

    def _after_sync_hook(self, *_):
        if self.diloco._local_step != 0:  # torchft zeroes its counter when a sync completes
            return
        self.syncs += 1
        committed = self.outer_stepped is not None  # the outer step runs only on a commit
        fragment = self.outer_stepped if committed else self.manager.current_step() % len(self.fragments)
        self.committed += committed
        # equal on every replica after a committed sync
        digest = sum(p.detach().double().sum() for p in self.fragments[fragment].parameters()).item()
        self.log(f"diloco: step {self.step} sync {self.syncs} fragment {fragment} "
                 f"{'committed' if committed else 'not committed, rolled back'} replicas "
                 f"{self.manager.num_participants()} digest {digest:.12e}")

    def sync_every_fragment(self):
        """After the last step: sync each fragment not just synced, then take the global weights."""
        count = len(self.fragments)
        for _ in range(count - 1):
            index = self.manager.current_step() % count
            fragment = self.diloco._fragments[index]
            self.manager.start_quorum()
            fragment.prepare_sync()
            committed = fragment.perform_sync()
            self.syncs += 1
            self.committed += committed
            self.log(f"diloco: final sync of fragment {index} {'committed' if committed else 'not committed'} "
                     f"replicas {self.manager.num_participants()}")
        for fragment in self.diloco._fragments:
            fragment.restore_parameters()

    def close(self):
        for handle in self.handles:
            handle.remove()
        self.diloco.__exit__(None, None, None)
        self.log(f"diloco: {self.syncs} fragment syncs ({self.committed} committed), {self.heals} heals")
        self.manager.shutdown(wait=False)


# --------------------
# Instrumentation

class RunLog:
    """Rank 0 writes log_dir/<run_id>.txt: source, environment, config, a line per step (for records/tool.py)."""

    def __init__(self, cfg: Config, comm: Comm):
        self.file = None
        if comm.rank:
            return
        os.makedirs(cfg.log_dir, exist_ok=True)
        self.path = os.path.join(cfg.log_dir, f"{cfg.run_id}.txt")
        self.file = open(self.path, "w", encoding="utf-8")
        source = Path(__file__).read_bytes()
        lines = source.decode("utf-8").splitlines()
        hardware = (torch.cuda.get_device_name() if cfg.device == "cuda"
                    else f"cpu ({platform.machine()}, {os.cpu_count()} cores)")
        self._write("\n".join([
            f"#### train_gpt.py log v{LOG_FORMAT_VERSION} run_id={cfg.run_id}",
            f"==== code train_gpt.py sha256={hashlib.sha256(source).hexdigest()} lines={len(lines)} ====", *lines,
            "==== end code ====", "==== environment ====", f"python: {sys.version.split()[0]}",
            f"torch: {torch.__version__}", f"triton: {getattr(triton, '__version__', 'not installed')}",
            f"hardware: {comm.world_size}x {hardware}", f"command: {' '.join([Path(sys.argv[0]).name] + sys.argv[1:])}",
            "==== config ====", "config: " + json.dumps(config_to_dict(cfg)),
            "==== training ===="]))
        print(f"logging to {self.path}", flush=True)

    def _write(self, text: str):
        self.file.write(text + "\n")
        self.file.flush()

    def __call__(self, text: str):
        if self.file is not None:
            print(text, flush=True)
            self._write(text)

    def finish(self, error: str = ""):
        if self.file is not None:
            self._write(f"{error}\n==== failed ====" if error else "==== end ====")
            self.file.close()
            self.file = None

class TrainingDiverged(UserError):
    pass

class LossWatch:
    """Each step's loss read a step late: its NaN check never stalls the GPU."""

    def __init__(self, comm: Comm, device: torch.device):
        self.comm, self.device, self.pending = comm, device, None
        self.losses: list[float] = []  # mean over the ranks, a step each

    def push(self, step: int, local_loss: Tensor):
        local = losses = local_loss.float().reshape(1)
        if self.comm.distributed:
            losses = local.new_empty(self.comm.world_size)
            all_gather_single(losses, local)
        host, event = losses, None
        if self.device.type == "cuda":
            host = torch.empty(losses.numel(), pin_memory=True).copy_(losses, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.flush()
        self.pending = (step, host, event)

    def flush(self):
        if self.pending is None:
            return
        (step, host, event), self.pending = self.pending, None
        if event is not None:
            event.synchronize()
        losses = host.tolist()
        bad = [rank for rank, loss in enumerate(losses) if not math.isfinite(loss)]
        if bad:
            raise TrainingDiverged(f"training diverged: loss is {losses[bad[0]]} at step {step + 1} on rank {bad[0]}")
        self.losses.append(sum(losses) / len(losses))

def compiled_graph_count() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])

class RecompileWatch:
    """Compiles after the warm-up (none should come): graphs, lazy backwards, CUDA graph recordings."""

    def __init__(self):
        from torch._dynamo.callback import CallbackTrigger, callback_handler
        self.handler, self.graphs = callback_handler, compiled_graph_count()
        self.after_warm_up = self.graphs
        self.runtime_triggers = {CallbackTrigger.LAZY_BACKWARD: "backward compiled lazily",
                                 CallbackTrigger.CUDAGRAPH_RECORDING: "CUDA graph recorded"}
        self.runtime_events, self.reported_events = [], 0
        self.handler.register_start_callback(self._on_runtime_compile)

    def _on_runtime_compile(self, args):
        what = self.runtime_triggers.get(args.callback_trigger)
        if what is not None:
            self.runtime_events.append(f"{what} for compiled graph {args.compile_id}")

    def close(self):
        self.handler.remove_start_callback(self._on_runtime_compile)

    def since_warm_up(self) -> int:
        return compiled_graph_count() - self.after_warm_up + len(self.runtime_events)

    def new_reasons(self) -> list[str]:
        reasons = self.runtime_events[self.reported_events:]
        self.reported_events, graphs, self.graphs = len(self.runtime_events), self.graphs, compiled_graph_count()
        new = [f"{self.graphs - graphs} new graph(s); TORCH_LOGS=recompiles names the failed guard"]
        return (new if self.graphs > graphs else []) + reasons

class StepTimes(dict):
    """Wall ms by step (the loss read a step late paces the host); summary() per stage: none should pass 1.2x median."""

    def __init__(self, schedule: Schedule):
        super().__init__()
        self.schedule = schedule

    def summary(self) -> list[str]:
        by_stage, lines = {}, []
        for step in self:
            by_stage.setdefault(self.schedule.stage(step - 1), []).append(step)
        for stage, steps in sorted(by_stage.items()):
            median, at = float(np.median([self[step] for step in steps])), max(steps, key=self.get)
            lines.append(f"step times, stage {stage}: {len(steps)} steps, median {median:.1f} ms, slowest "
                         f"{self[at]:.1f} ms at step {at} ({self[at] / median:.2f}x); "
                         f"{sum(self[step] > 1.2 * median for step in steps)} over 1.2x the median")
        return lines

def weights_checksum(model: nn.Module) -> str:
    total = squares = 0.0
    for p in model.parameters():
        as_double = p.detach().double()
        total, squares = total + as_double.sum().item(), squares + as_double.square().sum().item()
    return f"final weights: float64 sum {total:.12e}, sum of squares {squares:.12e}"


# --------------------
# main

def keep_freed_cpu_memory() -> bool:
    """glibc maps big buffers (the logits) afresh each step, faulting their pages in; CPU steps run faster from heap."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))

def init_distributed(cfg: Config) -> Comm:
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size not in (1, 2, 4, 8):
        raise UserError(f"world size {world_size} is not supported: run 1, 2, 4 or 8 processes (8 per node at most)")
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise UserError(NO_CUDA)
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible; start fewer "
                            "processes per node")
        torch.cuda.set_device(local_rank)
    if world_size > 1 or cfg.diloco:  # torchft's manager reaches torchrun's store through the process group
        if cfg.diloco and not os.environ.get("MASTER_ADDR"):
            raise UserError("--diloco=1: start each replica group with torchrun (torchft uses its store)")
        if cfg.device == "cuda":
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group("gloo")
    return Comm(rank, world_size, local_rank)

def check_inputs(cfg: Config):
    """--check: device, data and checkpoints, before anything compiles."""
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise UserError(NO_CUDA)
        check_gpu_features(cfg, torch.device("cuda", 0), choose_kernels(cfg, torch.device("cuda", 0)))
    train_paths = None if cfg.eval_only else shard_paths(cfg.train_files, "train_files", cfg.vocab_size)
    next(val_batches_for_rank(shard_paths(cfg.val_files, "val_files"), cfg, Comm()))
    if cfg.val_mask:
        read_val_mask(cfg)
    if cfg.resume:  # scanned once a process: the run's own read maps it, no more
        paths = train_paths or shard_paths(cfg.train_files, "train_files")
        check_resumable(read_checkpoint(cfg.resume, "resume"), cfg, paths)
    if cfg.init_from:
        check_same_model(read_checkpoint(cfg.init_from, "init_from"), cfg, "init_from")
    if cfg.diloco:
        import_torchft()
        if not os.environ.get("TORCHFT_LIGHTHOUSE"):
            raise UserError(LIGHTHOUSE_MISSING)

def main(argv: list[str] | None = None) -> int:
    comm = log = None
    try:
        cfg, flags = parse_cli(sys.argv[1:] if argv is None else argv)
        if "help" in flags:
            print(config_help())
            return 0
        check_inputs(cfg)
        if "check" in flags:
            print("ok: config, device and data files look right")
            return 0
        if cfg.device == "cpu":
            keep_freed_cpu_memory()
        comm = init_distributed(cfg)
        if not cfg.run_id:
            run_id = [str(uuid.uuid4())]
            if comm.distributed:  # all ranks agree on it
                dist.broadcast_object_list(run_id, 0)
            cfg = dataclasses.replace(cfg, run_id=run_id[0])
        log = RunLog(cfg, comm)
        if cfg.eval_only:
            evaluate_checkpoint(cfg, comm, log)
        else:
            train(cfg, comm, log)
        log.finish()
        return 0
    except UserError as e:
        # before the process group, every rank hits the same mistake: rank 0 says it
        if comm is not None or os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        if log is not None:
            log.finish(f"error: {e}")
        return 1
    except BaseException as e:
        if log is not None:
            log.finish(f"error: {type(e).__name__}: {e}")
        raise
    finally:
        if comm is not None and dist.is_initialized():
            gc.collect()  # DistAdam's gloo group goes now, not at exit
            dist.destroy_process_group()


# --------------------
# Appendix: Triton kernels and launchers, each with a plain-torch equivalent (--triton_kernels=0).

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
    jit = triton.jit
except ImportError:  # no Triton (e.g. macOS): the kernels stay plain functions, never launched
    triton = None

    def jit(fn):
        return fn

@jit
def _symmetric_matmul_kernel(X, Y, Out, M, K, sxb, sxm, sxk, syb, sym, syn, sob, som, son, alpha, beta,
                             HAS_Y: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """A lower-triangle tile of alpha X X^T (+ beta Y) and its mirror."""
    tile, batch = tl.program_id(0), tl.program_id(1)
    row = ((tl.sqrt(8.0 * tile + 1.0) - 1.0) / 2.0).to(tl.int32)
    row = tl.where((row + 1) * (row + 2) // 2 <= tile, row + 1, row)
    row = tl.where(row * (row + 1) // 2 > tile, row - 1, row)
    col = tile - row * (row + 1) // 2
    rows = row * BLOCK + tl.arange(0, BLOCK)
    cols = col * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    X += batch * sxb
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(X + rows[:, None] * sxm + (k0 + ks)[None, :] * sxk,
                    mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(X + cols[:, None] * sxm + (k0 + ks)[None, :] * sxk,
                    mask=(cols[:, None] < M) & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    acc *= alpha
    inside = (rows[:, None] < M) & (cols[None, :] < M)
    if HAS_Y:
        y = tl.load(Y + batch * syb + rows[:, None] * sym + cols[None, :] * syn, mask=inside, other=0.0)
        acc += beta * y.to(tl.float32)
    Out += batch * sob
    result = acc.to(Out.dtype.element_ty)
    tl.store(Out + rows[:, None] * som + cols[None, :] * son, result, mask=inside)
    if row != col:
        tl.store(Out + cols[None, :] * som + rows[:, None] * son, result, mask=inside)

if triton is not None:
    _symmetric_matmul_kernel = triton.autotune(
        [triton.Config(dict(BLOCK=b, BLOCK_K=k), num_warps=w, num_stages=st)
         for b, k, w, st in ((128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4), (128, 32, 8, 4))],
        key=["M", "K", "HAS_Y"])(_symmetric_matmul_kernel)

@jit
def _muon_apply_kernel(W, U, Scalars, N, DECAY: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < N
    w = tl.load(W + offsets, mask=inside)
    u = tl.load(U + offsets, mask=inside).to(tl.float32)
    if DECAY:
        w = w + tl.where(u * w >= 0, w, 0.0) * tl.load(Scalars + 1)
    tl.store(W + offsets, w + u * tl.load(Scalars), mask=inside)

# One MUFU instruction each, no range fix-ups; exact in the interpreter
@jit
def _ptx_f32(x, INSTRUCTION: tl.constexpr):
    return tl.inline_asm_elementwise(INSTRUCTION + " $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)

@jit
def _exp2_mufu(x, PTX: tl.constexpr):
    if PTX:
        return _ptx_f32(x, "ex2.approx.ftz.f32")
    else:
        return tl.exp2(x)

@jit
def _rcp_mufu(x, PTX: tl.constexpr):
    if PTX:
        return _ptx_f32(x, "rcp.approx.ftz.f32")
    else:
        return 1.0 / x

@jit
def _tanh_mufu(x, PTX: tl.constexpr):
    if PTX:
        return _ptx_f32(x, "tanh.approx.f32")
    else:
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0

@jit
def _exp2_on_fma_units(x):
    """2^x (x <= 15) on the FMA units, as FlashAttention-4."""
    x = tl.maximum(x, -125.0)
    shifted = x + 12582912.0
    frac = x - (shifted - 12582912.0)
    p = 1.0 + frac * (0.6932829280948685 + frac * (0.2422109718288663 + frac * 0.055008933087581535))
    bits = p.to(tl.int32, bitcast=True) + (shifted.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)

@jit
def _softcap_sigmoid(x, offset: tl.constexpr, divisor: tl.constexpr, PTX: tl.constexpr):
    return _rcp_mufu(1.0 + _exp2_mufu((x + offset) * (-1.4426950408889634 / divisor), PTX), PTX)

@jit
def _exp_z_minus_cap(x, cap: tl.constexpr, offset: tl.constexpr, divisor: tl.constexpr, PTX: tl.constexpr):
    return _exp2_mufu((_softcap_sigmoid(x, offset, divisor, PTX) - 1.0) * (cap * 1.4426950408889634), PTX)

@jit
def _scaled_softmax_grad(x, shift, one_hot, cap: tl.constexpr, offset: tl.constexpr, divisor: tl.constexpr,
                         PTX: tl.constexpr):
    """2^GRAD_EXP (w softmax(z) - one_hot 2^-GRAD_EXP) dz/dx, t = tanh((x + offset) / (2 divisor))."""
    t = _tanh_mufu((x + offset) * (0.5 / divisor), PTX)
    return ((_exp2_on_fma_units(t * (0.5 * cap * 1.4426950408889634) + shift) - one_hot)
            * ((cap / (4.0 * divisor)) * (1.0 - t * t)))

@jit
def _logaddexp(a, b):
    return tl.maximum(a, b) + tl.log(1.0 + tl.exp(-tl.abs(a - b)))

@jit
def _softcapped_ce_fp8_kernel(Logits, Targets, Weights, Loss, Grad, V, stride, period, LogCopy, LogSink, DCopy,
                              DSink, slot, cap: tl.constexpr, offset: tl.constexpr, divisor: tl.constexpr,
                              K: tl.constexpr, GRAD_EXP: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
                              PTX: tl.constexpr, COPY: tl.constexpr, FIRST: tl.constexpr):
    """A row per program: sum exp(z - cap) (z < cap: no running max), then the gradient times 2^GRAD_EXP.
    Loss: sum_k Weights[k] CE to token k + 1 ahead within `period` rows; COPY: the copy mixture's."""
    row = tl.program_id(0).to(tl.int64)
    Logits += row * stride
    Grad += row * V
    cols = tl.arange(0, BLOCK)
    tail_cols = tl.arange(0, TAIL)
    full = V // BLOCK * BLOCK
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, full, BLOCK):
        total += _exp_z_minus_cap(tl.load(Logits + start + cols).to(tl.float32), cap, offset, divisor, PTX)
    tail_total = tl.zeros([TAIL], dtype=tl.float32)
    for start in range(full, V, TAIL):
        inside = start + tail_cols < V
        x = tl.load(Logits + start + tail_cols, mask=inside, other=0.0).to(tl.float32)
        tail_total += tl.where(inside, _exp_z_minus_cap(x, cap, offset, divisor, PTX), 0.0)
    summed = tl.sum(total, axis=0) + tl.sum(tail_total, axis=0)
    lse = cap + tl.log(summed)
    position = row % period
    loss = 0.0
    weight = 0.0  # the softmax's weight
    lse_lm = lse
    q = 1.0  # d lse_lm / d lse
    q_less_1 = 0.0
    pointed = 1.0  # the LM's share of the next token's mixture
    gate_coef = 0.0
    if COPY:
        x_gate = tl.load(Logits + slot).to(tl.float32)
        gate = cap * _softcap_sigmoid(x_gate, offset, divisor, PTX)
        lse_lm = cap + tl.log(tl.maximum(summed - tl.exp(gate - cap), summed * 1e-7))
        q = tl.exp(lse - lse_lm)  # 1 / (1 - alpha)
        q_less_1 = tl.exp(gate - lse_lm)  # q - 1 from logs: no cancellation
        log_copy = tl.load(LogCopy + row)
        log_sink = tl.load(LogSink + row)
        kept = _logaddexp(lse_lm, gate + log_sink)
        sink_share = tl.exp(gate + log_sink - kept)
        w0 = tl.load(Weights)
        x_next = tl.load(Logits + tl.load(Targets + row)).to(tl.float32)
        from_lm = cap * _softcap_sigmoid(x_next, offset, divisor, PTX) - lse_lm + kept
        from_copy = gate + log_copy
        mixed = _logaddexp(from_lm, from_copy)
        pointed = tl.exp(from_lm - mixed)
        copied = tl.exp(from_copy - mixed)
        loss = w0 * (lse - mixed)
        weight = w0 * (1.0 + pointed * sink_share * q)
        gate_coef = -w0 * (pointed * sink_share * q + copied)
        tl.store(DCopy + row, -w0 * copied)
        tl.store(DSink + row, -w0 * pointed * sink_share)
    for k in tl.static_range(FIRST, K):
        inside_batch = position + k < period
        w = tl.where(inside_batch, tl.load(Weights + k), 0.0)
        x_target = tl.load(Logits + tl.load(Targets + row + k, mask=inside_batch, other=0)).to(tl.float32)
        loss += w * (lse_lm - cap * _softcap_sigmoid(x_target, offset, divisor, PTX))
        weight += w * q
        gate_coef -= w * q_less_1
    tl.store(Loss + row, loss)
    shift = (0.5 * cap - lse) * 1.4426950408889634 + tl.log2(weight) + GRAD_EXP
    for start in range(0, full, BLOCK):
        grad = _scaled_softmax_grad(tl.load(Logits + start + cols).to(tl.float32), shift, 0.0, cap, offset,
                                    divisor, PTX)
        tl.store(Grad + start + cols, grad.to(Grad.dtype.element_ty))
    for start in range(full, V, TAIL):
        inside = start + tail_cols < V
        x = tl.load(Logits + start + tail_cols, mask=inside, other=0.0).to(tl.float32)
        grad = _scaled_softmax_grad(x, shift, 0.0, cap, offset, divisor, PTX)
        tl.store(Grad + start + tail_cols, grad.to(Grad.dtype.element_ty), mask=inside)
    tl.debug_barrier()  # the targets' entries again, with -w: the barrier makes them land last
    for k in tl.static_range(K):
        inside_batch = position + k < period
        target = tl.load(Targets + row + k, mask=inside_batch, other=0)
        same = 0.0  # over offsets with this target
        for j in tl.static_range(K):
            inside_j = position + j < period
            amount = tl.load(Weights + j)
            if j == 0:
                amount = amount * pointed
            same += tl.where(inside_j & (tl.load(Targets + row + j, mask=inside_j, other=0) == target),
                             amount, 0.0)
        grad = _scaled_softmax_grad(tl.load(Logits + target).to(tl.float32), shift, same * 2.0 ** GRAD_EXP, cap,
                                    offset, divisor, PTX)
        tl.store(Grad + target, grad.to(Grad.dtype.element_ty), mask=inside_batch)
    if COPY:  # the gate, past the vocabulary, is no target
        grad = _scaled_softmax_grad(x_gate, shift, -gate_coef * 2.0 ** GRAD_EXP, cap, offset, divisor, PTX)
        tl.store(Grad + slot, grad.to(Grad.dtype.element_ty))

@jit
def _transpose_kernel(In, Out, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    tile = tl.load(In + rows[:, None].to(tl.int64) * N + cols[None, :], mask=inside)
    tl.store(Out + cols[:, None].to(tl.int64) * M + rows[None, :], tl.trans(tile), mask=tl.trans(inside))

@jit
def _copy_tile(q, K, Tokens, Docs, queries, keys, targets, documents, SCALE: tl.constexpr, BAND: tl.constexpr,
              D: tl.constexpr):
    k = tl.load(K + keys[:, None] * D + tl.arange(0, D)[None, :])
    s = tl.dot(q, tl.trans(k)) * SCALE
    back = queries[:, None] - keys[None, :]
    seen = (back >= 0) & (back < BAND) & (documents[:, None] == tl.load(Docs + keys)[None, :])
    hit = seen & (targets[:, None] == tl.load(Tokens + keys)[None, :])
    return s, seen, hit, k

@jit
def _copy_score_grads(s, seen, hit, log_z, log_hits, grad_z, grad_hits):
    p_z = tl.where(seen, tl.exp(tl.minimum(s - log_z[:, None], 0.0)), 0.0)
    p_hits = tl.where(hit, tl.exp(tl.minimum(s - log_hits[:, None], 0.0)), 0.0)
    return p_z * grad_z[:, None] + p_hits * grad_hits[:, None]

@jit
def _copy_scores_kernel(Q, K, Tokens, Targets, Docs, Sink, LogZ, LogHits, SCALE: tl.constexpr, BAND: tl.constexpr,
                        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """log_z (seen and sink) and log_hits of a query block."""
    start = tl.program_id(0) * BLOCK_M
    queries = start + tl.arange(0, BLOCK_M)
    q = tl.load(Q + queries[:, None] * D + tl.arange(0, D)[None, :])
    targets, documents = tl.load(Targets + queries), tl.load(Docs + queries)
    first_document = tl.load(Docs + start)
    max_z = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: no inf - inf
    sum_z = tl.zeros([BLOCK_M], tl.float32)
    max_hits, sum_hits = max_z, sum_z
    for key_start in range(tl.maximum(start - BAND, 0), start + BLOCK_M, BLOCK_N):
        if tl.load(Docs + key_start + BLOCK_N - 1) >= first_document:
            keys = key_start + tl.arange(0, BLOCK_N)
            s, seen, hit, _ = _copy_tile(q, K, Tokens, Docs, queries, keys, targets, documents, SCALE, BAND, D)
            s = s * 1.4426950408889634  # log2(e)
            new_z = tl.maximum(max_z, tl.max(tl.where(seen, s, -1e30), 1))
            sum_z = sum_z * tl.exp2(max_z - new_z) + tl.sum(tl.where(seen, tl.exp2(s - new_z[:, None]), 0.0), 1)
            new_hits = tl.maximum(max_hits, tl.max(tl.where(hit, s, -1e30), 1))
            sum_hits = (sum_hits * tl.exp2(max_hits - new_hits)
                        + tl.sum(tl.where(hit, tl.exp2(s - new_hits[:, None]), 0.0), 1))
            max_z, max_hits = new_z, new_hits
    seen_lse = (max_z + tl.log2(sum_z)) * 0.6931471805599453  # every query sees itself: sum_z >= 1
    tl.store(LogZ + queries, _logaddexp(seen_lse, tl.load(Sink + queries)))
    safe_sum = tl.where(sum_hits > 0, sum_hits, 1.0)
    tl.store(LogHits + queries, tl.where(sum_hits > 0, (max_hits + tl.log2(safe_sum)) * 0.6931471805599453, -1e9))

@jit
def _copy_scores_dq_kernel(Q, K, Tokens, Targets, Docs, LogZ, LogHits, GradZ, GradHits, DQ, SCALE: tl.constexpr,
                           BAND: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start = tl.program_id(0) * BLOCK_M
    queries = start + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    q = tl.load(Q + queries[:, None] * D + dims[None, :])
    targets, documents = tl.load(Targets + queries), tl.load(Docs + queries)
    log_z, log_hits = tl.load(LogZ + queries), tl.load(LogHits + queries)
    grad_z, grad_hits = tl.load(GradZ + queries), tl.load(GradHits + queries)
    first_document = tl.load(Docs + start)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    for key_start in range(tl.maximum(start - BAND, 0), start + BLOCK_M, BLOCK_N):
        if tl.load(Docs + key_start + BLOCK_N - 1) >= first_document:
            keys = key_start + tl.arange(0, BLOCK_N)
            s, seen, hit, k = _copy_tile(q, K, Tokens, Docs, queries, keys, targets, documents, SCALE, BAND, D)
            ds = _copy_score_grads(s, seen, hit, log_z, log_hits, grad_z, grad_hits)
            dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + queries[:, None] * D + dims[None, :], (dq * SCALE).to(DQ.dtype.element_ty))

@jit
def _copy_scores_dk_kernel(Q, K, Tokens, Targets, Docs, LogZ, LogHits, GradZ, GradHits, DK, T, SCALE: tl.constexpr,
                           BAND: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    key_start = tl.program_id(0) * BLOCK_N
    keys = key_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D)
    last_document = tl.load(Docs + key_start + BLOCK_N - 1)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    for start in range(key_start // BLOCK_M * BLOCK_M, tl.minimum(key_start + BLOCK_N + BAND, T), BLOCK_M):
        if tl.load(Docs + start) <= last_document:
            queries = start + tl.arange(0, BLOCK_M)
            q = tl.load(Q + queries[:, None] * D + dims[None, :])
            targets, documents = tl.load(Targets + queries), tl.load(Docs + queries)
            s, seen, hit, _ = _copy_tile(q, K, Tokens, Docs, queries, keys, targets, documents, SCALE, BAND, D)
            ds = _copy_score_grads(s, seen, hit, tl.load(LogZ + queries), tl.load(LogHits + queries),
                                   tl.load(GradZ + queries), tl.load(GradHits + queries))
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    tl.store(DK + keys[:, None] * D + dims[None, :], (dk * SCALE).to(DK.dtype.element_ty))

@jit
def _sorted_rows_add_kernel(Grads, SortedRows, Order, Out, T, dim, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    start = tl.program_id(0) * CHUNK
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    current = tl.load(SortedRows + start)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(CHUNK):
        j = start + i
        if j < T:
            row = tl.load(SortedRows + j)
            if row != current:
                tl.atomic_add(Out + current.to(tl.int64) * dim + cols, acc, mask=col_ok, sem="relaxed")
                acc = tl.zeros([BLOCK_D], dtype=tl.float32)
                current = row
            position = tl.load(Order + j).to(tl.int64)
            acc += tl.load(Grads + position * dim + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.atomic_add(Out + current.to(tl.int64) * dim + cols, acc, mask=col_ok, sem="relaxed")

@jit
def _gather_rows_kernel(Table, Indices, Out, T, dim, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    positions = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = (positions < T)[:, None] & (cols < dim)[None, :]
    rows = tl.load(Indices + positions, mask=positions < T, other=0).to(tl.int64)
    values = tl.load(Table + rows[:, None] * dim + cols[None, :], mask=inside)
    tl.store(Out + positions[:, None].to(tl.int64) * dim + cols[None, :], values.to(Out.dtype.element_ty), mask=inside)

@jit
def _relu2_epilogue(acc, post_desc, out_desc, row0, col0, GRAD: tl.constexpr):
    if GRAD:
        acc = acc * 2.0 * tl.sqrt(post_desc.load([row0, col0]).to(tl.float32))
    else:
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc
    out_desc.store([row0, col0], acc.to(out_desc.dtype))

@jit
def _relu2_matmul_kernel(a_desc, b_desc, out_desc, post_desc, M, N, K, GRAD: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, SPLIT: tl.constexpr, PROGRAMS: tl.constexpr):
    """Persistent programs, GROUP_M row blocks at a time; SPLIT=2: the epilogue in halves."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    half: tl.constexpr = BLOCK_N // 2
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
        first_m = (tile // per_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        row0 = (first_m + (tile % per_group) % group_rows) * BLOCK_M
        col0 = ((tile % per_group) // group_rows) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = tl.dot(a_desc.load([row0, k0]), b_desc.load([col0, k0]).T, acc)
        if SPLIT == 2:
            left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, half)), (0, 2, 1)))
            _relu2_epilogue(left, post_desc, out_desc, row0, col0, GRAD)
            _relu2_epilogue(right, post_desc, out_desc, row0, col0 + half, GRAD)
        else:
            _relu2_epilogue(acc, post_desc, out_desc, row0, col0, GRAD)

# One op name per module: the script and its import are two modules
@torch.library.custom_op(f"{__name__.replace('.', '_')}::relu2_matmul", mutates_args=())
def relu2_matmul(a: Tensor, b: Tensor, post: Tensor | None = None) -> Tensor:
    """relu(a @ b^T)^2, or given post (a @ b^T) * 2 sqrt(post)."""
    (M, K), N = a.shape, b.size(0)
    out = a.new_empty(M, N)
    block_m, block_n, block_k, group_m, split, warps, stages = RELU2_MM_CONFIG
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    programs = min(triton.cdiv(M, block_m) * triton.cdiv(N, block_n), sms)
    out_desc = TensorDescriptor.from_tensor(out, [block_m, block_n // split])
    _relu2_matmul_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [block_m, block_k]), TensorDescriptor.from_tensor(b, [block_n, block_k]),
        out_desc, TensorDescriptor.from_tensor(post, [block_m, block_n // split]) if post is not None else out_desc,
        M, N, K, GRAD=post is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        SPLIT=split, PROGRAMS=programs, num_warps=warps, num_stages=stages)
    return out

@relu2_matmul.register_fake
def _(a: Tensor, b: Tensor, post: Tensor | None = None) -> Tensor:
    return a.new_empty(a.size(0), b.size(0))

MUON_APPLY_BLOCK = 4096
CE_FP8_BLOCK, CE_FP8_WARPS, CE_FP8_TAIL = 16384, 16, 1024  # tuned on H100
COPY_FWD_BLOCKS, COPY_BWD_BLOCKS, COPY_WARPS = (128, 64), (64, 64), 8  # (BLOCK_M, BLOCK_N)
ROWS_CHUNK, ROWS_BLOCK_D, ROWS_WARPS = 64, 512, 4
RELU2_MM_CONFIG = (128, 256, 64, 8, 2, 8, 3)  # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT, warps, stages (H100)

def symmetric_matmul(X: Tensor, out: Tensor, alpha: float = 1.0, beta: float = 0.0, Y: Tensor | None = None):
    batch, M, K = X.shape
    tiles = lambda meta: (triton.cdiv(M, meta["BLOCK"]) * (triton.cdiv(M, meta["BLOCK"]) + 1) // 2, batch)
    Yt = Y if Y is not None else out
    _symmetric_matmul_kernel[tiles](
        X, Yt, out, M, K, *X.stride(), *Yt.stride(), *out.stride(), alpha, beta, HAS_Y=Y is not None)
    return out

def muon_apply_(weight: Tensor, update: Tensor, scalars: Tensor, decay: bool):
    """Muon._apply's ops on one fp32 matrix in one pass; no FMAs: bit-equal."""
    n = weight.numel()
    _muon_apply_kernel[(triton.cdiv(n, MUON_APPLY_BLOCK),)](
        weight, update, scalars, n, DECAY=decay, BLOCK=MUON_APPLY_BLOCK, enable_fp_fusion=False)

def transpose_fp8(x: Tensor, block_m: int = 64, block_n: int = 128, warps: int = 4) -> Tensor:
    """x^T: FP8 matmuls take K-major operands."""
    M, N = x.shape
    out = x.new_empty(N, M)
    _transpose_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
        x, out, M, N, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return out

def softcapped_ce_fp8(logits: Tensor, targets: Tensor, cap: tuple, losses: Tensor, grad: Tensor,
                      mtp: tuple | None = None, copy: tuple | None = None):
    """mtp = (weights summing to 1, period); copy = (gate column, log_copy, log_sink, d_copy, d_sink)."""
    rows, vocab = logits.shape
    weights, period = mtp if mtp is not None else (torch.ones(1, device=logits.device), rows)
    slot, log_copy, log_sink, d_copy, d_sink = copy if copy is not None else (0, losses, losses, losses, losses)
    _softcapped_ce_fp8_kernel[(rows,)](
        logits, targets, weights, losses, grad, vocab, logits.stride(0), period, log_copy, log_sink, d_copy, d_sink,
        slot, *cap, K=weights.numel(), GRAD_EXP=GRAD_E5M2_EXP, BLOCK=CE_FP8_BLOCK, TAIL=min(CE_FP8_TAIL, CE_FP8_BLOCK),
        PTX=logits.is_cuda, COPY=copy is not None, FIRST=int(copy is not None), num_warps=CE_FP8_WARPS)

class _CopyScores(torch.autograd.Function):
    """copy_log_probs' kernels; the backward recomputes the scores."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, sink: Tensor, tokens: Tensor, targets: Tensor, documents: Tensor,
                band: int) -> tuple[Tensor, Tensor]:
        T, d = q.shape
        log_z, log_hits = q.new_empty(T, dtype=torch.float32), q.new_empty(T, dtype=torch.float32)
        block_m, block_n = COPY_FWD_BLOCKS
        _copy_scores_kernel[(T // block_m,)](
            q, k, tokens, targets, documents, sink, log_z, log_hits, d ** -0.5, BAND=band, D=d, BLOCK_M=block_m,
            BLOCK_N=block_n, num_warps=COPY_WARPS)
        ctx.save_for_backward(q, k, sink, tokens, targets, documents, log_z, log_hits)
        ctx.band = band
        return log_hits - log_z, sink - log_z

    @staticmethod
    def backward(ctx, grad_copy: Tensor, grad_sink: Tensor):
        q, k, sink, tokens, targets, documents, log_z, log_hits = ctx.saved_tensors
        T, d = q.shape
        grad_copy, grad_sink = (g.float() if g is not None else torch.zeros_like(log_z) for g in (grad_copy, grad_sink))
        grad_z = -(grad_copy + grad_sink)  # log_copy = log_hits - log_z, log_sink = sink - log_z
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        block_m, block_n = COPY_BWD_BLOCKS
        args = (tokens, targets, documents, log_z, log_hits, grad_z, grad_copy)
        meta = dict(BAND=ctx.band, D=d, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=COPY_WARPS)
        _copy_scores_dq_kernel[(T // block_m,)](q, k, *args, dq, d ** -0.5, **meta)
        _copy_scores_dk_kernel[(T // block_n,)](q, k, *args, dk, T, d ** -0.5, **meta)
        return dq, dk, grad_sink + grad_z * torch.exp(sink - log_z), None, None, None, None

def gather_rows(table: Tensor, indices: Tensor, dtype: torch.dtype, use_triton: bool) -> Tensor:
    """table[indices] as dtype, converted as copied."""
    if not use_triton or dtype == table.dtype:
        return F.embedding(indices, table).to(dtype)
    T, dim = indices.numel(), table.size(1)
    out = table.new_empty(T, dim, dtype=dtype)
    _gather_rows_kernel[(triton.cdiv(T, 16), triton.cdiv(dim, 256))](
        table, indices, out, T, dim, BLOCK_T=16, BLOCK_D=256, num_warps=4)
    return out

def add_rows_(tables_grads: list[Tensor], indices: Tensor, row_grads: list[Tensor], use_triton: bool):
    """tables_grads[i][indices[t]] += row_grads[i][t]; the kernel sums equal sorted rows, then adds atomically."""
    if not use_triton:
        for grad, rows in zip(tables_grads, row_grads):
            grad.index_add_(0, indices, rows.to(grad.dtype))
        return
    sorted_rows, order = torch.sort(indices)
    T = indices.numel()
    for grad, rows in zip(tables_grads, row_grads):
        rows, dim = rows.contiguous(), rows.size(1)
        _sorted_rows_add_kernel[(triton.cdiv(T, ROWS_CHUNK), triton.cdiv(dim, ROWS_BLOCK_D))](
            rows, sorted_rows, order, grad, T, dim, CHUNK=ROWS_CHUNK, BLOCK_D=ROWS_BLOCK_D, num_warps=ROWS_WARPS)

class _FusedReLU2MLP(torch.autograd.Function):
    """relu(x @ fc_w^T)^2 @ proj_w, the activation and its derivative in matmul epilogues (speedrun 2025)."""

    @staticmethod
    def forward(ctx, x: Tensor, fc_w: Tensor, proj_w: Tensor) -> Tensor:
        post = relu2_matmul(x, fc_w)
        ctx.save_for_backward(x, fc_w, proj_w, post)
        return post @ proj_w

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, fc_w, proj_w, post = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_h = relu2_matmul(grad_y, proj_w, post)
        return grad_h @ fc_w, grad_h.t() @ x, post.t() @ grad_y

if __name__ == "__main__":
    sys.exit(main())
