"""Train a GPT-2-small-class model to a target FineWeb validation loss, as fast as one node allows.

    torchrun --standalone --nproc_per_node=8 train_gpt.py               # a record attempt
    python train_gpt.py --device=cpu --preset=tiny                      # a tiny run on the CPU
    python train_gpt.py --help                                          # every config field

One file, read top to bottom: config -> model -> comms -> optimizers -> data -> schedule -> logging ->
instrumentation -> checkpoints -> training loop -> DiLoCo -> main, then an appendix of Triton kernels. Importing it
runs nothing. The ideas (and many constants) come from the public NanoGPT speedrun
(github.com/KellerJordan/modded-nanogpt); comments credit them where they are used.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import gc
import glob
import hashlib
import itertools
import json
import logging
import math
import os
import platform
import queue
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import typing
import unicodedata
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256
LOG_FORMAT_VERSION = 1


# ----------------------------------------------------------------------------------------------------
# Config


class UserError(Exception):
    """Bad input (flag, value, file). main() prints it as one line and exits non-zero."""


# A Config field is `name: type = _<group>(default, "help")`: the helper of its group (_data, _run, ...) records the
# group and the one line of help that --help prints (config_help). A group's fields stand together, in CONFIG_GROUPS'
# order.
CONFIG_GROUPS = ("data", "run", "model", "optimizers", "speed switches", "DiLoCo")


def _config_field(group: str):
    def config_field(default, help: str):
        return dataclasses.field(default=default, metadata=dict(group=group, help=help))
    return config_field


_data, _run, _model, _optim, _speed, _diloco = map(_config_field, CONFIG_GROUPS)


@dataclass(frozen=True)
class Config:
    """Every setting of a run, each one a flag --name=value; `python train_gpt.py --help` lists them by group."""
    # ---- data
    train_files: str = _data("data/fineweb10B/fineweb_train_*.bin", "training shards, a glob")
    val_files: str = _data("data/fineweb10B/fineweb_val_*.bin", "validation shards, a glob")
    # the speedrun's value; the same in every run, so that validation losses compare
    val_tokens: int = _data(10_485_760, "tokens scored by each validation, a multiple of micro_batch_tokens")
    train_repeat: bool = _data(False, "start the training shards over when they run out (small corpora)")
    vocab_size: int = _data(50257, "tokenizer's vocabulary size (GPT-2's); the model pads it to a multiple of 128")
    bos_token: int = _data(50256, "token that starts every document of a shard (GPT-2's <|endoftext|>)")
    max_doc_len: int = _data(2048, "tokens kept of a document; the rest of a longer one is skipped")
    # The speedrun cuts documents shorter in its first stage (2026-02-10 record: 896, then 2048).
    doc_len_schedule: str = _data("896,2048,2048", "tokens kept of a document in each stage, each <= max_doc_len; "
                                                   "empty: max_doc_len throughout")
    # ---- run: schedule, validation, logging, seeds
    # 1270 scheduled steps, then 15 more (the speedrun's 2026-07 record): on bench2 this model ends lower in 15% fewer
    # steps than the 2026-02 record's set (--preset=record_2026_02) in all of its steps, and a schedule with an
    # extension ends lower than the same steps cooled down to their end (docs/performance.md)
    num_iterations: int = _run(1270, "scheduled steps: the stages split them and the lr cools down over them")
    extension_steps: int = _run(15, "further steps at the last stage's batch, the final lr and extension_windows")
    # batch: every micro-batch is micro_batch_tokens tokens, the unit of data and of the loss, and every
    # forward/backward packs the same number of them, so there is one compiled shape; the batch-size
    # schedule only changes how many micro-batches make a step.
    micro_batch_tokens: int = _run(16 * 1024, "tokens per micro-batch, a multiple of 128; each starts a document")
    # Schedules over equal stages of training (comma separated, one entry per stage):
    batch_schedule: str = _run("8,16,24", "micro-batches per step in each stage, summed over all ranks; multiples of 8")
    lr_schedule: str = _run("1.0,1.52,1.73", "lr multiplier of each stage: bigger batches take larger steps")
    window_schedule: str = _run("1:3,3:7,5:11", "short:long attention windows of each stage, in window_block tokens")
    # extension_windows: the speedrun's 2025-12 records
    extension_windows: str = _run("6:13", "short:long windows of the extension steps, in window_block tokens")
    final_windows: str = _run("6:20", "short:long windows of the final validation (YaRN extends the long one)")
    # The speedrun's code widens the final long window without rescaling its rotary tables (2026-07)
    final_yarn: bool = _run(True, "the final validation's longer window rescales the rotary tables (YaRN); 0: keeps them")
    window_block: int = _run(128, "tokens per unit of the attention windows")
    # --copy_pointer's reach, a run setting as the windows are: --eval_only can score a checkpoint at another band
    copy_band: int = _run(2048, "tokens back the copy pointer reaches, a multiple of 128")
    # The records cool down over 0.6 of the steps; 0.7 ended lower on two seeds on bench2 (docs/performance.md).
    cooldown_frac: float = _run(0.7, "last fraction of the scheduled steps, over which the lr decays linearly")
    # The lr floor of the speedrun's records since 2026-02 (0.15; 0.1 before)
    final_lr_frac: float = _run(0.15, "lr multiplier at the end of the cooldown, kept by the extension steps")
    val_loss_every: int = _run(250, "steps between validations; 0: validate only at the end")
    seed: int = _run(0, "seed of the initial weights and the warm-up's batches, not of the data order")
    run_id: str = _run("", "name of the run and of its log, log_dir/<run_id>.txt; empty: a fresh uuid")
    save_checkpoint: str = _run("", "file for the trained model, its optimizer state and its position; empty: none")
    checkpoint_every: int = _run(0, "steps between checkpoints beside save_checkpoint (<name>_stepNNNNNN.pt); 0: none")
    resume: str = _run("", "checkpoint to go on training from, at its step, as if never stopped")
    eval_only: bool = _run(False, "only validate the weights of --init_from on --val_files and --val_tokens")
    init_from: str = _run("", "checkpoint whose weights --eval_only validates or --sample continues text with")
    sample: str = _run("", "with --init_from: print a continuation of this prompt (GPT-2 BPE) and exit")
    sample_tokens: int = _run(64, "tokens --sample adds at most (it stops at a document's end)")
    temperature: float = _run(0.8, "softmax temperature of --sample; 0: always the likeliest token")
    log_dir: str = _run("logs", "folder of the logs")
    device: str = _run("cuda", "cuda | cpu (gloo, float32, no Triton)")
    # ---- model
    num_layers: int = _model(11, "transformer blocks")
    model_dim: int = _model(768, "width of the residual stream")
    num_heads: int = _model(6, "attention heads per layer; num_heads * head_dim = model_dim")
    head_dim: int = _model(128, "channels per attention head, a multiple of 4")
    mlp_ratio: int = _model(4, "MLP hidden width, in multiples of model_dim")
    attn_layout: str = _model("SSSLSS-SSSL", "one character per layer: S short window, L long window, - no attention")
    value_embed_layout: str = _model(
        ".01.....234", "one character per layer: the value-embedding table its values mix in, . for none")
    # Paired-head attention (speedrun 2026-01-07): the layer's heads h and h + num_heads/2 form one head over a
    # sequence of twice the length, (t, h) at position 2t and (t, h + num_heads/2) at 2t + 1, so each query sees
    # its partner head's keys too, over half the window in tokens.
    paired_head_layers: str = _model("0,2,5,9", "comma-separated layers whose heads attend in pairs; empty: none")
    # Learnable exclusive self-attention (Zhai 2025; the speedrun's 2026-04-29 record) on layers 1, 3, 4 and 7, as
    # the 2026-05-27 record has them beside its per-token gates
    xsa_layers: str = _model("1,3,4,7", "comma-separated layers with learned exclusive self-attention; empty: none")
    value_gate_reads_embed: bool = _model(True, "the value-embedding gate reads half its gate_dims inputs from the "
                                                 "value embedding")
    sublayer_scales: bool = _model(True, "attention and MLP each with residual and output scales; x0 and bigram "
                                          "after attention")
    attn_input_from: int = _model(7, "layers after this one attend to its output, not to their input; -1: none")
    # Dynamic dense connections (MUDD, Xiao et al. 2025, arXiv:2502.12170; the speedrun's 2026-04-22 record): two
    # small per-token MLPs of the residual stream mix earlier streams into the last layer (its values, its residual
    # and per-token versions of its sublayer scales) and into the residual before the head (in place of the backout).
    mudd: bool = _model(True, "dynamic dense connections into the last layer and the head; needs sublayer_scales")
    # The speedrun 2026-05-27 record's per-token gates (TokenGates): two small MLPs, of x0 and of the stream after layer skip_from,
    # give each layer's x0 and bigram scales, XSA strengths, the output gates of two layers and the skip's gate.
    token_gates: bool = _model(True, "per-token x0/bigram scales, XSA strengths, output and skip gates from two MLPs")
    skip_from: int = _model(3, "layer whose output is added, gated, to the input of layer skip_to")
    skip_to: int = _model(6, "layer whose input takes skip_from's output")
    # The head's logits x become cap * sigmoid((x + offset) / divisor) (speedrun 2024-11; 2025-12-26: 23, 5, 7.5).
    logit_softcap: float = _model(23.0, "cap of the head's soft-capped logits, at most 4 * logit_divisor")
    logit_offset: float = _model(5.0, "offset added to a logit inside the soft cap's sigmoid")
    logit_divisor: float = _model(7.5, "divisor of the offset logit inside the soft cap's sigmoid")
    # Multi-token prediction (speedrun 2025-12-22): per stage, separated by '/', the weights of the losses to the
    # tokens 1, 2, ... ahead, all from the same logits; "a>b" goes linearly from a to b over the stage; the
    # extension keeps the last stage's. The weights are normalised to sum to 1; validation is next-token only.
    mtp_schedule: str = _model("1,0.5,0.25>0/1,0.5>0/1",
                               "per-stage ('/') loss weights of the tokens 1, 2, ... ahead; a>b ramps; empty: off")
    # A copy pointer mixed into the next-token distribution (CPLM, the speedrun's pull request #379 of 2026-10-02):
    # one QK-normed head over the final hidden states puts mass on earlier tokens of the document, and the head's
    # first padding row is the logit of how much of the next token's probability goes to that pointer.
    copy_pointer: bool = _model(True, "mix a pointer over the document's earlier tokens into the next-token loss")
    # The token that followed the longest earlier repeat of the last 1 to 32 tokens in the document, as an input
    # (the speedrun's pull request #378 of 2026-10-02): its embedding, scaled by how long the repeat is and how
    # often it came before, enters at the input and again before the head.
    longest_match: bool = _model(True, "each token also reads the token after the longest earlier repeat of its "
                                        "last tokens")
    copy_sink_key: bool = _model(False, "the pointer's sink is a learned key each query scores, not one learned logit")
    # the speedrun's 2025-12 records: attn_scale, residual_init, value_embed_init_std and (2025-12-19) head_init_std
    attn_scale: float = _model(0.1, "softmax scale of the QK-normed heads; raised as the long window grows")
    residual_init: float = _model(1.1, "initial scale of the residual in each layer's input")
    head_init_std: float = _model(0.005, "std of the head's normal initialisation; 0: zeros")
    value_embed_init_std: float = _model(0.01, "std of the value-embedding tables' normal initialisation; 0: zeros")
    # 1: the speedrun's records add 2 sigmoid(gate) * value embedding to v unscaled (2026-01); 0.5 (--preset=plain):
    # the [0.5, 0.5] value lambdas of its records before 2026-01.
    value_embed_scale_init: float = _model(1.0, "initial learned scale of each layer's value embedding in v")
    # The speedrun's records scale each attention output projection by a learned scalar (init 1, Adam's scalars).
    attn_out_scale: bool = _model(True, "each attention output projection times a learned scalar, starting at 1")
    # The token embedding starts as a copy of the head and trains tied to it (one Adam update from the sum of both
    # gradients, with the head's settings) until untie_frac of the scheduled steps, then each goes on alone with a
    # copy of the shared Adam state (speedrun 2025-12-22).
    tie_embed: bool = _model(True, "the token embedding starts as the head and trains tied to it until untie_frac")
    untie_frac: float = _model(0.667, "fraction of the scheduled steps after which embedding and head train apart")
    # Per-token gates read from the first gate_dims channels of a layer's normed input (speedrun 2025-12-29 and
    # 2026-01): each attention head's output times sigmoid(.), each head's value embedding times 2 sigmoid(.), the
    # skip times 2 sigmoid(.) of the embedding's channels; all start as constants (zero weights).
    gates: bool = _model(True, "per-token gates on each head's output, each head's value embedding and the skip")
    gate_dims: int = _model(12, "leading channels of a layer's normed input that its gates read")
    # "Smear" (speedrun 2025-09): the gate reads the token's own first gate_dims channels; not across a document
    # start. Starts off (zero scale).
    smear: bool = _model(True, "each token's embedding adds a gated copy of the previous token's")
    # On the long-window layers each key's position-free half (the dims Rotary leaves unrotated) comes from the
    # previous token, not across a document or micro-batch start (speedrun 2025-12-14, "partial key offset").
    key_offset: bool = _model(True, "long-window layers take each key's unrotated half from the previous token")
    # "Backout" (speedrun 2025-12): the learned share starts at 0.5.
    backout_from: int = _model(7, "the head reads the residual minus a learned share of this layer's output; -1: off")
    # Hashed (previous token, token) embedding added to the residual stream (speedrun 2026-01-19).
    bigram_rows: int = _model(15 * 50304, "rows of the hashed (previous token, token) embedding table; 0: off")
    # The speedrun's 2026-05-20 record: a table 4x narrower and 3x longer, whose rows add into the first 192 channels,
    # each row times a fixed random +-1 vector picked by (previous token XOR token) mod 8192, so that bigrams sharing
    # a row pull it in decorrelated directions (the hashing trick's signs, Weinberger et al. 2009).
    bigram_dims: int = _model(192, "leading channels of the residual stream the bigram embedding adds into; 0: all")
    bigram_signs: int = _model(8192, "random +-1 vectors multiplying the bigram rows, picked per (previous token, "
                                     "token); 0: none")
    # The speedrun's pull request #375 (after DeepSeek's Engram): the bigram hash and its sign read each GPT-2 token's
    # class of tokens that differ only in case, accents and surrounding whitespace (" The", "THE" and "the" are one),
    # so that a row learns from every spelling of a pair.
    bigram_normalize: bool = _model(False, "hash bigrams of GPT-2 token classes (case, accents, spaces folded)")
    # ---- optimizers
    # Adam's groups (betas, weight decay multipliers: speedrun 2025-12 records): the value-embedding and bigram
    # tables ("table"), the token embedding, the head, and the scalars (adam_betas). Weight decay is cautious and
    # follows the lr squared: a decayed weight shrinks by lr^2 * adam_weight_decay * the group's multiplier a step.
    # Tied to the head (tie_embed), the token embedding takes the head's settings, also once untied; untied from
    # the start, the tables' lr and betas and no decay.
    adam_lr: float = _optim(0.008, "Adam's base lr, times each group's multiplier")
    adam_betas: tuple[float, float] = _optim((0.9, 0.99), "Adam betas of the scalars and gates")
    table_betas: tuple[float, float] = _optim(
        (0.75, 0.95), "Adam betas of the value and bigram tables (and the token embedding at tie_embed=0)")
    head_betas: tuple[float, float] = _optim(
        (0.5, 0.95), "Adam betas of the head (and the token embedding at tie_embed=1)")
    adam_eps: float = _optim(1e-10, "Adam's epsilon")
    # An average of the weights over the run's tail, blended into them before the final validation: of the embedding
    # and head (TailEMA, the speedrun's pull request #347: from step 848 of 1300, decay 0.9933, 65%), or of every
    # parameter (tail_ema_all). The speedrun's 2026-08-30 record blends such averages into all its matrices and then
    # scales each back to the norm it had before the blend (tail_ema_keep_norms): an average of weights that turned
    # over the tail is shorter than each of them.
    tail_ema_from: float = _optim(0.0, "fraction of the scheduled steps after which the tail average starts; 0: off")
    tail_ema_decay: float = _optim(0.9933, "per-step decay of the tail average")
    tail_ema_blend: float = _optim(0.65, "share of the tail average in the final weights")
    tail_ema_all: bool = _optim(False, "the tail average covers every parameter, not only the embedding and head")
    tail_ema_keep_norms: bool = _optim(False, "after the blend each matrix is scaled back to its norm before it")
    # The record's blends per kind of weight (TAIL_KIND_BLENDS): a slow (tail_ema_decay) and a fast average, each kind
    # its own shares of them; the value and output rows and the MLP end as averages only, the value tables as the fast.
    tail_ema_kinds: bool = _optim(False, "blend a slow and a fast tail average per kind of weight as the 2026-08-30 "
                                         "record does")
    tail_ema_fast_decay: float = _optim(0.9811, "per-step decay of the fast tail average (--tail_ema_kinds)")
    # The speedrun steps Adam on odd steps only, on two steps' gradients (since its 2025-09-30 record): half the
    # Adam updates and, on several GPUs, half its communication.
    adam_period: int = _optim(0, "Adam steps every this many steps, on their summed gradients; 0: 2, or 1 with --diloco")
    adam_weight_decay: float = _optim(0.005, "Adam's cautious weight decay, times lr^2 and the group's multiplier")
    table_wd_mul: float = _optim(5.0, "weight-decay multiplier of the value and bigram tables")
    head_wd_mul: float = _optim(150.0, "weight-decay multiplier of the head (and the token embedding at tie_embed=1)")
    embed_lr_mul: float = _optim(
        75.0, "lr multiplier of value and bigram tables (and the token embedding at tie_embed=0)")
    head_lr_mul: float = _optim(1.0, "lr multiplier of the head (and the token embedding at tie_embed=1)")
    scalar_lr_mul: float = _optim(5.0, "lr multiplier of the scalars (layer lambdas, skip, backout, smear scale)")
    copy_lr_mul: float = _optim(0.25, "lr multiplier of the copy pointer's projections and sink key (#379: 1)")
    # NorMuon (Li et al. 2025, arXiv:2510.05491; speedrun 2025-10-24): each orthogonalised update is rescaled per
    # row (or column: per entry of its longer side) by a second-moment estimate with this beta2, keeping its
    # Frobenius norm; 0 is plain Muon (--preset=plain pairs it with lr 0.06 and no shape lr, multiplier or decay).
    normuon_beta2: float = _optim(0.9, "NorMuon's second-moment beta2; 0: plain Muon")
    muon_qk_blocks: int = _optim(3, "row blocks Muon orthogonalises Q and K in, each (3: per head pair)")
    # The lr of a matrix is muon_lr, times sqrt(max(1, rows/cols)) of its (split) shape as stored with muon_shape_lr
    # (speedrun 2025-10-27), times muon_proj_lr_mul for the MLP's output projections (speedrun 2025-12-11).
    muon_lr: float = _optim(0.023, "Muon's lr of the hidden matrices")
    muon_shape_lr: bool = _optim(True, "scale a matrix's lr by sqrt(max(1, rows/cols))")
    muon_proj_lr_mul: float = _optim(2.0, "lr multiplier of the MLP's output projections")
    muon_momentum: float = _optim(0.95, "Muon's momentum between its warm-up and its cooldown")
    muon_momentum_start: float = _optim(0.85, "Muon's momentum at the first step and at the end")
    muon_momentum_warmup: int = _optim(300, "first steps, over which the momentum rises linearly to muon_momentum")
    muon_momentum_cooldown: int = _optim(50, "last steps, over which the momentum falls linearly to the start's")
    # The speedrun's 2026-08-30 record (ANVIL2's two rails): a slow momentum buffer runs beside the usual one from the
    # first step; from muon_slow_from of the scheduled steps on, the momentum the Nesterov step moves towards is
    # muon_slow_share of the slow buffer and the rest of the usual one, whose beta drops to muon_momentum_start.
    muon_slow_momentum: float = _optim(0.98, "beta of Muon's slow momentum buffer; 0: none")
    muon_slow_from: float = _optim(0.43, "fraction of the scheduled steps from which the slow buffer joins in")
    muon_slow_share: float = _optim(0.56, "the slow buffer's share of Muon's momentum once it joins in")
    # Cautious weight decay (Chen et al. 2025; speedrun 2025-11-10): where update and weight agree in sign the
    # weight shrinks by lr_eff * muon_weight_decay * lr each step, lr_eff the matrix's lr and lr its group's
    # scheduled one: the decay follows the lr squared.
    muon_weight_decay: float = _optim(1.2, "Muon's cautious weight decay, times the matrix's and the scheduled lr")
    # The speedrun's records reduce-scatter their gradients in bf16: half the bytes on the wire. Each rank's gradient
    # is rounded to bf16 before the average at every world size (one rank rounds it too), so 1, 2, 4 and 8 ranks
    # keep the same math up to the order of the bf16 sums.
    bf16_grad_comms: bool = _optim(False, "Muon's and Adam's gradients rounded to bf16 and reduce-scattered in it")
    # The forward reads the value and bigram tables only as rows cast to the compute dtype, so their all-gather can
    # travel in it (bf16 on GPUs: half of the Adam all-gathers' bytes) and every rank still runs the one-rank forward.
    bf16_table_gathers: bool = _optim(False, "Adam all-gathers the value and bigram tables in the compute dtype (bf16)")
    # The speedrun's pull request #371: the head's weight gradient from every 4th token row, times 4, an unbiased
    # estimate for a quarter of its matmul and of the FP8 gradient's transpose.
    head_wgrad_rows: int = _optim(1, "the FP8 head's weight gradient from every this-many-th token row, scaled to match")
    # ---- speed switches
    compile: bool = _speed(True, "torch.compile the model, over compile_scope")
    # Muon's compute between its collectives and its weight update replayed as CUDA graphs (CapturedSteps): the host
    # issues Muon's step in under 1 ms instead of its hundreds of launches. auto takes them on several GPUs, where the
    # host's launches set the step; on one GPU they were no faster (docs/performance.md).
    muon_graphs: str = _speed("auto", "Muon's compute as CUDA graphs: 1, 0 (kernel by kernel), "
                                      "auto (1 on several CUDA ranks)")
    # auto: see compile_model for why whole. split: two graphs, layers before split_layer and the rest, so that the
    # second one's backward ends before the first one's and its gradients' reduce-scatters overlap the first one.
    compile_scope: str = _speed("auto", "whole | split (two graphs) | regional (each block and the loss head) | auto (whole)")
    split_layer: int = _speed(0, "first layer of the second of --compile_scope=split's graphs; 0: num_layers // 2")
    compile_cache: str = _speed("", "file of torch's compile artifacts, loaded before the warm-up, saved after it")
    # max-autotune-no-cudagraphs: inductor benchmarks Triton GEMM templates against cuBLAS and fuses pointwise
    # epilogues into the winners (a much longer cold compile); reduce-overhead: the compiled forward and backward
    # replay as CUDA graphs, no per-kernel launch cost on the host (every graph recorded after the warm-up is logged
    # as a warning). auto: see resolve_compile_mode.
    compile_mode: str = _speed(
        "auto", "auto (CUDA graphs where they pay: resolve_compile_mode) | default | reduce-overhead | max-autotune*")
    # Up to about 1% faster steps on one H100 for minutes of a cold start (244 s of 315 at the defaults on 4 GPUs), so
    # auto tunes only where the result is kept for the next start: in --compile_cache's file, which holds the tuned
    # configs (docs/performance.md).
    tune_kernels: str = _speed("auto", "coordinate-descent tuning of inductor's Triton kernels (CUDA): 1, 0, auto "
                                       "(with --compile_cache)")
    attn_backend: str = _speed("auto", "auto (fa3 if it imports, else flex on CUDA; sdpa on CPU) "
                                       "| fa3 | flex | sdpa")
    triton_kernels: bool = _speed(True, "Triton kernels for Newton-Schulz, the loss and the MLP (CUDA); 0: plain torch")
    # e4m3 activations and weights, e5m2 logit gradients, scaled per tensor (speedrun 2024-12 idea, scales ours):
    # Hopper runs them at about twice the bf16 rate, and validation goes through the same FP8 forward. CPUs run the
    # same quantised arithmetic in plain torch.
    fp8_head: bool = _speed(True, "the head's three matmuls in FP8; a GPU needs compute capability 8.9+")
    # The MLP's ReLU^2 in the epilogues of two Triton matmuls (_FusedReLU2MLP), on CUDA with triton_kernels; 0: cuBLAS
    # matmuls and inductor's elementwise kernels (A/B).
    fused_mlp: bool = _speed(True, "the MLP as two Triton matmuls with ReLU^2 fused; needs compute capability 9.0+")
    # The embedding tables (token, value, bigram) through _RowLookup, instead of a dense [rows, dim] gradient per
    # forward plus a dense accumulation; the lookups then run outside the compiled graph, and steps are faster
    # (docs/performance.md).
    row_embedding_grads: bool = _speed(
        True, "embedding tables add only the rows a forward touched into their .grad; 0: dense")
    sparse_bigram_comms: bool = _speed(True, "the bigram table's gradient rows travel sparsely between ranks")
    # The value tables are read only at the step's tokens, so only those rows of their gradients are nonzero: sent
    # to their owners as the bigram table's are, 4-7x fewer bytes than dense reduce-scatters at 4 ranks on bench2
    # (bench/comm_model.py). Off until a repeat at 4 or 8 GPUs: one run on 4xH200 (docs/performance.md).
    sparse_value_comms: bool = _speed(False, "the value tables' gradient rows travel sparsely between ranks")
    # Between two Adam updates a rank's forwards read the value tables at their tokens and the bigram table at their
    # bigram rows only: at 4 ranks on bench2 a tenth of the rows the dense all-gathers deliver, at 8 ranks a
    # sixteenth (bench/comm_model.py). So after an update each rank takes from the owners just the rows its forwards
    # read until the next one, listed by the loader ahead (DistAdam's fetch_tables); the same values, fewer bytes.
    # Not where whole tables are read between updates (fetches_table_rows).
    table_row_fetch: bool = _speed(True, "after an Adam update, only the value and bigram table rows read until the "
                                          "next travel")
    # auto: per stage, the most (up to 8 on a GPU of at least PACK_8_MIN_GIB, else 4) that divides the stage's
    # micro-batches per rank (resolve_packing). Each micro-batch starts a document and its positions, so a packed
    # forward computes the same losses. Fewer, larger kernels make each step faster, for about 7 GiB more memory
    # per packed micro-batch (docs/performance.md).
    forward_micro_batches: int = _speed(0, "micro-batches of one rank packed into each forward/backward, in every "
                                           "stage; 0: auto, per stage")
    # ---- DiLoCo: across nodes, streaming DiLoCo on torchft (README: "Training across nodes")
    diloco: bool = _diloco(False, "train replica groups that sync rarely (streaming DiLoCo on torchft)")
    diloco_replicas: int = _diloco(2, "replica groups in the run; each reads its own share of the data")
    replica: int = _diloco(0, "this group's index, 0 .. diloco_replicas-1")
    # On the CPU benchmark 8 costs 0.005 nats against data parallelism, 16 0.025, 32 0.056 (docs/performance.md).
    sync_every: int = _diloco(8, "inner steps between two syncs of a fragment; may differ per replica (README)")
    num_fragments: int = _diloco(2, "contiguous groups of blocks, synced in turn")
    fragment_sync_delay: int = _diloco(0, "inner steps between launching a fragment's all-reduce and applying it")
    fragment_update_alpha: float = _diloco(0.0, "after a sync the fragment is (1 - alpha) * global + alpha * local")
    # The new global weights are (1 - outer_lr) * global + outer_lr * the replicas' mean (momentum 0). At speedrun
    # lengths (syncs every 8 steps) 0.7 without momentum comes within 0.03 nats of data parallelism, the Streaming
    # DiLoCo paper's 0.7 with Nesterov 0.9 0.24 behind, and a constant outer lr beats one that cools down with the
    # inner lr (bench/bench_diloco_quality.py, docs/performance.md).
    outer_lr: float = _diloco(0.7, "lr of the outer SGD step on a fragment's averaged pseudogradient; 1: plain mean")
    outer_momentum: float = _diloco(0.0, "Nesterov momentum of the outer SGD step")
    min_replicas: int = _diloco(1, "a sync commits only with at least this many replicas in the quorum")

    # The list-valued fields, parsed once, when first read (validate_config reads each, so a bad one fails there).
    @functools.cached_property
    def stage_batches(self) -> list[int]:
        return _parse_stage_list(self, "batch_schedule", int)

    @functools.cached_property
    def stage_lr_multipliers(self) -> list[float]:
        return _parse_stage_list(self, "lr_schedule", float)

    @functools.cached_property
    def stage_window_blocks(self) -> list[tuple[int, int]]:
        """(short, long) windows of each stage, in window_block units."""
        return _parse_stage_list(self, "window_schedule", _parse_window_pair)

    @functools.cached_property
    def final_window_blocks(self) -> tuple[int, int]:
        return _parse_one_window_pair(self, "final_windows")

    @functools.cached_property
    def extension_window_blocks(self) -> tuple[int, int]:
        return _parse_one_window_pair(self, "extension_windows")

    @functools.cached_property
    def stage_doc_lens(self) -> list[int]:
        """Tokens kept of a training document in each stage."""
        if not self.doc_len_schedule:
            return [self.max_doc_len] * len(self.stage_batches)
        return _parse_stage_list(self, "doc_len_schedule", int)

    @functools.cached_property
    def mtp_stages(self) -> list[list[tuple[float, float]]]:
        """Per stage, per offset, the multi-token weights (at the stage's start, at its end); next-token only
        when --mtp_schedule is empty."""
        return parse_mtp_schedule(self.mtp_schedule) if self.mtp_schedule else [[(1.0, 1.0)]]

    @functools.cached_property
    def paired_layers(self) -> list[int]:
        return parse_layer_list(self, "paired_head_layers")

    @property
    def front_layers(self) -> int:
        """Layers in the first of --compile_scope=split's graphs (GPT.trunk_front), at least 1."""
        return self.split_layer or max(1, self.num_layers // 2)

    @functools.cached_property
    def xsa_layer_list(self) -> list[int]:
        return parse_layer_list(self, "xsa_layers")

# The defaults until 2026-11-26: the ideas of the speedrun's record of 2026-02-06 and its 1515 + 40 steps, without the
# later records' ideas (2026-02-10 to 2026-08-30), the copy pointer and the longest match (pull requests #379 and #378)
# that are defaults now, for A/B runs against them, e.g. bench/ml_bench.sh "" "--preset=record_2026_02".
RECORD_2026_02 = dict(
    num_iterations=1515, extension_steps=40, cooldown_frac=0.55, final_lr_frac=0.1, doc_len_schedule="",
    value_gate_reads_embed=False, value_embed_init_std=0.0, value_embed_layout="01......234", normuon_beta2=0.95,
    sublayer_scales=False, attn_input_from=-1, xsa_layers="", muon_qk_blocks=1, bigram_rows=5 * 50304, bigram_dims=0,
    bigram_signs=0, mudd=False, token_gates=False, copy_pointer=False, longest_match=False, muon_slow_momentum=0.0,
)

PRESETS = {
    # A model small enough to train on two CPU processes in seconds, for tests and laptops. It keeps the 2026-02
    # record's set: the later records name layers and head pairs of the full model (XSA's layers, layer 7's output,
    # Q and K blocks of head pairs), and the pointer, the longest match and MUDD would slow every CPU test; the tests
    # turn each on where they test it.
    "tiny": {**RECORD_2026_02, **dict(
        num_layers=4, model_dim=64, num_heads=2, head_dim=32, attn_layout="SLSL", value_embed_layout="0..1",
        skip_from=1, skip_to=2, backout_from=2, paired_head_layers="0,2", micro_batch_tokens=256, max_doc_len=256,
        window_block=16,
        batch_schedule="8,8,16", window_schedule="1:2,2:4,3:6", final_windows="4:8",
        num_iterations=24, extension_steps=0, val_loss_every=8, val_tokens=2048, compile=False,
        muon_momentum_warmup=8, muon_momentum_cooldown=4, bigram_rows=4096,
        fp8_head=False,  # a CPU only emulates FP8, at about twice the test time; tests turn it on where needed
        # Packing pays on GPUs; SDPA's dense mask grows with the square of the forward's length (tests pack on purpose)
        forward_micro_batches=1,
    )},
    "record_2026_02": RECORD_2026_02,
}

# The defaults before 2026-11-25, without most of the speedrun 2026-02 record's ideas (plain Muon at lr 0.06; no
# gates, smear, backout, tied embedding, multi-token loss, key offset, paired heads or output scale; Adam on every
# step), for A/B runs, e.g. bench/ml_bench.sh "" "--preset=plain" (docs/performance.md compares the two). PLAIN holds
# what it changes in the 2026-02 set (the tests put it on the tiny model).
PLAIN = dict(
    normuon_beta2=0.0, muon_lr=0.06, muon_shape_lr=False, muon_proj_lr_mul=1.0, muon_weight_decay=0.0,
    gates=False, smear=False, backout_from=-1, value_embed_init_std=1.0, tie_embed=False, key_offset=False,
    mtp_schedule="", logit_softcap=30.0, logit_offset=0.0, logit_divisor=7.5, adam_period=1, paired_head_layers="",
    attn_out_scale=False, value_embed_scale_init=0.5,
)
PRESETS["plain"] = {**RECORD_2026_02, **PLAIN}

CLI_ONLY_FLAGS = ("preset", "check", "help")
COMPILE_MODES = ("auto", "default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead")
CUDA_GRAPH_MODES = ("max-autotune", "reduce-overhead")  # inductor replays CUDA graphs in these


def _parse_value(kind, text: str):
    if kind is bool or kind == "bool":
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected true/false/1/0")
    if kind in (int, "int"):
        return int(text.replace("_", ""))
    if kind in (float, "float"):
        return float(text)
    if kind in (str, "str"):
        return text
    # the only tuple field type: two floats, written "a,b"
    parts = [float(p) for p in text.split(",")]
    if len(parts) != 2:
        raise ValueError("expected two comma-separated numbers")
    return tuple(parts)


def parse_cli(argv: list[str]) -> tuple[Config, dict]:
    """`--name=value` overrides on top of an optional `--preset=NAME`. Returns (config, cli-only flags)."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    valid = ", ".join(list(fields) + list(CLI_ONLY_FLAGS))
    overrides, flags = {}, {}
    for arg in argv:
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument {arg!r}: arguments take the form --name=value")
        name, has_value, text = arg[2:].partition("=")
        if name in CLI_ONLY_FLAGS:
            flags[name] = text if has_value else "1"
            continue
        if name not in fields:
            raise UserError(f"unknown option --{name}. Valid options: {valid}")
        if not has_value:
            raise UserError(f"--{name} needs a value: --{name}=VALUE")
        kind = fields[name].type
        try:
            overrides[name] = _parse_value(kind, text)
        except ValueError as e:
            raise UserError(f"bad value for --{name}: {text!r} ({e}; the field is {kind})") from None
    values = {}
    if "preset" in flags:
        if flags["preset"] not in PRESETS:
            raise UserError(f"unknown --preset={flags['preset']}. Presets: {', '.join(PRESETS)}")
        values.update(PRESETS[flags["preset"]])
    values.update(overrides)
    cfg = Config(**values)
    validate_config(cfg)
    return cfg, flags


def _parse_stage_list(cfg: Config, name: str, parse) -> list:
    text = getattr(cfg, name)
    try:
        return [parse(item) for item in text.split(",")]
    except ValueError:
        raise UserError(f"bad --{name}={text!r}: see --help for its form") from None


def parse_mtp_schedule(text: str) -> list[list[tuple[float, float]]]:
    """'1,0.5,0.25>0/1,0.5>0/1' -> per stage, per offset, (weight at the stage's start, weight at its end)."""
    try:
        return [[(float(w.split(">")[0]), float(w.split(">")[-1])) for w in stage.split(",")] for stage in text.split("/")]
    except ValueError:
        raise UserError(f"bad --mtp_schedule={text!r}: weights separated by ',', stages by '/', a ramp as a>b") from None


def resolved_adam_period(cfg: Config) -> int:
    """--adam_period, where 0 means 2 (the speedrun's), or 1 under DiLoCo, whose syncs and heals land between
    any two steps."""
    return cfg.adam_period or (1 if cfg.diloco else 2)


def parse_layer_list(cfg: Config, name: str) -> list[int]:
    """A comma-separated list of layer indices, e.g. --paired_head_layers=0,2,5,9; empty: none."""
    text = getattr(cfg, name)
    try:
        layers = [int(item) for item in text.split(",")] if text else []
    except ValueError:
        raise UserError(f"bad --{name}={text!r}: use comma-separated layer indices, e.g. 0,2,5") from None
    if any(not 0 <= i < cfg.num_layers for i in layers) or len(set(layers)) != len(layers):
        raise UserError(f"--{name}={text!r}: use distinct layers 0 .. num_layers-1 ({cfg.num_layers - 1})")
    return layers


def _parse_window_pair(item: str) -> tuple[int, int]:
    short, long = item.split(":")
    return int(short), int(long)


def _parse_one_window_pair(cfg: Config, name: str) -> tuple[int, int]:
    pairs = _parse_stage_list(cfg, name, _parse_window_pair)
    if len(pairs) != 1:
        raise UserError(f"bad --{name}={getattr(cfg, name)!r}: one short:long pair")
    return pairs[0]


def fetches_table_rows(cfg: Config) -> bool:
    """--table_row_fetch where it applies: DiLoCo's syncs and a tail average of the value tables read the whole
    tables between Adam's updates, so those runs gather them whole."""
    return cfg.table_row_fetch and not cfg.diloco and not (cfg.tail_ema_from and (cfg.tail_ema_all or cfg.tail_ema_kinds))


def validate_config(cfg: Config) -> None:
    def need(ok: bool, message: str):
        if not ok:
            raise UserError(message)

    need(cfg.device in ("cuda", "cpu"), f"--device={cfg.device}: use cuda or cpu")
    # FP8 matmuls need the sampled rows (their reduced dimension) in multiples of 16
    need(cfg.head_wgrad_rows >= 1 and cfg.micro_batch_tokens % (16 * cfg.head_wgrad_rows) == 0,
         f"--head_wgrad_rows={cfg.head_wgrad_rows}: --micro_batch_tokens={cfg.micro_batch_tokens} must be a multiple of "
         f"16 times it")
    need(cfg.head_wgrad_rows == 1 or cfg.fp8_head, f"--head_wgrad_rows={cfg.head_wgrad_rows} needs --fp8_head=1")
    need(cfg.tune_kernels in ("auto", "1", "0"), f"--tune_kernels={cfg.tune_kernels}: use auto, 1 or 0")
    need(cfg.attn_backend in ("auto", "fa3", "flex", "sdpa"), f"--attn_backend={cfg.attn_backend}: use auto, fa3, flex or sdpa")
    need(cfg.compile_scope in ("auto", "whole", "split", "regional"),
         f"--compile_scope={cfg.compile_scope}: use auto, whole, split or regional")
    need(0 <= cfg.split_layer < cfg.num_layers,
         f"--split_layer={cfg.split_layer}: use a layer 1 .. num_layers-1 ({cfg.num_layers - 1}), or 0 for num_layers // 2")
    need(cfg.compile_mode in COMPILE_MODES, f"--compile_mode={cfg.compile_mode}: use {', '.join(COMPILE_MODES)}")
    need(cfg.muon_graphs in ("auto", "1", "0"), f"--muon_graphs={cfg.muon_graphs}: use auto, 1 or 0")
    need(not (cfg.muon_graphs == "1" and cfg.device != "cuda"),
         f"--muon_graphs=1 needs --device=cuda (CUDA graphs); on {cfg.device} pass --muon_graphs=0 or auto")
    need(len(cfg.attn_layout) == cfg.num_layers and set(cfg.attn_layout) <= set("SL-"),
         f"--attn_layout={cfg.attn_layout!r}: needs one of S/L/- per layer ({cfg.num_layers} layers)")
    need(len(cfg.value_embed_layout) == cfg.num_layers and all(c == "." or c.isdigit() for c in cfg.value_embed_layout),
         f"--value_embed_layout={cfg.value_embed_layout!r}: needs one digit or '.' per layer ({cfg.num_layers} layers)")
    need(all(v == "." or a != "-" for v, a in zip(cfg.value_embed_layout, cfg.attn_layout)),
         "--value_embed_layout puts a value embedding on a layer without attention (- in --attn_layout)")
    paired = cfg.paired_layers
    need(all(cfg.attn_layout[i] != "-" for i in paired),
         f"--paired_head_layers={cfg.paired_head_layers} names a layer without attention (- in --attn_layout)")
    need(all(cfg.attn_layout[i] != "-" for i in cfg.xsa_layer_list),
         f"--xsa_layers={cfg.xsa_layers} names a layer without attention (- in --attn_layout)")
    need(not paired or cfg.num_heads % 2 == 0,
         f"--paired_head_layers needs an even --num_heads (it is {cfg.num_heads})")
    need(0 <= cfg.skip_from < cfg.skip_to < cfg.num_layers,
         f"--skip_from={cfg.skip_from} --skip_to={cfg.skip_to}: need 0 <= skip_from < skip_to < num_layers")
    need(-1 <= cfg.attn_input_from < cfg.num_layers - 1,
         f"--attn_input_from={cfg.attn_input_from}: use a layer 0 .. num_layers-2 ({cfg.num_layers - 2}), or -1")
    need(-1 <= cfg.backout_from < cfg.num_layers,
         f"--backout_from={cfg.backout_from}: use a layer 0 .. num_layers-1 ({cfg.num_layers - 1}), or -1 for none")
    need(not cfg.token_gates or (cfg.sublayer_scales and 0 <= cfg.skip_from < cfg.num_layers - 1),
         "--token_gates=1 needs --sublayer_scales=1 and --skip_from below the last layer (the second MLP reads the "
         "stream after it)")
    need(0.0 <= cfg.muon_slow_momentum < 1.0 and 0.0 <= cfg.muon_slow_from <= 1.0 and 0.0 <= cfg.muon_slow_share <= 1.0,
         f"--muon_slow_momentum={cfg.muon_slow_momentum} --muon_slow_from={cfg.muon_slow_from} --muon_slow_share="
         f"{cfg.muon_slow_share}: use a beta in [0, 1), a fraction in [0, 1] and a share in [0, 1]")
    need(not cfg.mudd or (cfg.sublayer_scales and 0 <= cfg.backout_from < cfg.num_layers - 1 and cfg.num_layers >= 3
                          and cfg.num_heads % 2 == 0 and cfg.attn_layout[-1] != "-"
                          and any(c != "." for c in cfg.value_embed_layout)),
         "--mudd=1 needs --sublayer_scales=1, --backout_from below the last layer (its output is a source), at least "
         "3 layers, an even --num_heads, attention in the last layer and at least one value embedding")
    need(0 < cfg.logit_softcap <= 4 * cfg.logit_divisor,
         f"--logit_softcap={cfg.logit_softcap} must be positive and at most 4 * --logit_divisor={cfg.logit_divisor} "
         "(the FP8 head's gradient scale counts on dz/dlogit <= 1)")
    if cfg.mtp_schedule:
        stages = cfg.mtp_stages
        need(len(stages) == len(cfg.stage_batches),
             f"--mtp_schedule={cfg.mtp_schedule!r}: needs one entry per stage of --batch_schedule, separated by '/'")
        need(all(stage[0][0] > 0 and stage[0][1] > 0 and min(min(w) for w in stage) >= 0 for stage in stages),
             f"--mtp_schedule={cfg.mtp_schedule!r}: weights must be 0 or more, the next token's above 0")
    need(0.0 <= cfg.untie_frac <= 1.0, f"--untie_frac={cfg.untie_frac}: use a fraction of the scheduled steps, 0 .. 1")
    need(1 <= cfg.gate_dims <= cfg.model_dim, f"--gate_dims={cfg.gate_dims}: use 1 .. model_dim ({cfg.model_dim})")
    need(2 <= cfg.vocab_size <= 65536, f"--vocab_size={cfg.vocab_size}: shards hold 16-bit tokens, use 2 .. 65536")
    need(0 <= cfg.bos_token < cfg.vocab_size,
         f"--bos_token={cfg.bos_token} must be a token of the vocabulary (below --vocab_size={cfg.vocab_size})")
    need(cfg.num_heads * cfg.head_dim == cfg.model_dim, "num_heads * head_dim must equal model_dim")
    need(cfg.muon_qk_blocks >= 1 and cfg.num_heads % cfg.muon_qk_blocks == 0,
         f"--muon_qk_blocks={cfg.muon_qk_blocks}: use a divisor of --num_heads={cfg.num_heads}")
    need(cfg.head_dim % 4 == 0, "--head_dim must be a multiple of 4 (half-truncated rotary)")
    need(cfg.num_iterations >= 1, "--num_iterations must be at least 1")
    need(cfg.micro_batch_tokens % 128 == 0, "--micro_batch_tokens must be a multiple of 128")
    need(not cfg.copy_pointer or (cfg.copy_band > 0 and cfg.copy_band % COPY_BLOCK == 0),
         f"--copy_band={cfg.copy_band}: use a positive multiple of {COPY_BLOCK}")
    need(cfg.bigram_rows == 0 or (cfg.bigram_rows >= 16 and cfg.bigram_rows % 8 == 0),
         f"--bigram_rows={cfg.bigram_rows}: use 0 (off) or a multiple of 8 (rows are split evenly over ranks)")
    need(0 <= cfg.bigram_dims <= cfg.model_dim and cfg.bigram_signs >= 0,
         f"--bigram_dims={cfg.bigram_dims} --bigram_signs={cfg.bigram_signs}: use 0 .. model_dim ({cfg.model_dim}) "
         "channels (0: all) and 0 or more sign vectors")
    need(not cfg.bigram_normalize or cfg.bigram_rows, "--bigram_normalize=1 needs --bigram_rows above 0")
    need(0.0 <= cfg.tail_ema_from < 1.0 and 0.0 < cfg.tail_ema_decay < 1.0 and 0.0 <= cfg.tail_ema_blend <= 1.0,
         f"--tail_ema_from={cfg.tail_ema_from} --tail_ema_decay={cfg.tail_ema_decay} --tail_ema_blend="
         f"{cfg.tail_ema_blend}: use a fraction in [0, 1), a decay in (0, 1) and a share in [0, 1]")
    need(not cfg.tail_ema_kinds or (cfg.tail_ema_from and not cfg.tail_ema_all and 0.0 < cfg.tail_ema_fast_decay < 1.0),
         f"--tail_ema_kinds=1 needs --tail_ema_from above 0, --tail_ema_all=0 (it picks its own weights) and a "
         f"--tail_ema_fast_decay in (0, 1), not {cfg.tail_ema_fast_decay}")
    need(not (cfg.diloco and cfg.tail_ema_from), "--tail_ema_from with --diloco=1: replicas would average apart; "
         "use one of them")
    need(cfg.val_tokens % cfg.micro_batch_tokens == 0,
         f"--val_tokens={cfg.val_tokens} must be a multiple of --micro_batch_tokens={cfg.micro_batch_tokens}")
    batches, lrs, windows = cfg.stage_batches, cfg.stage_lr_multipliers, cfg.stage_window_blocks
    need(len(cfg.stage_doc_lens) == len(batches) and all(1 <= n <= cfg.max_doc_len for n in cfg.stage_doc_lens),
         f"--doc_len_schedule={cfg.doc_len_schedule}: one length per stage of --batch_schedule, each 1 .. "
         f"--max_doc_len={cfg.max_doc_len}")
    need(cfg.extension_steps >= 0, f"--extension_steps={cfg.extension_steps} must be 0 or more")
    need(len(batches) == len(lrs) == len(windows),
         "--batch_schedule, --lr_schedule and --window_schedule need the same number of stages")
    need(all(b > 0 and b % 8 == 0 for b in batches),
         f"--batch_schedule={cfg.batch_schedule}: each entry must be a positive multiple of 8, "
         "so that 1, 2, 4 and 8 processes split it evenly")
    extension = [cfg.extension_window_blocks]  # parsed (checked) even when there are no extension steps
    extension = extension if cfg.extension_steps else []
    longest = max(max(pair) for pair in windows + [cfg.final_window_blocks] + extension)
    need(longest * cfg.window_block <= cfg.micro_batch_tokens, "attention windows exceed micro_batch_tokens")
    need(cfg.adam_period >= 0, f"--adam_period={cfg.adam_period} must be 0 (auto) or more")
    period = resolved_adam_period(cfg)
    need(cfg.checkpoint_every >= 0 and cfg.checkpoint_every % period == 0,
         f"--checkpoint_every={cfg.checkpoint_every}: use 0 or a multiple of Adam's period ({period}), so that no "
         "summed gradient is pending at a checkpoint")
    need(not cfg.checkpoint_every or cfg.save_checkpoint, "--checkpoint_every needs --save_checkpoint=PATH")
    need(not cfg.eval_only or cfg.init_from, "--eval_only=1 needs --init_from=CHECKPOINT")
    need(not cfg.sample or cfg.init_from, "--sample needs --init_from=CHECKPOINT")
    need(not (cfg.sample and cfg.eval_only), "--sample and --eval_only=1: choose one")
    need(not cfg.init_from or cfg.eval_only or cfg.sample,
         "--init_from is read by --eval_only=1 or --sample (to train on, use --resume)")
    need(cfg.sample_tokens >= 1 and cfg.temperature >= 0,
         f"--sample_tokens={cfg.sample_tokens} --temperature={cfg.temperature}: need at least 1 and at least 0")
    # Other ranks' slices of a table gathered in bf16 are rounded: only the forward may read them.
    need(not (cfg.bf16_table_gathers and cfg.diloco), "--bf16_table_gathers with --diloco: DiLoCo reads whole "
         "tables; pass --bf16_table_gathers=0")
    need(not (cfg.bf16_table_gathers and cfg.tail_ema_from and (cfg.tail_ema_all or cfg.tail_ema_kinds)),
         "--bf16_table_gathers with a tail average of the value tables (--tail_ema_all or --tail_ema_kinds): pass "
         "--bf16_table_gathers=0")
    if cfg.diloco:
        need(cfg.adam_period <= 1, f"--adam_period={cfg.adam_period}: DiLoCo runs need 1 (a sync would land "
             "between the steps whose gradients Adam sums)")
        need(1 <= cfg.num_fragments <= cfg.num_layers,
             f"--num_fragments={cfg.num_fragments}: use 1 .. num_layers ({cfg.num_layers})")
        need(cfg.sync_every >= cfg.num_fragments and cfg.sync_every % cfg.num_fragments == 0,
             f"--sync_every={cfg.sync_every} must be a multiple of --num_fragments={cfg.num_fragments}: "
             "each fragment syncs once every sync_every steps, one fragment at a time")
        total = cfg.num_iterations + cfg.extension_steps
        need(total % cfg.sync_every == 0,
             f"--num_iterations + --extension_steps = {total} must be a multiple of --sync_every={cfg.sync_every}, "
             "so that replicas do the same number of syncs (a replica twice as fast: twice all three values)")
        need(0 <= cfg.fragment_sync_delay < cfg.sync_every // cfg.num_fragments,
             f"--fragment_sync_delay={cfg.fragment_sync_delay}: must be below sync_every/num_fragments "
             f"({cfg.sync_every // cfg.num_fragments})")
        need(0.0 <= cfg.fragment_update_alpha <= 1.0, "--fragment_update_alpha must be in [0, 1]")
        period = cfg.sync_every // cfg.num_fragments
        need(cfg.checkpoint_every % period == 0,
             f"--checkpoint_every={cfg.checkpoint_every}: with --diloco=1 use a multiple of sync_every/num_fragments "
             f"({period}), so that no fragment's all-reduce is in flight at a checkpoint")
        need(cfg.outer_lr > 0, f"--outer_lr={cfg.outer_lr} must be positive")
        need(0.0 <= cfg.outer_momentum < 1.0, f"--outer_momentum={cfg.outer_momentum} must be in [0, 1)")
        need(0 <= cfg.replica < cfg.diloco_replicas,
             f"--replica={cfg.replica}: use 0 .. diloco_replicas-1 (--diloco_replicas={cfg.diloco_replicas})")
        need(cfg.min_replicas >= 1, "--min_replicas must be at least 1")


def config_help() -> str:
    """--help: each group's fields as --name=default, a flag's own value, with their help in one column."""
    def flag(f: dataclasses.Field) -> str:
        value = f.default
        if isinstance(value, bool):
            value = int(value)
        elif isinstance(value, tuple):
            value = ",".join(map(str, value))
        return f"--{f.name}={value}"

    fields = dataclasses.fields(Config)
    width = max(len(flag(f)) for f in fields if len(flag(f)) <= 32)  # a longer flag has its help on the next line
    lines = [f"usage: train_gpt.py [--preset={'|'.join(PRESETS)}] [--check] [--name=value ...]"]
    for group in CONFIG_GROUPS:
        lines += ["", f"{group}:"]
        for f in fields:
            if f.metadata.get("group") == group:
                text = flag(f)
                gap = "  " if len(text) <= width else "\n" + " " * (width + 4)
                lines.append(f"  {text:{width}}{gap}{f.metadata['help']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Model


@dataclass(frozen=True)
class Kernels:
    """Where a run takes a Triton kernel instead of plain torch: decided once, by choose_kernels at startup, and
    handed down to the model (MLP, row lookups, loss head) and to Muon, which call no kernel on their own. All off,
    the default, is plain torch: the CPU's path, and the GPU's with --triton_kernels=0."""
    fused_mlp: bool = False  # the MLP as _FusedReLU2MLP
    rows: bool = False  # the embedding rows' gather and gradient kernels (gather_rows, add_rows_)
    loss: bool = False  # the softcapped cross-entropy kernels; with --fp8_head, torch._scaled_mm and its loss kernel
    newton_schulz: bool = False  # Muon's symmetric matmuls (symmetric_matmul)
    copy_pointer: bool = False  # the copy pointer's banded scores (_CopyScores)


PLAIN_TORCH = Kernels()


def choose_kernels(cfg: Config, device: torch.device) -> Kernels:
    """The Triton kernels of a run on `device`: every one on CUDA when Triton imports and --triton_kernels is on
    (the fused MLP also with --fused_mlp); none on the CPU."""
    on = device.type == "cuda" and triton is not None and cfg.triton_kernels
    return Kernels(fused_mlp=on and cfg.fused_mlp, rows=on, loss=on, newton_schulz=on, copy_pointer=on)


def rms_norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))


def next_multiple_of(n: int, k: int) -> int:
    return -(-n // k) * k


def yarn_rescale(freqs: Tensor, old_window: int, new_window: int, alpha: float = 1.0, beta: float = 32.0) -> Tensor:
    """YaRN-style frequency interpolation (Peng et al. 2023) for a window that grows old -> new tokens.

    Frequencies that turn fewer than `alpha` times across the old window are slowed by old/new, so
    positions in the new window look like the distances they were trained on; those turning more than
    `beta` times are kept; in between they blend. (The speedrun added this in its 2025-09-10 record.)
    """
    turns = old_window * freqs / (2 * math.pi)
    keep = ((turns - alpha) / (beta - alpha)).clamp(0, 1)
    ratio = old_window / new_window
    return freqs * (ratio + keep * (1 - ratio))


class Rotary(nn.Module):
    """Rotary position embedding on half of each head's dimensions; the other half carries no position.

    Half-truncated RoPE with base 1024 follows the speedrun's 2024-12 records. The rotation tables and
    the attention scale are buffers updated in place when the attention window grows, so compiled graphs
    read them as inputs and never recompile.
    """

    def __init__(self, head_dim: int, max_len: int, period: int | None = None, attn_scale: float = 0.12,
                 paired: bool = False):
        super().__init__()
        n = head_dim // 4
        freqs = torch.cat([(1 / 1024) ** torch.linspace(0, 1, n), torch.zeros(n)])
        self.register_buffer("base_freqs", freqs, persistent=False)
        # Positions restart every `period` tokens (each packed micro-batch), so a packed forward rotates
        # exactly as separate ones would.
        positions = torch.arange(max_len) % (period or max_len)
        self.register_buffer("positions", positions.to(torch.float32), persistent=False)
        self.register_buffer("cos", torch.empty(max_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_len, 2, head_dim // 2), persistent=False)  # (sin, -sin)
        # Paired heads see a sequence of twice the length: token t's two heads sit at positions 2t and 2t + 1.
        self.paired = paired
        if paired:
            doubled = 2 * positions.repeat_interleave(2) + torch.arange(2 * max_len) % 2
            self.register_buffer("paired_positions", doubled.to(torch.float32), persistent=False)
            self.register_buffer("paired_cos", torch.empty(2 * max_len, head_dim // 2), persistent=False)
            self.register_buffer("paired_sin", torch.empty(2 * max_len, 2, head_dim // 2), persistent=False)
        self.register_buffer("attn_scale", torch.empty(()), persistent=False)
        self.base_attn_scale = attn_scale
        self.set_window_history([])

    @torch.no_grad()
    def set_window_history(self, windows: list[int]) -> None:
        """Re-derive the tables from the sequence of long-window sizes (tokens) seen so far."""
        freqs, scale = self.base_freqs, self.base_attn_scale
        for old, new in zip(windows, windows[1:]):
            if new != old:
                freqs = yarn_rescale(freqs, old, new)
                scale *= 1 + 0.2 * math.log(new / old)  # sharper attention over a longer window
        for positions, cos, sin in [(self.positions, self.cos, self.sin)] + (
                [(self.paired_positions, self.paired_cos, self.paired_sin)] if self.paired else []):
            theta = torch.outer(positions, freqs)
            cos.copy_(theta.cos())
            sin.copy_(torch.stack([theta.sin(), -theta.sin()], dim=1))
        self.attn_scale.fill_(scale)

    def tables(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.cos, self.sin, self.attn_scale

    def paired_tables(self) -> tuple[Tensor, Tensor, Tensor] | None:
        return (self.paired_cos, self.paired_sin, self.attn_scale) if self.paired else None


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, head_dim]; rotates pairs (x1, x2) = (x[i], x[i + head_dim/2]) by position-dependent angles to
    (x1 cos + x2 sin, x2 cos - x1 sin); sin holds (sin, -sin) per position (Rotary). On a [T, heads, 2, head_dim/2]
    view with the halves swapped by a flip, rather than chunk and cat, inductor fuses the q/k norm's backward
    without writing fp32 intermediates to memory, and those kernels run faster (bench/bench_qk_prep.py,
    docs/performance.md)."""
    T, heads, dim = x.shape
    halves = x.float().view(T, heads, 2, dim // 2)
    rotated = halves * cos[:T, None, None, :] + halves.flip(-2) * sin[:T, None]
    return rotated.view(T, heads, dim).type_as(x)


def document_ids(cu_seqlens: Tensor, length: int) -> Tensor:
    """Document index of each of `length` positions, from the document starts in cu_seqlens (padded with
    `length`): a new document starts at every BOS and at every micro-batch's first position."""
    starts = torch.zeros(length + 1, dtype=torch.int32, device=cu_seqlens.device)
    starts.index_fill_(0, cu_seqlens.long(), 1)
    return torch.cumsum(starts[:length], dim=0, dtype=torch.int32)


# Attention backends. Each computes the same function of (q, k, v, documents, window): causal attention
# restricted to the query's own document (the document starts in cu_seqlens) and to the last `window`
# positions (the query included), with q already scaled. `prepare` builds, once per forward and outside
# compiled code, whatever the kernel needs for each window kind ("S" short, "L" long) over `length`
# positions, given also the forward's document count and longest document when the loader measured them
# (FA3 sizes its launch by them; the others need not); `__call__` runs inside the blocks.
# `for_paired_heads` gives the backend for sequences of twice the length, which paired-head layers attend over.


class SdpaAttention:
    """Plain PyTorch: a dense [T, T] boolean mask. Exact and simple; meant for CPUs and small T."""
    name = "sdpa"

    def for_paired_heads(self):
        return self

    def prepare(self, length: int, cu_seqlens: Tensor, windows: dict[str, int], documents: int | None = None,
                longest: int | None = None) -> dict:
        doc = document_ids(cu_seqlens, length)
        pos = torch.arange(length, device=cu_seqlens.device)
        distance = pos[:, None] - pos[None, :]
        allowed = (distance >= 0) & (doc[:, None] == doc[None, :])
        return {kind: allowed & (distance < w) for kind, w in windows.items()}

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        y = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=1.0)
        return y.transpose(0, 1)


class FlexAttention:
    """torch FlexAttention with block-sparse masks (the speedrun's 2024-11 switch to long contexts).

    The block masks are built here with a few eager tensor ops on the [blocks, blocks] grid instead of
    a compiled create_block_mask: at our length that compile puts a Triton sort on the cold start's
    critical path, where it takes most of the time (pytorch/pytorch#182060; docs/performance.md). Document ids are
    non-decreasing along the packed sequence, so two blocks share a document exactly when the query
    block's first document is the key block's last one, and that pair of positions is also the
    pair nearest in distance, which makes the block classification exact (see the test against
    create_block_mask). The mask functions for the partial blocks are created once and read the
    document ids and window sizes from tensors that `prepare` overwrites in place, so the compiled
    blocks never see a new function; stream order keeps a forward's backward ahead of the next
    forward's overwrite. The block masks are overwritten in place too: under CUDA graphs, torch
    takes the forward's inputs that the backward keeps for fixed addresses, so masks made afresh for
    each forward would have the backward graph recorded again and again (bench/why_rerecord.py finds
    such recordings; docs/performance.md). Forwards of another length (stages that pack another number of
    micro-batches) get a FlexAttention of their own, made at their first prepare.
    """
    name = "flex"
    block_size = 128  # FlexAttention's default tile

    def __init__(self, seq_len: int, device: torch.device):
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
        if seq_len % self.block_size:
            raise UserError(f"--micro_batch_tokens={seq_len} must be a multiple of {self.block_size} for the "
                            "flex attention backend")
        self.flex_attention, self.from_kv_blocks = flex_attention, BlockMask.from_kv_blocks
        self.seq_len = seq_len
        self.doc = torch.zeros(seq_len, dtype=torch.int32, device=device)
        self.window = {kind: torch.zeros((), dtype=torch.int32, device=device) for kind in "SL"}
        self.mask_mods = {kind: self._mask_mod(self.doc, self.window[kind]) for kind in "SL"}
        blocks = torch.arange(seq_len // self.block_size, device=device)
        self.block_offset = blocks[:, None] - blocks[None, :]  # query block - key block
        self.masks = {}  # kind -> the BlockMask whose tensors prepare() overwrites
        self.other_lengths: dict[int, FlexAttention] = {}

    @staticmethod
    def _mask_tensors(mask) -> list[Tensor]:
        """The block lists of a BlockMask, in both directions (the backward walks them by key block)."""
        return [mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
                mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices]

    @staticmethod
    def _mask_mod(doc: Tensor, window: Tensor):
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx]) & (q_idx - kv_idx < window)
        return mask_mod

    def _block_lists(self, window: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(partial count, partial indices, full count, full indices) per query block, as
        BlockMask.from_kv_blocks takes them."""
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

    def prepare(self, length: int, cu_seqlens: Tensor, windows: dict[str, int], documents: int | None = None,
                longest: int | None = None) -> dict:
        if length != self.seq_len:
            if length not in self.other_lengths:
                self.other_lengths[length] = FlexAttention(length, self.doc.device)
            return self.other_lengths[length].prepare(length, cu_seqlens, windows, documents, longest)
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
        y = self.flex_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                block_mask=mask, scale=1.0)
        return y[0].transpose(0, 1)


# FA3's kernels take the window, max_seqlen and the count of document starts as host ints. Our op takes them as ints,
# which compile_model marks symbolic (FA3_HOST_INT_SOURCES): one compiled graph serves every window pair and length
# (as constants each value was a whole-model compile of its own), and under CUDA graphs the op is captured with the
# rest of the step, one recorded graph per value. (Through a CPU tensor read as it ran, the op had to run between
# CUDA graphs, and inductor's graphs cut around it trained wrong: docs/performance.md.)
_fa3_kernels = None  # flash_attn_interface (or a stand-in), set by FlashAttention3


def _fa3_arguments(cu_seqlens: Tensor, window: int, max_seqlen: int, entries: int) -> dict:
    """What FA3's forward and backward both take: the first `entries` of cu_seqlens, max_seqlen, FA3's window (keys
    to the left of the query, besides itself), no scale."""
    cu_seqlens = cu_seqlens[:entries]
    return dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                softmax_scale=1.0, window_size_left=window - 1, window_size_right=0)


@torch.library.custom_op("gpt::fa3_varlen", mutates_args=())
def fa3_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int, max_seqlen: int,
               entries: int) -> tuple[Tensor, Tensor]:
    """Causal FA3 over documents with a sliding window; the kernels take the first `entries` of cu_seqlens. Returns
    the output and the log-sum-exp the backward needs."""
    out, lse, *_ = _fa3_kernels._flash_attn_forward(q, k, v, causal=True,
                                                    **_fa3_arguments(cu_seqlens, window, max_seqlen, entries))
    return out, lse


@fa3_varlen.register_fake
def _(q, k, v, cu_seqlens, window, max_seqlen, entries):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("gpt::fa3_varlen_backward", mutates_args=())
def fa3_varlen_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
                        window: int, max_seqlen: int, entries: int) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _fa3_kernels._flash_attn_backward(grad, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, is_causal=True,
                                      **_fa3_arguments(cu_seqlens, window, max_seqlen, entries))
    return dq, dk, dv


@fa3_varlen_backward.register_fake
def _(grad, q, k, v, out, lse, cu_seqlens, window, max_seqlen, entries):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fa3_save(ctx, inputs, output):
    q, k, v, cu_seqlens, *ints = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)
    ctx.ints = ints


def _fa3_backward(ctx, grad, _lse_grad):
    return *fa3_varlen_backward(grad, *ctx.saved_tensors, *ctx.ints), None, None, None, None


fa3_varlen.register_autograd(_fa3_backward, setup_context=_fa3_save)


class FlashAttention3:
    """FlashAttention-3 varlen kernels (Hopper): documents as separate sequences, a sliding window, through
    the opaque op fa3_varlen, whose ints compile_model marks symbolic, so one compiled graph serves every window pair
    and validation length.

    FA3's backward launches a thread block for every (sequence, key tile of max_seqlen) pair, empty
    ones included, so the kernels get the document starts cut to one entry per 256 tokens (of the
    loader's one per 16; the op cuts, so the graph always sees the loader's fixed length whatever
    the forward holds) and max_seqlen the longest a document can be, when the loader says the
    forward allows it: with all the loader's starts, or max_seqlen the whole forward, the empty blocks
    take most of the backward's time (docs/performance.md). Training documents never pass max_doc_len; a forward with
    a longer one (validation chunks are not cut) takes max_seqlen = the forward's length.
    Under CUDA graphs each (window, max_seqlen, count) is a recorded graph of its own: a value the warm-up did not
    meet (the uncut starts of a forward of more documents than the cut keeps) is recorded where it first comes.
    """
    name = "fa3"

    def __init__(self, module, max_doc_len: int):
        global _fa3_kernels
        _fa3_kernels = self.module = module
        self.max_doc_len = max_doc_len

    def for_paired_heads(self):
        return FlashAttention3(self.module, 2 * self.max_doc_len)

    def prepare(self, length: int, cu_seqlens: Tensor, windows: dict[str, int], documents: int | None = None,
                longest: int | None = None) -> dict:
        T = length
        entries = T // 256 + 1
        if documents is None or documents >= entries:  # the cut keeps at least one closing T
            entries = len(cu_seqlens)
        max_seqlen = self.max_doc_len if longest is not None and longest <= self.max_doc_len else T
        return {kind: (cu_seqlens, w, max_seqlen, entries) for kind, w in windows.items()}

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
        return fa3_varlen(q, k, v, *mask)[0]


def make_attention(cfg: Config, device: torch.device, seq_len: int):
    """Pick the attention backend for forwards of seq_len tokens: FA3 when it imports (CUDA), with or without CUDA
    graphs (fa3_varlen takes its window and lengths as ints, so it is captured with the step; on 4xH200 at one
    micro-batch per forward its graphs were 3-4% faster than flex's, docs/performance.md), else FlexAttention (CUDA),
    else SDPA."""
    choice = cfg.attn_backend
    if choice in ("fa3", "flex") and device.type != "cuda":  # FA3 is CUDA's; torch's flex has no backward on a CPU
        raise UserError(f"--attn_backend={choice} needs --device=cuda; on a CPU use --attn_backend=sdpa or auto")
    if choice == "fa3" or (choice == "auto" and device.type == "cuda"):
        try:
            import flash_attn_interface
            return FlashAttention3(flash_attn_interface, cfg.max_doc_len)
        except ImportError:
            if choice == "fa3":
                raise UserError("--attn_backend=fa3 but flash_attn_interface does not import; "
                                "install FlashAttention-3 or use --attn_backend=auto") from None
    if choice == "flex" or (choice == "auto" and device.type == "cuda"):
        return FlexAttention(seq_len, device)
    return SdpaAttention()


class CausalSelfAttention(nn.Module):
    """Multi-head attention with QK-norm and rotary. With `paired`, heads h and h + num_heads/2 attend as one
    head over a sequence of twice the length: [T, heads, head_dim] viewed as [2T, heads/2, head_dim] puts
    token t's head h at position 2t and its head h + num_heads/2 at 2t + 1, so each query also sees its
    partner head's keys of the earlier tokens (and the first head of a pair its partner's at its own
    token's), with positions, documents and the window counted on the doubled sequence; the rotary
    tables, the masks and the backend come for that length (speedrun 2026-01-07 record, "paired head attention").
    With `xsa` (exclusive self-attention, Zhai 2025; learnable as in the speedrun's 2026-04-29 record) each head's
    output loses tanh(alpha) of its component along the token's own value, alpha learned per head from 0.
    With `value_gate_reads_embed` the value-embedding gate reads half its channels from the value embedding
    (speedrun 2026-02-03). With `token_gated` (TokenGates) the XSA strength and the output gate come per token
    with each forward's LayerGates: this layer has no output gate of its own, only the value-embedding gate."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, gate_dims: int = 0, shift_keys: bool = False,
                 out_scale: bool = False, paired: bool = False, xsa: bool = False, value_gate_reads_embed: bool = False,
                 token_gated: bool = False):
        super().__init__()
        self.num_heads, self.head_dim, self.gate_dims, self.shift_keys = num_heads, head_dim, gate_dims, shift_keys
        self.paired, self.value_gate_reads_embed = paired, value_gate_reads_embed
        # Q, K, V and O stacked as one [4*dim, dim] matrix (each block out x in): the same shape as the
        # MLP weights, so the optimizer can treat all matrices of the model as one stack.
        self.qkvo_w = nn.Parameter(torch.empty(4 * dim, dim))
        # gate weights per head: the output gate (not with token_gated), then the value-embedding gate
        rows = 1 if token_gated else 2
        self.gate_w = nn.Parameter(torch.zeros(rows, num_heads, gate_dims)) if gate_dims else None
        self.out_scale = nn.Parameter(torch.ones(1)) if out_scale else None
        self.xsa_alpha = nn.Parameter(torch.zeros(num_heads)) if xsa and not token_gated else None

    def forward(self, x: Tensor, value_embed: Tensor, value_mix: Tensor, rope, mask, attend, starts: Tensor,
                mix: "LayerMix | None" = None, token: "LayerGates | None" = None) -> Tensor:
        """`mix` (MUDD's last layer): a value added to v and a per-token value-embedding gate in place of this
        layer's own. `token`: this layer's per-token XSA strength and output gate, where TokenGates gives them."""
        T, dim = x.shape
        cos, sin, scale = rope
        w = self.qkvo_w.to(x.dtype)
        q, k, v = (x @ w[: 3 * dim].T).view(T, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rms_norm(q), rms_norm(k)  # QK-norm
        if self.paired:  # the key offset moves unrotated dims only, so it may come before the rotary
            k = self.offset_keys(k, starts) if self.shift_keys else k
            sequence = (2 * T, self.num_heads // 2, self.head_dim)
            q, k = apply_rotary(q.reshape(sequence), cos, sin), apply_rotary(k.reshape(sequence), cos, sin)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            k = self.offset_keys(k, starts) if self.shift_keys else k
        # Value embeddings (speedrun 2024-12, after Zhou et al. 2024); layers without one get zeros, which
        # leaves the learned scale of v and lets every attention block share one compiled graph.
        out_gate = None
        if self.gate_w is not None:
            gate_w = self.gate_w.to(x.dtype)
            own_out_gate = gate_w.size(0) == 2
            if self.value_gate_reads_embed:
                half = self.gate_dims // 2
                if own_out_gate:
                    out_gate = torch.sigmoid(x[:, : self.gate_dims] @ gate_w[0].T)[..., None]  # [T, heads, 1]
                value_gate = torch.sigmoid(torch.cat([x[:, :half], value_embed[:, : self.gate_dims - half]], dim=-1)
                                           @ gate_w[-1].T)[..., None]
            else:  # the gates from one product
                gates = torch.sigmoid(x[:, : self.gate_dims] @ gate_w.view(-1, self.gate_dims).T)
                gates = gates.view(T, gate_w.size(0), self.num_heads, 1).unbind(1)  # [T, heads, 1] each
                out_gate, value_gate = gates if own_out_gate else (None, gates[0])
        value_embed = value_mix[1] * value_embed.view_as(v)
        if mix is not None:
            value_embed = mix.value_gate * value_embed
        elif self.gate_w is not None:
            value_embed = 2 * value_gate * value_embed
        v = value_mix[0] * v + value_embed
        if mix is not None:
            v = v + mix.value.view_as(v)
        own_value = v
        if self.paired:
            v = v.reshape(k.shape)
        q = (q * scale).type_as(k)
        y = attend(q, k, v, mask).reshape(T, self.num_heads, self.head_dim)
        strength = None
        if self.xsa_alpha is not None:
            strength = torch.tanh(self.xsa_alpha.to(y.dtype))[:, None]  # [heads, 1]
        elif token is not None and token.xsa is not None:
            strength = torch.tanh(token.xsa)[..., None]  # [T, heads, 1]
        if strength is not None:
            unit = F.normalize(own_value.float(), dim=-1).type_as(y)
            y = y - strength * (y * unit).sum(-1, keepdim=True) * unit
        if out_gate is not None:
            y = out_gate * y
        if token is not None and token.out is not None:
            y = token.out[..., None] * y
        y = y.reshape(T, dim) @ w[3 * dim:].T
        return y if self.out_scale is None else self.out_scale.to(y.dtype) * y

    def offset_keys(self, k: Tensor, starts: Tensor) -> Tensor:
        """Each key's dims that rotary leaves still (the second half of each half: rotary pairs dim i with
        i + head_dim/2) taken from the previous token, except at a document's start (speedrun 2026-01)."""
        halves = k.view(k.size(0), self.num_heads, 2, self.head_dim // 2)
        still = halves[..., self.head_dim // 4:]
        still = torch.where(starts[:, None, None, None], still, torch.cat([still[:1], still[:-1]]))
        return torch.cat([halves[..., : self.head_dim // 4], still], dim=-1).view_as(k)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, fused: bool):
        super().__init__()
        self.fc_w = nn.Parameter(torch.empty(hidden, dim))  # out x in
        self.proj_w = nn.Parameter(torch.empty(hidden, dim))  # in x out: stored transposed, same shape as fc_w
        self.fused = fused  # _FusedReLU2MLP (Kernels.fused_mlp), else plain torch

    def forward(self, x: Tensor) -> Tensor:
        fc_w, proj_w = self.fc_w.to(x.dtype), self.proj_w.to(x.dtype)
        if self.fused:
            return _FusedReLU2MLP.apply(x, fc_w, proj_w)
        return F.relu(x @ fc_w.T).square() @ proj_w  # ReLU^2 (So et al. 2021)


class Block(nn.Module):
    """Attention (if the layer has it) and an MLP, each on the normed stream. Two residual forms:
    - one scale per layer (speedrun 2024-11): x = residual * x + x0_scale * x0 + bigram_scale * bigram, then
      x + attention(norm x), then x + MLP(norm x);
    - --sublayer_scales (speedrun 2026-02-12, as simplified 2026-03-06): x = r_a * x + o_a * attention(norm a) +
      x0_scale * x0 + bigram_scale * bigram, then r_m * x + o_m * MLP(norm x), with a the layer's input or (past
      --attn_input_from) that layer's output; a layer without attention only runs its MLP.
    value_scales (a layer with attention): [value scale, value-embedding scale] of the attention's v. fused_mlp:
    Kernels.fused_mlp. With `mixed` (MUDD's last layer) the sublayer scales are per token, from a LayerMix, and the
    block has none of its own; with --token_gates the x0 and bigram scales are per token, from the forward's
    LayerGates."""

    def __init__(self, cfg: Config, has_attention: bool, shift_keys: bool = False, paired: bool = False,
                 xsa: bool = False, fused_mlp: bool = False, mixed: bool = False):
        super().__init__()
        # MUDD's last layer under --token_gates takes its value gate from the LayerMix and its output gate from the
        # token gates, so it has no gate weights of its own
        gate_dims = cfg.gate_dims if cfg.gates and not (mixed and cfg.token_gates) else 0
        self.attn = (CausalSelfAttention(cfg.model_dim, cfg.num_heads, cfg.head_dim, gate_dims, shift_keys,
                                         cfg.attn_out_scale, paired, xsa, cfg.value_gate_reads_embed, cfg.token_gates)
                     if has_attention else None)
        self.paired = paired
        self.mlp = MLP(cfg.model_dim, cfg.mlp_ratio * cfg.model_dim, fused_mlp)
        self.value_scales = nn.Parameter(torch.tensor([0.5, cfg.value_embed_scale_init])) if has_attention else None
        if mixed:  # the sublayer scales come with each forward's LayerMix
            self.residual_scales = self.output_scales = self.injection = self.lambdas = None
        elif cfg.sublayer_scales:  # sqrt(1.1) per sublayer: 1.1 per layer, as the single scale
            self.residual_scales = nn.Parameter(torch.full((2,), cfg.residual_init ** 0.5))  # attention, MLP
            self.output_scales = nn.Parameter(torch.ones(2))  # attention, MLP
            self.injection = None if cfg.token_gates else nn.Parameter(torch.tensor([0.0, 0.05]))  # x0, bigram
            self.lambdas = None
        else:
            self.residual_scales = self.output_scales = self.injection = None
            self.lambdas = nn.Parameter(torch.tensor([cfg.residual_init, 0.0, 0.1]))  # residual, x0, bigram
        self.attend = None  # the attention backend, set by GPT

    def forward(self, x: Tensor, x0: Tensor, value_embed: Tensor, rope, mask, bigram: Tensor | None,
                starts: Tensor, attn_input: Tensor | None = None, mix: "LayerMix | None" = None,
                token: "LayerGates | None" = None) -> Tensor:
        value_scales = self.value_scales.to(x.dtype) if self.value_scales is not None else None
        if self.lambdas is not None:
            lambdas = self.lambdas.to(x.dtype)
            x = lambdas[0] * x + lambdas[1] * x0  # every layer can re-read the embedding (speedrun 2024-11)
            if bigram is not None:
                x = x + lambdas[2] * bigram
            if self.attn is not None:
                source = x if attn_input is None else attn_input
                x = x + self.attn(rms_norm(source), value_embed, value_scales, rope, mask, self.attend, starts)
            return x + self.mlp(rms_norm(x))
        if mix is not None:
            scales = mix.scales
        else:
            residual, output = (p.to(x.dtype) for p in (self.residual_scales, self.output_scales))
            if self.injection is not None:
                injection = self.injection.to(x.dtype)
                x0_scale, bigram_scale = injection[0], injection[1]
            else:  # per token; a layer without attention adds neither
                x0_scale, bigram_scale = token.inject if token is not None and token.inject is not None else (None, None)
            scales = (residual[0], output[0], x0_scale, bigram_scale, residual[1], output[1])
        residual_attn, output_attn, x0_scale, bigram_scale, residual_mlp, output_mlp = scales
        if self.attn is not None:
            source = x if attn_input is None else attn_input
            y = self.attn(rms_norm(source), value_embed, value_scales, rope, mask, self.attend, starts, mix, token)
            x = residual_attn * x + output_attn * y + x0_scale * x0
            if bigram is not None:
                x = x + bigram_scale * bigram
        return residual_mlp * x + output_mlp * self.mlp(rms_norm(x))


class DenseMix(nn.Module):
    """MUDD's per-token mixing weights (Xiao et al. 2025): an MLP of the raw residual stream,
    (W2 gelu(W1 x) + b) * 0.1, with W2 zero at the start, so that each weight starts at its given initial value for
    every token and learns from there (the speedrun's 2026-04-22 record: 64 hidden units, output scale 0.1)."""

    HIDDEN, SCALE = 64, 0.1

    def __init__(self, dim: int, initial: list[float]):
        super().__init__()
        self.initial = initial
        self.w1 = nn.Parameter(torch.empty(self.HIDDEN, dim))
        self.w2 = nn.Parameter(torch.empty(len(initial), self.HIDDEN))
        self.bias = nn.Parameter(torch.empty(len(initial)))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        bound = self.w1.size(1) ** -0.5  # nn.Linear's default
        self.w1.uniform_(-bound, bound)
        self.w2.zero_()
        self.bias.copy_(torch.tensor(self.initial) / self.SCALE)

    def forward(self, x: Tensor) -> Tensor:
        """[T, dim] -> [T, len(initial)]."""
        hidden = F.gelu(x @ self.w1.to(x.dtype).T)
        return (hidden @ self.w2.to(x.dtype).T + self.bias.to(x.dtype)) * self.SCALE

    def mix_into(self, x: Tensor, sources) -> Tensor:
        """x plus the sources ([T, dim] each, one per weight) weighted per token by this MLP of x."""
        return x + sum(w * source for w, source in zip(self(x).split(1, dim=1), sources))


class LayerMix(typing.NamedTuple):
    """What MUDD hands the last layer: a value added to its v ([T, dim]), the per-token value-embedding gate
    ([T, heads, 1]) and its six sublayer scales, each [T, 1]: residual and output of the attention, x0, bigram,
    residual and output of the MLP."""
    value: Tensor
    value_gate: Tensor
    scales: tuple


class LayerGates(typing.NamedTuple):
    """What TokenGates hands one layer, each per token or None where the layer has none: its (x0 scale, bigram
    scale) ([T, 1] each), its XSA strengths before the tanh and its output gates ([T, heads] each)."""
    inject: tuple | None
    xsa: Tensor | None
    out: Tensor | None


class TokenGates(nn.Module):
    """The speedrun 2026-05-27 record's per-token gates: two DenseMix MLPs, `pre` of x0 for the layers up to
    skip_from and `post` of the stream entering the layer after it (skip_from's output) for the rest. Their lanes
    give, per layer with attention, the x0 and bigram scales (0 and 0.05 at the start; not for MUDD's last layer,
    whose scales MUDD gives), the XSA strength of each head on the XSA layers (tanh of it; 0), and on layers
    skip_from and the last an output gate per head (0.25; the other layers have none); and the skip's gate, times
    sigmoid(skip_gate) (0.5)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.split = cfg.skip_from + 1
        last, heads = cfg.num_layers - 1, cfg.num_heads
        initial = ([], [])
        self.lanes = []  # per layer: {name: (post?, first lane, lanes)}
        for i, kind in enumerate(cfg.attn_layout):
            lanes, side = {}, initial[i >= self.split]
            wanted = [("skip", [0.5])] if i == cfg.skip_to else []
            if kind != "-":
                wanted += [("inject", [0.0, 0.05])] if not (cfg.mudd and i == last) else []
                wanted += [("xsa", [0.0] * heads)] if i in cfg.xsa_layer_list else []
                wanted += [("out", [0.25] * heads)] if i in (cfg.skip_from, last) else []
            for name, values in wanted:
                lanes[name] = (i >= self.split, len(side), len(values))
                side.extend(values)
            self.lanes.append(lanes)
        self.pre, self.post = DenseMix(cfg.model_dim, initial[0]), DenseMix(cfg.model_dim, initial[1])

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
    """The pointer half of CPLM (the speedrun's pull request #379): one head of QK-normed queries and keys (a
    learned gain on the queries) over the final hidden states, attending causally within each document over the
    last `band` positions and to a learned sink. Its mass on earlier positions holding the target token is the
    pointer's probability of that token; the sink's mass goes back to the LM."""

    def __init__(self, dim: int, head_dim: int, band: int, use_triton: bool = False, sink_key: bool = False):
        super().__init__()
        self.band, self.use_triton = band, use_triton
        self.q_w = nn.Parameter(torch.empty(head_dim, dim))
        self.k_w = nn.Parameter(torch.empty(head_dim, dim))
        self.q_gain = nn.Parameter(torch.empty(head_dim))
        # the sink's logit, or with sink_key the key each query scores it by; shape [1], not [], as torchft's
        # DiLoCo cannot back up 0-d parameters
        self.sink = nn.Parameter(torch.empty(head_dim if sink_key else 1))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        bound = math.sqrt(3) * 0.5 * self.q_w.size(1) ** -0.5  # the attention matrices' init
        self.q_w.uniform_(-bound, bound)
        self.k_w.uniform_(-bound, bound)
        self.q_gain.fill_(1.0)
        self.sink.zero_()

    def forward(self, h: Tensor, tokens: Tensor, targets: Tensor, documents: Tensor) -> tuple[Tensor, Tensor]:
        """(log pointer mass on targets[t], log sink mass) per position of h [T, dim]; documents [T] numbers each
        position's document, increasing."""
        q = rms_norm(h @ self.q_w.to(h.dtype).T) * self.q_gain.to(h.dtype)
        k = rms_norm(h @ self.k_w.to(h.dtype).T)
        sink = (q.float() @ self.sink.float()) * q.size(1) ** -0.5 if self.sink.numel() > 1 else self.sink
        return copy_log_probs(q, k, sink, tokens, targets, documents, self.band, self.use_triton)


MATCH_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # the repeat lengths looked for (the pull request's)
MATCH_BUCKETS = 1 + 3 * len(MATCH_LENGTHS)  # no repeat; then per length: seen before once, twice, three times or more
# Two polynomial hashes modulo primes under 2**31, so no int64 product overflows: a key of about 62 bits
_MATCH_PRIMES, _MATCH_MULTIPLIERS = (2147483629, 2147483587), (1000003, 999331)


def longest_matches(tokens: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
    """For each position t: the longest L of MATCH_LENGTHS whose last L tokens (t-L+1 .. t, all in t's document)
    came before in the document, ending at some p < t; returns (tokens[p + 1] for the latest such p, the bucket:
    1 + 3 * (L's index) + (earlier repeats, 1 to 3 or more) - 1, or 0 where no length repeats). starts [T] marks
    where documents (and packed micro-batches) start. A stable sort of one hashed key per (length, position) puts
    every position right after its latest earlier repeat (the pull request's method); no host sync. The first
    position of a run of equal values in a sorted vector comes from searchsorted, not from a running maximum: torch's
    cummax of one long row is a scan with indices in one thread block, which took 12.8 ms of a 711 ms step on an
    H100 (docs/performance.md)."""
    T = tokens.numel()
    positions = torch.arange(T, device=tokens.device)
    documents = torch.cumsum(starts.long(), 0)  # nondecreasing: a document's first position is its start
    document_start = torch.searchsorted(documents, documents)
    tokens = tokens.long()
    ids = tokens + 1
    hashes = [torch.zeros_like(ids), torch.zeros_like(ids)]
    keys = []
    for length in range(1, MATCH_LENGTHS[-1] + 1):
        entering = F.pad(ids, (length - 1, 0))[:T]  # the token length-1 back (0 before the first)
        hashes = [(h * m + entering) % prime for h, m, prime in zip(hashes, _MATCH_MULTIPLIERS, _MATCH_PRIMES)]
        if length in MATCH_LENGTHS:
            # the document and the length go into the key: repeats count within one document, at one length
            mixed = [(h + (documents * 7919 + length) * (i + 1)) % prime
                     for i, (h, prime) in enumerate(zip(hashes, _MATCH_PRIMES))]
            key = mixed[0] * _MATCH_PRIMES[1] + mixed[1]
            # a context reaching before its document never matches: a distinct negative key each
            keys.append(torch.where(positions - (length - 1) >= document_start, key,
                                    -1 - (len(keys) * T + positions)))
    flat = torch.stack(keys).view(-1)
    ordered, order = torch.sort(flat, stable=True)  # equal keys stay in position order
    index = torch.arange(flat.numel(), device=tokens.device)
    repeats = torch.cat([torch.zeros(1, dtype=torch.bool, device=tokens.device), ordered[1:] == ordered[:-1]])
    previous = torch.where(repeats, torch.cat([order[:1], order[:-1]]), -1)
    earlier = index - torch.searchsorted(ordered, ordered)  # repeats of the key before this one
    previous = torch.empty_like(previous).scatter_(0, order, previous).view(len(MATCH_LENGTHS), T)
    earlier = torch.empty_like(earlier).scatter_(0, order, earlier).view(len(MATCH_LENGTHS), T)
    candidates, buckets = torch.zeros_like(ids), torch.zeros_like(ids)
    for i in range(len(MATCH_LENGTHS)):  # the longest repeat wins
        found = previous[i] >= 0
        following = tokens[(previous[i] % T + 1).clamp(max=T - 1)]
        candidates = torch.where(found, following, candidates)
        buckets = torch.where(found, 1 + 3 * i + earlier[i].clamp(max=3) - 1, buckets)
    return candidates, buckets


class LongestMatch(nn.Module):
    """The feature of longest_matches (the speedrun's pull request #378): the embedding of each position's
    candidate token times a learned scale of its bucket, plus a learned vector of its bucket. Both start at zero, so
    the model starts as it would without; it is added at the input (gain 0.5) and before the head (gain 1)."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(MATCH_BUCKETS))
        self.bucket_embed = nn.Parameter(torch.zeros(MATCH_BUCKETS, dim))
        self.gains = nn.Parameter(torch.empty(2))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        self.scale.zero_()
        self.bucket_embed.zero_()
        self.gains.copy_(torch.tensor([0.5, 1.0]))

    def forward(self, rows: Tensor, buckets: Tensor) -> Tensor:
        """The feature [T, dim] from the candidates' embedding rows; none from a candidate where nothing repeats."""
        scale = torch.where(buckets > 0, self.scale[buckets], 0.0).to(rows.dtype)
        return scale[:, None] * rows + self.bucket_embed[buckets].to(rows.dtype)


class _RowLookup(torch.autograd.Function):
    """The rows of one or more [rows, dim] tables at the same indices (the token table and the value-embedding
    tables all look up the tokens), each in its own dtype. The backward adds each table's row gradients
    straight into its .grad (add_rows_), which GPT.prepare_grads keeps dense over a step's forwards, and hands
    autograd no gradient for the tables: no sparse tensor is made, and only the rows a forward touched cost
    anything. Autograd still runs each table's AccumulateGrad node after this backward, with no gradient,
    and with it the post-accumulate hooks that launch DistAdam's reduce-scatter (tests/test_train.py checks
    they fire)."""

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
        use_triton = ctx.use_triton and all(grad.dtype == torch.float32 for grad in grads)
        add_rows_(grads, indices, row_grads, use_triton)
        return (None, None, None) + (None,) * len(ctx.tables)


class GPT(nn.Module):
    """kernels: the run's Triton kernels (choose_kernels); plain torch unless given. forward_micro_batches: the most
    micro-batches one forward packs (the rotary tables' length)."""

    def __init__(self, cfg: Config, attend, compute_dtype: torch.dtype, forward_micro_batches: int = 1,
                 kernels: Kernels = PLAIN_TORCH):
        super().__init__()
        self.cfg, self.attend, self.compute_dtype, self.kernels = cfg, attend, compute_dtype, kernels
        # padded for efficient matmuls; the copy pointer's gate is the row after the vocabulary
        vocab = next_multiple_of(cfg.vocab_size + cfg.copy_pointer, 128)
        dim = cfg.model_dim
        self.embed = nn.Embedding(vocab, dim)
        num_value_embeds = 1 + max((int(c) for c in cfg.value_embed_layout if c != "."), default=-1)
        self.value_embeds = nn.ModuleList(nn.Embedding(vocab, dim) for _ in range(num_value_embeds))
        paired = cfg.paired_layers
        last = cfg.num_layers - 1
        self.blocks = nn.ModuleList(Block(cfg, kind != "-", cfg.key_offset and kind == "L", i in paired,
                                          i in cfg.xsa_layer_list, kernels.fused_mlp, mixed=cfg.mudd and i == last)
                                    for i, kind in enumerate(cfg.attn_layout))
        self.attend_paired = attend.for_paired_heads() if paired else None
        for block in self.blocks:
            block.attend = self.attend_paired if block.paired else attend
        # sigmoid(-1.5) ~ 0.18 (speedrun 2025-09). Shape [1], not a 0-d scalar: torchft's DiLoCo cannot
        # back up 0-d parameters.
        self.skip_gate = nn.Parameter(torch.tensor([-1.5]))
        self.skip_gate_w = nn.Parameter(torch.zeros(cfg.gate_dims)) if cfg.gates and not cfg.token_gates else None
        self.token_gates = TokenGates(cfg) if cfg.token_gates else None
        self.smear_gate_w = nn.Parameter(torch.zeros(cfg.gate_dims)) if cfg.smear else None
        self.smear_scale = nn.Parameter(torch.zeros(1)) if cfg.smear else None
        self.backout = nn.Parameter(torch.tensor([0.5])) if cfg.backout_from >= 0 and not cfg.mudd else None
        if cfg.mudd:
            # Sources: the stream entering layer 0 (x_in), the outputs of layers backout_from (mid), last - 1 (prev)
            # and skip_from, and the first value embedding. The last layer's weights, read from prev: three for the
            # value added to v (x_in, mid, prev), three for its input (x_in, mid, prev: (1 + w) * prev), two
            # value-embedding gates (each for half the heads; 2 as the sigmoid gate's largest), its six sublayer
            # scales at the static ones' starting values. The head's, read from the last layer's output: x_in, mid,
            # prev, the value embedding, skip_from's output; mid's starts as the backout (-0.5).
            half_residual = cfg.residual_init ** 0.5
            self.mudd_layer = DenseMix(dim, [0.0] * 6 + [2.0, 2.0] + [half_residual, 1.0, 0.0, 0.05, half_residual, 1.0])
            self.mudd_head = DenseMix(dim, [0.0, -0.5, 0.0, 0.0, 0.0])
        else:
            self.mudd_layer = self.mudd_head = None
        bigram_dims = cfg.bigram_dims or dim
        self.bigram_embed = nn.Embedding(cfg.bigram_rows, bigram_dims) if cfg.bigram_rows else None
        if cfg.bigram_rows and cfg.bigram_signs:  # fixed, the same in every run and on every rank
            signs = torch.randint(0, 2, (cfg.bigram_signs, bigram_dims), generator=torch.Generator().manual_seed(0),
                                  device="cpu")
            self.register_buffer("bigram_signs", (2 * signs - 1).float(), persistent=False)
        else:
            self.bigram_signs = None
        classes = bigram_token_classes(cfg) if self.bigram_signs is not None else None
        self.register_buffer("token_classes", None if classes is None else torch.from_numpy(classes), persistent=False)
        self.lm_head = nn.Linear(dim, vocab, bias=False)  # its own weight; tie_embed trains the embedding as a copy
        self.copy_pointer = (CopyPointer(dim, cfg.head_dim, cfg.copy_band, kernels.copy_pointer, cfg.copy_sink_key)
                             if cfg.copy_pointer else None)
        self.longest_match = LongestMatch(dim) if cfg.longest_match else None
        self.find_matches = longest_matches  # compile_model compiles it on its own: the lookups around it stay eager
        self.rotary = Rotary(cfg.head_dim, forward_micro_batches * cfg.micro_batch_tokens, period=cfg.micro_batch_tokens,
                             attn_scale=cfg.attn_scale, paired=bool(paired))
        self.replays_cuda_graphs = False  # set when compiled in a CUDA_GRAPH_MODES mode
        # The multi-token loss weights, normalised: a buffer the compiled graphs read and set_mtp_weights
        # overwrites in place (no recompile, and CUDA graphs see the new values).
        offsets = max(len(stage) for stage in cfg.mtp_stages)
        self.register_buffer("mtp_weights", torch.zeros(offsets), persistent=False)
        self.mtp_weights[0] = 1.0
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        dim = self.cfg.model_dim
        bound = math.sqrt(3) * 0.5 * dim ** -0.5  # uniform with std 0.5/sqrt(dim)
        for block in self.blocks:
            if block.attn is not None:
                block.attn.qkvo_w.uniform_(-bound, bound)
            block.mlp.fc_w.uniform_(-bound, bound)
            block.mlp.proj_w.zero_()
        self.lm_head.weight.normal_(std=self.cfg.head_init_std) if self.cfg.head_init_std else self.lm_head.weight.zero_()
        if self.cfg.tie_embed:
            self.embed.weight.copy_(self.lm_head.weight)
        if self.bigram_embed is not None:
            self.bigram_embed.weight.zero_()
        for table in self.value_embeds:
            table.weight.normal_(std=self.cfg.value_embed_init_std)
        gates = (self.token_gates.pre, self.token_gates.post) if self.token_gates is not None else ()
        for mix in (self.mudd_layer, self.mudd_head, self.copy_pointer, self.longest_match, *gates):
            if mix is not None:
                mix.reset_parameters()

    def matrix_params(self) -> dict[str, list[nn.Parameter]]:
        """The hidden matrices (for Muon), by kind."""
        return {
            "attn": [b.attn.qkvo_w for b in self.blocks if b.attn is not None],
            "mlp_in": [b.mlp.fc_w for b in self.blocks],
            "mlp_out": [b.mlp.proj_w for b in self.blocks],
        }

    def compile_regions(self, mode: str | None):
        """Compile each block and the loss head separately: one small graph per distinct block type
        (attention or not) instead of one whole-model graph, which compiles several times faster."""
        # Block variants each take a cache entry of the one Block.forward; the default limit of 8
        # would silently fall back to eager if a configuration ever made more.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        for block in self.blocks:
            block.compile(dynamic=False, fullgraph=True, mode=mode)
        self.loss_head = torch.compile(self.loss_head, dynamic=False, fullgraph=True, mode=mode)

    def prepare_masks(self, tokens: Tensor, cu_seqlens: Tensor, windows: tuple[int, int], documents: int | None = None,
                      longest: int | None = None) -> dict:
        """The masks of each window kind ("S", "L"; "PS", "PL" for paired-head layers, over the doubled sequence)."""
        sizes = {"S": windows[0], "L": windows[1]}
        masks = self.attend.prepare(tokens.numel(), cu_seqlens, sizes, documents, longest)
        if self.attend_paired is not None:
            kinds = {self.cfg.attn_layout[i] for i, block in enumerate(self.blocks) if block.paired}
            doubled = self.attend_paired.prepare(2 * tokens.numel(), 2 * cu_seqlens, {kind: sizes[kind] for kind in kinds},
                                                 documents, None if longest is None else 2 * longest)
            masks.update({"P" + kind: mask for kind, mask in doubled.items()})
        return masks

    def embedding_tables(self) -> list[nn.Parameter]:
        tables = [self.embed.weight] + [ve.weight for ve in self.value_embeds]
        return tables + ([self.bigram_embed.weight] if self.bigram_embed is not None else [])

    def rows_read(self, batch: "ForwardBatch") -> dict:
        """{table: the rows a forward of `batch` (or of a loader slot, Prefetcher.peek) reads (sorted, unique, on the
        host)} for the tables whose rows the loader lists: the bigram table's, and the value tables' when it lists the
        tokens read (token_rows_used).
        The token embedding is left out: the longest matches read it at rows found on the GPU."""
        rows = {}
        if batch.bigram_rows_used is not None and self.bigram_embed is not None:
            rows[self.bigram_embed.weight] = batch.bigram_rows_used
        if batch.token_rows_used is not None:
            rows.update((table.weight, batch.token_rows_used) for table in self.value_embeds)
        return rows

    def prepare_grads(self):
        """Before a step's first backward. With row_embedding_grads each table gets a zeroed dense .grad for
        its row gradients to be added into. Under CUDA graphs every parameter does: a first gradient kept as
        .grad would live in the graph's memory, which the next forward's replay overwrites."""
        if self.replays_cuda_graphs:
            params = list(self.parameters())
        elif self.cfg.row_embedding_grads:
            params = self.embedding_tables()
        else:
            return
        for p in params:
            if p.grad is None:  # else it holds the gradients an optimizer is adding up over steps
                p.grad = torch.zeros_like(p)

    def forward(self, tokens: Tensor, targets: Tensor | None, masks: dict, bigrams: Tensor | None = None) -> Tensor:
        """Mean cross-entropy over one forward's tokens (one or several packed micro-batches): tokens, targets
        and bigram rows are [T]; without targets the [T, padded vocab] soft-capped logits. Call prepare_grads()
        before a step's first backward."""
        token_tables = [self.embed.weight] + [ve.weight for ve in self.value_embeds]
        match = None
        if self.longest_match is not None:
            candidates, buckets = self.find_matches(tokens, self.starts_of(tokens))
        if self.cfg.row_embedding_grads:
            use_triton = self.kernels.rows
            # The value and bigram rows go straight into the compute dtype, as the trunk would convert them
            # (same values, half the bytes to write, copy into the CUDA graph and read back); the token rows
            # are rms-normed in float32 first.
            dtypes = (self.embed.weight.dtype,) + (self.compute_dtype,) * len(self.value_embeds)
            token_rows, *value_rows = _RowLookup.apply(tokens, use_triton, dtypes, *token_tables)
            bigram_rows = None
            if self.bigram_embed is not None:
                bigram_rows, = _RowLookup.apply(bigrams, use_triton, (self.compute_dtype,), self.bigram_embed.weight)
            if self.longest_match is not None:
                match = _RowLookup.apply(candidates, use_triton, (self.compute_dtype,), self.embed.weight) + (buckets,)
        else:
            token_rows, *value_rows = [F.embedding(tokens, table) for table in token_tables]
            bigram_rows = F.embedding(bigrams, self.bigram_embed.weight) if self.bigram_embed is not None else None
            if self.longest_match is not None:
                match = (F.embedding(candidates, self.embed.weight), buckets)
        return self.trunk(tokens, token_rows, value_rows, bigram_rows, targets, masks, match)

    def starts_of(self, tokens: Tensor) -> Tensor:
        """Where a document (BOS) or a packed micro-batch starts: nothing reaches across (smear, key offset, the
        copy pointer, longest matches)."""
        positions = torch.arange(tokens.numel(), device=tokens.device)
        return (tokens == self.cfg.bos_token) | (positions % self.cfg.micro_batch_tokens == 0)

    def trunk(self, tokens: Tensor, token_rows: Tensor, value_rows: list[Tensor], bigram_rows: Tensor | None, targets: Tensor,
              masks: dict, match: tuple | None = None) -> Tensor:
        """Everything after the embedding lookups: the first cfg.front_layers layers (trunk_front), then the others and
        the loss (trunk_back). One graph when this is compiled whole; --compile_scope=split compiles the two halves
        apart, so that the back half's backward ends first and hands its parameters their gradients (starting their
        reduce-scatters) while the front half's backward still runs. match: (the candidates' embedding rows, their
        buckets) of longest_matches, with --longest_match."""
        state = self.trunk_front(tokens, token_rows, value_rows, bigram_rows, masks, match)
        return self.trunk_back(state, targets, masks)

    def trunk_front(self, tokens: Tensor, token_rows: Tensor, value_rows: list[Tensor], bigram_rows: Tensor | None,
                    masks: dict, match: tuple | None = None) -> dict:
        """The streams entering layer 0, then the first cfg.front_layers layers; returns what the later layers read."""
        cfg = self.cfg
        starts = self.starts_of(tokens)
        if self.smear_scale is not None:
            previous = torch.cat([token_rows[:1] * 0, token_rows[:-1]])
            gate = self.smear_scale * torch.sigmoid(token_rows[:, : cfg.gate_dims] @ self.smear_gate_w.to(token_rows.dtype))
            token_rows = token_rows + (gate * ~starts)[:, None] * previous
        matched = None
        if match is not None:  # after the smear, as the pull request adds it
            matched = self.longest_match(*match).float()
            token_rows = token_rows + self.longest_match.gains[0] * matched
        x0 = rms_norm(token_rows).to(self.compute_dtype)
        value_embeds = [rows.to(self.compute_dtype) for rows in value_rows]
        # Every attention block should call its compiled graph with inputs that look alike to dynamo's
        # guards: x not aliasing x0, and zeros that require grad like a real value embedding (inside
        # a whole-model graph there are no such guards, and dynamo cannot create a leaf that does).
        x = x0.clone()
        no_value_embed = torch.zeros_like(x0, requires_grad=not torch.compiler.is_compiling())
        bigram = self.bigram_input(tokens, starts, bigram_rows) if bigram_rows is not None else None
        first_bigram = bigram
        gates = self.token_gates
        pre = gates.pre(x0) if gates is not None else None
        if bigram is not None and self.blocks[0].injection is not None:  # the bigram enters before layer 0 there
            x, first_bigram = x0 + self.blocks[0].injection[1].to(x0.dtype) * bigram, None
        elif bigram is not None and gates is not None and "inject" in gates.lanes[0]:
            x, first_bigram = x0 + gates.lane(0, "inject", pre, None)[:, 1:] * bigram, None
        state = dict(x=x, x0=x0, x_in=x, tokens=tokens, starts=starts, value_embeds=value_embeds, no_value_embed=no_value_embed,
                     bigram=bigram, first_bigram=first_bigram, pre=pre, post=None, skip=None, attn_input=None,
                     backout=None, previous=None, matched=matched)
        return self.run_layers(state, range(self.cfg.front_layers), masks)

    def trunk_back(self, state: dict, targets: Tensor, masks: dict) -> Tensor:
        """The layers from cfg.front_layers on, the mix or backout before the head, and the loss."""
        state = self.run_layers(state, range(self.cfg.front_layers, len(self.blocks)), masks)
        x = state["x"]
        if self.mudd_head is not None:
            x = self.mudd_head.mix_into(x, (state["x_in"], state["backout"], state["previous"], state["value_embeds"][0],
                                            state["skip"]))
        elif self.backout is not None:
            x = x - self.backout.to(x.dtype) * state["backout"]
        if state["matched"] is not None:  # and again before the head's norm
            x = x + (self.longest_match.gains[1] * state["matched"]).to(x.dtype)
        return self.loss_head(x, targets, state["tokens"], state["starts"])

    def run_layers(self, state: dict, layers: range, masks: dict) -> dict:
        """The given blocks in order, from and into `state` (a new dict): the stream x, the streams later layers
        read (skip, attention input, backout, MUDD's previous), and the per-token gates."""
        cfg, gates = self.cfg, self.token_gates
        state = dict(state)
        x, x0 = state["x"], state["x0"]
        rope, paired_rope = self.rotary.tables(), self.rotary.paired_tables()
        last = len(self.blocks) - 1
        for i in layers:
            block = self.blocks[i]
            if gates is not None and i == gates.split:
                state["post"] = gates.post(x)
            pre, post = state["pre"], state["post"]
            if i == cfg.skip_to:
                gate = torch.sigmoid(self.skip_gate).to(x.dtype)
                if self.skip_gate_w is not None:
                    gate = gate * 2 * torch.sigmoid(x0[:, : cfg.gate_dims] @ self.skip_gate_w.to(x.dtype))[:, None]
                elif gates is not None:
                    gate = gate * gates.lane(i, "skip", pre, post)
                x = x + gate * state["skip"]
            ve_index = cfg.value_embed_layout[i]
            value_embed = state["no_value_embed"] if ve_index == "." else state["value_embeds"][int(ve_index)]
            kind = cfg.attn_layout[i]
            layer_rope, mask = (paired_rope, masks["P" + kind]) if block.paired else (rope, masks.get(kind))
            mix = None
            if self.mudd_layer is not None and i == last:
                state["previous"] = x
                x, mix = self.mix_into_last_layer(x, state["x_in"], state["backout"])
            token = gates.layer(i, pre, post) if gates is not None else None
            x = block(x, x0, value_embed, layer_rope, mask, state["first_bigram"] if i == 0 else state["bigram"],
                      state["starts"], state["attn_input"], mix, token)
            if i == cfg.attn_input_from:  # the layers after it attend to this output (speedrun 2026-03-06)
                state["attn_input"] = x
            if i == cfg.skip_from:
                state["skip"] = x
            if i == cfg.backout_from:
                state["backout"] = x
        state["x"] = x
        return state

    def bigram_input(self, tokens: Tensor, starts: Tensor, rows: Tensor) -> Tensor:
        """The bigram rows as the residual stream takes them: each times its sign vector, (previous token XOR
        token) mod their count (0 where a document or micro-batch starts; speedrun 2026-05-20), and zero past
        bigram_dims."""
        bigram = rows.to(self.compute_dtype)
        if self.bigram_signs is not None:
            if self.token_classes is not None:  # --bigram_normalize: the signs of the classes' pair, as the row
                tokens = self.token_classes[tokens]
            previous = torch.cat([tokens[:1], tokens[:-1]])
            index = torch.where(starts, 0, torch.bitwise_xor(previous, tokens) % self.bigram_signs.size(0))
            bigram = bigram * self.bigram_signs[index].to(bigram.dtype)
        narrower = self.cfg.model_dim - bigram.size(1)
        return F.pad(bigram, (0, narrower)) if narrower else bigram

    def mix_into_last_layer(self, x: Tensor, x_in: Tensor, mid: Tensor) -> tuple[Tensor, LayerMix]:
        """MUDD before the last layer, from its input x (the previous layer's output): the layer's new input and
        what it mixes in (speedrun 2026-04-22)."""
        w = self.mudd_layer(x)
        c = w[:, :6].split(1, dim=1)  # [T, 1] each
        value = c[0] * x_in + c[1] * mid + c[2] * x
        x = (1 + c[5]) * x + c[3] * x_in + c[4] * mid
        heads = self.cfg.num_heads
        value_gate = w[:, 6:8].repeat_interleave(heads // 2, dim=1)[..., None]  # lane 0: the first half of the heads
        return x, LayerMix(value, value_gate, tuple(w[:, 8:14].split(1, dim=1)))

    @torch.no_grad()
    def set_mtp_weights(self, weights: list[float]):
        """The multi-token loss weights from now on (normalised here); [1] is next-token only. One fill per weight:
        no host-to-device copy to wait for."""
        total = sum(weights)
        for k in range(self.mtp_weights.numel()):
            self.mtp_weights[k].fill_(weights[k] / total if k < len(weights) else 0.0)

    def loss_head(self, x: Tensor, targets: Tensor | None, tokens: Tensor | None = None,
                  starts: Tensor | None = None) -> Tensor:
        """The mean loss of the final stream x to targets; with the copy pointer the next-token term is of the
        mixture, and tokens and starts (where documents and micro-batches start) say what it can point at. Without
        targets, the LM's soft-capped logits (sampling leaves the pointer out)."""
        cfg = self.cfg
        use_triton = self.kernels.loss
        cap = (cfg.logit_softcap, cfg.logit_offset, cfg.logit_divisor)
        # rows of each micro-batch predict inside it only, so packed forwards compute the losses of separate ones
        mtp = (self.mtp_weights, cfg.micro_batch_tokens) if self.mtp_weights.numel() > 1 else None
        x = rms_norm(x)
        if targets is None:  # generation: the soft-capped logits themselves
            return softcap(x @ self.lm_head.weight.to(x.dtype).T, cap)
        copy = None
        if self.copy_pointer is not None:
            copy = (cfg.vocab_size, *self.copy_pointer(x, tokens, targets, torch.cumsum(starts.long(), 0)))
        if cfg.fp8_head:
            return fp8_softcapped_head(x, self.lm_head.weight, targets, cap, use_triton, mtp, copy, cfg.head_wgrad_rows)
        logits = x @ self.lm_head.weight.to(x.dtype).T
        if copy is not None:
            return copy_mixture_losses(softcap(logits, cap), targets, *copy, mtp).mean()
        return softcapped_cross_entropy(logits, targets, cap, use_triton, mtp)


# ----------------------------------------------------------------------------------------------------
# Comms


@dataclass(frozen=True)
class Comm:
    """Who we are in the job. Without a process group (world size 1) nothing is communicated."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def current_rank_and_world() -> tuple[int, int]:
    """Rank and size of the default process group; (0, 1) when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ----------------------------------------------------------------------------------------------------
# Optimizers
#
# The training loop sees only torch.optim-style objects (param_groups with an "initial_lr", zero_grad,
# step); each step() does its own gradient communication, so a sharded optimizer drops in unchanged.


def grads_or_zeros(params: list[Tensor]) -> list[Tensor]:
    """Each parameter's gradient, zeros for one that got none (what both optimizers send for it)."""
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


class _LaunchWhenGradsReady:
    """The backward hooks DistAdam and Muon share. While armed (the training loop arms them for the last
    forward's backward), `launch(unit)` runs as soon as every parameter of a unit (an Adam bucket,
    a Muon group: anything with .params) has its gradient accumulated, so the unit's reduce-scatter
    overlaps the rest of the backward."""

    def __init__(self, units: list, launch):
        self.unit_of = {p: unit for unit in units for p in unit.params}
        self.launch = launch
        self.armed = False
        self.ready: dict = {}  # unit -> parameters whose gradient is complete in this backward
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

    def remove(self):
        """Take the hooks off the parameters. A hook makes a cycle (parameter -> hook -> optimizer -> parameter)
        that the garbage collector does not free through a tensor, so without this the optimizer, and with
        it DistAdam's gloo group and that group's threads, live on until the interpreter's exit, where
        tearing them down aborts the process now and then ("terminate called without an active exception")."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


class _AdamBucket:
    """Parameters of one param group whose gradients travel in one reduce-scatter. A bucket is one
    tensor, or several small ones packed together; `shard` elements of its flat form belong to each rank.
    It keeps its group's index, not the group: load_state_dict replaces the param_groups dicts, and the
    hyperparameters must be read from the live ones."""

    def __init__(self, params: list[Tensor], group_index: int, world_size: int):
        self.params, self.group_index = params, group_index
        self.numel = sum(p.numel() for p in params)
        self.shard = -(-self.numel // world_size)
        self.padded = self.shard * world_size
        # One parameter of a size that divides evenly is used in place; anything else goes through a
        # zero-padded flat copy.
        self.in_place = len(params) == 1 and self.padded == self.numel
        self.pending = None  # waits for the communication; returns this rank's averaged gradient shard
        self.gather_dtype = None  # what its all-gather sends, when narrower than the parameter (DistAdam decides)

    def flat(self, tensors: list[Tensor]) -> Tensor:
        if self.in_place:
            return tensors[0].view(-1)
        flat = tensors[0].new_zeros(self.padded)
        torch.cat([t.reshape(-1) for t in tensors], out=flat[: self.numel])
        return flat

    def owned(self, flat: Tensor, rank: int) -> Tensor:
        """The slice of a flat form (from flat()) that `rank` owns."""
        return flat[rank * self.shard: (rank + 1) * self.shard]


class _MergedBuckets:
    """Small buckets of any param groups whose gradients travel in one reduce-scatter and whose updates in one
    all-gather. The packed buffer is rank-major: rank r's block is every member's shard r in turn, so the
    reduce-scatter hands each rank exactly the shards it owns of each member, each is updated with its own group's
    settings, and the all-gather of the blocks rebuilds every member: the math of one collective per bucket, with
    one launch and one rendezvous of the ranks instead of one per bucket."""

    def __init__(self, members: list[_AdamBucket], world_size: int):
        self.members, self.world_size = members, world_size
        self.params = [p for bucket in members for p in bucket.params]
        self.bounds = [0]
        for bucket in members:
            self.bounds.append(self.bounds[-1] + bucket.shard)
        self.shard = self.bounds[-1]  # one rank's block
        self.pending = None

    def pack(self, flats: list[Tensor]) -> Tensor:
        """Each member's padded flat vector, in the rank-major layout."""
        return torch.cat([flat.view(self.world_size, -1) for flat in flats], dim=1).reshape(-1)

    def split_block(self, block: Tensor) -> list[Tensor]:
        """One rank's block into each member's shard."""
        return [block[a:b] for a, b in zip(self.bounds, self.bounds[1:])]

    def unpack(self, packed: Tensor) -> list[Tensor]:
        """The rank-major buffer into each member's padded flat vector."""
        rows = packed.view(self.world_size, self.shard)
        return [rows[:, a:b].reshape(-1) for a, b in zip(self.bounds, self.bounds[1:])]


def union_of_rows(row_lists: list[np.ndarray], num_rows: int) -> np.ndarray:
    """The sorted union of row indices below num_rows, through a mask: at 24 micro-batches of 16K bigram rows,
    np.unique of their concatenation is about 70 times slower (docs/performance.md)."""
    touched = np.zeros(num_rows, dtype=bool)
    for rows in row_lists:
        touched[rows] = True
    return np.flatnonzero(touched)


class _RowsToOwners:
    """Sorted row indices of row-sharded tables sent to their owners (rank r owns rows [r*R, (r+1)*R)): the per-owner
    counts through all_to_all_single on the gloo group when built (CPU, while the GPU works), then, once, the indices
    themselves through all_to_all_single on the device (exchange_rows). The sparse gradient exchange and the row fetch
    both start this way."""

    def __init__(self, rows: np.ndarray, rows_per_rank: int, world_size: int, pin: bool, cpu_group):
        self.rows_per_rank, self.world_size = rows_per_rank, world_size
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        self.send_counts = np.diff(np.searchsorted(rows, np.arange(world_size + 1) * rows_per_rank))
        self.send_rows = torch.from_numpy(rows)
        if pin:
            self.send_rows = self.send_rows.pin_memory()
        self.recv_counts = torch.empty(world_size, dtype=torch.int64)
        self.counts_sent = dist.all_to_all_single(self.recv_counts, torch.from_numpy(self.send_counts),
                                                  group=cpu_group, async_op=True)
        self.rows = None  # after exchange_rows: (the rows sent, on the device; the rows received; their wait)

    def exchange_rows(self, device: torch.device) -> tuple[list[int], list[int]]:
        """Launch the indices' exchange (the first call only); returns the (sent, received) row counts by rank."""
        self.counts_sent.wait()  # a CPU collective: the host waits, the GPU does not
        send_splits, recv_splits = self.send_counts.tolist(), self.recv_counts.numpy().tolist()
        if self.rows is None:
            send_rows = self.send_rows.to(device, non_blocking=True)
            recv_rows = torch.empty(sum(recv_splits), dtype=torch.int64, device=device)
            work = dist.all_to_all_single(recv_rows, send_rows, recv_splits, send_splits, async_op=True)
            self.rows = (send_rows, recv_rows, work)
        return send_splits, recv_splits


class _RowExchange(_RowsToOwners):
    """One step's sparse gradient exchange for row-sharded tables of one height, read at the same rows (see DistAdam).
    Built when the touched rows are known; launch() runs once per table, when its gradient is ready. The row indices
    travel once, at the first launch."""

    def __init__(self, param: Tensor, rows: np.ndarray, rank: int, world_size: int, cpu_group):
        super().__init__(rows, param.size(0) // world_size, world_size, param.is_cuda, cpu_group)
        self.rank = rank

    def launch(self, grad: Tensor, dtype: torch.dtype | None = None):
        """Send the touched rows to their owners (in dtype when given); returns a function that waits and gives
        this rank's averaged gradient shard (flat), summed in grad's dtype."""
        send_splits, recv_splits = self.exchange_rows(grad.device)
        send_rows, recv_rows, rows_sent = self.rows
        values = grad.index_select(0, send_rows)
        if dtype is not None:
            values = values.to(dtype)
        recv_values = values.new_empty(sum(recv_splits), grad.size(1))
        values_sent = dist.all_to_all_single(recv_values, values, recv_splits, send_splits, async_op=True)

        def finish() -> Tensor:
            rows_sent.wait()
            values_sent.wait()
            shard = grad.new_zeros(self.rows_per_rank, grad.size(1))
            shard.index_add_(0, recv_rows - self.rank * self.rows_per_rank, recv_values.to(grad.dtype))
            return shard.div_(self.world_size).view(-1)
        return finish


class _RowFetch(_RowsToOwners):
    """One Adam update's row fetch for tables of one height read at the same rows (see DistAdam's fetch_tables).
    Built before the last backward from the rows this rank's forwards read until the next update, less its own
    block (current after its update): the counts asked of each owner travel at once, the row indices once the step's
    reduce-scatters are launched (ask), and the rows after the tables' update (send)."""

    def __init__(self, tables: list[Tensor], rows: np.ndarray, rank: int, world_size: int, cpu_group):
        rows_per_rank = tables[0].size(0) // world_size
        own = (rows >= rank * rows_per_rank) & (rows < (rank + 1) * rows_per_rank)
        super().__init__(rows[~own], rows_per_rank, world_size, tables[0].is_cuda, cpu_group)
        self.tables = tables

    def ask(self):
        """Send each owner the indices of the rows this rank needs from it."""
        self.exchange_rows(self.tables[0].device)

    def send(self, dtype: torch.dtype | None = None):
        """After this rank's blocks of the tables are updated: send the rows asked of it (in dtype when given, the
        tables side by side in one buffer) and receive those it asked for. Returns the function that waits and
        writes them into the tables."""
        asked_of_owners, asked_of_us = self.exchange_rows(self.tables[0].device)
        need, asked, asked_sent = self.rows
        asked_sent.wait()
        values = torch.cat([table.index_select(0, asked).to(dtype or table.dtype) for table in self.tables], dim=1)
        received = values.new_empty(need.size(0), values.size(1))
        work = dist.all_to_all_single(received, values, asked_of_owners, asked_of_us, async_op=True)

        def finish():
            work.wait()
            for table, part in zip(self.tables, received.split([t.size(1) for t in self.tables], dim=1)):
                table.index_copy_(0, need, part.to(table.dtype))
        return finish


class DistAdam(torch.optim.Optimizer):
    """Adam with cautious weight decay (adam_update_), gradients, optimizer state and updates sharded over ranks
    (ZeRO-1 style; the speedrun's 2025-05 "replace all_reduce with reduce_scatter" record).

    Every parameter is seen as a flat vector of which rank r owns the contiguous slice
    [r*shard, (r+1)*shard); exp_avg and exp_avg_sq exist only for that slice, so the state is 1/world
    of plain AdamW's. Small parameters of one param group share a bucket (their gradients are packed
    with one copy); a bucket whose size is not a multiple of the world size is zero-padded to the next
    multiple (in the default model the scalar bucket, 68 values padded to 72 at 8 ranks, and the two gate vectors
    of 12, each padded to 16; padding stays zero because its gradient is zero).

    Communication schedule of one step, world size W > 1 (W = 1 sends nothing):
      1. reduce_scatter_tensor (average) of each bucket's gradient into this rank's shard, launched from
         a backward hook as soon as the bucket's last gradient is accumulated, when the training loop
         armed the hooks (before_last_backward) for the last forward; otherwise at step(). The buckets under
         MERGE values (the scalars, gates and small MLPs of every group) go together in one reduce-scatter
         (_MergedBuckets): each collective costs a launch and a rendezvous of the ranks, whatever its size; a tied
         pair (tied=) sends its summed gradient in the leader's reduce-scatter;
      2. in launch order, for each bucket (or the merged ones): wait for its reduce-scatter, update the owned
         slice (adam_update_, compiled on CUDA; the merged ones together in multi-tensor ops, adam_update_multi_),
         launch all_gather_into_tensor of the updated slice into the parameter;
      3. wait for every all-gather (and unpack packed buckets into their parameters). launch_step does 1 and 2
         and returns 3, which the training loop runs after the other optimizer's launch.
    A parameter under gather_dtypes (--bf16_table_gathers: the value and bigram tables, which the forward reads
    only as rows cast to the compute dtype) is all-gathered in that dtype, half the bytes of fp32: each rank keeps
    its own slice in full precision and the others' slices as the owners' values rounded, which cast to the
    compute dtype give the same rows as the full values, so every rank's forward is the one rank's. exact_params()
    gathers the full values when the whole weights are read (a checkpoint).
    No all_reduce is issued. A step while `accumulating` (--adam_period > 1) sends nothing and updates
    nothing: its gradients add to the next step's, which sends their sum (and the union of both steps' rows).

    fetch_tables (--table_row_fetch): groups of tables read only at one list of rows (the value tables at the
    tokens, the bigram table at the bigram rows; 2-D, rows divisible by the world size). When the training loop
    passes the rows this rank's forwards read until Adam's next update (rows_ahead, from the loader), their
    all-gathers in step 2 become a fetch of those rows: the per-owner counts through all_to_all_single on the gloo
    group at once (CPU, while the forward runs); the row indices through all_to_all_single after step 1's launches;
    once the group's tables are updated, one all_to_all_single of the asked rows, the tables side by side, which
    every rank writes into its tables in step 3. Every forward until the next update then reads the owners' values,
    as after the dense all-gathers, while the rows no forward reads stay stale until whole_tables() (validation, a
    checkpoint, the end of training) gathers the tables whole. Without rows_ahead the tables are gathered whole.

    sparse_params (2-D, rows divisible by the world size), e.g. the bigram table: when the training loop
    passes the rows this rank's batches touched since the last step (sorted, unique; known on the host
    from the loader), step 1 becomes a sparse exchange (the speedrun's 2026-02-06 record): the per-owner
    row counts go through all_to_all_single on a gloo group right away (CPU, while the forward runs);
    when the gradient is ready, the row indices and then the gradient rows go to their owners with
    all_to_all_single (split sizes from the host counts, so nothing waits on the GPU); each owner sums
    what it receives into its shard. Untouched rows have zero gradient, so this equals the dense
    reduce-scatter up to summation order. The all-gather stays dense. Tables read at the same rows (the value
    tables under --sparse_value_comms) share one count exchange and one exchange of the row indices.
    """

    SMALL = 8192  # parameters below this many values share their param group's bucket
    MERGE = 1 << 20  # on several ranks, buckets below this many values share one reduce-scatter and all-gather

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, sparse_params=(), compiled: bool = False, tied: tuple | None = None,
                 grad_dtype: torch.dtype | None = None, gather_dtypes: dict | None = None, fetch_tables=()):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.grad_dtype = grad_dtype  # gradients rounded to it before they travel (--bf16_grad_comms); None: as is
        self.gather_dtypes = dict(gather_dtypes or {})  # {parameter: what its all-gather sends}
        # compiled: one fused kernel per bucket shape (CUDA); the lr and decay go in as tensors, so a new value
        # is no new graph. The shards under MERGE values share one graph of symbolic length per betas and eps
        # (update_small_): the default model's 26 buckets came to 16 graphs, each compiled in a cold start, where the
        # small ones now make 2 (on several ranks the merged ones take adam_update_multi_ instead). Not tuned by
        # --tune_kernels: a memory-bound elementwise kernel gains nothing from it.
        untuned = {"coordinate_descent_tuning": False}
        self.update_, self.update_small_ = (
            (torch.compile(adam_update_, dynamic=False, fullgraph=True, options=untuned),
             torch.compile(adam_update_, dynamic=True, fullgraph=True, options=untuned))
            if compiled else (adam_update_, adam_update_))
        self.scalars: dict[int, Tensor] = {}  # group index -> [lr, decay] on the parameters' device
        self.rank, self.world_size = current_rank_and_world()
        self.distributed = self.world_size > 1
        self.sparse_params = set(sparse_params) if self.distributed else set()
        for p in self.sparse_params:
            if p.ndim != 2 or p.size(0) % self.world_size or p.numel() < self.SMALL:
                raise ValueError(f"sparse parameter of shape {tuple(p.shape)}: needs rows divisible by the world size")
        # a group is fetched when each table's rows split evenly over the ranks and it has a bucket of its own; the
        # rest are gathered whole (the tiny tables of a test model)
        self.fetch_groups = [list(tables) for tables in fetch_tables if tables and all(
            p.ndim == 2 and p.size(0) % self.world_size == 0 and p.numel() >= self.SMALL for p in tables)
        ] if self.distributed else []
        fetched = {p for tables in self.fetch_groups for p in tables}
        if fetched & set(tied or ()):
            raise ValueError("a tied parameter cannot be fetched by rows")
        self.cpu_group = dist.new_group(backend="gloo") if self.sparse_params or fetched else None
        self.row_exchanges: dict[Tensor, _RowExchange] = {}
        self.buckets: list[_AdamBucket] = []
        for index, group in enumerate(self.param_groups):
            small = [p for p in group["params"] if p.numel() < self.SMALL]
            self.buckets += [_AdamBucket([p], index, self.world_size) for p in group["params"] if p.numel() >= self.SMALL]
            if small:
                self.buckets.append(_AdamBucket(small, index, self.world_size))
        # tied = (follower, leader), two parameters of one shape: until untie() the follower is not updated but
        # adds its gradient to the leader's before they travel and is overwritten with the leader after each step.
        # Whether they are still tied lives in the follower's state (empty until untie()), so a loaded state dict
        # carries it.
        self.tied = tied
        self.tied_ready: set = set()  # the tied buckets whose gradients are done in this step (_launch_reduce)
        for bucket in self.buckets:  # what the all-gather of each one-parameter bucket sends (None: its own dtype)
            dtype = self.gather_dtypes.get(bucket.params[0]) if len(bucket.params) == 1 else None
            bucket.gather_dtype = dtype if self.distributed and dtype != bucket.params[0].dtype else None
        apart = (self.sparse_params | set(tied or ()) | fetched
                 | {b.params[0] for b in self.buckets if b.gather_dtype is not None})
        mergeable = [b for b in self.buckets if b.numel < self.MERGE and not set(b.params) & apart]
        merged = [_MergedBuckets(mergeable, self.world_size)] if self.distributed and len(mergeable) > 1 else []
        # what travels in one collective: a bucket, or the merged small ones
        self.units: list = [b for b in self.buckets if not merged or b not in mergeable] + merged
        self.launched: list = []
        self.host_steps = None  # (the merged buckets' step tensors, their counts on the host): _update_merged
        self.grad_hooks = _LaunchWhenGradsReady(self.units, self._launch_reduce)
        # Set before each step by the training loop (--adam_period): while accumulating, step() and zero_grad()
        # do nothing, so the step's gradients add to the .grad of the next, and its sparse rows wait here.
        self.accumulating = False
        self.deferred_rows: dict[Tensor, list] = {}
        self.fetches: list[_RowFetch] = []  # this update's row fetches (before_last_backward)
        self.fetched_buckets = {b.params[0]: b for b in self.buckets if b.params[0] in fetched}
        self.stale = False  # whether some fetched table holds rows older than its owner's (whole_tables)
        if tied is not None:
            follower, leader = tied
            self.tied_buckets = [next((b for b in self.buckets if len(b.params) == 1 and b.params[0] is p), None)
                                 for p in tied]
            if follower.shape != leader.shape or None in self.tied_buckets:
                raise ValueError("tied parameters need one shape and a bucket each")

    def before_last_backward(self, sparse_rows: dict | None = None, rows_ahead: dict | None = None):
        """Let the coming backward launch each bucket's reduce-scatter as soon as its gradients are done.
        sparse_rows: {sparse parameter: the rows each of this rank's forwards of the step touched (a list of
        sorted unique arrays)}; starts their counts exchange. Rows of other parameters are not looked at.
        rows_ahead: {table: the rows each forward until the next update reads} for the fetched tables; starts the
        counts of their fetch. A table missing from it fetches every row (its forwards could not be listed: every rank
        still takes part in the same collectives); None fetches nothing and the tables are gathered whole."""
        if self.accumulating:
            for p, row_lists in (sparse_rows or {}).items():
                if p in self.sparse_params:  # the only ones whose rows are exchanged
                    self.deferred_rows.setdefault(p, []).extend(row_lists)
            return
        self.grad_hooks.armed = True
        made = []  # tables read at the same rows (the value tables) share one exchange: one count exchange on gloo
        for p, row_lists in (sparse_rows or {}).items():
            if p in self.sparse_params:
                rows = union_of_rows(self.deferred_rows.pop(p, []) + list(row_lists), p.size(0))
                exchange = next((e for e, r in made if e.rows_per_rank * self.world_size == p.size(0)
                                 and np.array_equal(r, rows)), None)
                if exchange is None:
                    exchange = _RowExchange(p, rows, self.rank, self.world_size, self.cpu_group)
                    made.append((exchange, rows))
                self.row_exchanges[p] = exchange
        if rows_ahead is not None:
            self.fetches = [_RowFetch(tables, union_of_rows(rows_ahead[tables[0]], tables[0].size(0))
                                      if tables[0] in rows_ahead else np.arange(tables[0].size(0)),
                                      self.rank, self.world_size, self.cpu_group)
                            for tables in self.fetch_groups]

    def _reduce_scatter(self, flat: Tensor, shard: int):
        """Launch the averaging reduce-scatter of flat (in grad_dtype when set); returns a function that waits and
        gives this rank's shard in flat's dtype."""
        sent = flat if self.grad_dtype is None else flat.to(self.grad_dtype)
        out = sent.new_empty(shard)
        work = dist.reduce_scatter_tensor(out, sent, op=dist.ReduceOp.AVG, async_op=True)
        return lambda: (work.wait(), out.to(flat.dtype))[1]

    def _launch_reduce(self, bucket):
        if isinstance(bucket, _MergedBuckets):
            packed = bucket.pack([member.flat(grads_or_zeros(member.params)) for member in bucket.members])
            bucket.pending = self._reduce_scatter(packed, bucket.shard)
            self.launched.append(bucket)
            return
        grads = grads_or_zeros(bucket.params)
        if self.is_tied() and bucket in self.tied_buckets:
            # The update reads only the pair's summed gradient, so the sum travels, in the leader's reduce-scatter:
            # one collective of the table's size where two would be (the follower's pending only marks it sent).
            self.tied_ready.add(bucket)
            if len(self.tied_ready) < 2:
                return
            follower, leader = self.tied_buckets
            grads = [grads_or_zeros(leader.params)[0] + grads_or_zeros(follower.params)[0]]
            follower.pending, bucket = (lambda: None), leader
        exchange = self.row_exchanges.pop(bucket.params[0], None)
        if exchange is not None:
            bucket.pending = exchange.launch(grads[0], self.grad_dtype)
        elif self.distributed:
            bucket.pending = self._reduce_scatter(bucket.flat(grads), bucket.shard)
        else:
            flat = bucket.flat(grads)
            if self.grad_dtype is not None:  # rounded as it would be on its way to the other ranks
                flat = flat.to(self.grad_dtype).to(flat.dtype)
            bucket.pending = lambda: flat
        self.launched.append(bucket)

    def zero_grad(self, set_to_none: bool = True):
        if not self.accumulating:
            super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self):
        self.launch_step()()

    @torch.no_grad()
    def launch_step(self):
        """Steps 1 and 2 of the schedule: every update computed and its all-gather launched. Returns the function
        that does step 3 (waits for the all-gathers and writes the parameters), so that the training loop can
        finish another optimizer's step while these all-gathers are on the wire (train_step)."""
        if self.accumulating:
            return lambda: None
        for unit in self.units:
            if unit.pending is None:
                self._launch_reduce(unit)
        for fetch in self.fetches:
            fetch.ask()
        fetched = {table for fetch in self.fetches for table in fetch.tables}
        gathers = []
        tied = self.is_tied()
        for index, group in enumerate(self.param_groups):  # each group's lr and decay, once a step
            if index not in self.scalars:
                self.scalars[index] = torch.zeros(2, device=group["params"][0].device)
            self.scalars[index][0].fill_(group["lr"])  # a fill kernel each: no host-to-device copy to wait for
            self.scalars[index][1].fill_(cautious_decay(group))
        for bucket in self.launched:
            if isinstance(bucket, _MergedBuckets):
                flats = [member.flat(member.params) for member in bucket.members]
                owned = [member.owned(flat, self.rank) for member, flat in zip(bucket.members, flats)]
                self._update_merged(bucket.members, owned, bucket.split_block(bucket.pending()))
                packed = owned[0].new_empty(bucket.shard * self.world_size)
                gathers.append((bucket, packed, self._all_gather(bucket, packed, torch.cat(owned))))
                continue
            if tied and bucket is self.tied_buckets[0]:
                continue  # its gradient travelled in the leader's (_launch_reduce)
            grad_shard = bucket.pending()
            flat = bucket.flat(bucket.params)
            owned = bucket.owned(flat, self.rank)
            self._update(bucket, owned, grad_shard)
            if bucket.params[0] in fetched:
                continue  # its rows travel in the fetch below
            if self.distributed:
                gathers.append((bucket, flat, self._all_gather(bucket, flat, owned, bucket.gather_dtype)))
            elif not bucket.in_place:
                gathers.append((bucket, flat, None))
        # updated in place (rows divisible by the world size): nothing left to write but the fetched rows
        gathers += [(None, None, fetch.send(self.fetched_buckets[fetch.tables[0]].gather_dtype))
                    for fetch in self.fetches]
        self.stale = bool(self.fetches)  # the other fetched tables were gathered whole
        for unit in self.units:
            unit.pending = None
        self.fetches = []
        self.launched = []
        self.row_exchanges = {}
        self.tied_ready.clear()
        self.grad_hooks.disarm()

        @torch.no_grad()
        def finish():
            params, values = [], []  # gathered values for the parameters not updated in place: one copy for all
            for bucket, flat, wait in gathers:
                if wait is not None:
                    wait()
                if bucket is None:  # a row fetch
                    continue
                if isinstance(bucket, _MergedBuckets):
                    for member, member_flat in zip(bucket.members, bucket.unpack(flat)):
                        params += member.params
                        values += self._param_views(member, member_flat)
                elif not bucket.in_place:
                    params += bucket.params
                    values += self._param_views(bucket, flat)
            if params:
                torch._foreach_copy_(params, values)
            if tied:
                self.tied[0].copy_(self.tied[1])
        return finish

    def _all_gather(self, bucket, flat: Tensor, owned: Tensor, dtype: torch.dtype | None = None):
        """Launch the all-gather of this rank's updated slice (owned; a view of flat for a bucket, the packed block
        of merged ones) into flat; returns the function that waits for it. In a narrower dtype (a bucket's) the
        others' slices arrive rounded and this rank's own stays."""
        if dtype is None:
            return dist.all_gather_into_tensor(flat, owned, async_op=True).wait
        gathered = flat.new_empty(bucket.padded, dtype=dtype)
        work = dist.all_gather_into_tensor(gathered, owned.to(dtype), async_op=True)
        start, end = self.rank * bucket.shard, (self.rank + 1) * bucket.shard

        def finish():
            work.wait()
            flat[:start].copy_(gathered[:start])
            flat[end:].copy_(gathered[end:])
        return finish

    @torch.no_grad()
    def whole_tables(self):
        """Every rank the whole of the tables fetched by rows (fetch_tables), from their owners (a dense all-gather
        each, in their own dtype): before anything but a training forward reads them (validation, a checkpoint, the
        weights' checksum). Nothing when no row is stale."""
        if self.stale:
            for bucket in self.fetched_buckets.values():
                self._gather_whole(bucket)
            self.stale = False

    @torch.no_grad()
    def exact_params(self):
        """Give every rank the full-precision values of the parameters all-gathered in a narrower dtype, from their
        owners (one all-gather each, in their own dtype), and the tables fetched by rows whole: before the whole
        weights are read, as a checkpoint does. The forward is the same before and after."""
        self.whole_tables()
        for bucket in self.buckets:
            if bucket.gather_dtype is not None:
                self._gather_whole(bucket)

    def _gather_whole(self, bucket: _AdamBucket):
        """The bucket's parameters whole on every rank, each slice its owner's (one all-gather, in their own dtype)."""
        flat = bucket.flat(bucket.params)
        self._all_gather(bucket, flat, bucket.owned(flat, self.rank))()
        if not bucket.in_place:
            torch._foreach_copy_(bucket.params, self._param_views(bucket, flat))

    @staticmethod
    def _param_views(bucket: _AdamBucket, flat: Tensor) -> list[Tensor]:
        """Each of the bucket's parameters as a view of its flat form."""
        offsets = itertools.accumulate((p.numel() for p in bucket.params), initial=0)
        return [flat[offset: offset + p.numel()].view_as(p) for p, offset in zip(bucket.params, offsets)]

    def close(self):
        """End of training: remove the gradient hooks (_LaunchWhenGradsReady.remove says why)."""
        self.grad_hooks.remove()

    def is_tied(self) -> bool:
        return self.tied is not None and not self.state[self.tied[0]].get("untied", False)

    def untie(self):
        """From now on the follower trains alone, starting from a copy of the Adam state they shared."""
        follower, leader = self.tied
        self.state[follower] = {key: value.clone() if isinstance(value, Tensor) else value
                                for key, value in self.state[leader].items()}
        self.state[follower]["untied"] = True

    def load_state_dict(self, state_dict: dict):
        super().load_state_dict(state_dict)
        # torch leaves a loaded "step" on the device it was saved from (the CPU, after torchft's
        # checkpoint transfer); the fused kernel needs it beside the moments.
        for state in self.state.values():
            if "step" in state:
                state["step"] = state["step"].to(state["exp_avg"].device)

    def _state(self, bucket: _AdamBucket, owned: Tensor) -> dict:
        state = self.state[bucket.params[0]]
        if "step" not in state:  # the first update (an untie before it leaves the follower only its flag)
            state["step"] = torch.zeros((), dtype=torch.float32, device=owned.device)
            state["exp_avg"] = torch.zeros_like(owned)
            state["exp_avg_sq"] = torch.zeros_like(owned)
        return state

    def _update_merged(self, members: list[_AdamBucket], owned: list[Tensor], grad_shards: list[Tensor]):
        """The merged small buckets' updates as a few multi-tensor ops (adam_update_multi_), not a compiled call
        each: 18 buckets in the default model at 8 ranks, whose launches the host paid on every Adam step. Their
        step counts are kept on the host too: 0 for a state made here, else read from the device once (one sync)
        whenever the step tensors are new ones (a loaded or rebuilt state)."""
        fresh = all("step" not in self.state[member.params[0]] for member in members)
        states = [self._state(member, own) for member, own in zip(members, owned)]
        steps = [state["step"] for state in states]
        if self.host_steps is None or any(a is not b for a, b in zip(self.host_steps[0], steps)):
            self.host_steps = (steps, [0] * len(steps) if fresh else
                               [int(count) for count in torch.stack(steps).tolist()])
        counts = [count + 1 for count in self.host_steps[1]]
        self.host_steps = (steps, counts)
        torch._foreach_add_(steps, 1)
        settings = [self.param_groups[member.group_index] for member in members]
        adam_update_multi_(owned, grad_shards, [state["exp_avg"] for state in states],
                           [state["exp_avg_sq"] for state in states], counts, settings)

    def _update(self, bucket: _AdamBucket, owned: Tensor, grad_shard: Tensor):
        state = self._state(bucket, owned)
        state["step"] += 1
        group = self.param_groups[bucket.group_index]
        scalars = self.scalars[bucket.group_index]
        beta1, beta2 = group["betas"]
        update_ = self.update_small_ if owned.numel() < self.MERGE else self.update_
        update_(owned, grad_shard, state["exp_avg"], state["exp_avg_sq"], state["step"], scalars[0], scalars[1],
                beta1, beta2, group["eps"])


def adam_update_(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor, lr: Tensor,
                 decay: Tensor, beta1: float, beta2: float, eps: float) -> None:
    """One Adam step of a flat slice, in place, as torch.optim.Adam computes it, then cautious weight decay
    (Chen et al. 2025; speedrun 2025-12-18 for Adam's tables): where the update and the weight have the same sign
    the weight also shrinks by `decay` (lr squared times the group's weight_decay) of itself."""
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
    update = (lr / bias1) * exp_avg / (exp_avg_sq.sqrt() / bias2.sqrt() + eps)
    p.sub_(update + decay * (update * p > 0) * p)


def cautious_decay(group: dict) -> float:
    """The fraction of itself a decayed weight of this param group loses in a step: lr squared times the group's
    weight_decay, so the decay follows the schedule's lr squared."""
    return group["lr"] ** 2 * group["weight_decay"]


def foreach_same_sign(updates: list[Tensor], weights: list[Tensor], strict: bool) -> list[Tensor]:
    """1 where update * weight > 0 (strict) or >= 0, else 0, for each pair: the masks of cautious weight decay in
    multi-tensor ops, which have no comparison: sign(update * weight) clamped at 0, or plus 1 clamped at 1."""
    masks = torch._foreach_mul(updates, weights)
    torch._foreach_sign_(masks)
    if strict:
        torch._foreach_clamp_min_(masks, 0)
    else:
        torch._foreach_add_(masks, 1.0)
        torch._foreach_clamp_max_(masks, 1.0)
    return masks


def adam_update_multi_(ps: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                       steps: list[int], groups: list[dict]) -> None:
    """adam_update_ for many slices at once, each with its param group's settings (lr, betas, eps, weight_decay)
    and its step count, both on the host: a few multi-tensor ops whatever the number of slices. The bias
    corrections are computed on the host in float64, where adam_update_ computes them in float32 on the device;
    the update is otherwise the same sequence of operations."""
    for beta1 in {group["betas"][0] for group in groups}:  # lerp_ takes one weight per call
        chosen = [i for i, group in enumerate(groups) if group["betas"][0] == beta1]
        torch._foreach_lerp_([exp_avgs[i] for i in chosen], [grads[i] for i in chosen], 1 - beta1)
    beta2s = [group["betas"][1] for group in groups]
    torch._foreach_mul_(exp_avg_sqs, beta2s)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, [1 - beta2 for beta2 in beta2s])
    denominators = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denominators, [math.sqrt(1 - beta2 ** step) for beta2, step in zip(beta2s, steps)])
    torch._foreach_add_(denominators, [group["eps"] for group in groups])
    updates = torch._foreach_mul(exp_avgs, [group["lr"] / (1 - group["betas"][0] ** step)
                                            for group, step in zip(groups, steps)])
    torch._foreach_div_(updates, denominators)
    # cautious weight decay where there is any: where update * p > 0
    decays = [cautious_decay(group) for group in groups]
    decayed = [i for i, decay in enumerate(decays) if decay]
    if decayed:
        masks = foreach_same_sign([updates[i] for i in decayed], [ps[i] for i in decayed], strict=True)
        torch._foreach_mul_(masks, [decays[i] for i in decayed])
        torch._foreach_mul_(masks, [ps[i] for i in decayed])
        torch._foreach_add_([updates[i] for i in decayed], masks)
    torch._foreach_sub_(ps, updates)


# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): per-iteration coefficients for
# X <- a X + (b A + c A^2) X with A = X X^T, computed for 5 iterations with safety factor 2e-2; the
# values are the ones the speedrun adopted in its 2025-09-29 record. They drive every singular value
# of X into roughly [0.7, 1.1] from anywhere in (0, 1].
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def orthogonalized_dtype(grads: Tensor) -> torch.dtype:
    """What orthogonalize computes and returns in: bf16 on the GPU (the iteration is robust to it), fp32 elsewhere
    so CPU tests are exact."""
    return torch.bfloat16 if grads.is_cuda else torch.float32


def orthogonalize(grads: Tensor, use_triton: bool) -> Tensor:
    """Approximately replace each matrix of a [..., rows, cols] batch by U V^T of its SVD.

    In orthogonalized_dtype. With use_triton (Kernels.newton_schulz; CUDA), X X^T and b A + c A A (A symmetric) use
    the symmetric kernel, which skips the products above the diagonal (the speedrun's 2025-07 Triton Muon record);
    otherwise plain torch.
    """
    X = grads.to(orthogonalized_dtype(grads))
    transposed = X.size(-2) > X.size(-1)
    if transposed:  # iterate on the smaller Gram matrix
        X = X.mT
    # Frobenius norm bounds the spectral norm: after this every singular value is below 1.
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6)
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


def plan_muon_groups(shapes: list[tuple[int, ...]], world_size: int, layers: list[int] | None = None) -> list[list[int]]:
    """Split matrices (by index) into communication groups: one shape per group, smaller shapes first,
    and each shape's matrices in two halves whose sizes are multiples of the world size when the count
    allows it, so a reduce-scatter needs no padding and the second half's communication overlaps the
    first half's orthogonalisation. A group whose size is not a multiple of world_size gets padded.
    With each matrix's layer given, a shape's matrices go by layer from the last one down, the order in which
    the backward finishes them, so the first half's reduce-scatter can start before the backward's end."""
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
    """Parts of an optimizer's step as CUDA graphs, one per key: a part runs eagerly until it meets the same tensors
    (storages) as in its last run, then is captured once and replayed at every later step with those tensors. New
    tensors (state made afresh, a checkpoint's, a DiLoCo heal) make it run eagerly and capture again. Captured parts
    hold no collectives (ProcessGroupNCCL collectives captured in graphs are reported to hang: docs/design.md) and
    read their scheduled values from device tensors refilled before each step. The host then launches a part's
    dozens of kernels as one graph: on several GPUs the host's launches, not the GPU, set the step."""

    def __init__(self):
        self.graphs: dict = {}  # key -> (graph, tensors' signature, what the part returned)
        self.seen: dict = {}  # key -> tensors' signature after the part's last eager run

    @staticmethod
    def signature(tensors: list) -> tuple:
        return tuple((t.data_ptr(), t.numel()) if t is not None else None for t in tensors)

    def run(self, key, compute, tensors):
        """compute() (the part), with tensors() the tensors it reads or writes besides its temporaries."""
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
        """(the CUDA graph of compute(), what compute returned), the graph recorded and then replayed once: the
        tensors it returns are the graph's, rewritten by each replay."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: the loader's thread may wait on its copies' events meanwhile (as inductor's graphs allow it)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # recorded, not run
            result = compute()
        graph.replay()
        return graph, result


class _MuonGroup:
    def __init__(self, params: list[Tensor], world_size: int):
        self.params = params
        self.per_rank = -(-len(params) // world_size)
        self.padding = self.per_rank * world_size - len(params)
        self.pending = None  # (work or None, this rank's averaged gradients [per_rank, rows, cols])
        # Under CUDA graphs the graphs read and write these, allocated once (buffer): the reduce-scatter's output
        # (the gradients, in the parameters' dtype), this rank's updates and every rank's gathered updates.
        self.inbox = self.outbox = self.gathered = None

    def buffer(self, name: str, make, keep: bool) -> Tensor:
        """The group's tensor `name` (inbox, outbox, gathered): with keep (under CUDA graphs, which read and write the
        same tensor at every replay) made once and kept; else made anew, freed when the step is done with it."""
        if not keep:
            return make()
        if getattr(self, name) is None:
            setattr(self, name, make())
        return getattr(self, name)


class Muon(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024): Nesterov momentum, then replace each matrix's update by the nearest
    semi-orthogonal matrix, computed with Polar Express iterations (POLAR_EXPRESS_COEFFS). With beta2 > 0 it
    is NorMuon: the orthogonalised update is rescaled per entry of its longer side by the inverse root of a
    running mean of that entry's squared update (normuon_), keeping the update's Frobenius norm. Weight decay is
    cautious (only where update and weight agree in sign) and scales with lr_eff * lr. With shape_lr a matrix's
    lr is multiplied by sqrt(max(1, rows/cols)) of its (split) shape; a group's "lr_mul" multiplies it too. With
    slow_momentum a second momentum buffer runs, mixed in by the groups' scheduled "slow_share" (muon_momentum_).

    Each param group may set "split": its matrices are stacks of that many row blocks, each
    orthogonalised on its own (a [4d, d] QKVO weight is Q, K, V and O), or runs of blocks of differing
    heights, ((rows, count), ...) from the top (Q and K per head pair, V and O whole: ((256, 6), (768, 2));
    the speedrun's 2026-04-08 record). Storing the attention weights in the MLP weights' shape lets all
    matrices share reduce-scatters (the speedrun's 2025-09 "MuonCustomSizing" record).

    Communication schedule of one step, world size W > 1 (W = 1 sends nothing and runs the same math):
      1. for every group of plan_muon_groups (stacked same-shape gradients), launch reduce_scatter_tensor
         (average): rank r receives the gradients of matrices [r*k, (r+1)*k) of the group. The launch
         comes from a backward hook as soon as the group's last gradient is accumulated, when the
         training loop armed the hooks (before_last_backward) for the last forward; otherwise at
         step();
      2. for each group in order: wait, apply momentum to the owned matrices (momentum buffers exist only
         for those), orthogonalise them (QKVO matrices per projection), launch all_gather_into_tensor of
         the updates;
      3. wait for the gathers and apply every update to every replica. launch_step does 1 and 2 and returns 3,
         which the training loop runs after DistAdam's updates are launched.
    Default model (10 QKVO + 22 MLP matrices, all 3072 x 768): two groups of 16 matrices at every world
    size; per rank and group 2 matrices at W=8, 4 at W=4, 8 at W=2; padding 0 at 1, 2, 4 and 8 ranks. `layers`
    (each parameter's layer) puts the last layers' matrices in the first group: under --compile_scope=split it
    is complete, and its reduce-scatter launched, when the second graph's backward ends.
    """

    def __init__(self, params, lr: float, momentum: float, weight_decay: float = 0.0, beta2: float = 0.0,
                 shape_lr: bool = False, use_triton: bool = False, layers: list[int] | None = None,
                 slow_momentum: float = 0.0, grad_dtype: torch.dtype | None = None, cuda_graphs: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, split=1, lr_mul=1.0))
        self.beta2, self.shape_lr, self.slow_momentum = beta2, shape_lr, slow_momentum
        self.grad_dtype = grad_dtype  # gradients rounded to it before the reduce-scatter (--bf16_grad_comms); None: as is
        self.use_triton = use_triton  # Kernels.newton_schulz: orthogonalize's Triton kernel, else plain torch
        self.rank, self.world_size = current_rank_and_world()
        self.distributed = self.world_size > 1
        params = [p for group in self.param_groups for p in group["params"]]
        # A group's index, not the group: load_state_dict (a DiLoCo heal) replaces the param_groups dicts,
        # and the scheduled lr and momentum are written into the new ones.
        self.group_index_of = {p: i for i, group in enumerate(self.param_groups) for p in group["params"]}
        plan = plan_muon_groups([tuple(p.shape) for p in params], self.world_size, layers)
        self.groups = [_MuonGroup([params[i] for i in indices], self.world_size) for indices in plan]
        self.grad_hooks = _LaunchWhenGradsReady(self.groups, self._launch_reduce)
        for group in self.param_groups:  # one lr per param group: its matrices share the shape factor
            if len({self.shape_factor(p, group) for p in group["params"]}) > 1:
                raise ValueError("Muon: the matrices of a param group need one shape factor (shape and split)")
        # The scheduled settings of each param group as device tensors, refilled at every step: the steps read
        # them there, so a CUDA graph of a step reads each step's values (SCALARS names the columns).
        self.scalars: Tensor | None = None
        self.cuda_graphs = cuda_graphs
        self.graphs = CapturedSteps() if cuda_graphs else None
        # With the Triton kernels (on CUDA): each kind of matrix orthogonalised on a stream of its own, side by side
        # (kind_streams; at one rank's few matrices a kind's kernels leave most of the GPU idle), and the update and
        # its decay applied in one pass over each matrix (muon_apply_; 8x faster than the multi-tensor ops on 1xH100).
        self.parallel_kinds, self.side_streams = use_triton, []
        self.fused_apply = use_triton and all(p.dtype == torch.float32 for p in params)

    def before_last_backward(self, sparse_rows: dict | None = None, rows_ahead: dict | None = None):
        """Let the coming backward launch each group's reduce-scatter as soon as its gradients are done,
        overlapping it with the rest of the backward (sparse_rows, rows_ahead: DistAdam's; nothing here is sparse)."""
        self.grad_hooks.armed = True

    def _launch_reduce(self, group: _MuonGroup):
        grads = grads_or_zeros(group.params)
        grads += [torch.zeros_like(grads[0])] * group.padding
        stacked = torch.stack(grads)
        if self.grad_dtype is not None:
            stacked = stacked.to(self.grad_dtype)
        if self.distributed:
            owned = group.buffer("inbox", lambda: stacked.new_empty(group.per_rank, *stacked.shape[1:]),
                                 self.cuda_graphs)
            group.pending = (dist.reduce_scatter_tensor(owned, stacked, op=dist.ReduceOp.AVG, async_op=True), owned)
        elif self.cuda_graphs:  # the graph reads the same tensor every step
            group.pending = (None, group.buffer("inbox", lambda: torch.empty_like(stacked), True).copy_(stacked))
        else:
            group.pending = (None, stacked)

    def _owned_updates(self, group: _MuonGroup, grads: Tensor) -> Tensor:
        """Momentum and orthogonalisation of this rank's matrices of the group, each kind of matrix (run of row
        blocks) in one batch, the kinds side by side with parallel_kinds; padding slots stay zero."""
        first = self.rank * group.per_rank
        owned = group.params[first: first + group.per_rank]
        # (first row, block height, blocks, run) -> the owned matrices with that run of blocks
        by_run: dict[tuple[int, int, int, int], list[int]] = {}
        directions = []
        for i, p in enumerate(owned):
            settings = self.param_groups[self.group_index_of[p]]
            one_minus_fast, momentum, slow_share = self.scalars[self.group_index_of[p], :3].unbind(0)
            directions.append(muon_momentum_(grads[i], self.state[p], momentum, one_minus_fast, self.slow_momentum,
                                             slow_share))
            first_row = 0
            for run, (height, count) in enumerate(row_blocks(p, settings)):
                by_run.setdefault((first_row, height, count, run), []).append(i)
                first_row += height * count
        updates = group.buffer("outbox", lambda: grads.new_empty(grads.shape, dtype=orthogonalized_dtype(grads)),
                               self.cuda_graphs).zero_()
        streams = self.kind_streams(len(by_run))
        for stream, ((first_row, height, count, run), members) in zip(streams, by_run.items()):
            with torch.cuda.stream(stream):  # None: the current stream
                rows = slice(first_row, first_row + height * count)
                batch = torch.stack([directions[i][rows] for i in members])
                n, cols = len(members), batch.size(-1)
                ortho = orthogonalize(batch.view(n * count, height, cols), self.use_triton)
                if self.beta2:
                    states = [self.state[owned[i]] for i in members]
                    ortho = normuon_(ortho, states, count, self.beta2,
                                     "second_moment" if run == 0 else f"second_moment_{run}")
                ortho = ortho.view(n, height * count, cols)
                for slot, index in enumerate(members):  # indexing with a list would copy it to the GPU: a host sync
                    updates[index, rows].copy_(ortho[slot])
        self.join_kind_streams(streams)
        return updates

    def kind_streams(self, count: int) -> list:
        """The CUDA streams the kinds of matrices' orthogonalisations run on: with parallel_kinds the first on the
        current stream and each other on a side stream that waits for it, so small batches' kernels run side by side;
        else all on the current stream (None)."""
        if not self.parallel_kinds or count < 2:
            return [None] * count
        current = torch.cuda.current_stream()
        while len(self.side_streams) < count - 1:
            self.side_streams.append(torch.cuda.Stream())
        for stream in self.side_streams[:count - 1]:
            stream.wait_stream(current)
        return [None] + self.side_streams[:count - 1]

    @staticmethod
    def join_kind_streams(streams: list) -> None:
        """The current stream waits for every side stream of kind_streams."""
        for stream in streams:
            if stream is not None:
                torch.cuda.current_stream().wait_stream(stream)

    # the columns of self.scalars, one row per param group
    SCALARS = ("one_minus_fast", "momentum", "slow_share", "neg_lr", "neg_decay")

    def fill_scalars(self):
        """The scheduled settings into self.scalars, in one copy: 1 - the usual buffer's beta, the momentum, the
        slow buffer's share, -lr of the group's matrices and -(lr * weight_decay * scheduled lr)."""
        rows = []
        for settings in self.param_groups:
            momentum, fast = settings["momentum"], settings.get("fast_momentum")
            lr = self.matrix_lr(settings["params"][0], settings)
            rows.append((1 - (momentum if fast is None else fast), momentum, settings.get("slow_share", 0.0), -lr,
                         -lr * settings["weight_decay"] * settings["lr"]))
        values = torch.tensor(rows, dtype=torch.float32)
        device = self.param_groups[0]["params"][0].device
        if device.type == "cuda":  # from pinned memory, without waiting for the GPU (a pageable copy would sync)
            values = values.pin_memory()  # torch's pinned allocator keeps the block until the copy has run
        if self.scalars is None:
            self.scalars = values.to(device, non_blocking=True)
        else:
            self.scalars.copy_(values, non_blocking=True)

    def zero_state_(self):
        """Empty the state, as a new optimizer's: under cuda_graphs the buffers are zeroed where they are, which is what
        the first step would make them, so the captured graphs go on reading them; else they are dropped."""
        if not self.cuda_graphs:
            self.state.clear()
            return
        for state in self.state.values():
            for buffer in state.values():
                buffer.zero_()

    @torch.no_grad()
    def step(self):
        self.launch_step()()

    @torch.no_grad()
    def launch_step(self):
        """Steps 1 and 2 of the schedule: every group's updates computed and their all-gathers launched. Returns the
        function that does step 3 (waits for the all-gathers and applies the updates). On a step where Adam updates,
        these all-gathers queue on the NCCL stream behind Adam's reduce-scatters; finishing after Adam's updates are
        launched (train_step), the compute stream runs those updates meanwhile instead of waiting."""
        for group in self.groups:
            if group.pending is None:  # not launched from the backward
                self._launch_reduce(group)
        self.grad_hooks.disarm()
        self.fill_scalars()
        gathers = []
        for index, group in enumerate(self.groups):
            work, grads = group.pending
            if work is not None:
                work.wait()
            updates = self._run(("updates", index), lambda group=group, grads=grads: self._owned_updates(
                group, grads.to(group.params[0].dtype)))  # back from grad_dtype
            if self.distributed:
                everything = group.buffer(
                    "gathered", lambda: updates.new_empty(group.per_rank * self.world_size, *updates.shape[1:]),
                    self.cuda_graphs)
                gathers.append((index, group, everything,
                                dist.all_gather_into_tensor(everything, updates, async_op=True)))
            else:
                gathers.append((index, group, updates, None))
            group.pending = None

        @torch.no_grad()
        def finish():
            for index, group, updates, work in gathers:
                if work is not None:
                    work.wait()
                self._run(("apply", index), lambda group=group, updates=updates: self._apply(
                    group.params, updates[:len(group.params)]))
        return finish

    def _run(self, key, compute):
        """compute() (which returns, or writes into, the group's fixed buffers); under cuda_graphs, captured as a CUDA
        graph once its inputs have settled (CapturedSteps) and replayed from then on."""
        if self.graphs is None:
            return compute()
        return self.graphs.run(key, compute, lambda: self._inputs_of(key))

    def _inputs_of(self, key) -> list[Tensor]:
        """Every tensor the graph of `key` reads or writes besides its own temporaries: a new one (a state reset, a
        checkpoint's state, a DiLoCo heal) means the graph must be captured again."""
        kind, index = key
        group = self.groups[index]
        tensors = [self.scalars] + list(group.params)
        if kind == "updates":
            first = self.rank * group.per_rank
            states = [self.state[p] for p in group.params[first: first + group.per_rank]]
            tensors += [group.inbox, group.outbox] + [t for state in states for t in state.values()]
        else:
            tensors += [group.gathered if self.distributed else group.outbox]
        return tensors

    def _apply(self, params: list[Tensor], updates: Tensor):
        """p -= lr * update for every matrix of a group, after cautious weight decay (only where the update pushes the
        weight towards zero too: update * p >= 0). With fused_apply one kernel per matrix (muon_apply_), else
        multi-tensor ops, a few launches per param group instead of six per matrix: on several GPUs the host's
        launches, not the GPU, set the step (docs/performance.md). The lr and decay are device tensors
        (self.scalars), so a CUDA graph of this reads each step's."""
        if self.fused_apply:
            for i, p in enumerate(params):
                group_index = self.group_index_of[p]
                muon_apply_(p, updates[i], self.scalars[group_index, 3:],
                            bool(self.param_groups[group_index]["weight_decay"]))
            return
        cast = {dtype: updates.to(dtype).unbind(0) for dtype in {p.dtype for p in params}}  # one cast per dtype
        by_group: dict[tuple, tuple[list, list]] = {}
        for i, p in enumerate(params):
            weights, steps = by_group.setdefault((self.group_index_of[p], p.dtype), ([], []))
            weights.append(p)
            steps.append(cast[p.dtype][i])
        for (group_index, _), (weights, steps) in by_group.items():
            neg_lr, neg_decay = self.scalars[group_index, 3:].unbind(0)
            if self.param_groups[group_index]["weight_decay"]:  # where update * p >= 0
                decayed = foreach_same_sign(steps, weights, strict=False)
                torch._foreach_mul_(decayed, weights)
                torch._foreach_mul_(decayed, neg_decay)
                torch._foreach_add_(weights, decayed)
            torch._foreach_add_(weights, torch._foreach_mul(steps, neg_lr))

    def close(self):
        """End of training: remove the gradient hooks (_LaunchWhenGradsReady.remove says why)."""
        self.grad_hooks.remove()

    def matrix_lr(self, p: Tensor, settings: dict) -> float:
        """The lr of one matrix: its group's (scheduled) lr, times its group's lr_mul, times the shape factor."""
        return settings["lr"] * settings["lr_mul"] * self.shape_factor(p, settings)

    def shape_factor(self, p: Tensor, settings: dict) -> float:
        """With shape_lr, sqrt(max(1, rows / cols)) of the matrix's first block (the runs of the attention weights
        all give 1); else 1."""
        if not self.shape_lr:
            return 1.0
        rows, cols = row_blocks(p, settings)[0][0], p.size(-1)
        return max(1.0, rows / cols) ** 0.5


def row_blocks(p: Tensor, settings: dict) -> list[tuple[int, int]]:
    """A Muon matrix's runs of row blocks, (height, count) from the top, from its group's "split"."""
    split = settings["split"]
    runs = [(p.size(-2) // split, split)] if isinstance(split, int) else [tuple(run) for run in split]
    if sum(height * count for height, count in runs) != p.size(-2):
        raise ValueError(f"Muon split {split} does not cover the {p.size(-2)} rows of a {tuple(p.shape)} matrix")
    return runs


def normuon_(ortho: Tensor, states: list[dict], split: int, beta2: float, key: str = "second_moment") -> Tensor:
    """NorMuon's rescaling of orthogonalised updates ortho [n * split, rows, cols] (each of the n owned matrices is
    `split` blocks, one states[i] each matrix): per entry of each block's longer side, the mean square of the
    update along the other side feeds a running mean (beta2, kept in the state under `key`, no bias
    correction); the update is divided by its root, then scaled back to its Frobenius norm."""
    n = len(states)
    blocks, rows, cols = ortho.shape
    reduce_dim = -1 if rows >= cols else -2  # one statistic per entry of the longer side
    update = ortho.float()
    mean_square = update.square().mean(dim=reduce_dim, keepdim=True)  # [n * split, rows, 1] or [.., 1, cols]
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
    factor = inverse_root * (norm / rescaled_norm.clamp_min(1e-10))
    return (update * factor).to(ortho.dtype)


def muon_momentum_(grad: Tensor, state: dict, momentum, one_minus_fast, slow: float = 0.0, slow_share=0.0) -> Tensor:
    """Update the momentum buffer in `state` (moving it `one_minus_fast` of the way to grad: 1 - its beta); return
    the Nesterov-style update direction, grad moved `momentum` of the way towards the momentum. With slow > 0 a
    second buffer of beta `slow` updates too and the momentum is slow_share of it and the rest of the first (ANVIL2's
    two rails). momentum, one_minus_fast and slow_share are floats or 0-dim tensors (Muon's scheduled scalars)."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad)
    buf = state["momentum_buffer"]
    buf.lerp_(grad, one_minus_fast)
    if not slow:
        return grad.lerp(buf, momentum)
    if "slow_momentum_buffer" not in state:
        state["slow_momentum_buffer"] = torch.zeros_like(grad)
    slow_buf = state["slow_momentum_buffer"]
    slow_buf.lerp_(grad, 1 - slow)
    return grad.lerp(buf.lerp(slow_buf, slow_share), momentum)


# ----------------------------------------------------------------------------------------------------
# Data
#
# Shards use the llm.c / speedrun layout: 256 little-endian int32 (magic, version, token count, ...)
# then the tokens as little-endian uint16. Each document starts with BOS.


class DataError(UserError):
    pass


def read_shard(path: str) -> np.ndarray:
    """Validate a shard's header and size; return its tokens as a read-only memory map."""
    size = os.path.getsize(path)
    header_bytes = SHARD_HEADER_INTS * 4
    if size < header_bytes:
        raise DataError(f"{path}: {size} bytes, too short for the {header_bytes}-byte shard header")
    header = np.fromfile(path, dtype="<i4", count=SHARD_HEADER_INTS)
    if header[0] != SHARD_MAGIC:
        raise DataError(f"{path}: not a token shard (magic number {header[0]}, expected {SHARD_MAGIC})")
    if header[1] != SHARD_VERSION:
        raise DataError(f"{path}: shard version {header[1]} is not supported (expected {SHARD_VERSION})")
    num_tokens = int(header[2])
    expected = header_bytes + 2 * num_tokens
    if size != expected:
        raise DataError(f"{path}: header says {num_tokens:,} tokens ({expected:,} bytes) but the file has "
                        f"{size:,} bytes; the file is truncated or corrupt, download or build it again")
    return np.memmap(path, dtype="<u2", mode="r", offset=header_bytes, shape=(num_tokens,))


def shard_paths(pattern: str, flag: str) -> list[str]:
    """The shards matching a glob, each checked, so that bad data fails before any compiling."""
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise DataError(f"--{flag}={pattern!r} matches no files. Download FineWeb shards with "
                        f"`python data/cached_fineweb10B.py 9` or point --{flag} at your own shards")
    for path in paths:
        if os.path.isdir(path):
            raise DataError(f"--{flag}={pattern!r} matches the folder {path}: give the shard files, e.g. "
                            f"--{flag}='{os.path.join(path, '*.bin')}'")
        read_shard(path)
    return paths


def check_vocabulary(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """A token id past the model's tables (data from another tokenizer) is an error here, naming the data,
    not an out-of-range embedding row later: the GPU's row gather does not check its indices."""
    if len(tokens) and int(tokens.max()) >= vocab_size:
        position = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"{where}: token {int(tokens[position])} at position {position:,} is not below "
                        f"--vocab_size={vocab_size}; the data comes from another tokenizer (set --vocab_size and "
                        "--bos_token to its own)")


def document_starts(path: str, bos: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A shard's tokens (memory-mapped), checked against the vocabulary, and the offsets of its BOS tokens."""
    tokens = read_shard(path)
    check_vocabulary(tokens, vocab_size, path)
    return tokens, np.flatnonzero(tokens == bos)


def bos_aligned_batches(paths: list[str], length: int, max_doc_len, repeat: bool, on_new_pass=None, *,
                        bos: int, vocab_size: int):
    """Yield (tokens, spans): each batch is `length` tokens made of whole documents from their BOS on,
    each cut at max_doc_len, the last one cut to fit (speedrun 2025-07: batches start at a BOS).
    max_doc_len: an int, or a function of the batch's index (0, 1, ...) giving that batch's cut.

    The text of a document past max_doc_len is dropped; so is the tail of each shard. With `repeat`,
    the shards start over when they run out, and on_new_pass(number) is called. The next shard is mapped
    and indexed on a helper thread while this one is read: done in line, a shard's first read pauses the host
    for longer than its lead over the GPU, which then idles (docs/performance.md).
    """
    def shard_order():
        for number in range(1, sys.maxsize if repeat else 2):
            for path in paths:
                yield number, path

    order = shard_order()
    current, produced = next(order), False
    index = 0  # of the batch being built
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-index") as indexer:
        job = indexer.submit(document_starts, current[1], bos, vocab_size)
        while current is not None:
            following = next(order, None)
            tokens, starts = job.result()
            if following is not None:
                job = indexer.submit(document_starts, following[1], bos, vocab_size)
            ends = np.append(starts[1:], len(tokens))
            doc = 0
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
                produced = True
                index += 1
                yield tokens, spans
            pass_ends = following is None or following[0] > current[0]
            if pass_ends and not produced:
                raise DataError(f"no batch of {length} tokens could be built from {paths[0]}...: the shards need "
                                f"documents that start with the BOS token {bos} (--bos_token)")
            if pass_ends and following is not None and on_new_pass is not None:
                on_new_pass(following[0])
            current = following


def train_batches_for_rank(paths: list[str], cfg: Config, comm: Comm, on_new_pass=None):
    """This rank's share of the global sequence of micro-batches: every world_size-th one, so the same
    micro-batches (in the same steps) are seen on 1, 2, 4 or 8 processes. DiLoCo replica groups
    interleave the same way, so no two replicas read the same micro-batch."""
    replicas, replica = (cfg.diloco_replicas, cfg.replica) if cfg.diloco else (1, 0)
    stride, offset = replicas * comm.world_size, replica * comm.world_size + comm.rank
    max_doc_len = cfg.max_doc_len
    if len(set(cfg.stage_doc_lens)) > 1:  # the cut of the stage the batch trains in
        stage_of = Schedule(cfg).stage_of_micro_batch

        def max_doc_len(index: int) -> int:
            in_group = index // stride * comm.world_size + index % stride % comm.world_size  # one group's count
            return cfg.stage_doc_lens[min(stage_of(in_group), len(cfg.stage_doc_lens) - 1)]
    batches = bos_aligned_batches(paths, cfg.micro_batch_tokens + 1, max_doc_len, cfg.train_repeat, on_new_pass,
                                  bos=cfg.bos_token, vocab_size=cfg.vocab_size)
    try:
        for index, (tokens, spans) in enumerate(batches):
            if index % stride == offset:
                yield np.concatenate([tokens[start:end] for start, end in spans])
    finally:
        batches.close()  # stops its shard-indexing thread


def drop(count: int, batches):
    """`batches` (a generator) after its first `count`; closing this closes `batches`."""
    try:
        for index, batch in enumerate(batches):
            if index >= count:
                yield batch
    finally:
        batches.close()


def val_micro_batches_per_rank(cfg: Config, world_size: int) -> int:
    """Validation micro-batches each rank scores: val_tokens in micro-batches, dealt to the ranks in turn."""
    return cfg.val_tokens // cfg.micro_batch_tokens // world_size


def val_batches_for_rank(paths: list[str], cfg: Config, comm: Comm):
    """Consecutive, unaligned chunks of the validation stream; the first val_tokens tokens are scored."""
    shards = [read_shard(path) for path in paths]
    available = sum(len(s) for s in shards)
    if available < cfg.val_tokens + 1:
        raise DataError(f"--val_files={cfg.val_files!r} hold {available:,} tokens, fewer than "
                        f"--val_tokens={cfg.val_tokens:,} (+1); lower --val_tokens")
    stream = shards[0] if len(shards) == 1 else np.concatenate(shards)
    check_vocabulary(stream[: cfg.val_tokens + 1], cfg.vocab_size, f"--val_files={cfg.val_files!r}")
    T = cfg.micro_batch_tokens
    for index in range(comm.rank, cfg.val_tokens // T, comm.world_size):
        yield np.asarray(stream[index * T: index * T + T + 1])


def bigram_hash(tokens: np.ndarray, rows: int, bos: int, classes: np.ndarray | None = None) -> np.ndarray:
    """Row of the bigram embedding for each position: a multiplicative (Fibonacci) hash of the pair
    (previous token, token) into rows - 1 buckets, of the tokens' classes where given (--bigram_normalize).
    Positions without a previous token of their own document (the window's first position, and every BOS) get
    the reserved last row."""
    t = (tokens if classes is None else classes[tokens]).astype(np.uint64)
    pairs = t[:-1] * np.uint64(65536) + t[1:]
    mixed = (pairs * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)  # wraps mod 2**64, as intended
    out = np.empty(len(tokens), dtype=np.int32)
    out[0] = rows - 1
    out[1:] = mixed % np.uint64(rows - 1)
    out[tokens == bos] = rows - 1
    return out


def max_documents(seq_len: int) -> int:
    # Fixed length of cu_seqlens so FA3 sees one shape; 16 tokens per document on average is far
    # below what real text has.
    return seq_len // 16 + 1


def micro_batch_document_starts(inputs: np.ndarray, bos: int) -> np.ndarray:
    """Where the documents of one micro-batch start: at every BOS, and at position 0 even without one (a
    validation chunk begins mid-document)."""
    starts = np.flatnonzero(inputs == bos)
    return starts if len(starts) and starts[0] == 0 else np.insert(starts, 0, 0)


@dataclass
class ForwardBatch:
    """One forward's inputs: one micro-batch, or several packed one after the other (T tokens in all)."""
    inputs: Tensor  # [T] int32
    targets: Tensor  # [T] int64
    cu_seqlens: Tensor  # [max_documents + 1] int32: document starts, then T repeated
    bigrams: Tensor | None = None  # [T] int32 rows of the bigram embedding
    bigram_rows_used: np.ndarray | None = None  # sorted unique values of bigrams, on the host
    token_rows_used: np.ndarray | None = None  # sorted unique values of inputs, on the host (when asked for)
    documents: int | None = None  # how many documents cu_seqlens starts (the rest is padding)
    longest_document: int | None = None


class _Slot:
    """Host buffers for one forward: up to `packed` micro-batches of seq_len tokens, one after the other; `length`
    tokens of them filled."""

    def __init__(self, seq_len: int, pin: bool, bos: int, bigram_rows: int = 0, packed: int = 1,
                 token_classes: np.ndarray | None = None, token_rows: int = 0):
        length = seq_len * packed
        self.token_rows = token_rows  # the vocabulary size, when the tokens read are wanted (token_rows_used)
        self.token_rows_used = None
        self.bos, self.token_classes = bos, token_classes
        self.inputs = torch.empty(length, dtype=torch.int32, pin_memory=pin)
        self.targets = torch.empty(length, dtype=torch.int64, pin_memory=pin)
        self.cu_seqlens = torch.empty(max_documents(length) + 1, dtype=torch.int32, pin_memory=pin)
        self.bigram_rows = bigram_rows
        self.bigrams = torch.empty(length, dtype=torch.int32, pin_memory=pin) if bigram_rows else None
        self.bigram_rows_used = None
        self.documents = self.longest_document = None
        self.length = 0
        self.copied = None  # CUDA event: the device copy out of this slot has finished

    def fill(self, windows: list[np.ndarray]):
        """windows: one [seq_len + 1] token window per packed micro-batch. Each is a sequence of its own:
        it starts a document, and its first bigram has no previous token."""
        starts = []
        offset = 0
        for window in windows:
            inputs = window[:-1]
            end = offset + len(inputs)
            self.inputs.numpy()[offset:end] = inputs
            self.targets.numpy()[offset:end] = window[1:]
            if self.bigram_rows:
                self.bigrams.numpy()[offset:end] = bigram_hash(inputs, self.bigram_rows, self.bos, self.token_classes)
            starts.append(micro_batch_document_starts(inputs, self.bos) + offset)
            offset = end
        self.length = offset
        if self.bigram_rows:
            self.bigram_rows_used = np.unique(self.bigrams.numpy()[:offset])
        if self.token_rows:  # through a mask: 0.1 ms for 16K tokens on this repo's CPU machine, np.unique 2.4
            self.token_rows_used = union_of_rows([self.inputs.numpy()[:offset]], self.token_rows)
        starts = np.concatenate(starts)
        cu = self.cu_seqlens.numpy()[: max_documents(offset) + 1]
        if len(starts) >= len(cu):
            raise DataError(f"{offset} tokens hold {len(starts)} documents, more than the {len(cu) - 1} supported; "
                            "the documents are implausibly short")
        cu[: len(starts)] = starts
        cu[len(starts):] = offset
        self.documents, self.longest_document = len(starts), int(np.diff(cu[: len(starts) + 1]).max())


class Prefetcher:
    """Builds the inputs of each forward (`packed` micro-batches from `batches`, a stream of token windows; or with
    `sizes`, each forward's count in turn, none over `packed`) on a background thread into pinned host buffers; next()
    starts their non-blocking copy to the device and returns at once, so the next batch is ready while the GPU works.

    A few buffer slots rotate between the thread and the caller; the thread refills a slot only after
    the CUDA event recorded behind its copy has fired, so a buffer is never overwritten mid-copy. peek(n) holds the
    next n filled slots back for their row lists, so it needs more than n slots.
    """

    def __init__(self, batches, seq_len: int, device: torch.device, slots: int = 4, bigram_rows: int = 0,
                 packed: int = 1, *, bos: int, token_classes: np.ndarray | None = None, sizes=None,
                 token_rows: int = 0):
        self.device = device
        self.free, self.ready = queue.Queue(), queue.Queue()
        for _ in range(slots):
            self.free.put(_Slot(seq_len, pin=device.type == "cuda", bos=bos, bigram_rows=bigram_rows, packed=packed,
                                token_classes=token_classes, token_rows=token_rows))
        self.closed = False
        self.slots = slots
        self.ahead: collections.deque = collections.deque()  # filled slots taken from `ready` by peek(), in order
        self.source = batches
        sizes = itertools.repeat(packed) if sizes is None else sizes
        self.thread = threading.Thread(target=self._fill, args=(batches, sizes, packed), daemon=True)
        self.thread.start()

    def _fill(self, batches, sizes, packed: int):
        try:
            windows = iter(batches)
            for size in sizes:
                if not 0 < size <= packed:
                    raise ValueError(f"a forward of {size} micro-batches in slots of {packed}")
                group = list(itertools.islice(windows, size))
                if len(group) < size:  # a partial group at the end of the stream is left out, like a stream that ran out
                    break
                slot = self.free.get()
                if slot is None or self.closed:
                    return
                if slot.copied is not None:
                    slot.copied.synchronize()
                slot.fill(group)
                self.ready.put(slot)
            self.ready.put(StopIteration())
        except BaseException as e:  # handed to the training thread, which raises it
            self.ready.put(e)

    def peek(self, n: int) -> list | None:
        """The next n forwards' host buffers, not consumed (their bigram_rows_used and token_rows_used: what the
        forwards will read); None if the stream ends or fails before n of them."""
        if n >= self.slots:
            raise ValueError(f"peeking {n} forwards ahead needs more than {n} loader slots, not {self.slots}")
        while len(self.ahead) < n:
            item = self.ready.get()
            self.ahead.append(item)
            if isinstance(item, BaseException):  # next() raises it when the caller gets there
                return None
        return list(itertools.islice(self.ahead, n))

    def next(self) -> ForwardBatch:
        item = self.ahead.popleft() if self.ahead else self.ready.get()
        if isinstance(item, StopIteration):
            raise DataError("the training data ran out: add shards (python data/cached_fineweb10B.py N), "
                            "lower --num_iterations, or set --train_repeat=1")
        if isinstance(item, BaseException):
            raise item
        length = item.length
        tensors = (item.inputs[:length], item.targets[:length], item.cu_seqlens[: max_documents(length) + 1],
                   item.bigrams[:length] if item.bigrams is not None else None)
        if self.device.type == "cuda":
            batch = ForwardBatch(*(t.to(self.device, non_blocking=True) if t is not None else None for t in tensors))
            item.copied = torch.cuda.Event()
            item.copied.record()
        else:  # the slot is reused, so the CPU path hands out copies
            batch = ForwardBatch(*(t.clone() if t is not None else None for t in tensors))
        batch.bigram_rows_used, batch.token_rows_used = item.bigram_rows_used, item.token_rows_used
        batch.documents, batch.longest_document = item.documents, item.longest_document
        self.free.put(item)
        return batch

    def close(self):
        """Stop the thread and wait for it: a thread still inside numpy or torch when the interpreter
        exits is torn down in a way that aborts the process ("terminate called without an active exception")."""
        self.closed = True
        self.free.put(None)  # wakes the thread if it waits for a slot
        self.thread.join()
        # The same for the loader's own thread (bos_aligned_batches indexes the next shard on one): closing the
        # generator now stops it, where a generator left to the garbage collector could be finalised at exit.
        if hasattr(self.source, "close"):
            self.source.close()


def prefetch(windows, cfg: Config, device: torch.device, packed: int, sizes=None, ahead: int = 0) -> Prefetcher:
    """The one way a run loads its batches (training, validation and the warm-up's stand-ins): token windows in,
    forwards of `packed` micro-batches (or of `sizes`' counts in turn, none over `packed`) of the run's length,
    bigram rows and BOS token out. ahead: the most forwards train_step will peek at (--table_row_fetch)."""
    return Prefetcher(windows, cfg.micro_batch_tokens, device, slots=max(4, ahead + 2), bigram_rows=cfg.bigram_rows,
                      packed=packed, bos=cfg.bos_token, token_classes=bigram_token_classes(cfg), sizes=sizes,
                      token_rows=cfg.vocab_size if cfg.sparse_value_comms or fetches_table_rows(cfg) else 0)


def normalized_token_classes(token_bytes: list[bytes], vocab_size: int) -> np.ndarray:
    """Each token id's class for --bigram_normalize: the smallest id whose text is the same after NFKC, accents
    stripped (NFD without its non-spacing marks), lower case, and runs of spaces, tabs and newlines as one space,
    stripped at both ends unless that is all there is (pull request #375's normaliser). Tokens that are not whole
    UTF-8, or whose text normalizes to nothing, and ids past token_bytes (the padding) are classes of their own."""
    classes = np.arange(vocab_size, dtype=np.int64)
    first: dict[str, int] = {}
    for token, raw in enumerate(token_bytes[:vocab_size]):
        try:
            text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", raw.decode("utf-8")))
        except UnicodeDecodeError:
            continue
        text = re.sub(r"[ \t\r\n]+", " ", "".join(c for c in text if unicodedata.category(c) != "Mn").lower())
        text = text if text == " " else text.strip()
        if text:
            classes[token] = first.setdefault(text, token)
    return classes


_TOKEN_CLASSES: dict[int, np.ndarray] = {}  # vocab_size -> normalized_token_classes of GPT-2's tokens


def bigram_token_classes(cfg: Config) -> np.ndarray | None:
    """GPT-2's token classes with --bigram_normalize (built once per process: the loader's hash and the model's
    sign vectors both read them), else None."""
    if not cfg.bigram_normalize:
        return None
    if cfg.vocab_size not in _TOKEN_CLASSES:
        _TOKEN_CLASSES[cfg.vocab_size] = normalized_token_classes(gpt2_token_bytes("--bigram_normalize=1"),
                                                                  cfg.vocab_size)
    return _TOKEN_CLASSES[cfg.vocab_size]


# ----------------------------------------------------------------------------------------------------
# Schedule


class Schedule:
    """Everything that changes during training, as a function of the step.

    The num_iterations scheduled steps are cut into equal stages (one per entry of batch_schedule); each stage
    has a batch size, an lr multiplier and a pair of attention windows, and the lr cools down linearly to
    final_lr_frac by the end of them. Then come extension_steps more at the last stage's batch, the final lr and
    extension_windows (the speedrun's "scheduled + extension" shape, 2025-12 records). Growing the batch and the
    windows over training follows the speedrun's 2025-11 (batch) and 2024-11 (window) records.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.num_iterations = cfg.num_iterations  # scheduled steps
        self.adam_period = resolved_adam_period(cfg)
        self.total_steps = cfg.num_iterations + cfg.extension_steps
        self.untie_step = round(cfg.untie_frac * cfg.num_iterations)  # with --tie_embed
        self.mtp = cfg.mtp_stages
        self.mtp_offsets = max(len(stage) for stage in self.mtp)
        self.batches, self.lr_multipliers = cfg.stage_batches, cfg.stage_lr_multipliers
        block = cfg.window_block
        in_tokens = [(short * block, long * block) for short, long in cfg.stage_window_blocks]
        if cfg.extension_steps:
            short, long = cfg.extension_window_blocks
            in_tokens.append((short * block, long * block))
        self.stage_windows = in_tokens
        short, long = cfg.final_window_blocks
        self.final_windows = (short * block, long * block)
        # micro-batches before the first step of each stage after the first, the extension counted as one
        firsts = [next(s for s in range(self.total_steps + 1) if s == self.total_steps or self.stage(s) >= k)
                  for k in range(1, len(self.batches) + 1)]
        self.stage_starts = [self.micro_batches_before(s) for s in firsts]

    def validates(self, step: int) -> bool:
        """Whether validation runs before this step (step total_steps: the end)."""
        every = self.cfg.val_loss_every
        return step == self.total_steps or (every > 0 and step % every == 0)

    def validation_step(self, step: int) -> int:
        """The step whose windows (and YaRN tables) the validation before `step` uses: the last trained one, so a
        validation at a stage's first step scores the model with the windows it was trained with, not the next
        stage's; the final validation gets final_windows."""
        return step - 1 if 0 < step < self.total_steps else step

    def stage(self, step: int) -> int:
        """The stage of a step; the extension steps are a stage of their own, after the scheduled ones."""
        if step >= self.num_iterations and self.cfg.extension_steps:
            return len(self.batches)
        return min(step * len(self.batches) // self.num_iterations, len(self.batches) - 1)

    def mtp_weights(self, step: int) -> list[float]:
        """The multi-token loss weights of a step (mtp_offsets of them, unnormalised): linear within the stage; the
        extension keeps the last stage's end."""
        stage = self.stage(step)
        stages = len(self.batches)
        if stage >= stages:
            weights = [end for _, end in self.mtp[-1]]
        else:
            start, end = -(-stage * self.num_iterations // stages), -(-(stage + 1) * self.num_iterations // stages)
            t = (step - start) / max(end - start, 1)
            weights = [a + (b - a) * t for a, b in self.mtp[stage]]
        return weights + [0.0] * (self.mtp_offsets - len(weights))

    def micro_batches_before(self, step: int) -> int:
        """Micro-batches of all steps before this one, summed over all ranks."""
        return sum(self.micro_batches(s) for s in range(step))

    def stage_of_micro_batch(self, index: int) -> int:
        """The stage of the step that trains micro-batch `index` (0, 1, ... over all ranks of the run; the
        extension counts as the stage after the last)."""
        return sum(index >= start for start in self.stage_starts)

    def micro_batches(self, step: int) -> int:
        """Micro-batches in this step, summed over all ranks."""
        return self.batches[min(self.stage(step), len(self.batches) - 1)]

    def lr_multiplier(self, step: int) -> float:
        lr = self.lr_multipliers[min(self.stage(step), len(self.batches) - 1)]
        cooldown_start = self.num_iterations * (1 - self.cfg.cooldown_frac)
        if step >= cooldown_start:
            t = min((step - cooldown_start) / max(self.num_iterations - cooldown_start, 1), 1.0)
            lr = lr * (1 - t) + self.cfg.final_lr_frac * t
        return lr

    def adam_updates(self, step: int) -> bool:
        """Whether Adam updates at this step (else its gradients only add up): steps adam_period - 1, 2 *
        adam_period - 1, ...; at adam_period 2 the odd steps, as in the speedrun."""
        return (step + 1) % self.adam_period == 0

    def muon_momentum(self, step: int) -> float:
        """Linear warm-up from muon_momentum_start, and back down over the last steps of training."""
        cfg = self.cfg
        low, high = cfg.muon_momentum_start, cfg.muon_momentum
        if step < cfg.muon_momentum_warmup:
            return low + (high - low) * step / cfg.muon_momentum_warmup
        steps_left = self.total_steps - step
        if steps_left < cfg.muon_momentum_cooldown:
            return low + (high - low) * steps_left / cfg.muon_momentum_cooldown
        return high

    def muon_rails(self, step: int) -> tuple[float, float]:
        """(beta of Muon's usual momentum buffer, the slow buffer's share of the momentum) at a step: the scheduled
        momentum and 0 until the slow buffer joins in (muon_slow_from), then muon_momentum_start and
        muon_slow_share."""
        cfg = self.cfg
        if cfg.muon_slow_momentum and step >= round(cfg.muon_slow_from * cfg.num_iterations):
            return cfg.muon_momentum_start, cfg.muon_slow_share
        return self.muon_momentum(step), 0.0

    def windows(self, step: int) -> tuple[int, int]:
        """(short, long) attention windows in tokens; the final validation gets the extended pair."""
        if step >= self.total_steps:
            return self.final_windows
        return self.stage_windows[self.stage(step)]

    def long_window_history(self, step: int) -> list[int]:
        """The long windows used up to this step, for YaRN to replay."""
        history = [long for _, long in self.stage_windows[: self.stage(step) + 1]]
        if step >= self.total_steps and self.cfg.final_yarn:
            history.append(self.final_windows[1])
        return history


# ----------------------------------------------------------------------------------------------------
# Logging


class RunLog:
    """Rank 0 writes logs/<run_id>.txt: the source of this file, the environment, the config, then one
    line per step (records/tool.py reads this layout back); other ranks write nothing."""

    def __init__(self, cfg: Config, comm: Comm):
        self.file = None
        if not comm.is_main:
            return
        os.makedirs(cfg.log_dir, exist_ok=True)
        self.path = os.path.join(cfg.log_dir, f"{cfg.run_id}.txt")
        self.file = open(self.path, "w", encoding="utf-8")
        source = Path(__file__).read_bytes()
        code = source.decode("utf-8")
        lines = code.splitlines()
        self._write(f"#### train_gpt.py log v{LOG_FORMAT_VERSION} run_id={cfg.run_id}")
        self._write(f"==== code train_gpt.py sha256={hashlib.sha256(source).hexdigest()} lines={len(lines)} ====")
        self._write("\n".join(lines))
        self._write("==== end code ====")
        self._write("==== environment ====")
        for key, value in environment(cfg, comm).items():
            self._write(f"{key}: {value}")
        self._write("==== nvidia-smi ====")
        self._write(nvidia_smi())
        self._write("==== config ====")
        self._write("config: " + json.dumps(dataclasses.asdict(cfg)))
        self._write("==== training ====")
        print(f"logging to {self.path}", flush=True)

    def _write(self, text: str):
        self.file.write(text + "\n")
        self.file.flush()

    def __call__(self, text: str):
        """One line to stdout and the log (rank 0 only)."""
        if self.file is not None:
            print(text, flush=True)
            self._write(text)

    def finish(self):
        if self.file is not None:
            self._write("==== end ====")
            self.file.close()
            self.file = None


def environment(cfg: Config, comm: Comm) -> dict[str, str]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    if cfg.device == "cuda":
        hardware = f"{comm.world_size}x {torch.cuda.get_device_name()}"
    else:
        hardware = f"{comm.world_size}x cpu ({platform.machine()}, {os.cpu_count()} cores)"
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton_version,
        "device": cfg.device,
        "world_size": str(comm.world_size),
        "hardware": hardware,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    }


def nvidia_smi() -> str:
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "not available"


# ----------------------------------------------------------------------------------------------------
# Instrumentation
#
# What a run reports beside its losses, without slowing its steps: each step's loss read back one step late and
# checked (LossWatch), every step's time judged against its stage's (StepTimes), anything compiled after the
# warm-up (RecompileWatch), where the compile time went, and a checksum of the final weights.


class TrainingDiverged(UserError):
    pass


class LossWatch:
    """Reads each step's loss back to the host one step late, so checking it for NaN/inf never stalls
    the GPU: by the time step s is read, step s+1 is already queued behind it. On CUDA the event behind each
    step also times it: gpu_ms[step] is the GPU time from the previous step's end to this one's (idle
    gaps included), so a slow step can be told apart from a host that launched it late."""

    def __init__(self, comm: Comm, device: torch.device):
        self.comm, self.device = comm, device
        self.pending = None
        self.previous_end = None  # the CUDA event behind the last step read back, if its successor follows it
        self.losses: list[float] = []  # mean over all ranks, one per step
        self.gpu_ms: dict[int, float] = {}  # step (1-based) -> GPU ms since the previous step's end

    def push(self, step: int, local_loss: Tensor):
        losses = local_loss.float().reshape(1)
        if self.comm.distributed:
            losses = losses.new_empty(self.comm.world_size)
            dist.all_gather_into_tensor(losses, local_loss.float().reshape(1))
        if self.device.type == "cuda":
            host = torch.empty(losses.numel(), pin_memory=True)
            host.copy_(losses, non_blocking=True)
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        else:
            host, event = losses, None
        self.flush()
        self.pending = (step, host, event)

    def flush(self, other_work_follows: bool = False):
        """Read the pending step. other_work_follows: something else (validation) runs on the GPU before
        the next step, so that step's GPU time cannot be measured from this one's end."""
        if self.pending is None:
            return
        step, host, event = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
            if self.previous_end is not None:
                self.gpu_ms[step + 1] = self.previous_end.elapsed_time(event)
            self.previous_end = None if other_work_follows else event
        losses = host.tolist()
        bad = [rank for rank, loss in enumerate(losses) if not math.isfinite(loss)]
        if bad:
            raise TrainingDiverged(f"training diverged: loss is {losses[bad[0]]} at step {step + 1} on rank {bad[0]}")
        self.losses.append(sum(losses) / len(losses))


def compiled_graph_count() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


class RecompileWatch:
    """Reports what compiled after the warm-up (there should be nothing): new dynamo graphs with the guard
    that failed, backward graphs compiled lazily at their first backward, and CUDA graphs recorded under
    --compile_mode=reduce-overhead (a recording costs a warm-up run, a capture and two synchronizations)."""

    def __init__(self):
        from torch._dynamo.callback import CallbackTrigger, callback_handler
        from torch._dynamo.utils import guard_failures
        self.failures = guard_failures
        self.graphs = self.after_warm_up = compiled_graph_count()
        self.seen = {code: len(reasons) for code, reasons in guard_failures.items()}
        # torch announces runtime compiles and recordings to registered callbacks, with the graph's compile id
        self.runtime_triggers = {CallbackTrigger.LAZY_BACKWARD: "backward compiled lazily",
                                 CallbackTrigger.CUDAGRAPH_RECORDING: "CUDA graph recorded"}
        self.runtime_events: list[str] = []
        self.reported_events = 0
        self.handler = callback_handler
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
        """What compiled since the last call and why ("where: failed guard", "CUDA graph recorded for ...")."""
        reasons = self.runtime_events[self.reported_events:]
        self.reported_events = len(self.runtime_events)
        if compiled_graph_count() == self.graphs:
            return reasons
        self.graphs = compiled_graph_count()
        guards = []
        for code, failures in list(self.failures.items()):
            for failure in failures[self.seen.get(code, 0):]:
                where = f"{code.co_name} ({Path(code.co_filename).name}:{code.co_firstlineno})"
                guards.append(f"{where}: {failure.splitlines()[0].strip()}")
            self.seen[code] = len(failures)
        return (guards or ["a new graph (no guard failed: first call of a new function)"]) + reasons


class StepTimes:
    """Each timed step's time, summarised per stage of the schedule at the end of the log (the target: no step
    slower than 1.2x its stage's median), and the Python garbage collections that ran after the warm-up
    (validation included) with their pauses.

    On a GPU a step is judged by its GPU time (LossWatch.gpu_ms: from the previous step's end to its own, idle
    gaps included), the time it held up training. The host's wall time per step is shown beside it but judges
    nothing: the host runs ahead of the GPU, so a host pause that the lead absorbs makes one step long and the
    next one short by as much, while their GPU times stay at the median (docs/performance.md).
    Without a GPU the wall time is all there is. Slow steps are listed with the host's time inside train_step
    (launch): a long launch is a host stall; a long GPU time after a normal launch is the GPU or a peer."""

    SLOW = 1.2  # a step this many times its stage's median is flagged in the summary
    LISTED = 10  # slow steps listed one by one, slowest first

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.by_stage: dict[int, list[int]] = {}  # stage -> steps
        self.wall_ms: dict[int, float] = {}  # step -> host wall time
        self.launch_ms: dict[int, float] = {}  # step -> host ms inside train_step
        self.step = 0
        self.collections: list[tuple[float, int, int]] = []  # (ms, generation, step)
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict):
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.collections.append((1000 * (time.perf_counter() - self._gc_started), info["generation"], self.step))

    def add(self, step: int, ms: float, launch_ms: float):
        """Step `step` (1-based, as logged) took `ms` of wall time, of which `launch_ms` were spent issuing its work."""
        self.by_stage.setdefault(self.schedule.stage(step - 1), []).append(step)
        self.wall_ms[step], self.launch_ms[step] = ms, launch_ms
        self.step = step + 1

    def close(self):
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def summary(self, gpu_ms: dict[int, float]) -> list[str]:
        lines, slow_steps = [], []
        for stage, steps in sorted(self.by_stage.items()):
            # the first step after the warm-up and after each validation has no GPU time and is left out
            timed = [step for step in steps if step in gpu_ms]
            judge, what = (gpu_ms, "GPU") if timed else (self.wall_ms, "wall")
            timed = timed or steps
            median = float(np.median([judge[step] for step in timed]))
            at = max(timed, key=judge.get)
            slow = [(judge[step] / median, step) for step in timed if judge[step] > self.SLOW * median]
            slow_steps += [(ratio, step, what) for ratio, step in slow]
            line = (f"step times, stage {stage}: {len(steps)} steps, {what} median {median:.1f} ms, slowest "
                    f"{judge[at]:.1f} ms at step {at} ({judge[at] / median:.2f}x); {len(slow)} over {self.SLOW}x the median")
            if judge is gpu_ms:
                wall = [self.wall_ms[step] for step in steps]
                line += f"; wall median {np.median(wall):.1f} ms, slowest {max(wall) / np.median(wall):.2f}x"
            lines.append(line + f"; median launch {np.median([self.launch_ms[step] for step in steps]):.1f} ms")
        for ratio, step, what in sorted(slow_steps, reverse=True)[: self.LISTED]:
            lines.append(f"slow step {step}: {ratio:.2f}x its stage's {what} median; wall {self.wall_ms[step]:.1f} ms, "
                         f"launch {self.launch_ms[step]:.1f} ms" + (f", GPU {gpu_ms[step]:.1f} ms" if step in gpu_ms else ""))
        if self.collections:
            longest, generation, step = max(self.collections)
            lines.append(f"garbage collections after the warm-up: {len(self.collections)}, "
                         f"{sum(ms for ms, _, _ in self.collections):.0f} ms in all; longest {longest:.1f} ms "
                         f"(generation {generation}, step {step})")
        return lines


class CompileCacheWatch:
    """How torch's two graph caches (inductor's FX graph cache and AOTAutograd's) served the graphs compiled while
    it watches: hits, misses, and bypasses with their reasons. A bypassed graph is compiled afresh every time, a
    warm cache or a --compile_cache file notwithstanding, so its reason is what to fix for a faster start. torch
    gives the reasons only as INFO lines of two of its loggers: a filter on each collects them and lets through
    only what the logger would have passed anyway."""
    LOGGERS = ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache")

    def __init__(self):
        from torch._dynamo.utils import counters
        self.counters = counters
        self.start = self._counts()
        self.reasons: collections.Counter = collections.Counter()
        self.loggers = [(logging.getLogger(name), logging.getLogger(name).level) for name in self.LOGGERS]
        self.quiet_below = {logger.name: logger.getEffectiveLevel() for logger, _ in self.loggers}
        for logger, _ in self.loggers:
            logger.addFilter(self._collect)
            logger.setLevel(min(logging.INFO, logger.getEffectiveLevel()))

    def _counts(self) -> collections.Counter:
        inductor, aot = self.counters["inductor"], self.counters["aot_autograd"]
        return collections.Counter(hits=inductor["fxgraph_cache_hit"] + aot["autograd_cache_hit"],
                                   misses=inductor["fxgraph_cache_miss"] + aot["autograd_cache_miss"],
                                   bypasses=inductor["fxgraph_cache_bypass"] + aot["autograd_cache_bypass"])

    def _collect(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Bypassing"):
            self.reasons[" ".join(message.split())[:200]] += 1
        return record.levelno >= self.quiet_below.get(record.name, logging.WARNING)

    def close(self) -> None:
        for logger, level in self.loggers:
            logger.removeFilter(self._collect)
            logger.setLevel(level)

    def counts(self) -> collections.Counter:
        """hits, misses and bypasses of the graphs compiled while watched."""
        counts = self._counts()
        counts.subtract(self.start)
        return counts

    def summary(self) -> str:
        """'cache_hits:H cache_misses:M cache_bypasses:B' for the graphs compiled while watched."""
        counts = self.counts()
        return " ".join(f"cache_{kind}:{counts[kind]}" for kind in ("hits", "misses", "bypasses"))

    def bypass_lines(self) -> list[str]:
        return [f"compile cache bypassed {n}x: {reason}" for reason, n in self.reasons.most_common()]


class TritonJitWatch:
    """Triton kernels compiled on their first launch in this process while it watches (or read from Triton's own
    cache): our kernels launched outside compiled graphs (the row gradients, Newton-Schulz). Their seconds are warm-up
    time that torch's compile phases do not count; their names tell CompileCache which of Triton's cache entries to
    keep. Watches through Triton's JIT hooks, calling any hooks already set."""

    def __init__(self):
        self.kernels, self.seconds, self.names, self._started = 0, 0.0, set(), {}
        try:
            from triton import knobs
        except ImportError:  # no Triton (or one without knobs): nothing to watch
            self.runtime = None
            return
        self.runtime = knobs.runtime
        self._before_was, self._after_was = self.runtime.jit_cache_hook, self.runtime.jit_post_compile_hook
        self.runtime.jit_cache_hook, self.runtime.jit_post_compile_hook = self._before, self._after

    def _before(self, **info):
        self._started[info.get("repr")] = time.perf_counter()
        # a true value tells Triton to skip the compile: only an earlier hook may say so
        return self._before_was(**info) if self._before_was else None

    def _after(self, **info):
        start = self._started.pop(info.get("repr"), None)
        if start is not None:
            self.kernels += 1
            self.seconds += time.perf_counter() - start
        if getattr(info.get("fn"), "name", None):  # the qualified name; Triton's cache names the kernel by its last part
            self.names.add(info["fn"].name.rsplit(".", 1)[-1])
        return self._after_was(**info) if self._after_was else None

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.jit_cache_hook, self.runtime.jit_post_compile_hook = self._before_was, self._after_was
            self.runtime = None

    def summary(self) -> str:
        return f"Triton JIT outside the graphs: {self.kernels} kernels, {self.seconds:.1f}s"


def compile_phase_times(top: int = 12) -> str:
    """Where the compile time went: torch's own phase timers (nested, so they do not add up), longest
    first. The names are torch internals and vary across versions."""
    from torch._dynamo.utils import compile_times
    names, values = compile_times(repr="csv", aggregate=True)
    longest = sorted(zip(names, (float(v) for v in values)), key=lambda item: -item[1])[:top]
    return ", ".join(f"{name} {seconds:.1f}s" for name, seconds in longest if seconds >= 0.5)


def seconds_since_process_start() -> float | None:
    """Wall time since this process began (Linux /proc), imports included: the whole cold-start cost."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in clock ticks
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def weights_checksum(model: nn.Module) -> str:
    """A log line to tell whether two runs ended with the same weights (after a refactor, under another
    compile mode or world size): float64 sum and sum of squares over every parameter."""
    total = squares = 0.0
    with torch.no_grad():
        for p in model.parameters():
            as_double = p.detach().double()
            total += as_double.sum().item()
            squares += as_double.square().sum().item()
    return f"final weights: float64 sum {total:.12e}, sum of squares {squares:.12e}"


# ----------------------------------------------------------------------------------------------------
# Checkpoints
#
# One torch.save file, written by rank 0 through a temporary file and a rename, so a crash mid-write never leaves a
# file that looks whole. It holds full tensors only: the optimizers' sharded state is gathered from its owners, and
# on loading each rank keeps its own shards again, so a checkpoint resumes at any world size with the same math.
# Loaded with weights_only=True: tensors, numbers, strings, lists, tuples and dicts, nothing that runs code.

CHECKPOINT_KIND, CHECKPOINT_FORMAT = "train_gpt.py checkpoint", 2  # 2: value scales only where a layer has attention


class CheckpointError(UserError):
    pass


def model_fields(cfg: Config) -> dict:
    """The settings a model's weights depend on: its group of fields, and the vocabulary."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.metadata["group"] == "model"}
    return {"vocab_size": cfg.vocab_size, **fields}


def checkpoint_path_at(path: str, step: int) -> str:
    """Where --checkpoint_every writes the checkpoint of `step`: beside --save_checkpoint, the step in its name."""
    base = Path(path)
    return str(base.with_name(f"{base.stem}_step{step:06d}{base.suffix or '.pt'}"))


def data_fingerprint(paths: list[str]) -> list[tuple[str, int]]:
    """The training shards as a resume compares them: file names and sizes, in reading order."""
    return [(os.path.basename(path), os.path.getsize(path)) for path in paths]


def _owner_state_everywhere(state: dict | None, owner: int, comm: Comm, device: torch.device) -> dict:
    """A parameter's optimizer state, held by rank `owner`, as CPU tensors on every rank."""
    if not comm.distributed:
        return {key: value.detach().cpu().clone() for key, value in state.items()}
    layout = [[(key, tuple(value.shape), value.dtype) for key, value in state.items()] if comm.rank == owner else None]
    dist.broadcast_object_list(layout, src=owner)
    full = {}
    for key, shape, dtype in layout[0]:
        tensor = state[key].contiguous() if comm.rank == owner else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=owner)
        full[key] = tensor.cpu().clone()
    return full


def gather_optimizer_states(model: GPT, optimizers, comm: Comm, device: torch.device) -> tuple[dict, dict]:
    """(Muon's, DistAdam's) state as {parameter name: {key: full tensor or value}}, the same at every world size.
    Muon keeps each matrix's state on the rank that owns the matrix; DistAdam keeps each bucket's moments sharded
    across ranks (one step count and the untie flag per bucket, under its first parameter's name)."""
    names = {p: name for name, p in model.named_parameters()}
    muon, adam = optimizers
    muon_state = {}
    for group in muon.groups:
        for i, p in enumerate(group.params):
            owner = i // group.per_rank
            own = muon.state.get(p, {}) if comm.rank == owner else None
            muon_state[names[p]] = _owner_state_everywhere(own, owner, comm, device)
    adam_state = {}
    for bucket in adam.buckets:
        state = adam.state.get(bucket.params[0], {})
        first = {key: value for key, value in state.items() if not isinstance(value, Tensor)}  # the untie flag
        if "step" in state:
            first["step"] = state["step"].item()
        adam_state[names[bucket.params[0]]] = first
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                continue
            flat = state[key]
            if comm.distributed:
                flat = state[key].new_empty(bucket.padded)
                dist.all_gather_into_tensor(flat, state[key])
            offset = 0
            for p in bucket.params:
                entry = adam_state.setdefault(names[p], {})
                entry[key] = flat[offset: offset + p.numel()].view_as(p).cpu().clone()
                offset += p.numel()
    return muon_state, adam_state


def scatter_optimizer_states(model: GPT, optimizers, muon_state: dict, adam_state: dict, comm: Comm,
                             device: torch.device) -> None:
    """The inverse of gather_optimizer_states at this run's world size: each rank takes its own matrices' Muon
    state and its shard of every bucket's Adam moments."""
    names = {p: name for name, p in model.named_parameters()}
    muon, adam = optimizers
    muon.state.clear()
    for group in muon.groups:
        for p in group.params[comm.rank * group.per_rank: (comm.rank + 1) * group.per_rank]:
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


def rng_states() -> dict:
    numpy_state = np.random.get_state()
    states = {"torch": torch.get_rng_state(), "numpy": (torch.from_numpy(numpy_state[1].astype(np.int64)),
                                                       *map(int, numpy_state[2:4]), float(numpy_state[4])),
              "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), position, has_gauss, cached))
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def write_atomically(target: Path, write):
    """write(temporary) writes a file beside target, which then replaces target in one rename: a reader sees the old
    file or the new one, never half of one, and a failed write leaves nothing behind. Returns what write returns."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        result = write(temporary)
        os.replace(temporary, target)
        return result
    finally:
        temporary.unlink(missing_ok=True)


def save_checkpoint(path: str, model: GPT, optimizers, cfg: Config, comm: Comm, device: torch.device, step: int,
                    progress: dict) -> None:
    """Everything a resume needs, from every rank's shards, into `path` (written by rank 0, atomically).
    progress: the training loop's own position (time, losses, validations) and the data it reads."""
    optimizers[1].exact_params()  # the full values of tables all-gathered in bf16 (--bf16_table_gathers)
    muon_state, adam_state = gather_optimizer_states(model, optimizers, comm, device)
    if comm.rank == 0:
        checkpoint = dict(kind=CHECKPOINT_KIND, format=CHECKPOINT_FORMAT, step=step, config=dataclasses.asdict(cfg),
                          model={name: t.detach().cpu().clone() for name, t in model.state_dict().items()},
                          muon=muon_state, adam=adam_state, rng=rng_states(), **progress)
        write_atomically(Path(path), lambda temporary: torch.save(checkpoint, temporary))
    if comm.distributed:
        dist.barrier()


def read_checkpoint(path: str, flag: str) -> dict:
    """A checkpoint file's contents, or one line naming the flag and what is wrong with the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"--{flag}={path}: no such file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # mmap: ranks share pages
    except Exception as e:  # truncated, not a torch file, or holding objects weights_only refuses
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"--{flag}={path}: not a readable checkpoint ({reason})") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("kind") != CHECKPOINT_KIND:
        raise CheckpointError(f"--{flag}={path}: not a checkpoint of train_gpt.py")
    if checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"--{flag}={path}: checkpoint format {checkpoint.get('format')}, this code reads "
                              f"{CHECKPOINT_FORMAT}")
    return checkpoint


def check_same_model(checkpoint: dict, cfg: Config, flag: str) -> None:
    # A field newer than the checkpoint was then at the value it came in with, the one that leaves the model as it
    # was: its default then, which RECORD_2026_02 keeps for the fields whose default changed since.
    saved = {**model_fields(Config(**RECORD_2026_02)), **checkpoint["config"]}
    differing = [f"{name}={saved.get(name)!r} (here {value!r})" for name, value in model_fields(cfg).items()
                 if saved.get(name) != value]
    if differing:
        raise CheckpointError(f"--{flag}={getattr(cfg, flag)}: the checkpoint's model differs: "
                              + ", ".join(differing) + "; pass the model flags it was trained with")


def check_resumable(checkpoint: dict, cfg: Config, train_paths: list[str]) -> None:
    check_same_model(checkpoint, cfg, "resume")
    here = data_fingerprint(train_paths)
    if [tuple(entry) for entry in checkpoint["data"]] != here:
        raise CheckpointError(f"--resume={cfg.resume}: it was trained on other data files ({len(checkpoint['data'])} "
                              f"shards, the first {tuple(checkpoint['data'][0])}) than --train_files ({len(here)}, "
                              f"the first {here[0]}); resume with the same shards")
    saved = checkpoint["config"]
    if cfg.diloco != ("diloco" in checkpoint):
        raise CheckpointError(f"--resume={cfg.resume}: the checkpoint was written {'with' if 'diloco' in checkpoint else 'without'} "
                              f"--diloco=1; resume it {'with' if 'diloco' in checkpoint else 'without'} it")
    if cfg.diloco and (saved["sync_every"], saved["num_fragments"]) != (cfg.sync_every, cfg.num_fragments):
        raise CheckpointError(f"--resume={cfg.resume}: the checkpoint's DiLoCo replica synced with "
                              f"--sync_every={saved['sync_every']} --num_fragments={saved['num_fragments']} (here "
                              f"{cfg.sync_every} and {cfg.num_fragments}); resume with those")
    total = Schedule(cfg).total_steps
    if checkpoint["step"] > total:
        raise CheckpointError(f"--resume={cfg.resume}: the checkpoint is at step {checkpoint['step']}, past this "
                              f"run's {total} steps")


def load_checkpoint_weights(model: GPT, checkpoint: dict) -> None:
    """Copies into the existing tensors, so that compiled graphs (and CUDA graphs) keep their addresses."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(checkpoint["model"][name])


# ----------------------------------------------------------------------------------------------------
# Training loop


def build_optimizers(model: GPT, cfg: Config) -> Optimizers:
    """Adam for embeddings, head and scalars; Muon for the hidden matrices (speedrun 2024-10)."""
    matrices = model.matrix_params()
    dim, qk = cfg.model_dim, cfg.muon_qk_blocks
    attn_split = 4 if qk == 1 else ((dim // qk, 2 * qk), (dim, 2))  # Q and K in qk blocks each, then V and O
    layer_of = {p: i for i, block in enumerate(model.blocks) for p in block.parameters()}
    grad_dtype = torch.bfloat16 if cfg.bf16_grad_comms else None  # what both optimizers' gradients travel as
    muon = Muon([dict(params=matrices["attn"], split=attn_split), dict(params=matrices["mlp_in"]),
                 dict(params=matrices["mlp_out"], lr_mul=cfg.muon_proj_lr_mul)],
                lr=cfg.muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.muon_weight_decay,
                beta2=cfg.normuon_beta2, shape_lr=cfg.muon_shape_lr, use_triton=model.kernels.newton_schulz,
                layers=[layer_of[p] for kind in ("attn", "mlp_in", "mlp_out") for p in matrices[kind]],
                slow_momentum=cfg.muon_slow_momentum, grad_dtype=grad_dtype,
                cuda_graphs=uses_muon_graphs(cfg, next(model.parameters()).device, current_rank_and_world()[1]))
    bigram = [model.bigram_embed.weight] if model.bigram_embed is not None else []
    tables = [ve.weight for ve in model.value_embeds] + bigram
    scalars = [model.skip_gate] + [block.value_scales for block in model.blocks if block.value_scales is not None]
    scalars += [block.lambdas for block in model.blocks if block.lambdas is not None]
    residual_scales = [block.residual_scales for block in model.blocks if block.residual_scales is not None]
    # the speedrun's 2026-03-06 record: betas 0.9 / 0.95; the residual scales at the scalars' lr, the others at the base
    mixing = [p for block in model.blocks if block.output_scales is not None
              for p in (block.output_scales, block.injection) if p is not None]
    scalars += [p for p in (model.backout, model.smear_scale) if p is not None]
    scalars += [b.attn.out_scale for b in model.blocks if b.attn is not None and b.attn.out_scale is not None]
    gates = [block.attn.gate_w for block in model.blocks if block.attn is not None and block.attn.gate_w is not None]
    xsa = [b.attn.xsa_alpha for b in model.blocks if b.attn is not None and b.attn.xsa_alpha is not None]
    mixes = [mix for mix in (model.mudd_layer, model.mudd_head) if mix is not None]
    record_gates = [model.token_gates.pre, model.token_gates.post] if model.token_gates is not None else []
    pointer = model.copy_pointer
    wd = cfg.adam_weight_decay

    def mix_groups(mixes: list[DenseMix], lr: float, **betas) -> list[dict]:
        """Adam groups of DenseMix MLPs: their weights with weight decay, their biases without."""
        return [dict(params=[p for mix in mixes for p in (mix.w1, mix.w2)], lr=lr, weight_decay=wd, **betas),
                dict(params=[mix.bias for mix in mixes], lr=lr, weight_decay=0.0, **betas)] if mixes else []

    adam = DistAdam([dict(params=tables, lr=cfg.adam_lr * cfg.embed_lr_mul, betas=cfg.table_betas,
                          weight_decay=wd * cfg.table_wd_mul),
                     # tied to the head, the token embedding takes the head's settings, also once untied
                     dict(params=[model.embed.weight], lr=cfg.adam_lr * cfg.head_lr_mul, betas=cfg.head_betas,
                          weight_decay=wd * cfg.head_wd_mul) if cfg.tie_embed else
                     dict(params=[model.embed.weight], lr=cfg.adam_lr * cfg.embed_lr_mul, betas=cfg.table_betas,
                          weight_decay=0.0),
                     dict(params=[model.lm_head.weight], lr=cfg.adam_lr * cfg.head_lr_mul, betas=cfg.head_betas,
                          weight_decay=wd * cfg.head_wd_mul),
                     dict(params=scalars, lr=cfg.adam_lr * cfg.scalar_lr_mul, weight_decay=0.0)]
                    + ([dict(params=gates, lr=cfg.adam_lr, weight_decay=0.0)] if gates else [])
                    + ([dict(params=residual_scales, lr=cfg.adam_lr * cfg.scalar_lr_mul, betas=(0.9, 0.95),
                              weight_decay=0.0), dict(params=mixing, lr=cfg.adam_lr, betas=(0.9, 0.95), weight_decay=0.0)]
                       if residual_scales else [])
                    # as the speedrun's 2026-04-29 record: betas 0.9 / 0.95, the base lr
                    + ([dict(params=xsa, lr=cfg.adam_lr, betas=(0.9, 0.95), weight_decay=0.0)] if xsa else [])
                    # MUDD's mixing MLPs at a quarter of the base lr (speedrun 2026-04-22); the 2026-05-27 record's
                    # gate MLPs at a tenth, betas 0.9 / 0.99
                    + mix_groups(mixes, cfg.adam_lr * 0.25)
                    + mix_groups(record_gates, cfg.adam_lr * 0.1, betas=(0.9, 0.99))
                    # the copy pointer's projections (and sink key), by default at MUDD's quarter lr, its query
                    # gain (and sink logit) as scalars
                    + ([dict(params=[pointer.q_w, pointer.k_w] + [pointer.sink] * cfg.copy_sink_key,
                             lr=cfg.adam_lr * cfg.copy_lr_mul, weight_decay=0.0),
                        dict(params=[pointer.q_gain] + [pointer.sink] * (not cfg.copy_sink_key),
                             lr=cfg.adam_lr * cfg.scalar_lr_mul, weight_decay=0.0)] if pointer is not None else [])
                    # the longest-match feature's scales, bucket vectors and gains at the base lr
                    + ([dict(params=list(model.longest_match.parameters()), lr=cfg.adam_lr, weight_decay=0.0)]
                       if model.longest_match is not None else [])
                    # the smear and skip gates learn slowly (speedrun 2025-12-21: lr x0.01 and x0.05)
                    + ([dict(params=[model.smear_gate_w], lr=cfg.adam_lr * 0.01, weight_decay=0.0)]
                       if model.smear_gate_w is not None else [])
                    + ([dict(params=[model.skip_gate_w], lr=cfg.adam_lr * 0.05, weight_decay=0.0)]
                       if model.skip_gate_w is not None else []),
                    lr=cfg.adam_lr, betas=cfg.adam_betas, eps=cfg.adam_eps,
                    sparse_params=(bigram if cfg.sparse_bigram_comms else [])
                    + ([ve.weight for ve in model.value_embeds] if cfg.sparse_value_comms else []),
                    compiled=cfg.compile and next(model.parameters()).is_cuda,
                    tied=(model.embed.weight, model.lm_head.weight) if cfg.tie_embed else None,
                    grad_dtype=grad_dtype,
                    gather_dtypes={table: model.compute_dtype for table in tables} if cfg.bf16_table_gathers else None,
                    fetch_tables=[[ve.weight for ve in model.value_embeds], bigram] if fetches_table_rows(cfg) else ())
    # Muon launches first. The collectives of both share one NCCL stream, and every wait on them is a wait of
    # the compute stream: Adam's step ends waiting for its all-gathers (its tables, the largest transfer
    # of the step), so a Muon launching after it would start its Newton-Schulz only then. Launching first,
    # Muon's reduce-scatters (launched early in the backward hooks' order, behind only the head's) are
    # done soon and its Newton-Schulz runs while Adam's reduce-scatters are still on the wire. The two
    # update disjoint parameters, so the order does not change the math.
    optimizers = Optimizers([muon, adam])
    covered = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    missing = [name for name, p in model.named_parameters() if not any(p is q for q in covered)]
    if missing or len(covered) != len({id(p) for p in covered}):
        raise RuntimeError(f"optimizer parameter split is wrong; unassigned: {missing}")
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


def set_hyperparameters(optimizers, schedule: Schedule, step: int):
    lr_multiplier = schedule.lr_multiplier(step)
    for opt in optimizers:
        if isinstance(opt, DistAdam):
            if opt.is_tied() and step >= schedule.untie_step:
                opt.untie()
            opt.accumulating = not schedule.adam_updates(step)
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lr_multiplier
            if isinstance(opt, Muon):
                group["momentum"] = schedule.muon_momentum(step)
                group["fast_momentum"], group["slow_share"] = schedule.muon_rails(step)


def forward_loss(model: GPT, batch: ForwardBatch, windows: tuple[int, int]) -> Tensor:
    # Under CUDA graphs: everything the previous forward returned has been used, so the graphs may reuse its memory.
    # Elsewhere the call would do nothing but import inductor's graph trees (1.4 s of a CPU run's start).
    if model.replays_cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()
    masks = model.prepare_masks(batch.inputs, batch.cu_seqlens, windows, batch.documents, batch.longest_document)
    return model(batch.inputs, batch.targets, masks, batch.bigrams)


class Optimizers(list):
    """The run's optimizers (Muon, DistAdam), stepped together. step() launches each one's updates in order
    (launch_step: its reduce-scatters' waits, its updates, its all-gathers launched), then finishes each in the same
    order (waits for its all-gathers, writes its parameters). On a step where Adam updates, Muon's all-gathers queue
    on the one NCCL stream behind Adam's reduce-scatters; finishing Muon only after Adam's updates are launched lets
    the compute stream run those updates meanwhile, and Muon's writes run while Adam's all-gathers are on the wire.
    The two update disjoint parameters, so the math is that of stepping one after the other. Hooks registered here
    (torchft's DiLoCo) run before the first launch and after the last finish, once a step."""

    def __init__(self, optimizers):
        super().__init__(optimizers)
        self.pre_hooks: dict = collections.OrderedDict()  # a handle keeps a weak reference: a plain dict takes none
        self.post_hooks: dict = collections.OrderedDict()

    def register_step_pre_hook(self, hook) -> torch.utils.hooks.RemovableHandle:
        return self._register(self.pre_hooks, hook)

    def register_step_post_hook(self, hook) -> torch.utils.hooks.RemovableHandle:
        return self._register(self.post_hooks, hook)

    @staticmethod
    def _register(hooks: dict, hook) -> torch.utils.hooks.RemovableHandle:
        handle = torch.utils.hooks.RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def step(self, mark=None):
        """mark(phase), when given, is called after each optimizer's launch and after its finish (the benchmark's
        timer; a phase's time is the sum of both)."""
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


def train_step(model: GPT, optimizers: Optimizers, batches: Prefetcher, windows: tuple[int, int], forwards: int,
               mark=None, ahead: int = 0) -> Tensor:
    """Forward/backward over this rank's micro-batches, `forwards` batches of them, then the optimizers.
    Returns the mean loss.

    Each forward's loss is a mean over its tokens (its micro-batches all have the same length); dividing
    by the local forward count and then averaging over ranks (inside the optimizers) gives the mean over
    all micro-batches of the step, so 1, 2, 4 or 8 processes, packing any number of micro-batches per
    forward, compute the same update. `mark(phase)`, when given, is called as each phase (forward,
    backward, each optimizer's launch and its finish by class name: Optimizers.step) ends: the benchmark's
    CUDA-event timer. ahead (--table_row_fetch, on a step where Adam updates): the forwards of the steps up to
    Adam's next update, whose table rows the loader lists now and DistAdam fetches after this update.
    """
    mark = mark or (lambda phase: None)
    model.prepare_grads()
    total = None
    sparse_rows = collections.defaultdict(list)  # table -> the rows each forward read
    for index in range(forwards):
        batch = batches.next()
        for table, rows in model.rows_read(batch).items():
            sparse_rows[table].append(rows)
        if index == forwards - 1:  # let gradient communication start inside the last backward
            rows_ahead = None  # with ahead: table -> the rows each forward until Adam's next update reads
            if ahead:
                rows_ahead = collections.defaultdict(list)  # left empty where the stream ends first: every row
                for coming in batches.peek(ahead) or []:
                    for table, rows in model.rows_read(coming).items():
                        rows_ahead[table].append(rows)
            for opt in optimizers:
                if hasattr(opt, "before_last_backward"):
                    opt.before_last_backward(sparse_rows, rows_ahead)
        loss = forward_loss(model, batch, windows)
        mark("forward")
        (loss / forwards).backward()
        mark("backward")
        # a copy: under --compile_mode=reduce-overhead the next replay of the CUDA graph reuses loss's memory
        total = loss.detach().clone() if total is None else total + loss.detach()
    optimizers.step(mark)
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)  # each optimizer its own parameters: Adam's may be adding up
    return total / forwards


def evaluate(model: GPT, cfg: Config, comm: Comm, val_paths: list[str], windows: tuple[int, int],
             device: torch.device, packed: int) -> float:
    """Mean loss over the fixed validation tokens, `packed` micro-batches per forward. It runs with
    autograd on, like training, so that it reuses the training graphs instead of compiling no-grad copies
    of them (a third of the cold compile time); each forward's saved activations are freed as soon as
    its loss is read."""
    batches = prefetch(val_batches_for_rank(val_paths, cfg, comm), cfg, device, packed)
    count = val_micro_batches_per_rank(cfg, comm.world_size) // packed
    total = torch.zeros((), device=device)
    try:
        for _ in range(count):
            batch = batches.next()
            total += forward_loss(model, batch, windows).detach()
    finally:
        batches.close()
    if comm.distributed:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.item() / (count * comm.world_size)


def dummy_batches(cfg: Config, seed: int):
    """Random token windows for the warm-up: documents of random length, none longer than max_doc_len, as in
    training."""
    rng = np.random.default_rng(seed)
    while True:
        window = rng.integers(0, cfg.vocab_size - 1, cfg.micro_batch_tokens + 1)
        window += window >= cfg.bos_token  # any token but BOS, which marks the starts
        window[0] = cfg.bos_token
        window[rng.integers(1, cfg.micro_batch_tokens, cfg.micro_batch_tokens // 512 + 1)] = cfg.bos_token
        window[:: cfg.max_doc_len] = cfg.bos_token
        window = window.astype(np.uint16)
        yield window


def warm_up_forwards(schedule: Schedule, packing: Packing, world_size: int, cuda_graphs: bool) -> dict:
    """(attention windows, micro-batches per forward) -> forwards per warm-up step, for every pair the timed region
    meets: each stage's (the extension's included) at the stage's size, each validation's at the validation's size.
    Under CUDA graphs a pair runs as many forwards per step as the stages that use it, and at least two: a graph is
    recorded at its second call (the first runs in a warm-up mode); with one, the timed region would record it."""
    runs = {}
    last = len(schedule.batches) - 1
    for stage, windows in enumerate(schedule.stage_windows):
        size = packing.for_stage(stage)
        forwards = schedule.batches[min(stage, last)] // world_size // size if cuda_graphs else 1
        runs[windows, size] = max(runs.get((windows, size), 1), forwards)
    for step in range(schedule.total_steps + 1):
        if schedule.validates(step):
            runs.setdefault((schedule.windows(schedule.validation_step(step)), packing.validation), 1)
    return {key: max(forwards, 2) if cuda_graphs else forwards for key, forwards in sorted(runs.items())}


def warm_up(model: GPT, optimizers, cfg: Config, comm: Comm, schedule: Schedule, device: torch.device,
            packing: Packing, log=None):
    """Run every graph the timed region will need (forward and backward of each pair of window sizes and forward
    size, warm_up_forwards; the optimizer step; validation reuses them) on random data, then restore the initial
    weights and empty the optimizer state. Nothing here is timed. log, when given, gets a line per pair as it
    finishes: a compile that tunes its kernels runs for minutes, and the lines show it advancing."""
    initial = {name: t.detach().clone() for name, t in model.state_dict().items()}
    runs = warm_up_forwards(schedule, packing, comm.world_size, model.replays_cuda_graphs)
    sizes = [size for (_, size), forwards in runs.items() for _ in range(forwards)]
    batches = prefetch(dummy_batches(cfg, seed=cfg.seed + 1 + comm.rank), cfg, device, packing.largest, sizes)
    start = time.perf_counter()
    try:
        for number, ((windows, size), forwards) in enumerate(runs.items(), 1):
            train_step(model, optimizers, batches, windows, forwards=forwards)
            if log is not None:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                log(f"warm-up {number}/{len(runs)}: windows {windows[0]}/{windows[1]}, {size} micro-batch(es) per "
                    f"forward, {forwards} forward(s), done at {time.perf_counter() - start:.1f}s")
    finally:
        batches.close()
    model.load_state_dict(initial)
    for opt in optimizers:
        if isinstance(opt, Muon):
            opt.zero_state_()
        else:
            opt.state.clear()


@dataclass
class TrainResult:
    train_losses: list[float]  # per step, mean over ranks
    val_losses: list[tuple[int, float]]  # (step, loss)
    train_time_ms: float


@dataclasses.dataclass
class Trainer:
    """What the timed loop (or a benchmark) needs once the warm-up is done."""
    model: GPT
    optimizers: list
    schedule: Schedule
    device: torch.device
    recompiles: RecompileWatch
    packing: Packing

    def per_forward(self, step: int) -> int:
        """Micro-batches in each forward of the step."""
        return self.packing.for_stage(self.schedule.stage(step))

    def forwards(self, step: int, world_size: int) -> int:
        """Forwards this rank runs in the step."""
        return self.schedule.micro_batches(step) // world_size // self.per_forward(step)

    def forwards_ahead(self, step: int, world_size: int) -> int:
        """--table_row_fetch on several ranks, at a step where Adam updates: the forwards this rank runs in the steps
        after it up to Adam's next update, whose table rows the update fetches (train_step's ahead); else 0."""
        schedule = self.schedule
        if not (fetches_table_rows(self.model.cfg) and world_size > 1 and schedule.adam_updates(step)):
            return 0
        last = min(step + schedule.adam_period, schedule.total_steps - 1)
        return sum(self.forwards(s, world_size) for s in range(step + 1, last + 1))

    def forward_sizes(self, start: int, world_size: int):
        """Micro-batches of each forward from step `start` to the end of the schedule, in order (the loader's)."""
        for step in range(start, self.schedule.total_steps):
            yield from [self.per_forward(step)] * self.forwards(step, world_size)


# Auto packs up to 8 micro-batches per forward only on a GPU with at least this much memory (GiB): with the default
# config 8 per forward peak at about 64 GiB allocated, 4 at about 37 (docs/performance.md).
PACK_8_MIN_GIB = 72


@dataclass(frozen=True)
class Packing:
    """Micro-batches per forward: `stages` for each stage of the schedule (the extension takes the last's) and
    `validation` for the validation's forwards. Each size is a graph of its own; validation takes a training size."""
    stages: tuple[int, ...]
    validation: int

    @property
    def largest(self) -> int:
        return max(*self.stages, self.validation)

    @property
    def smallest(self) -> int:
        return min(*self.stages, self.validation)

    def for_stage(self, stage: int) -> int:
        """The size of a stage's forwards; the extension (Schedule.stage's stage after the last) takes the last's."""
        return self.stages[min(stage, len(self.stages) - 1)]

    def describe(self) -> str:
        if len({*self.stages, self.validation}) == 1:
            return f"{self.validation} micro-batch(es)"
        return f"{', '.join(map(str, self.stages))} micro-batches by stage ({self.validation} in validation)"


def resolve_packing(cfg: Config, world_size: int, device_memory_gib: float | None = None) -> Packing:
    """--forward_micro_batches in every stage and in validation (it must divide each one's micro-batches per rank),
    or for 0 per stage the most that divide the stage's micro-batches per rank: up to 8 on a GPU of at least
    PACK_8_MIN_GIB, up to 4 otherwise (default schedule: 8 in every stage on one such GPU; 2, 4, 6 on 4; 1, 2, 3 on
    8). Validation takes the largest stage size that divides its micro-batches per rank, so it runs the training's
    graphs. A stage in one forward makes the step faster than in several smaller ones: 2.4-4.1% per stage at 6
    micro-batches per rank on 4xH200, where it also cut the host's cost of a step to a third; the activations grow
    by about 7 GiB per micro-batch (docs/performance.md)."""
    per_rank = [n // world_size for n in cfg.stage_batches]
    validation = val_micro_batches_per_rank(cfg, world_size)
    fixed = cfg.forward_micro_batches
    if fixed:
        uneven = [f"stage {i}: {n}" for i, n in enumerate(per_rank) if n % fixed]
        uneven += [f"validation: {validation}"] if validation % fixed else []
        if fixed < 0 or uneven:
            raise UserError(f"--forward_micro_batches={fixed} must divide the micro-batches per rank at {world_size} "
                            f"process(es) ({', '.join(uneven or ['it must be positive'])}); use 0 (auto)")
        return Packing(tuple(fixed for _ in per_rank), fixed)
    most = 8 if device_memory_gib is not None and device_memory_gib >= PACK_8_MIN_GIB else 4

    def most_that_divide(n: int) -> int:
        return max(k for k in range(1, most + 1) if n % k == 0)
    stages = tuple(most_that_divide(n) for n in per_rank)
    shared = [k for k in stages if validation % k == 0]
    return Packing(stages, max(shared) if shared else most_that_divide(validation))


def resolve_compile_mode(cfg: Config, device: torch.device, packing: Packing) -> str:
    """--compile_mode=auto: reduce-overhead (CUDA graphs) on a GPU where they make the steps faster, else default.
    - One micro-batch per forward in any stage (8 GPUs' first stage, or --forward_micro_batches=1): the host's
      launches set the step, and graphs are taken for every stage (the mode is the whole model's). On
      4xH200 FA3 under graphs took 36% off the last stage against FA3 without them, and was 3-4% faster than flex
      under graphs; the graphs compute the gradients computed without them, with FA3 on one GPU and two ranks, with
      flex on four ranks (bench/graph_check.py), and two ranks under graphs train as without
      (tests/gpu/test_cuda_ranks.py).
    - Bigger forwards: default. There the GPU sets the step: graphs were no faster at 2 micro-batches per forward on
      2xH200, nor with FA3 on 4xH200 (0.5-1.5% slower per stage, with the host's cost of a step more than halved),
      nor with flex on 1xH100 at 8, whose cold start they made 17 s longer.
    - Default on CPUs, which have no graphs, and under DiLoCo. An explicit mode is taken as asked.
    Measurements: docs/performance.md."""
    if cfg.compile_mode != "auto":
        return cfg.compile_mode
    if device.type != "cuda" or cfg.diloco:
        return "default"
    return "reduce-overhead" if packing.smallest == 1 else "default"


def uses_muon_graphs(cfg: Config, device: torch.device, world_size: int) -> bool:
    """Whether Muon replays its compute as CUDA graphs (--muon_graphs): 1 or auto on several ranks, on CUDA only."""
    return device.type == "cuda" and (cfg.muon_graphs == "1" or (cfg.muon_graphs == "auto" and world_size > 1))


def check_gpu_features(cfg: Config, device: torch.device, kernels: Kernels) -> None:
    """The default kernels need a recent GPU: one line naming the GPU and the flag that turns each one off."""
    if device.type != "cuda":
        return
    capability, name = torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)
    if cfg.fp8_head and capability < (8, 9):
        raise UserError(f"the FP8 head (--fp8_head, on by default) needs FP8 matmuls (compute capability 8.9 or "
                        f"newer: Ada, Hopper); {name} has none: pass --fp8_head=0")
    if kernels.fused_mlp and capability < (9, 0):
        raise UserError(f"the fused MLP (--fused_mlp, on by default) needs the TMA copy engine (compute capability "
                        f"9.0 or newer: Hopper); {name} has none: pass --fused_mlp=0")


def build_model(cfg: Config, comm: Comm, log: RunLog) -> tuple[GPT, torch.device, Packing]:
    """The model on this rank's device, the same initial weights on every rank; with the micro-batches per forward."""
    device = torch.device("cuda", comm.local_rank) if cfg.device == "cuda" else torch.device("cpu")
    torch.manual_seed(cfg.seed)
    memory_gib = torch.cuda.get_device_properties(device).total_memory / 2 ** 30 if device.type == "cuda" else None
    packing = resolve_packing(cfg, comm.world_size, memory_gib)
    attend = make_attention(cfg, device, packing.largest * cfg.micro_batch_tokens)
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernels = choose_kernels(cfg, device)
    check_gpu_features(cfg, device, kernels)
    # Built on its device: the tables' random init on a CPU took about 3 s of every start on an H100 machine.
    with device:
        model = GPT(cfg, attend, compute_dtype, forward_micro_batches=packing.largest, kernels=kernels).to(device)
    if comm.distributed:  # same seed gives the same init, but make certain
        for t in model.state_dict().values():
            dist.broadcast(t, 0)
    num_params = sum(p.numel() for p in model.parameters())
    log(f"model: {num_params:,} parameters, attention backend {attend.name}, compute dtype {compute_dtype}, "
        f"world size {comm.world_size}, {packing.describe()} of {cfg.micro_batch_tokens} tokens per forward")
    return model, device, packing


def configure_inductor(cfg: Config, device: torch.device) -> bool:
    """Inductor's options for our graphs, set before they compile (torch keeps them process-wide). Returns whether
    it tunes the kernels."""
    import torch._functorch.config as functorch
    import torch._inductor.config as inductor
    tune = cfg.tune_kernels == "1" or (cfg.tune_kernels == "auto" and bool(cfg.compile_cache))
    inductor.coordinate_descent_tuning = tune and device.type == "cuda"
    if device.type == "cuda":
        find_tuned_configs_in_this_cache_folder()
    if inductor.coordinate_descent_tuning:
        keep_tuned_configs_on_cache_hits()
        prefer_tuned_cache_entries()
        tune_only_kernels_without_stored_tuning()
    # AOTAutograd's cache refuses graphs with custom autograd Functions unless told otherwise, and the FP8 head, the
    # loss and the copy pointer are such Functions: the whole-model graph was traced and compiled afresh at every
    # start, warm caches and --compile_cache notwithstanding. Dynamo traces each Function's forward and backward into
    # the graph, so the cache key covers them.
    functorch.autograd_cache_allow_custom_autograd_functions = True
    return inductor.coordinate_descent_tuning


def triton_cache_dir() -> Path:
    """Where Triton keeps its compiled kernels, as Triton itself decides (TRITON_CACHE_DIR, else under ~/.triton)."""
    try:
        from triton import knobs
        return Path(knobs.cache.dir)
    except ImportError:
        return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def find_tuned_configs_in_this_cache_folder() -> bool:
    """A kernel that comes from a cache (--compile_cache, or a warm inductor cache) keeps the path of the file it was
    compiled to, in the writing run's inductor cache folder, and torch looks its tuned config up beside that path.
    Where that folder is gone or is another run's (an empty cache, another machine, another TORCHINDUCTOR_CACHE_DIR),
    every lookup missed and coordinate descent tuned each kernel again: minutes of a start from a tuned file. The
    file puts the configs back in this run's folder, under the kernel file's last folder and name, so each lookup
    now goes there. Returns whether it is in place (not on a torch whose autotune cache is made another way)."""
    try:
        from torch._inductor.runtime.autotune_cache import AutotuneCache
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return False
    plain = AutotuneCache.__dict__.get("create")
    if hasattr(getattr(plain, "__func__", None), "plain"):  # already in place
        return True
    if not isinstance(plain, staticmethod):
        return False

    def create(inductor_meta, filename, configs_hash):
        if filename:
            here, folder = os.path.realpath(cache_dir()), os.path.realpath(os.path.dirname(filename))
            if os.path.commonpath([here, folder]) != here:
                filename = os.path.join(here, os.path.basename(folder), os.path.basename(filename))
        return plain.__func__(inductor_meta, filename, configs_hash)

    create.plain = plain.__func__
    AutotuneCache.create = staticmethod(create)
    return True


def keep_tuned_configs_on_cache_hits() -> bool:
    """Torch without the fix of pytorch#172819 tunes every coordinate-descent-tuned kernel again when its graph comes
    from a cache (a warm inductor cache, or --compile_cache): a kernel compiled with one config never takes its tuned
    config from the autotune cache, and one that finds it does not mark it as tuned. Where the installed torch's
    CachingAutotuner.recheck_autotune_cache has that guard (len(configs) > 1), recheck_tuned_config takes its place.
    Returns whether it did."""
    import inspect
    from torch._inductor.runtime import triton_heuristics
    autotuner = triton_heuristics.CachingAutotuner
    try:
        source = inspect.getsource(autotuner.recheck_autotune_cache)
    except (AttributeError, OSError, TypeError):  # another torch: leave it as it is
        return False
    if "len(configs) > 1" not in source:
        return False
    autotuner.recheck_autotune_cache = recheck_tuned_config
    return True


def recheck_tuned_config(self, reload_kernel_from_src) -> None:
    """CachingAutotuner.recheck_autotune_cache as torch fixed it: a kernel loaded from a cache runs the config the
    autotune cache holds for it, with coordinate descent's mark where tuning found it, whatever it was compiled with."""
    from torch._inductor.runtime import triton_heuristics as heuristics
    compiled = [result.config for result in self.compile_results]
    cached, _, self.autotune_cache_info = heuristics.check_autotune_cache(compiled, self.filename, self.inductor_meta)
    if len(cached) != 1:
        return
    best = cached[0]
    key = heuristics.triton_config_to_hashable(best)
    same = [result for result in self.compile_results if heuristics.triton_config_to_hashable(result.config) == key]
    if same:
        same[0].config.found_by_coordesc = getattr(best, "found_by_coordesc", False)
        self.compile_results = same[:1]
    else:  # found at run time (coordinate descent): never compiled ahead, so compile it now
        if self.fn.fn is None:
            self.fn = reload_kernel_from_src().fn
        self.compile_results = [self._precompile_config(best)]


def prefer_tuned_cache_entries() -> bool:
    """Two ways torch's autotune cache loses a config coordinate descent found, so that a start from
    --compile_cache tunes the kernel again (on an H100 with FA3, 5 to 76 s of a start), closed here:
    - the entry is stored against a hash of the candidate configs it was tuned from, and a lookup that hashes other
      candidates misses, though the entry is for this very kernel (it is found by the kernel's source hash): the
      FA3 model's two split scans, whose one candidate hashed differently from the write's. Such a miss now takes
      the config coordinate descent stored (stored_tuned_config), at every lookup: when a kernel is made and when
      one loaded from a cache checks again;
    - a winner of plain autotuning is saved over it: on torch 2.11 a reduction kernel that runs its tuned config
      may add smaller-block variants when its registers spill, benchmark them, and save the winner unmarked, so
      the next lookup of that kernel finds an untuned config (14 RMS-norm reductions on one start). An unmarked
      save no longer replaces a marked entry.
    Returns whether both are in place (not on a torch whose autotune cache reads or writes another way)."""
    try:
        from torch._inductor.runtime.autotune_cache import AutotuneCache
    except ImportError:
        return False
    plain_read, plain_save = AutotuneCache.__dict__.get("read_best"), AutotuneCache.__dict__.get("save")
    if hasattr(plain_read, "plain"):  # already in place
        return True
    if plain_read is None or plain_save is None or not hasattr(AutotuneCache, "_read"):
        return False

    def read_best(self, inductor_meta, configs):
        best = plain_read(self, inductor_meta, configs)
        if best is None and inductor_meta.get("coordinate_descent_tuning"):
            best = stored_tuned_config(self, configs, inductor_meta)
        return best

    def save(self, config, time_taken_ns, found_by_coordesc=False, **kwargs):
        if not found_by_coordesc:
            stored = self._read()
            if isinstance(stored, dict) and stored.get("found_by_coordesc"):
                return
        plain_save(self, config, time_taken_ns, found_by_coordesc=found_by_coordesc, **kwargs)

    read_best.plain, save.plain = plain_read, plain_save
    AutotuneCache.read_best, AutotuneCache.save = read_best, save
    return True


def stored_tuned_config(cache, configs: list, inductor_meta: dict):
    """The config coordinate descent found for this kernel, as the autotune cache holds it, whatever configs hash it
    was stored against; None where it holds none (or this torch reads its cache another way). The entry is found by
    the kernel's source hash and torch's own, so it was tuned for this very kernel; the configs hash only says which
    candidates it was tuned from."""
    try:
        from torch._inductor.runtime.autotune_cache import _load_cached_autotuning
        stored = cache._read()
    except (ImportError, AttributeError):
        return None
    if not isinstance(stored, dict) or not stored.get("found_by_coordesc"):
        return None
    return _load_cached_autotuning(dict(stored), stored.get("configs_hash"), configs, inductor_meta)


def tune_only_kernels_without_stored_tuning() -> bool:
    """The last word before a kernel is tuned at its first run: where the autotune cache holds a config coordinate
    descent found for it, that config runs and is not tuned again. On torch 2.11 with FA3 on an H100, 4 to 7
    reductions per start from --compile_cache (5 to 20 s of it) reached tuning from a config without the mark though
    the cache's lookup for them hit, by two ways:
    - persistent reductions whose autotuner reached its first run with its untuned config (bench/autotune_probe saw
      no lookup of theirs until the tuning reloaded the kernel's source);
    - a reduction whose tuned config spills registers adds smaller-block variants, benchmarks them and tunes the
      winner. Torch 2.13 adds no variants after a cache hit; here neither does 2.11.
    Returns whether it is in place (not on a torch whose autotuner tunes or scales its blocks by other names)."""
    from torch._inductor.runtime import triton_heuristics as heuristics
    autotuner = heuristics.CachingAutotuner
    plain_tune = autotuner.__dict__.get("coordinate_descent_tuning")
    plain_scale = autotuner.__dict__.get("_dynamic_scale_rblock")
    if hasattr(plain_tune, "plain"):  # already in place
        return True
    if plain_tune is None or plain_scale is None:
        return False
    untuned_kinds = {getattr(heuristics.HeuristicType, name, None) for name in ("TEMPLATE", "USER_AUTOTUNE", "FIXED")}

    def coordinate_descent_tuning(self, launcher, *args, **kwargs):
        if self.heuristic_type not in untuned_kinds:  # (torch never tunes those: our kernels, called every launch)
            stored = stored_tuned_launcher(self, launcher)
            if stored is not None:
                return stored
            FirstTuningNotice.say(self.inductor_meta.get("kernel_name", "?"))
        return plain_tune(self, launcher, *args, **kwargs)

    def _dynamic_scale_rblock(self):
        if (getattr(self, "autotune_cache_info", None) or {}).get("autotune_cache_state") != "hit":
            plain_scale(self)

    coordinate_descent_tuning.plain, _dynamic_scale_rblock.plain = plain_tune, plain_scale
    autotuner.coordinate_descent_tuning = coordinate_descent_tuning
    autotuner._dynamic_scale_rblock = _dynamic_scale_rblock
    return True


class FirstTuningNotice:
    """One log line at the first kernel that coordinate descent tunes after a --compile_cache file loaded: a start
    from a tuned file should tune nothing, and tuning every kernel again takes minutes, which the log should say
    when they begin, not after. CompileCache.load arms it; the line goes once."""
    armed = None  # a function of the kernel's name, which logs the line

    @classmethod
    def say(cls, kernel_name: str) -> None:
        log_line, cls.armed = cls.armed, None
        if log_line is not None:
            log_line(kernel_name)


def stored_tuned_launcher(autotuner, launcher):
    """A launcher of the config coordinate descent stored for this autotuner's kernel, marked as tuned: `launcher`
    itself where that is its config, else one compiled now (as tuning would compile it); None where none is stored."""
    from torch._inductor.runtime import triton_heuristics as heuristics
    from torch._inductor.runtime.autotune_cache import AutotuneCache
    if not autotuner.filename:
        return None
    cache = AutotuneCache.create(autotuner.inductor_meta, autotuner.filename,
                                 heuristics.hash_configs([launcher.config]))
    config = stored_tuned_config(cache, [launcher.config], autotuner.inductor_meta) if cache else None
    if config is None:
        return None
    if heuristics.triton_config_to_hashable(config) != heuristics.triton_config_to_hashable(launcher.config):
        if autotuner.fn.fn is None:  # compiled in a worker, which drops the source: torch's tuning reloads it too
            autotuner.fn = autotuner._reload_kernel().fn
        with autotuner.lock:
            launcher = autotuner._precompile_config(config).make_launcher()
    launcher.config.found_by_coordesc = True
    return launcher


def tuned_kernel_entries() -> set[str]:
    """The Triton cache entries (folder names) of the configs coordinate descent chose in this process. torch bundles
    a graph's kernels as it compiles the graph, before they are tuned at their first run, so its artifacts lack the
    tuned configs' binaries, and a start from the file compiled each of them again, one after another in the main
    process (30.6 s of a 66.8 s start with FA3 on an H100). Each autotuner's launchers run the configs it chose, and
    every launcher carries its binary's entry name as cache_hash; only a launcher that stores its cubin also keeps
    the binary (bin), so cache_hash is read first (torch 2.11's static launchers have no bin)."""
    try:
        from torch._inductor.runtime.runtime_utils import triton_hash_to_path_key
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:  # another torch: the tuned configs compile again at the next start, as before
        return set()
    entries = set()
    for obj in gc.get_objects():
        # type(), not isinstance: that reads __class__, which raises on a dead weak proxy and warns on deprecated names
        if issubclass(type(obj), CachingAutotuner):
            for launcher in getattr(obj, "launchers", None) or ():
                if not getattr(getattr(launcher, "config", None), "found_by_coordesc", False):
                    continue
                entry = getattr(launcher, "cache_hash", None)
                binary_hash = getattr(getattr(launcher, "bin", None), "hash", None)
                if not entry and binary_hash:
                    entry = triton_hash_to_path_key(binary_hash)
                if entry:
                    entries.add(entry)
    return entries


class CompileCache:
    """--compile_cache=PATH: torch's portable compile artifacts, loaded before the warm-up and written (by rank 0)
    after it, so a fresh machine or an empty TORCHINDUCTOR_CACHE_DIR skips most compiling. The file is a zip of
    torch's artifacts (TORCH_MEMBER) and, under TRITON_FOLDER, the Triton cache entries that torch's artifacts do not
    hold: our kernels launched outside the graphs (by kernel name: TritonJitWatch.names), the compiled launchers (each
    a .so), and the configs coordinate descent chose (tuned_kernel_entries); loading puts back any entry that Triton's
    cache lacks. Entries are found by a hash of the source, the GPU and the Triton version, so a foreign one is never
    read. A file that cannot be used (corrupt, foreign, another torch version) is ignored with a warning."""

    TORCH_MEMBER, TRITON_FOLDER = "torch_artifacts.bin", "triton"

    def __init__(self, path: str, log: RunLog, comm: Comm):
        self.path, self.log, self.comm = path, log, comm
        self.loaded = False

    def load(self):
        if not os.path.exists(self.path):
            self.log(f"compile cache {self.path}: none yet; it is written after the warm-up")
            return
        torch_log = logging.getLogger("torch.compiler._cache")
        level = torch_log.level
        torch_log.setLevel(logging.ERROR)  # torch logs a traceback for unreadable files; we say it in one line
        info, reason, restored = None, "corrupt, or written by another torch version", 0
        try:
            with zipfile.ZipFile(self.path) as bundle:
                info = torch.compiler.load_cache_artifacts(bundle.read(self.TORCH_MEMBER))
                if info is not None:
                    restored = self.restore_triton_entries(bundle, triton_cache_dir())
        except Exception as e:  # whatever the file holds, a bad cache must never stop a run
            info, reason = None, f"{type(e).__name__}: {e}"
        finally:
            torch_log.setLevel(level)
        if info is None:
            self.log(f"warning: compile cache {self.path} ignored ({reason}); compiling from scratch")
        else:
            self.loaded = True
            self.log(f"compile cache {self.path}: loaded {self.counts(info)}; {restored} Triton cache entries put back")
            FirstTuningNotice.armed = lambda kernel: self.log(
                f"warning: compile cache {self.path} holds no tuned config for kernel {kernel}: coordinate descent "
                f"tunes it now, and each other kernel without one (minutes if many; --tune_kernels=0 skips tuning)")

    def save(self, kernel_names: set[str], graph_cache: collections.Counter):
        """Writes the file, unless this run loaded it and it served most graphs (graph_cache: their hits and misses):
        torch saves only the artifacts this process used, and a start from the file uses fewer than the run that
        compiled them (of a tuned file's 139, 88 came back), so rewriting it would lose tuned configs."""
        if self.loaded and graph_cache["hits"] >= graph_cache["misses"]:
            self.log(f"compile cache {self.path}: it served this run ({graph_cache['hits']} cache hits, "
                     f"{graph_cache['misses']} misses), so it is left as it is; delete it to write a new one")
            return
        artifacts = torch.compiler.save_cache_artifacts()
        if not self.comm.is_main or artifacts is None:
            return
        cache, tuned = triton_cache_dir(), tuned_kernel_entries()

        def write(temporary: Path) -> int:
            with zipfile.ZipFile(temporary, "w") as bundle:  # stored, not deflated: cubins and pickles barely shrink
                bundle.writestr(self.TORCH_MEMBER, artifacts[0])
                return self.add_triton_entries(bundle, cache, kernel_names, tuned)

        entries = write_atomically(Path(self.path), write)
        tuned_present = sum((cache / name).is_dir() for name in tuned)
        self.log(f"compile cache {self.path}: saved {os.path.getsize(self.path):,} bytes, {self.counts(artifacts[1])}, "
                 f"{entries} Triton cache entries" + (f", {tuned_present} of them tuned configs" if tuned else ""))

    @classmethod
    def add_triton_entries(cls, bundle: zipfile.ZipFile, cache: Path, kernel_names: set[str],
                           entry_names: set[str] = frozenset()) -> int:
        """Each entry of Triton's cache (a folder named by a hash) that holds one of the kernels named (its group
        file __grp__NAME.json) or a compiled launcher (.so), or is one of entry_names: the number added."""
        groups = {f"__grp__{name}.json" for name in kernel_names}
        added = 0
        for entry in sorted(cache.iterdir()) if cache.is_dir() else ():
            files = [f for f in entry.iterdir() if f.is_file()] if entry.is_dir() else []
            if files and (entry.name in entry_names or any(f.name in groups or f.suffix == ".so" for f in files)):
                for f in files:
                    bundle.write(f, f"{cls.TRITON_FOLDER}/{entry.name}/{f.name}")
                added += 1
        return added

    @classmethod
    def restore_triton_entries(cls, bundle: zipfile.ZipFile, cache: Path) -> int:
        """Writes each bundled entry that the cache lacks, whole or not at all (a folder renamed into place), so
        that a process reading the cache at the same time never sees half an entry: the number written."""
        entries: dict[str, list[zipfile.ZipInfo]] = {}
        for member in bundle.infolist():
            parts = member.filename.split("/")
            if len(parts) == 3 and parts[0] == cls.TRITON_FOLDER and all(p not in ("", ".", "..") for p in parts[1:]):
                entries.setdefault(parts[1], []).append(member)
        restored = 0
        for name, members in entries.items():
            if (cache / name).exists():
                continue
            cache.mkdir(parents=True, exist_ok=True)
            tmp = cache / f".{name}.tmp{os.getpid()}"
            tmp.mkdir(exist_ok=True)
            for member in members:
                file_name = member.filename.rsplit("/", 1)[1]
                data = bundle.read(member)
                if file_name.startswith("__grp__"):
                    data = cls.group_in_folder(data, cache / name)
                (tmp / file_name).write_bytes(data)
            try:
                os.rename(tmp, cache / name)
                restored += 1
            except OSError:  # another process put it there first
                shutil.rmtree(tmp, ignore_errors=True)
        return restored

    @staticmethod
    def group_in_folder(data: bytes, folder: Path) -> bytes:
        """A Triton group file (__grp__NAME.json) names its entry's files by their paths on the writing machine, and
        Triton's lookup misses where one does not exist: a start from the file compiled each of our kernels and each
        tuned config again, one after another, wherever the writer's cache folder was not. The paths now name the
        files in the entry's folder here, FOLDER (torch's own bundle of Triton kernels does the same)."""
        try:
            group = json.loads(data)
            paths = group["child_paths"]
            group["child_paths"] = {child: str(folder / Path(path).name) for child, path in paths.items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            return data  # not a group file as Triton writes it: left as it is
        return json.dumps(group).encode()

    @staticmethod
    def counts(info) -> str:
        """'N artifacts (kind n, ...)': the autotune kind holds the kernels' tuned configs, coordinate descent's too."""
        kinds = {kind: len(keys) for kind, keys in sorted(info.artifacts.items()) if keys}
        return f"{sum(kinds.values())} artifacts ({', '.join(f'{kind} {n}' for kind, n in kinds.items())})"


# The ints of FA3's masks (FlashAttention3.prepare) in the compiled functions' arguments: window, max_seqlen and
# count of each kind, in the whole model's `masks` and a block's `mask` (--compile_scope=regional). Marked symbolic,
# one compiled graph serves every value (the graphs are compiled with dynamic=False, under which each value would be
# a whole-model compile of its own).
FA3_HOST_INT_SOURCES = r"L\['masks'\]\['P?[SL]'\]\[[123]\],L\['mask'\]\[[123]\]"


def compile_model(model: GPT, cfg: Config, comm: Comm, device: torch.device, packing: Packing) -> tuple[str, str]:
    """Wrap the model's forward (or its blocks) in torch.compile as --compile, --compile_scope and --compile_mode
    say; the graphs compile at the first calls. Returns the scope and mode chosen."""
    scope = cfg.compile_scope
    if scope == "auto":
        # The one whole-model graph makes faster steps than a graph per block (fewer launches from the
        # host, fusion across blocks), for a longer cold compile (docs/performance.md).
        scope = "whole"
    compile_mode = resolve_compile_mode(cfg, device, packing)
    mode = None if compile_mode == "default" else compile_mode
    model.replays_cuda_graphs = cfg.compile and compile_mode in CUDA_GRAPH_MODES
    if cfg.compile and isinstance(model.attend, FlashAttention3):
        torch.compiler.config.dynamic_sources = FA3_HOST_INT_SOURCES
    if cfg.compile and scope == "whole":
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        if cfg.row_embedding_grads:  # the lookups' backward writes .grad outside autograd: they stay eager
            model.trunk = torch.compile(model.trunk, dynamic=False, fullgraph=True, mode=mode)
            model.find_matches = torch.compile(model.find_matches, dynamic=False, fullgraph=True)
        else:
            model.compile(dynamic=False, fullgraph=True, mode=mode)
    elif cfg.compile and scope == "split":
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        model.trunk_front = torch.compile(model.trunk_front, dynamic=False, fullgraph=True, mode=mode)
        model.trunk_back = torch.compile(model.trunk_back, dynamic=False, fullgraph=True, mode=mode)
    elif cfg.compile:
        model.compile_regions(mode)
    return scope, compile_mode


def build_and_warm_up(cfg: Config, comm: Comm, log: RunLog) -> Trainer:
    """Model, optimizers and every compiled graph, with the compile time logged; nothing here is timed."""
    model, device, packing = build_model(cfg, comm, log)
    schedule = Schedule(cfg)
    # Untimed warm-up: compile and tune every kernel, then start over from the same weights.
    start = time.perf_counter()
    optimizers = build_optimizers(model, cfg)
    tunes = cfg.compile and configure_inductor(cfg, device)
    cache = CompileCache(cfg.compile_cache, log, comm) if cfg.compile and cfg.compile_cache else None
    if cache is not None:
        cache.load()
    scope, compile_mode = compile_model(model, cfg, comm, device, packing)
    caches, jit = CompileCacheWatch(), TritonJitWatch()
    try:
        if tunes:
            log("warm-up: inductor tunes every kernel it holds no tuning for (--tune_kernels): minutes from empty caches")
        warm_up(model, optimizers, cfg, comm, schedule, device, packing, log)
    except torch.OutOfMemoryError as e:
        raise UserError(f"out of GPU memory in the warm-up, with up to {packing.largest} micro-batch(es) of "
                        f"{cfg.micro_batch_tokens} tokens per forward ({str(e).splitlines()[0]}): lower "
                        "--forward_micro_batches or --micro_batch_tokens") from None
    finally:
        caches.close()
        jit.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    recompiles = RecompileWatch()
    since_start = seconds_since_process_start()
    log(f"compile_time:{time.perf_counter() - start:.1f}s graphs:{recompiles.graphs} {caches.summary()}"
        + (f" since_process_start:{since_start:.1f}s" if since_start is not None else ""))
    for line in caches.bypass_lines():
        log(line)
    if cfg.compile:
        log(f"compile scope: {scope}, mode: {compile_mode}" + (" (auto)" if cfg.compile_mode == "auto" else "")
            + f"; phases: {compile_phase_times()}; {jit.summary()}")
    if cache is not None:
        cache.save(jit.names, caches.counts())
    return Trainer(model, optimizers, schedule, device, recompiles, packing)


def train(cfg: Config, comm: Comm, log: RunLog) -> TrainResult:
    train_paths = shard_paths(cfg.train_files, "train_files")
    val_paths = shard_paths(cfg.val_files, "val_files")
    checkpoint = read_checkpoint(cfg.resume, "resume") if cfg.resume else None  # a bad one fails before compiling
    if checkpoint is not None:
        check_resumable(checkpoint, cfg, train_paths)
    run = TrainingRun(cfg, comm, log, build_and_warm_up(cfg, comm, log), train_paths, val_paths)
    if checkpoint is not None:
        run.restore(checkpoint)
        del checkpoint
    run.loop()
    return run.report()


# --tail_ema_kinds: the speedrun's 2026-08-30 record's shares of the slow and the fast tail average in the final
# weights of each kind (the rest is the weights as trained); the other parameters are left as they are.
TAIL_KIND_BLENDS = {"embedding and head": (0.65, 0.0), "query and key rows": (0.55, 0.0),
                    "value and output rows, MLP": (0.35, 0.65), "value embeddings": (0.0, 1.0)}


def tail_parts_by_kind(model: GPT) -> list[tuple[Tensor, float, float]]:
    """(a view of some weights, its slow share, its fast share) for --tail_ema_kinds: the attention matrix in two
    parts, its query and key rows and its value and output rows."""
    blends = TAIL_KIND_BLENDS
    parts = [(p.detach(), *blends["embedding and head"]) for p in (model.embed.weight, model.lm_head.weight)]
    for block in model.blocks:
        if block.attn is not None:
            w = block.attn.qkvo_w.detach()
            half = 2 * w.size(1)
            parts += [(w[:half], *blends["query and key rows"]), (w[half:], *blends["value and output rows, MLP"])]
        parts += [(p.detach(), *blends["value and output rows, MLP"]) for p in (block.mlp.fc_w, block.mlp.proj_w)]
    return parts + [(table.weight.detach(), *blends["value embeddings"]) for table in model.value_embeds]


class TailEMA:
    """--tail_ema_from: a float32 exponential moving average of the token embedding and the head (--tail_ema_all: of
    every parameter), started from their weights after step `start` and updated after every later step, then
    blended into them before the final validation; with keep_norms each blended matrix (two or more dims) is then
    scaled back to its norm before the blend. With --tail_ema_kinds, a slow (tail_ema_decay) and a fast average
    (tail_ema_fast_decay) of the weights of tail_parts_by_kind, blended by each kind's shares. Nothing is sent: every
    rank holds the same weights, so the same averages."""

    def __init__(self, model: GPT, cfg: Config):
        self.start = max(1, round(cfg.tail_ema_from * cfg.num_iterations))
        self.keep_norms, self.kinds, self.all = cfg.tail_ema_keep_norms, cfg.tail_ema_kinds, cfg.tail_ema_all
        if cfg.tail_ema_kinds:
            parts = tail_parts_by_kind(model)
        else:
            params = list(model.parameters()) if cfg.tail_ema_all else [model.embed.weight, model.lm_head.weight]
            parts = [(p.detach(), cfg.tail_ema_blend, 0.0) for p in params]
        self.params = [w for w, _, _ in parts]
        self.shares = [(slow, fast) for _, slow, fast in parts]
        self.blend = cfg.tail_ema_blend
        # one average per (part, "slow" or "fast", decay) that has a share, the slow ones first
        self.entries = [(i, which, decay) for which, column, decay in (("slow", 0, cfg.tail_ema_decay),
                                                                      ("fast", 1, cfg.tail_ema_fast_decay))
                        for i, shares in enumerate(self.shares) if shares[column]]
        self.average: list[Tensor] | None = None

    def after_step(self, done: int):
        """`done` steps are done."""
        if done < self.start:
            return
        weights = [self.params[i].float() for i, _, _ in self.entries]
        if self.average is None:
            self.average = [w.clone() for w in weights]
            return
        for decay in sorted({decay for _, _, decay in self.entries}):
            picked = [k for k, (_, _, d) in enumerate(self.entries) if d == decay]
            torch._foreach_lerp_([self.average[k] for k in picked], [weights[k] for k in picked], 1.0 - decay)

    @torch.no_grad()
    def blend_into_weights(self):
        if self.average is None:
            return
        averages = {(i, which): average for (i, which, _), average in zip(self.entries, self.average)}
        for i, (w, (slow, fast)) in enumerate(zip(self.params, self.shares)):
            norm = w.float().norm() if self.keep_norms and w.ndim >= 2 else None
            blended = w.float() * (1.0 - slow - fast)
            for which, share in (("slow", slow), ("fast", fast)):
                if share:
                    blended += share * averages[i, which]
            w.copy_(blended)
            if norm is not None:
                w.mul_((norm / w.float().norm().clamp(min=1e-30)).to(w.dtype))

    def describe(self, step: int) -> str:
        """The log's line on the blend after `step`."""
        what = ("each kind of weight, slow and fast average by the record's shares" if self.kinds else
                f"{'every parameter' if self.all else 'the embedding and head'}: {self.blend:.0%} of it")
        return f"tail average of steps {self.start}..{step} blended into {what}" + (
            ", norms kept" if self.keep_norms else "")

    def state_dict(self) -> list[Tensor] | None:
        return None if self.average is None else [a.cpu().clone() for a in self.average]

    def load_state_dict(self, state: list[Tensor] | None):
        self.average = None if state is None else [a.to(self.params[i].device)
                                                   for a, (i, _, _) in zip(state, self.entries)]


class TrainingRun:
    """The timed loop and what it keeps between steps. Between two steps it may validate and write a checkpoint,
    with the clock paused: train_time counts the steps only."""

    def __init__(self, cfg: Config, comm: Comm, log: RunLog, trainer: Trainer, train_paths: list[str],
                 val_paths: list[str]):
        self.cfg, self.comm, self.log, self.trainer = cfg, comm, log, trainer
        self.model, self.optimizers, self.schedule, self.device = (trainer.model, trainer.optimizers,
                                                                   trainer.schedule, trainer.device)
        self.train_paths, self.val_paths = train_paths, val_paths
        self.diloco = StreamingDiLoCo(cfg, self.model, self.optimizers, self.device, log) if cfg.diloco else None
        self.tail_ema = TailEMA(self.model, cfg) if cfg.tail_ema_from else None
        self.watch = LossWatch(comm, self.device)
        self.val_losses: list[tuple[int, float]] = []
        self.reported = 0  # training losses already averaged into a validation line
        self.history = None  # the long-window history the rotary tables were last set for
        self.start_step = 0
        self.train_time_ms = 0.0  # timed training up to the last pause
        self.previous_ms = 0.0  # timed training at the end of the previous step
        self.clock = None
        self.batches = self.step_times = None

    def restore(self, checkpoint: dict):
        load_checkpoint_weights(self.model, checkpoint)
        scatter_optimizer_states(self.model, self.optimizers, checkpoint["muon"], checkpoint["adam"], self.comm,
                                 self.device)
        set_rng_states(checkpoint["rng"])
        self.start_step = checkpoint["step"]
        self.train_time_ms = self.previous_ms = checkpoint["train_time_ms"]
        self.watch.losses, self.reported = list(checkpoint["train_losses"]), checkpoint["reported"]
        self.val_losses = [tuple(entry) for entry in checkpoint["val_losses"]]
        if self.diloco is not None:
            self.diloco.load_state_dict(checkpoint["diloco"], self.start_step)
        if self.tail_ema is not None:
            self.tail_ema.load_state_dict(checkpoint.get("tail_ema"))
            if self.tail_ema.average is None and self.start_step > self.tail_ema.start:
                self.log(f"note: the checkpoint holds no tail average; it starts at step {self.start_step}")
        self.log(f"resumed from {self.cfg.resume} at step {self.start_step}")

    def batches_from(self, step: int) -> Prefetcher:
        """This rank's micro-batches from those of `step` on (the earlier ones are read and dropped)."""
        cfg, comm = self.cfg, self.comm

        def note_new_pass(number: int):  # called from the loader thread; repeated data skews the losses
            self.log(f"note: the training data starts over (pass {number}); later losses are on repeated data")

        skip = self.schedule.micro_batches_before(step) // comm.world_size
        windows = drop(skip, train_batches_for_rank(self.train_paths, cfg, comm, note_new_pass))
        ahead = max((self.trainer.forwards_ahead(s, comm.world_size) for s in range(step, self.schedule.total_steps)),
                    default=0)
        return prefetch(windows, cfg, self.device, self.trainer.packing.largest,
                        self.trainer.forward_sizes(step, comm.world_size), ahead)

    def synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def pause_clock(self):
        self.synchronize()
        self.train_time_ms += 1000 * (time.perf_counter() - self.clock)

    def start_clock(self):
        self.synchronize()
        self.clock = time.perf_counter()

    def follow_window_history(self, step: int):
        history = self.schedule.long_window_history(step)
        if history != self.history:
            self.history = history
            self.model.rotary.set_window_history(history)

    def loop(self):
        cfg, schedule = self.cfg, self.schedule
        N = schedule.total_steps
        self.batches = self.batches_from(self.start_step)
        # Compiling leaves hundreds of thousands of long-lived Python objects, and a full collection walks them
        # all: a pause of hundreds of ms inside a step; frozen, a collection skips them (docs/performance.md).
        # The log's garbage-collection line tells whether any pause is left. Frozen, and watched, right before
        # the try whose finally undoes both; a caller that froze objects of its own keeps its choice: this run
        # neither freezes nor unfreezes then.
        freezes = gc.get_freeze_count() == 0
        gc.collect()
        if freezes:
            gc.freeze()
        self.step_times = StepTimes(schedule)
        try:
            if self.diloco is not None:
                self.diloco.__enter__()
            self.start_clock()
            step = self.start_step
            while True:
                last = step == N
                if last and self.diloco is not None:
                    self.diloco.sync_every_fragment()
                if last and self.tail_ema is not None and step != self.start_step:
                    self.tail_ema.blend_into_weights()
                    self.log(self.tail_ema.describe(step))
                if schedule.validates(step) and not (cfg.resume and step == self.start_step):  # else it is logged
                    self.validate(step)
                periodic = cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and 0 < step < N
                if cfg.save_checkpoint and step != self.start_step and (last or periodic):
                    self.write_checkpoint(cfg.save_checkpoint if last else checkpoint_path_at(cfg.save_checkpoint, step),
                                          step)
                if last:
                    break
                step = self.run_step(step)
            self.watch.flush()
        finally:
            self.batches.close()
            for optimizer in self.optimizers:
                optimizer.close()
            self.trainer.recompiles.close()
            self.step_times.close()
            if freezes:
                gc.unfreeze()
            if self.diloco is not None:
                self.diloco.close()

    def validate(self, step: int):
        self.pause_clock()
        self.watch.flush(other_work_follows=True)
        seen = self.schedule.validation_step(step)
        if self.schedule.mtp_offsets > 1:
            self.model.set_mtp_weights([1.0])
        self.follow_window_history(seen)
        self.optimizers[1].whole_tables()  # --table_row_fetch: validation reads rows no training forward fetched
        val_loss = evaluate(self.model, self.cfg, self.comm, self.val_paths, self.schedule.windows(seen), self.device,
                            self.trainer.packing.validation)
        self.val_losses.append((step, val_loss))
        recent = self.watch.losses[self.reported:]  # training loss since the previous validation
        self.reported = len(self.watch.losses)
        self.log(f"step:{step}/{self.schedule.total_steps} val_loss:{val_loss:.4f} train_time:{self.train_time_ms:.0f}ms "
                 f"step_avg:{self.train_time_ms / max(step, 1):.2f}ms"
                 + (f" train_loss:{sum(recent) / len(recent):.4f}" if recent else ""))
        self.start_clock()

    def write_checkpoint(self, path: str, step: int):
        self.pause_clock()
        self.watch.flush(other_work_follows=True)
        save_checkpoint(path, self.model, self.optimizers, self.cfg, self.comm, self.device, step,
                        dict(train_time_ms=self.train_time_ms, train_losses=self.watch.losses, reported=self.reported,
                             val_losses=self.val_losses, data=data_fingerprint(self.train_paths),
                             **({"tail_ema": self.tail_ema.state_dict()} if self.tail_ema is not None else {}),
                             **({"diloco": self.diloco.state_dict()} if self.diloco is not None else {})))
        self.log(f"checkpoint: {path} at step {step}")
        self.start_clock()

    def run_step(self, step: int) -> int:
        """Train step `step`; returns the next one (after a DiLoCo heal, the healed replica's)."""
        schedule, comm, diloco = self.schedule, self.comm, self.diloco
        self.follow_window_history(step)
        set_hyperparameters(self.optimizers, schedule, step)
        if schedule.mtp_offsets > 1:
            self.model.set_mtp_weights(schedule.mtp_weights(step))
        if diloco is not None:
            diloco.step = step + 1  # what a peer healing from us during this step resumes at
        launch_started = time.perf_counter()
        loss = train_step(self.model, self.optimizers, self.batches, schedule.windows(step),
                          self.trainer.forwards(step, comm.world_size), ahead=self.trainer.forwards_ahead(
                              step, comm.world_size))
        launch_ms = 1000 * (time.perf_counter() - launch_started)
        if diloco is not None and diloco.step != step + 1:  # healed from a peer inside this step
            self.log(f"diloco: recovered weights and optimizer state from a peer; step {step + 1} -> {diloco.step}; "
                     f"the data goes on from this rank's micro-batch "
                     f"{schedule.micro_batches_before(diloco.step) // comm.world_size}")
            step = diloco.step - 1
            self.batches.close()  # a restarted replica read from the start of its share: go on where the peer is
            self.batches = self.batches_from(diloco.step)
        if self.tail_ema is not None:
            self.tail_ema.after_step(step + 1)
        self.watch.push(step, loss)
        elapsed_ms = self.train_time_ms + 1000 * (time.perf_counter() - self.clock)
        self.step_times.add(step + 1, elapsed_ms - self.previous_ms, launch_ms)
        self.previous_ms = elapsed_ms
        N = schedule.total_steps
        self.log(f"step:{step + 1}/{N} train_time:{elapsed_ms:.0f}ms step_avg:{elapsed_ms / (step + 1):.2f}ms")
        for reason in self.trainer.recompiles.new_reasons():
            self.log(f"warning: recompiled in the timed region at step {step + 1}: {reason}")
        return step + 1

    def report(self) -> TrainResult:
        """The run's closing lines: recompiles, step times per stage (every rank's), peak memory, the checksum."""
        log, comm, recompiles = self.log, self.comm, self.trainer.recompiles
        for reason in recompiles.new_reasons():  # validation graphs, if any slipped past the warm-up
            log(f"warning: recompiled in the timed region: {reason}")
        log(f"graphs compiled in the timed region: {recompiles.since_warm_up()}")
        summaries = [self.step_times.summary(self.watch.gpu_ms)]
        if comm.distributed:  # a pause on one rank shows on the others as GPU time spent waiting in a collective
            own, summaries = summaries[0], [None] * comm.world_size
            dist.all_gather_object(summaries, own)
        for rank, lines in enumerate(summaries):
            for line in lines:
                log(line if rank == 0 else f"rank {rank}: {line}")
        if self.device.type == "cuda":
            log(f"peak memory allocated: {torch.cuda.max_memory_allocated() // 2**20} MiB "
                f"reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB")
        self.optimizers[1].whole_tables()  # --table_row_fetch: every rank's weights whole, as the checksum reads them
        log(weights_checksum(self.model))
        return TrainResult(self.watch.losses, self.val_losses, self.train_time_ms)


def evaluate_checkpoint(cfg: Config, comm: Comm, log: RunLog) -> float:
    """--eval_only: the validation loss of --init_from's weights on --val_files, computed as training validates
    at the checkpoint's step (its attention windows and rotary tables, from the run's own schedule)."""
    checkpoint = read_checkpoint(cfg.init_from, "init_from")
    check_same_model(checkpoint, cfg, "init_from")
    val_paths = shard_paths(cfg.val_files, "val_files")
    model, device, packing = build_model(cfg, comm, log)
    load_checkpoint_weights(model, checkpoint)
    compile_model(model, cfg, comm, device, packing)
    windows = set_up_as_validated(model, checkpoint)
    val_loss = evaluate(model, cfg, comm, val_paths, windows, device, packing.validation)
    log(f"eval_only: {cfg.init_from} at step {checkpoint['step']} val_loss:{val_loss:.4f} "
        f"({cfg.val_tokens} tokens of {cfg.val_files})")
    return val_loss


def set_up_as_validated(model: GPT, checkpoint: dict) -> tuple[int, int]:
    """Give the model the rotary tables and next-token-only loss that validation had at the checkpoint's step,
    from the run's own schedule; returns that validation's attention windows."""
    known = {f.name for f in dataclasses.fields(Config)}
    schedule = Schedule(Config(**{k: v for k, v in checkpoint["config"].items() if k in known}))
    seen = schedule.validation_step(checkpoint["step"])
    model.rotary.set_window_history(schedule.long_window_history(seen))
    model.set_mtp_weights([1.0])
    return schedule.windows(seen)


@torch.no_grad()
def generate(model: GPT, cfg: Config, prompt: list[int], windows: tuple[int, int], count: int, temperature: float,
             seed: int, device: torch.device) -> list[int]:
    """Up to `count` tokens after `prompt`, stopping after a BOS: one whole forward per token (no key-value cache).
    The text sits at the start of one micro-batch, padded after it with token 0, which causal attention keeps
    from changing the text's logits."""
    length = cfg.micro_batch_tokens
    slot = _Slot(length, pin=False, bos=cfg.bos_token, bigram_rows=cfg.bigram_rows,
                 token_classes=bigram_token_classes(cfg))
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    while len(tokens) < min(len(prompt) + count, length):
        window = np.zeros(length + 1, dtype=np.int64)
        window[: len(tokens)] = tokens
        slot.fill([window])
        inputs = slot.inputs.to(device)
        masks = model.prepare_masks(inputs, slot.cu_seqlens.to(device), windows, slot.documents, slot.longest_document)
        bigrams = slot.bigrams.to(device) if cfg.bigram_rows else None
        logits = model(inputs, None, masks, bigrams)[len(tokens) - 1, : cfg.vocab_size].float().cpu()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator))
        tokens.append(token)
        if token == cfg.bos_token:
            break
    return tokens[len(prompt):]


def gpt2_encoding(needed_by: str = "--sample"):
    """tiktoken's GPT-2 BPE, or one line saying that `needed_by` needs it."""
    try:
        import tiktoken
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # no package, no network, no cached files
        raise UserError(f"{needed_by} needs tiktoken's gpt2 encoding, which did not load ({type(e).__name__}): "
                        "pip install tiktoken; offline, see data/tokenize_text.py's help") from None


def gpt2_token_bytes(needed_by: str) -> list[bytes]:
    """The bytes of each GPT-2 token, by id."""
    encoding = gpt2_encoding(needed_by)
    return [encoding.decode_single_token_bytes(token) for token in range(encoding.n_vocab)]


def gpt2_codec():
    """GPT-2 BPE's (encode, decode), from tiktoken."""
    encoding = gpt2_encoding()
    return encoding.encode_ordinary, encoding.decode


def sample_from_checkpoint(cfg: Config, comm: Comm, log: RunLog, codec=None) -> str:
    """--sample: a continuation of the prompt from --init_from's weights, logged (and so printed by rank 0).
    codec: (encode, decode) for the prompt and the tokens; GPT-2 BPE when not given."""
    checkpoint = read_checkpoint(cfg.init_from, "init_from")
    check_same_model(checkpoint, cfg, "init_from")
    encode, decode = codec or gpt2_codec()
    prompt = [cfg.bos_token] + list(encode(cfg.sample))
    if max(prompt) >= cfg.vocab_size:
        raise UserError(f"--sample: the prompt's tokens go up to {max(prompt)}, outside the model's vocabulary "
                        f"(--vocab_size={cfg.vocab_size})")
    if len(prompt) >= cfg.micro_batch_tokens:
        raise UserError(f"--sample: the prompt is {len(prompt)} tokens, the model reads at most "
                        f"{cfg.micro_batch_tokens - 1} (--micro_batch_tokens)")
    model, device, _ = build_model(dataclasses.replace(cfg, forward_micro_batches=1), comm, log)
    load_checkpoint_weights(model, checkpoint)
    windows = set_up_as_validated(model, checkpoint)
    added = generate(model, cfg, prompt, windows, cfg.sample_tokens, cfg.temperature, cfg.seed, device)
    text = decode([t for t in added if t != cfg.bos_token])
    log(f"sample (temperature {cfg.temperature}, seed {cfg.seed}): {cfg.sample!r} -> {text!r}")
    return text


# ----------------------------------------------------------------------------------------------------
# Across nodes: streaming DiLoCo on torchft
LIGHTHOUSE_MISSING = ("--diloco=1 needs TORCHFT_LIGHTHOUSE=http://host:port, the address of a running lighthouse "
                      "(torchft_lighthouse --min_replicas=1)")


def import_torchft():
    try:
        import torchft
        import torchft.local_sgd
    except ImportError as e:
        raise UserError(f"--diloco=1 needs torchft, which did not import ({e}): pip install torchft") from None
    return torchft


def diloco_fragments(model: GPT, count: int) -> list[nn.Module]:
    """`count` contiguous groups of blocks; the input side (token, value and bigram embeddings, the longest-match
    feature) syncs with the first, the output side (head, skip gate, copy pointer) with the last. Every parameter is
    in exactly one."""
    bounds = [round(i * len(model.blocks) / count) for i in range(count + 1)]
    fragments = []
    for lo, hi in zip(bounds, bounds[1:]):
        fragment = nn.Module()
        fragment.blocks = nn.ModuleList(model.blocks[lo:hi])
        fragments.append(fragment)
    fragments[0].embed, fragments[0].value_embeds = model.embed, model.value_embeds
    if model.longest_match is not None:
        fragments[0].longest_match = model.longest_match
    if model.bigram_embed is not None:
        fragments[0].bigram_embed = model.bigram_embed
    fragments[-1].lm_head = model.lm_head
    for name in ("mudd_layer", "mudd_head", "token_gates", "copy_pointer"):
        if getattr(model, name) is not None:
            fragments[-1].add_module(name, getattr(model, name))
    for name in ("skip_gate", "skip_gate_w", "backout"):
        if getattr(model, name) is not None:
            fragments[-1].register_parameter(name, getattr(model, name))
    for name in ("smear_gate_w", "smear_scale"):
        if getattr(model, name) is not None:
            fragments[0].register_parameter(name, getattr(model, name))
    placed = [id(p) for f in fragments for p in f.parameters()]
    if sorted(placed) != sorted(id(p) for p in model.parameters()):
        raise RuntimeError("DiLoCo fragments do not hold each model parameter exactly once")
    return fragments


def detached_copy(tree, device: torch.device | str | None = None):
    """Tensors cloned (onto `device` if given), containers rebuilt: torchft may serve a checkpoint while training
    goes on."""
    if isinstance(tree, Tensor):
        return tree.detach().to(device, copy=True) if device is not None else tree.detach().clone()
    if isinstance(tree, dict):
        return {key: detached_copy(value, device) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(detached_copy(value, device) for value in tree)
    return tree


class StreamingDiLoCo:
    """Streaming DiLoCo (Douillard et al., 2025) across replica groups, on torchft's Manager and DiLoCo.

    Each replica group is one torchrun job (a node) that trains as usual: its inner optimizers
    (DistAdam, Muon) communicate only inside the group, every step. Across groups, per fragment f:
      - every sync_every/num_fragments steps, fragment_sync_delay steps before the sync: a quorum with
        the lighthouse (a new or restarted replica heals here, downloading model, inner-optimizer state
        and the loop position from a peer), then an async all-reduce (average over the quorum) of the
        fragment's pseudogradient, global - local; f = the manager's committed syncs mod num_fragments;
      - at the sync: wait, reset the fragment to its global weights and, when every replica commits,
        one Nesterov SGD step of its outer optimizer on the pseudogradient gives the new global
        weights, mixed in place as (1 - alpha) * global + alpha * local. A failed commit (a replica died
        mid-all-reduce) keeps the old global weights and retries the fragment at the next quorum.
    One fragment is in flight at a time; each syncs once every sync_every steps. Replicas start from
    the same --seed, so none heals at step 0; one that (re)starts behind the others heals, and its
    optimizers then follow the schedule from the healed step (they read their param_groups afresh on every
    step). A checkpoint keeps what only this replica holds of DiLoCo (state_dict), so replicas restarted from
    checkpoints of one step go on as if never stopped, and one restarted from an older step heals. `manager` is for
    tests (built without state-dict functions: this class registers its own); normally it is built from torchft's
    environment (TORCHFT_LIGHTHOUSE, torchrun's store).
    """

    def __init__(self, cfg: Config, model: GPT, optimizers: Optimizers, device: torch.device, log, manager=None):
        torchft = import_torchft()
        self.model, self.optimizers, self.log = model, optimizers, log
        self.step = 0  # the loop's position, part of the checkpoint a healing peer receives
        self.sync_every = cfg.sync_every
        self.manager = manager or self._manager(torchft, cfg, device)
        self.manager.register_state_dict_fn("default", self._load, self._save)
        self.heals = 0
        self.fragments = diloco_fragments(model, cfg.num_fragments)
        self.outer = [torch.optim.SGD(f.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                                      nesterov=cfg.outer_momentum > 0) for f in self.fragments]
        for index, opt in enumerate(self.outer):
            opt.register_step_post_hook(functools.partial(self._outer_step_hook, index))
        self.diloco = torchft.local_sgd.DiLoCo(
            self.manager, self.fragments, optimizers, self.outer, sync_every=cfg.sync_every,
            backup_device=device, fragment_sync_delay=cfg.fragment_sync_delay,
            fragment_update_alpha=cfg.fragment_update_alpha)
        self.syncs = self.committed = 0
        self.sync_seconds = 0.0
        self.hook_start = self.entered = 0.0
        self.outer_stepped = None
        self.handles = []

    def _manager(self, torchft, cfg: Config, device: torch.device):
        from datetime import timedelta
        if not os.environ.get("TORCHFT_LIGHTHOUSE"):
            raise UserError(LIGHTHOUSE_MISSING)
        pg = torchft.ProcessGroupNCCL() if device.type == "cuda" else torchft.ProcessGroupGloo()
        # torchft reads TORCHFT_CONNECT_TIMEOUT_SEC itself, but not for its first lighthouse connection.
        connect = timedelta(seconds=float(os.environ.get("TORCHFT_CONNECT_TIMEOUT_SEC", 60)))
        try:
            # init_sync=False: replicas start from the same seed, so none needs its peer's weights at step 0;
            # a replica that (re)starts behind the others still heals.
            return torchft.Manager(pg=pg, load_state_dict=None, state_dict=None, init_sync=False,
                                   min_replica_size=cfg.min_replicas, use_async_quorum=False,
                                   replica_id=f"train_gpt_{cfg.replica}", timeout=timedelta(seconds=60),
                                   quorum_timeout=timedelta(seconds=900), connect_timeout=connect)
        except RuntimeError as e:
            address = os.environ["TORCHFT_LIGHTHOUSE"]
            raise UserError(f"--diloco=1: no torchft lighthouse answered at TORCHFT_LIGHTHOUSE={address} "
                            f"({str(e).splitlines()[0][:200]}); start torchft_lighthouse there or fix the address") from None

    def _save(self) -> dict:
        return detached_copy({"model": self.model.state_dict(), "step": self.step, "sync_every": self.sync_every,
                              "optimizers": [opt.state_dict() for opt in self.optimizers]})

    def _load(self, state: dict):
        self.heals += 1
        self.model.load_state_dict(state["model"])
        for opt, opt_state in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(opt_state)
        # The same point of training in our own steps: a peer with another sync_every (other hardware)
        # counts steps at another rate, and num_iterations scales with sync_every.
        self.step = state["step"] * self.sync_every // state["sync_every"]

    def state_dict(self) -> dict:
        """For a checkpoint, beside the model and the inner optimizers: the committed syncs (they pick the next
        fragment), the inner steps since the last sync, and each fragment's global weights and outer momentum.
        Taken between steps when no fragment's all-reduce is in flight (--checkpoint_every sees to it)."""
        if any(fragment._allreduce_work for fragment in self.diloco._fragments):
            raise RuntimeError("a DiLoCo checkpoint was asked for while a fragment's all-reduce is in flight")
        return detached_copy({"manager": self.manager.state_dict(), "local_step": self.diloco._local_step,
                              "fragments": [{"global_weights": fragment.original_parameters,
                                             "outer_optimizer": opt.state_dict()}
                                            for fragment, opt in zip(self.diloco._fragments, self.outer)]}, "cpu")

    def load_state_dict(self, state: dict, step: int):
        self.manager.load_state_dict(state["manager"])
        self.diloco._local_step = state["local_step"]
        for fragment, opt, saved in zip(self.diloco._fragments, self.outer, state["fragments"]):
            for name, tensor in fragment.original_parameters.items():
                tensor.copy_(saved["global_weights"][name])
            opt.load_state_dict(saved["outer_optimizer"])
        self.step = step

    def __enter__(self):
        # Ours run just before and just after torchft's hook (hooks run in the order they were added).
        self.handles.append(self.optimizers.register_step_post_hook(self._before_sync_hook))
        self.diloco.__enter__()
        self.handles.append(self.optimizers.register_step_post_hook(self._after_sync_hook))
        self.entered = time.perf_counter()
        return self

    def _outer_step_hook(self, fragment: int, *_):
        self.outer_stepped = fragment

    def _before_sync_hook(self, *_):
        self.hook_start = time.perf_counter()
        self.outer_stepped = None

    def _after_sync_hook(self, *_):
        self.sync_seconds += time.perf_counter() - self.hook_start
        if self.diloco._local_step != 0:  # torchft zeroes its counter when a sync completes
            return
        self.syncs += 1
        # The outer optimizer steps only on a commit; otherwise the manager's step (which picks the
        # fragment) has not moved.
        committed = self.outer_stepped is not None
        fragment = self.outer_stepped if committed else self.manager.current_step() % len(self.fragments)
        self.committed += committed
        # The fragment's weights as one number: equal on every replica after a committed sync when alpha = 0.
        digest = sum(p.detach().double().sum() for p in self.fragments[fragment].parameters()).item()
        self.log(f"diloco: step {self.step} sync {self.syncs} fragment {fragment} "
                 f"{'committed' if committed else 'not committed, rolled back'} replicas "
                 f"{self.manager.num_participants()} digest {digest:.12e}")

    def sync_every_fragment(self):
        """After the last inner step: one more sync of each fragment the last step did not sync, then every
        fragment takes its global weights (no local mix), so all replicas end with one model, the one the
        final validation scores. The order is torchft's (the manager's committed syncs pick the fragment)."""
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
        wall = time.perf_counter() - self.entered
        self.log(f"diloco: {self.syncs} fragment syncs ({self.committed} committed), {self.heals} heals, "
                 f"{self.sync_seconds:.1f}s in quorums, all-reduce waits and outer steps "
                 f"({100 * self.sync_seconds / wall:.1f}% of the {wall:.1f}s loop)")
        self.manager.shutdown(wait=False)


# ----------------------------------------------------------------------------------------------------
# main


def keep_freed_cpu_memory() -> bool:
    """On the CPU a step allocates and frees buffers above glibc's largest mmap threshold (32 MB): one forward's
    logits with GPT-2's vocabulary are 50 MB. glibc maps each such buffer afresh and unmaps it when freed, so every
    step page-faults all of them in again, spending more time in the kernel than computing. Served from the heap,
    which keeps freed memory for reuse, those steps run nearly 3 times as fast (docs/performance.md). glibc only:
    returns whether it took effect."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def init_distributed(cfg: Config) -> Comm:
    """World size 1 without torchrun; under torchrun, one process per GPU (or CPU process with gloo)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size not in (1, 2, 4, 8):
        raise UserError(f"world size {world_size} is not supported: run on 1, 2, 4 or 8 processes, "
                        "so that every step's batch splits evenly (8 processes per node at most)")
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device=cuda, but torch sees no CUDA GPU (torch.cuda.is_available() is False); "
                            "pass --device=cpu to run on the CPU")
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible; "
                            "start at most that many processes per node")
        torch.cuda.set_device(local_rank)
    if world_size > 1 or cfg.diloco:  # torchft's manager joins torchrun's store through the process group
        if cfg.diloco and not os.environ.get("MASTER_ADDR"):
            raise UserError("--diloco=1: start each replica group with torchrun (torchft uses its store)")
        if cfg.device == "cuda":
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group("gloo")
    return Comm(rank, world_size, local_rank)


def check_inputs(cfg: Config) -> None:
    """What --check verifies before a launch: the config, the device and every data file."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device=cuda, but torch sees no CUDA GPU; pass --device=cpu to run on the CPU")
    if cfg.device == "cuda":
        cuda = torch.device("cuda", 0)
        check_gpu_features(cfg, cuda, choose_kernels(cfg, cuda))
    # The first training shard in full (the loader checks the others as it reaches them): a shard from another
    # tokenizer fails here, before minutes of compiling. An evaluation reads no training data.
    if not (cfg.eval_only or cfg.sample):
        document_starts(shard_paths(cfg.train_files, "train_files")[0], cfg.bos_token, cfg.vocab_size)
    if not cfg.sample:
        next(val_batches_for_rank(shard_paths(cfg.val_files, "val_files"), cfg, Comm()))  # enough val tokens?
    if cfg.resume:  # memory-mapped, so reading it again to resume costs little
        check_resumable(read_checkpoint(cfg.resume, "resume"), cfg, shard_paths(cfg.train_files, "train_files"))
    if cfg.init_from:
        check_same_model(read_checkpoint(cfg.init_from, "init_from"), cfg, "init_from")
    if cfg.sample:  # GPT-2's BPE, before anything is written
        gpt2_encoding()
    if cfg.diloco:  # before minutes of compiling, not after
        import_torchft()
        if not os.environ.get("TORCHFT_LIGHTHOUSE"):
            raise UserError(LIGHTHOUSE_MISSING)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    comm = None
    try:
        cfg, flags = parse_cli(argv)
        if "help" in flags:
            print(config_help())
            return 0
        if "check" in flags:
            check_inputs(cfg)
            print("ok: config, device and data files look right")
            return 0
        check_inputs(cfg)  # before anything is written or compiled
        if cfg.device == "cpu":
            keep_freed_cpu_memory()
        comm = init_distributed(cfg)
        if not cfg.run_id:
            run_id = [str(uuid.uuid4())]
            if comm.distributed:  # every rank must agree on the run id
                dist.broadcast_object_list(run_id, 0)
            cfg = dataclasses.replace(cfg, run_id=run_id[0])
        log = RunLog(cfg, comm)
        if cfg.eval_only:
            evaluate_checkpoint(cfg, comm, log)
        elif cfg.sample:
            sample_from_checkpoint(cfg, comm, log)
        else:
            train(cfg, comm, log)
        log.finish()
        return 0
    except UserError as e:
        # Before the process group exists every rank hits the same launch mistake: one line, from rank 0.
        if comm is not None or os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if comm is not None and dist.is_initialized():
            gc.collect()  # the run's optimizers, and with them DistAdam's gloo group, go now, not at the exit
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------
# Appendix: Triton kernels (used where choose_kernels turns them on: on CUDA when Triton imports; every one has a
# plain-torch equivalent, which the model calls on the CPU and with --triton_kernels=0)

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.autotune(
        configs=[triton.Config(dict(BLOCK=b, BLOCK_K=k), num_warps=w, num_stages=st)
                 for b, k, w, st in ((128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4), (128, 32, 8, 4))],
        key=["M", "K", "HAS_Y"])
    @triton.jit
    def _symmetric_matmul_kernel(X, Y, Out, M, K, sxb, sxm, sxk, syb, sym, syn, sob, som, son, alpha, beta,
                                 HAS_Y: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
        """Out[b] = alpha * X[b] @ X[b]^T (+ beta * Y[b]) for symmetric results: each program computes one
        tile on or below the diagonal and also writes its mirror, so half the products are skipped."""
        tile, batch = tl.program_id(0), tl.program_id(1)
        # tile -> (row, col) with col <= row, counting the lower triangle row by row
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
            a = tl.load(X + rows[:, None] * sxm + (k0 + ks)[None, :] * sxk, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
            b = tl.load(X + cols[:, None] * sxm + (k0 + ks)[None, :] * sxk, mask=(cols[:, None] < M) & k_ok[None, :], other=0.0)
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


def symmetric_matmul(X: Tensor, out: Tensor, alpha: float = 1.0, beta: float = 0.0, Y: Tensor | None = None) -> Tensor:
    """out = alpha * X @ X^T + beta * Y over a [batch, M, K] stack, with the Triton kernel above."""
    batch, M, K = X.shape
    tiles = lambda meta: (triton.cdiv(M, meta["BLOCK"]) * (triton.cdiv(M, meta["BLOCK"]) + 1) // 2, batch)
    Yt = Y if Y is not None else out
    _symmetric_matmul_kernel[tiles](X, Yt, out, M, K, *X.stride(), *Yt.stride(), *out.stride(), alpha, beta,
                                    HAS_Y=Y is not None)
    return out


if triton is not None:
    @triton.jit
    def _muon_apply_kernel(W, U, Scalars, N, DECAY: tl.constexpr, BLOCK: tl.constexpr):
        """W += neg_decay * W where U * W >= 0 (DECAY), then W += neg_lr * U; Scalars = (neg_lr, neg_decay)."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < N
        w = tl.load(W + offsets, mask=inside)
        u = tl.load(U + offsets, mask=inside).to(tl.float32)
        if DECAY:
            decayed = tl.where(u * w >= 0, w, 0.0) * tl.load(Scalars + 1)
            w = w + decayed
        tl.store(W + offsets, w + u * tl.load(Scalars), mask=inside)


MUON_APPLY_BLOCK = 4096


def muon_apply_(weight: Tensor, update: Tensor, scalars: Tensor, decay: bool) -> None:
    """Muon._apply's multi-tensor ops for one fp32 matrix in one pass (reads the weight and the bf16 update once,
    writes the weight once, where the ops read and wrote it nine times): cautious decay, then the step. Without fused
    multiply-adds, so each product rounds to fp32 as the multi-tensor ops round it: bit-equal to them."""
    if not (weight.is_contiguous() and update.is_contiguous()) or update.shape != weight.shape:
        raise ValueError(f"muon_apply_ needs a contiguous weight and update of one shape, got {tuple(weight.shape)} "
                         f"and {tuple(update.shape)}")
    n = weight.numel()
    _muon_apply_kernel[(triton.cdiv(n, MUON_APPLY_BLOCK),)](weight, update, scalars, n, DECAY=decay,
                                                           BLOCK=MUON_APPLY_BLOCK, enable_fp_fusion=False)


if triton is not None:
    @triton.jit
    def _softcapped_row_loss(Logits, target, V, cap: tl.constexpr, offset: tl.constexpr, divisor: tl.constexpr,
                             BLOCK: tl.constexpr):
        """(logsumexp(z), its loss logsumexp(z) - z[target]) of one row of logits,
        z = cap * sigmoid((logit + offset) / divisor)."""
        cols = tl.arange(0, BLOCK)
        # z lies in (0, cap), so exp(z - cap) <= 1 and the sum cannot overflow: no running max is needed.
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            inside = start + cols < V
            x = tl.load(Logits + start + cols, mask=inside, other=0.0).to(tl.float32)
            total += tl.where(inside, tl.exp(cap * tl.sigmoid((x + offset) / divisor) - cap), 0.0)
        lse = cap + tl.log(tl.sum(total, axis=0))
        return lse, lse - cap * tl.sigmoid((tl.load(Logits + target).to(tl.float32) + offset) / divisor)

    @triton.jit
    def _softcapped_row_grad(Logits, Grad, target, lse, scale, V, cap: tl.constexpr, offset: tl.constexpr,
                             divisor: tl.constexpr, BLOCK: tl.constexpr):
        """Writes one row's d loss / d logit times scale in Grad's dtype: scale * (softmax(z) - onehot) * dz/dlogit,
        with dz/dlogit = cap / divisor * s (1 - s) <= cap / (4 divisor), s = sigmoid((logit + offset) / divisor)."""
        cols = tl.arange(0, BLOCK)
        for start in range(0, V, BLOCK):
            inside = start + cols < V
            s = tl.sigmoid((tl.load(Logits + start + cols, mask=inside, other=0.0).to(tl.float32) + offset) / divisor)
            d = tl.exp(cap * s - lse) - tl.where(start + cols == target, 1.0, 0.0)
            tl.store(Grad + start + cols, (scale * d * (cap / divisor) * s * (1.0 - s)).to(Grad.dtype.element_ty),
                     mask=inside)

    @triton.jit
    def _softcapped_ce_forward_kernel(Logits, Targets, Loss, Lse, V, stride, cap: tl.constexpr, offset: tl.constexpr,
                                      divisor: tl.constexpr, BLOCK: tl.constexpr):
        """One row per program: each row's loss and logsumexp."""
        row = tl.program_id(0).to(tl.int64)
        lse, loss = _softcapped_row_loss(Logits + row * stride, tl.load(Targets + row), V, cap, offset, divisor, BLOCK)
        tl.store(Loss + row, loss)
        tl.store(Lse + row, lse)

    @triton.jit
    def _softcapped_ce_backward_kernel(Logits, Targets, Lse, GradLoss, GradLogits, V, stride, grad_stride,
                                       cap: tl.constexpr, offset: tl.constexpr, divisor: tl.constexpr,
                                       BLOCK: tl.constexpr):
        """One row per program: the row's upstream gradient times d loss / d logit (_softcapped_row_grad)."""
        row = tl.program_id(0).to(tl.int64)
        _softcapped_row_grad(Logits + row * stride, GradLogits + row * grad_stride, tl.load(Targets + row),
                             tl.load(Lse + row), tl.load(GradLoss + row), V, cap, offset, divisor, BLOCK)

CE_BLOCK, CE_WARPS = 1024, 4  # the loss kernels' launch shape (bench/bench_loss.py sweeps it)


def _softcapped_ce_rows(logits: Tensor, targets: Tensor, softcap: tuple) -> tuple[Tensor, Tensor]:
    """Per-row loss and logsumexp of the softcapped logits, with the forward kernel."""
    rows, vocab = logits.shape
    loss = logits.new_empty(rows, dtype=torch.float32)
    lse = torch.empty_like(loss)
    _softcapped_ce_forward_kernel[(rows,)](logits, targets, loss, lse, vocab, logits.stride(0), *softcap,
                                           BLOCK=CE_BLOCK, num_warps=CE_WARPS)
    return loss, lse


class _SoftcappedCrossEntropy(torch.autograd.Function):
    """Per-row loss of softcapped logits with the two kernels above: the forward reads the bf16 logits
    once and keeps only each row's logsumexp; the backward reads them once more and writes the bf16
    gradient, so no fp32 copy of the [tokens, vocab] logits is ever made."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, softcap: tuple) -> Tensor:
        loss, lse = _softcapped_ce_rows(logits, targets, softcap)
        ctx.save_for_backward(logits, targets, lse)
        ctx.softcap = softcap
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        logits, targets, lse = ctx.saved_tensors
        rows, vocab = logits.shape
        grad = torch.empty_like(logits)
        _softcapped_ce_backward_kernel[(rows,)](logits, targets, lse, grad_loss.contiguous(), grad, vocab,
                                                logits.stride(0), grad.stride(0), *ctx.softcap,
                                                BLOCK=CE_BLOCK, num_warps=CE_WARPS)
        return grad, None, None


def softcap(logits: Tensor, cap: tuple) -> Tensor:
    """z = cap * sigmoid((logits + offset) / divisor), cap = (cap, offset, divisor): logits squeezed into (0, cap)."""
    return cap[0] * torch.sigmoid((logits.float() + cap[1]) / cap[2])


def multi_token_targets(targets: Tensor, mtp: tuple | None) -> list[tuple[Tensor, Tensor]]:
    """Per offset k, (each row's weight [rows], its target k + 1 ahead [rows]): mtp = (weights [K], period) gives
    row i targets[i + k] at weights[k] where i + k stays inside the row's micro-batch of `period` rows, and 0
    elsewhere (multi-token prediction); None gives the next token at weight 1."""
    if mtp is None:
        return [(torch.ones_like(targets, dtype=torch.float32), targets.long())]
    weights, period = mtp
    position = torch.arange(targets.numel(), device=targets.device) % period
    # the rolled targets wrap around at the end, where the weight is 0
    return [(weights[k] * (position + k < period), torch.cat([targets[k:], targets[:k]]).long())
            for k in range(weights.numel())]


def multi_token_losses(z: Tensor, targets: Tensor, mtp: tuple | None) -> Tensor:
    """Per-row loss of softcapped logits z [rows, vocab]: the weighted sum of the cross-entropies to the targets of
    multi_token_targets (the next token's alone without mtp)."""
    lse = torch.logsumexp(z, dim=1)
    return sum(w * (lse - z.gather(1, ahead[:, None])[:, 0]) for w, ahead in multi_token_targets(targets, mtp))


COPY_BLOCK = 128  # queries per block of the copy pointer's banded scores


def copy_log_probs(q: Tensor, k: Tensor, sink: Tensor, tokens: Tensor, targets: Tensor, documents: Tensor,
                   band: int, use_triton: bool = False) -> tuple[Tensor, Tensor]:
    """Per query t of q, k [T, d]: softmax over the scores q_t . k_j / sqrt(d) of the positions j <= t of its
    document less than `band` back, and the sink's score (sink: [T], or [1] for all); returns (log of the mass on
    the j with tokens[j] == targets[t], log of the sink's mass), float32 [T] each; the first is about -1e9 where no
    such j is.

    Blocks of COPY_BLOCK queries each score the band before them and themselves, [T, band + COPY_BLOCK] scores in
    all: no [T, T] matrix. With use_triton (Kernels.copy_pointer; CUDA) the kernels of _CopyScores, which keep no
    scores for the backward."""
    T, d = q.shape
    sink = sink.float().expand(T)
    if use_triton:
        return _CopyScores.apply(*(t.contiguous() for t in (q, k, sink, tokens, targets, documents)), band)
    sink = sink.reshape(T // COPY_BLOCK, COPY_BLOCK)
    blocks, width = T // COPY_BLOCK, band + COPY_BLOCK
    keys = F.pad(k, (0, 0, band, 0)).unfold(0, width, COPY_BLOCK)  # [blocks, d, width], block b's keys from b*B - band
    scores = torch.bmm(q.view(blocks, COPY_BLOCK, d), keys).float() * d ** -0.5
    key_at = torch.arange(blocks, device=q.device)[:, None] * COPY_BLOCK - band + torch.arange(width, device=q.device)
    back = torch.arange(T, device=q.device).view(blocks, COPY_BLOCK, 1) - key_at[:, None, :]
    key_documents = F.pad(documents, (band, 0), value=-1).unfold(0, width, COPY_BLOCK)[:, None, :]
    seen = (back >= 0) & (back < band) & (key_documents == documents.view(blocks, COPY_BLOCK, 1))
    key_tokens = F.pad(tokens, (band, 0), value=-1).unfold(0, width, COPY_BLOCK)[:, None, :]
    hits = seen & (key_tokens == targets.view(blocks, COPY_BLOCK, 1))
    # -1e9, not -inf: a query with no hit keeps finite gradients
    log_z = torch.logaddexp(torch.logsumexp(scores.masked_fill(~seen, -1e9), -1), sink)
    log_hits = torch.logsumexp(scores.masked_fill(~hits, -1e9), -1)
    return (log_hits - log_z).reshape(T), (sink - log_z).reshape(T)


def gated_log_sum_exps(z: Tensor, slot: int) -> tuple[Tensor, Tensor, Tensor]:
    """(log-sum-exp of each row of z, its gate z[:, slot], the log-sum-exp of its other columns): the last from the
    same pass over z, lse + log(1 - alpha), log(1 - e^u) computed stably on both sides of u = -ln 2 (Maechler
    2012)."""
    lse = torch.logsumexp(z, dim=1)
    gate = z[:, slot]
    u = torch.minimum(gate - lse, torch.full_like(lse, -1e-7))
    return lse, gate, lse + torch.where(u > -0.6931, torch.log(-torch.expm1(u)), torch.log1p(-torch.exp(u)))


def copy_mixture_losses(z: Tensor, targets: Tensor, slot: int, log_copy: Tensor, log_sink: Tensor,
                        mtp: tuple | None) -> Tensor:
    """Per-row losses of softcapped logits z [rows, vocab] whose column `slot` is the copy gate (CPLM, the
    speedrun's pull request #379): with alpha its softmax share, a the pointer's sink mass and p_lm the softmax of
    the other columns, the next token's probability is p_lm(y) (1 - alpha (1 - a)) + alpha p_copy(y), p_copy(y) =
    exp(log_copy) for y = the target; which sums to 1 over y. The tokens further ahead (mtp) take p_lm's loss."""
    lse, gate, lse_lm = gated_log_sum_exps(z, slot)
    losses = []
    for k, (w, ahead) in enumerate(multi_token_targets(targets, mtp)):
        picked = z.gather(1, ahead[:, None])[:, 0]
        if k == 0:  # times exp(lse): p_lm(y) (exp(lse_lm) + exp(gate) a) and exp(gate) p_copy(y)
            from_lm = picked - lse_lm + torch.logaddexp(lse_lm, gate + log_sink)
            losses.append(w * (lse - torch.logaddexp(from_lm, gate + log_copy)))
        else:
            losses.append(w * (lse_lm - picked))
    return sum(losses)


def softcapped_cross_entropy(logits: Tensor, targets: Tensor, cap: tuple, use_triton: bool,
                             mtp: tuple | None = None) -> Tensor:
    """Mean cross-entropy of softcap(logits, cap), a [rows, vocab] input; with mtp, multi_token_losses.

    The soft cap squeezes logits into (0, cap): the speedrun's 30*sigmoid(z/7.5) form of Gemma 2's tanh
    cap, which keeps logits from growing without bound early in training (its 2025-12-26 record shifts it:
    23*sigmoid((z+5)/7.5)). With use_triton (Kernels.loss; CUDA) the fused kernels compute next-token losses;
    otherwise, and for multi-token losses, plain torch.
    """
    if use_triton and mtp is None:
        return _SoftcappedCrossEntropy.apply(logits, targets, cap).mean()
    return multi_token_losses(softcap(logits, cap), targets, mtp).mean()


if triton is not None:
    # Single MUFU instructions for the FP8 loss kernel, without the range fix-ups tl.exp and tl.sigmoid's
    # division put around them; exact formulas where there is no GPU (the interpreter).
    @triton.jit
    def _ptx_f32(x, INSTRUCTION: tl.constexpr):
        """One PTX instruction of one f32 operand, element by element."""
        return tl.inline_asm_elementwise(INSTRUCTION + " $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def _exp2_mufu(x, PTX: tl.constexpr):
        if PTX:
            return _ptx_f32(x, "ex2.approx.ftz.f32")
        else:
            return tl.exp2(x)

    @triton.jit
    def _rcp_mufu(x, PTX: tl.constexpr):
        if PTX:
            return _ptx_f32(x, "rcp.approx.ftz.f32")
        else:
            return 1.0 / x

    @triton.jit
    def _tanh_mufu(x, PTX: tl.constexpr):
        """tanh(x); on the GPU tanh.approx, relative error 2^-11."""
        if PTX:
            return _ptx_f32(x, "tanh.approx.f32")
        else:
            return 2.0 * tl.sigmoid(2.0 * x) - 1.0

    @triton.jit
    def _exp2_on_fma_units(x):
        """2^x for x <= 15 with no MUFU or conversion instruction (FlashAttention-4 computes part of its softmax
        so): adding 1.5 * 2^23 rounds x to an integer j held in the low mantissa bits, a cubic gives 2^(x - j)
        on [-1/2, 1/2] (relative error 1e-4), and an integer add puts j into the exponent. Below 2^-125: 2^-125."""
        x = tl.maximum(x, -125.0)
        shifted = x + 12582912.0
        frac = x - (shifted - 12582912.0)
        p = 1.0 + frac * (0.6932829280948685 + frac * (0.2422109718288663 + frac * 0.055008933087581535))
        bits = p.to(tl.int32, bitcast=True) + (shifted.to(tl.int32, bitcast=True) << 23)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _softcap_sigmoid(x, offset: tl.constexpr, divisor: tl.constexpr, PTX: tl.constexpr):
        """s = sigmoid((x + offset) / divisor), so that z = cap * s: two MUFU instructions (ex2, rcp)."""
        return _rcp_mufu(1.0 + _exp2_mufu((x + offset) * (-1.4426950408889634 / divisor), PTX), PTX)

    @triton.jit
    def _exp_z_minus_cap(x, cap: tl.constexpr, offset: tl.constexpr, divisor: tl.constexpr, PTX: tl.constexpr):
        """exp(z - cap), the loss pass's term: three MUFU instructions (ex2, rcp, ex2)."""
        return _exp2_mufu((_softcap_sigmoid(x, offset, divisor, PTX) - 1.0) * (cap * 1.4426950408889634), PTX)

    @triton.jit
    def _scaled_softmax_grad(x, shift, one_hot, cap: tl.constexpr, offset: tl.constexpr, divisor: tl.constexpr,
                             PTX: tl.constexpr):
        """2^GRAD_EXP (w softmax(z) - one_hot / 2^GRAD_EXP) dz/dlogit, shift = (cap / 2 - lse + log(w)) log2(e) +
        GRAD_EXP. With t = tanh((x + offset) / (2 divisor)): z = cap / 2 (1 + t) and dz/dlogit = cap / (4 divisor)
        (1 - t^2), so one MUFU instruction."""
        t = _tanh_mufu((x + offset) * (0.5 / divisor), PTX)
        return ((_exp2_on_fma_units(t * (0.5 * cap * 1.4426950408889634) + shift) - one_hot)
                * ((cap / (4.0 * divisor)) * (1.0 - t * t)))

    @triton.jit
    def _logaddexp(a, b):
        high = tl.maximum(a, b)
        return high + tl.log(1.0 + tl.exp(-tl.abs(a - b)))

    @triton.jit
    def _softcapped_ce_fp8_kernel(Logits, Targets, Weights, Loss, Grad, V, stride, period, LogCopy, LogSink, DCopy,
                                  DSink, slot, cap: tl.constexpr, offset: tl.constexpr, divisor: tl.constexpr,
                                  K: tl.constexpr, GRAD_EXP: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr,
                                  PTX: tl.constexpr, COPY: tl.constexpr, FIRST: tl.constexpr):
        """One row per program, two passes over it: the first sums exp(z - cap) for the loss (z < cap, so no
        running max is needed), the second writes the loss's gradient for an upstream gradient of 2^GRAD_EXP in
        Grad's dtype (e5m2 in the trainer), where no value exceeds 2^GRAD_EXP (cap <= 4 divisor and the K weights
        sum to at most 1).

        The row's loss is the sum over k < K of Weights[k] times the cross-entropy to Targets[row + k] (the token
        k + 1 ahead), for the k that keep row + k inside the row's micro-batch of `period` rows (multi-token
        prediction; K = 1, weight 1: next-token cross-entropy).

        With COPY the next token's term is the copy mixture's (copy_mixture_losses: column `slot` the gate, the
        pointer's log-masses LogCopy and LogSink), the further tokens' the LM's without the gate's column, and
        DCopy and DSink get the row loss's derivatives by the two log-masses. Every term is a function of the log-
        sum-exp, the targets' z and the gate's z, so the gradient keeps its form: a per-row multiple of the
        softmax (at most 1 at every logit), minus per-row amounts at the targets and at the gate's column.

        tl.sigmoid and tl.exp would take six MUFU (special function unit) operations per logit, enough to bound
        the kernel as much as memory does. The loss pass takes three single instructions (loss within 1e-6 of
        float64); the gradient pass, whose output keeps 3 significant bits, one (tanh.approx), its exp on the FMA
        units. Blocks of BLOCK logits by 16 warps leave fewer rows in flight than small blocks, so the second
        pass finds more of its row still in L2; the row's tail goes in masked blocks of TAIL, and the target's -1
        is written once, after the pass, instead of being compared for at every logit."""
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
        weight = 0.0  # the softmax's multiple in the gradient
        lse_lm = lse  # the log-sum-exp the LM's terms take
        q = 1.0  # d lse_lm / d lse
        q_less_1 = 0.0
        pointed = 1.0  # the next token's target: its share of the mixture that comes from the LM
        gate_coef = 0.0  # the gradient's amount at the gate's column, besides the softmax's
        if COPY:
            x_gate = tl.load(Logits + slot).to(tl.float32)
            gate = cap * _softcap_sigmoid(x_gate, offset, divisor, PTX)
            lse_lm = cap + tl.log(tl.maximum(summed - tl.exp(gate - cap), summed * 1e-7))
            q = tl.exp(lse - lse_lm)  # 1 / (1 - alpha)
            # q - 1 and 1 - r straight from their logs: as differences from 1 they lose every digit below fp32's
            # 6e-8, as much as the gate's whole gradient where alpha is small
            q_less_1 = tl.exp(gate - lse_lm)
            log_copy = tl.load(LogCopy + row)
            log_sink = tl.load(LogSink + row)
            kept = _logaddexp(lse_lm, gate + log_sink)
            sink_share = tl.exp(gate + log_sink - kept)  # 1 - r, r = the LM's share of what the pointer keeps
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
        for k in tl.static_range(FIRST, K):  # FIRST: 1 with COPY, whose next token's term is above
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
        tl.debug_barrier()  # the targets' entries again, now with their -w: after the barrier they land last
        for k in tl.static_range(K):
            inside_batch = position + k < period
            target = tl.load(Targets + row + k, mask=inside_batch, other=0)
            same = 0.0  # the amount of every offset whose target is this one (a repeated token)
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
        if COPY:  # the gate is no target (it lies past the vocabulary)
            grad = _scaled_softmax_grad(x_gate, shift, -gate_coef * 2.0 ** GRAD_EXP, cap, offset, divisor, PTX)
            tl.store(Grad + slot, grad.to(Grad.dtype.element_ty))

    @triton.jit
    def _transpose_kernel(In, Out, M, N, row_step, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Out [N, M] = In[::row_step] [M, N]^T for one [BLOCK_M, BLOCK_N] tile of a contiguous In."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = (rows[:, None] < M) & (cols[None, :] < N)
        tile = tl.load(In + (rows[:, None] * row_step).to(tl.int64) * N + cols[None, :], mask=inside)
        tl.store(Out + cols[:, None].to(tl.int64) * M + rows[None, :], tl.trans(tile), mask=tl.trans(inside))


def transpose_fp8(x: Tensor, block_m: int = 64, block_n: int = 128, warps: int = 4, row_step: int = 1) -> Tensor:
    """A contiguous copy of x[::row_step].T (x: contiguous [M, N] FP8) with the Triton tile kernel, about 9 times as
    fast as torch's copy of the transposed view (bench/bench_loss.py fp8_grad, docs/design.md)."""
    M, N = -(-x.size(0) // row_step), x.size(1)
    out = x.new_empty(N, M)
    _transpose_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](x, out, M, N, row_step, BLOCK_M=block_m,
                                                                        BLOCK_N=block_n, num_warps=warps)
    return out


# The FP8 logit gradient is needed in two layouts: [T, V] for the input gradient's matmul and [V, T] for the
# weight gradient's (FP8 matmuls on Hopper take both operands contiguous along the reduced dimension). The
# forward's kernel writes [T, V] and transpose_fp8 makes [V, T] from it in the backward: the same bits as a second
# launch recomputing it from the logits in [V, T] order, in less time (bench/bench_loss.py fp8_grad, docs/design.md).
E4M3_MAX = 448.0
# The largest |gradient| lands at most at 2**15, under e5m2's 57344: no overflow, 2**31 of range.
GRAD_E5M2_EXP = 15
GRAD_E5M2_MAX = 2.0 ** GRAD_E5M2_EXP
# The fused loss kernel's launch shape: the fastest of the blocks and warps tried on one H100, at one packed
# forward's [65536, 50304] logits and at 131,072 rows (bench/bench_ce_fp8.py, docs/performance.md).
CE_FP8_BLOCK, CE_FP8_WARPS, CE_FP8_TAIL = 16384, 16, 1024


def softcapped_ce_fp8(logits: Tensor, targets: Tensor, cap: tuple, losses: Tensor, grad: Tensor,
                      mtp: tuple | None = None, copy: tuple | None = None) -> None:
    """_softcapped_ce_fp8_kernel: each row's loss into losses [T], its gradient into grad [T, V]; cap = (cap, offset,
    divisor); mtp = (weights [K] summing to 1, period), or None for next-token losses; copy = (the gate's column,
    log_copy [T], log_sink [T], d_copy [T], d_sink [T]) for the copy mixture, the last two written, or None."""
    rows, vocab = logits.shape
    weights, period = mtp if mtp is not None else (torch.ones(1, device=logits.device), rows)
    slot, log_copy, log_sink, d_copy, d_sink = copy if copy is not None else (0, losses, losses, losses, losses)
    _softcapped_ce_fp8_kernel[(rows,)](logits, targets, weights, losses, grad, vocab, logits.stride(0), period,
                                       log_copy, log_sink, d_copy, d_sink, slot, *cap, K=weights.numel(),
                                       GRAD_EXP=GRAD_E5M2_EXP, BLOCK=CE_FP8_BLOCK, TAIL=min(CE_FP8_TAIL, CE_FP8_BLOCK),
                                       PTX=logits.is_cuda, COPY=copy is not None, FIRST=int(copy is not None),
                                       num_warps=CE_FP8_WARPS)


class _Fp8SoftcappedHead(torch.autograd.Function):
    """Mean softcapped cross-entropy of x @ weight.T over the rows, with the three matmuls in FP8, scaled per tensor.

    Forward: x (rms-normed, so |x| <= sqrt(dim)) and weight (scaled by its absolute max) as e4m3, bf16 logits,
    then one kernel that reads them twice: the losses, and the logit gradient of the mean for an upstream
    gradient of rows * GRAD_E5M2_MAX, as e5m2. Only that gradient is kept for the backward (half the logits'
    bytes), which reads no logits: its upstream gradient g only sets the scale, g / rows / GRAD_E5M2_MAX, of
    grad_x = grad @ w and grad_w = grad^T @ x (the latter straight into float32). `fast`: torch._scaled_mm and
    the Triton kernels; otherwise the same quantised arithmetic in plain torch (CPUs, tests). With log_copy and
    log_sink (the copy pointer's, [rows] each) the next token's loss is the copy mixture's, column `slot` its gate
    (copy_mixture_losses), and the two get their gradients too. With wgrad_rows = k > 1 grad_w sums rows 0, k, 2k,
    ... only, times k: an unbiased estimate (the rows are alike in distribution) for 1/k of its matmul and transpose."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, targets: Tensor, cap: tuple, fast: bool, mtp_weights: Tensor | None,
                period: int, slot: int = 0, log_copy: Tensor | None = None, log_sink: Tensor | None = None,
                wgrad_rows: int = 1) -> Tensor:
        mtp = (mtp_weights, period) if mtp_weights is not None else None
        x_scale = x.new_full((), x.size(1) ** 0.5 / E4M3_MAX, dtype=torch.float32)
        w_scale = (weight.detach().abs().amax().float() / E4M3_MAX).clamp(min=1e-30)
        x_q = (x.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        w_q = (weight.detach().float() / w_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        rows = x.size(0)
        if fast:
            logits = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16,
                                      use_fast_accum=True)
            vocab = logits.size(1)
            losses = logits.new_empty(rows, dtype=torch.float32)
            grad_q = logits.new_empty(rows, vocab, dtype=torch.float8_e5m2)
            copy = None
            if log_copy is not None:
                d_copy, d_sink = torch.empty_like(losses), torch.empty_like(losses)
                copy = (slot, log_copy.float().contiguous(), log_sink.float().contiguous(), d_copy, d_sink)
            softcapped_ce_fp8(logits, targets, cap, losses, grad_q, mtp, copy)
        else:
            logits = (x_q.float() * x_scale) @ (w_q.float() * w_scale).t()
            s = torch.sigmoid((logits + cap[1]) / cap[2])
            z = cap[0] * s
            if log_copy is None:
                losses = multi_token_losses(z, targets, mtp)
                d = multi_token_grad(z, targets, mtp)
            else:
                masses = (log_copy.float(), log_sink.float())
                losses = copy_mixture_losses(z, targets, slot, *masses, mtp)
                d, d_copy, d_sink = copy_mixture_grad(z, targets, slot, *masses, mtp)
            grad_q = (GRAD_E5M2_MAX * d * (cap[0] / cap[2]) * s * (1.0 - s)).to(torch.float8_e5m2)
        ctx.save_for_backward(x_q, w_q, x_scale, w_scale, grad_q,
                              *((d_copy, d_sink) if log_copy is not None else ()))
        ctx.fast, ctx.x_dtype, ctx.w_dtype, ctx.wgrad_rows = fast, x.dtype, weight.dtype, wgrad_rows
        ctx.copy_dtype = log_copy.dtype if log_copy is not None else None
        return losses.mean()

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        x_q, w_q, x_scale, w_scale, grad_q, *pointer_grads = ctx.saved_tensors
        grad_scale = grad_loss.float() / grad_q.size(0) / GRAD_E5M2_MAX
        k = ctx.wgrad_rows  # grad_w from rows 0, k, 2k, ..., times k
        if ctx.fast:
            grad_qt = transpose_fp8(grad_q, row_step=k)
            # _scaled_mm wants its second operand column-major: the transposed copies are small.
            grad_x = torch._scaled_mm(grad_q, w_q.t().contiguous().t(), scale_a=grad_scale, scale_b=w_scale,
                                      out_dtype=ctx.x_dtype)
            grad_w = torch._scaled_mm(grad_qt, x_q[::k].t().contiguous().t(), scale_a=grad_scale * k,
                                      scale_b=x_scale, out_dtype=torch.float32)
        else:
            grad = grad_q.float() * grad_scale
            grad_x = (grad @ (w_q.float() * w_scale)).to(ctx.x_dtype)
            grad_w = grad[::k].t() @ (x_q[::k].float() * (x_scale * k))
        grad_copy = grad_sink = None
        if pointer_grads:  # the mean's upstream gradient times each row's derivatives
            grad_copy, grad_sink = ((g * (grad_loss.float() / grad_q.size(0))).to(ctx.copy_dtype) for g in pointer_grads)
        return grad_x, grad_w.to(ctx.w_dtype), None, None, None, None, None, None, grad_copy, grad_sink, None


def multi_token_grad(z: Tensor, targets: Tensor, mtp: tuple | None) -> Tensor:
    """d multi_token_losses / d z, row by row: the row's weights times softmax(z), minus each weight at its target."""
    softmax = torch.softmax(z, dim=1)
    rows = torch.arange(z.size(0), device=z.device)
    d = torch.zeros_like(softmax)
    for w, ahead in multi_token_targets(targets, mtp):
        d += w[:, None] * softmax
        d[rows, ahead] -= w
    return d


def copy_mixture_grad(z: Tensor, targets: Tensor, slot: int, log_copy: Tensor, log_sink: Tensor,
                      mtp: tuple | None) -> tuple[Tensor, Tensor, Tensor]:
    """d copy_mixture_losses summed over the rows / d (z, log_copy, log_sink), in closed form (the FP8 loss kernel's
    formulas; autograd inside the head's forward would not trace whole): a per-row multiple of softmax(z), minus
    per-row amounts at the targets and at the gate's column. The parts of the gate's amount that are differences
    from 1 come from their logarithms, as small as alpha where the gate is shut."""
    lse, gate, lse_lm = gated_log_sum_exps(z, slot)
    q, q_less_1 = torch.exp(lse - lse_lm), torch.exp(gate - lse_lm)  # 1 / (1 - alpha) and alpha / (1 - alpha)
    kept = torch.logaddexp(lse_lm, gate + log_sink)
    sink_share = torch.exp(gate + log_sink - kept)  # the sink's share of what the pointer keeps of the LM
    (w0, next_tokens), *ahead = multi_token_targets(targets, mtp)
    from_lm = z.gather(1, next_tokens[:, None])[:, 0] - lse_lm + kept
    mixed = torch.logaddexp(from_lm, gate + log_copy)
    pointed, copied = torch.exp(from_lm - mixed), torch.exp(gate + log_copy - mixed)
    weight = w0 * (1 + pointed * sink_share * q) + sum(w * q for w, _ in ahead)
    d = weight[:, None] * torch.softmax(z, dim=1)
    rows = torch.arange(z.size(0), device=z.device)
    d[rows, next_tokens] -= w0 * pointed
    for w, tokens in ahead:
        d[rows, tokens] -= w
    d[:, slot] -= w0 * (pointed * sink_share * q + copied) + sum(w * q_less_1 for w, _ in ahead)
    return d, -w0 * copied, -w0 * pointed * sink_share


def fp8_softcapped_head(x: Tensor, weight: Tensor, targets: Tensor, cap: tuple, use_triton: bool,
                        mtp: tuple | None = None, copy: tuple | None = None, wgrad_rows: int = 1) -> Tensor:
    """Mean softcapped cross-entropy of x @ weight.T (x: [rows, dim] rms-normed, weight: [vocab, dim]) with
    FP8 matmuls, next-token or multi-token (mtp), the next token's of the copy mixture with copy = (the gate's
    column, log_copy, log_sink): _Fp8SoftcappedHead. With use_triton (Kernels.loss; CUDA) the fast kernels,
    otherwise plain torch. The weight's gradient comes from every wgrad_rows-th row."""
    weights, period = mtp if mtp is not None else (None, 0)
    slot, log_copy, log_sink = copy or (0, None, None)
    return _Fp8SoftcappedHead.apply(x, weight, targets, cap, use_triton, weights, period, slot, log_copy, log_sink,
                                    wgrad_rows)


if triton is not None:
    @triton.jit
    def _copy_tile(q, K, Tokens, Docs, queries, keys, targets, documents, SCALE: tl.constexpr, BAND: tl.constexpr,
                  D: tl.constexpr):
        """The scores [M, N] of queries (rows q [M, D], positions, targets, documents) against the keys at positions
        `keys`, which of them each query sees (its document, less than BAND back), which of those hold its target,
        and the keys' rows."""
        k = tl.load(K + keys[:, None] * D + tl.arange(0, D)[None, :])
        s = tl.dot(q, tl.trans(k)) * SCALE
        back = queries[:, None] - keys[None, :]
        seen = (back >= 0) & (back < BAND) & (documents[:, None] == tl.load(Docs + keys)[None, :])
        hit = seen & (targets[:, None] == tl.load(Tokens + keys)[None, :])
        return s, seen, hit, k

    @triton.jit
    def _copy_score_grads(s, seen, hit, log_z, log_hits, grad_z, grad_hits):
        """d loss / d s of a tile: each query's softmax over what it sees (its normaliser log_z takes the sink in)
        times the gradient of log_z, plus its softmax over the hits times that of log_hits."""
        p_z = tl.where(seen, tl.exp(tl.minimum(s - log_z[:, None], 0.0)), 0.0)
        p_hits = tl.where(hit, tl.exp(tl.minimum(s - log_hits[:, None], 0.0)), 0.0)
        return p_z * grad_z[:, None] + p_hits * grad_hits[:, None]

    @triton.jit
    def _copy_scores_kernel(Q, K, Tokens, Targets, Docs, Sink, LogZ, LogHits, SCALE: tl.constexpr, BAND: tl.constexpr,
                            D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """One block of BLOCK_M queries: log_z (the scores seen and the sink) and log_hits, both by an online
        log-sum-exp over the key tiles of the band, in base 2. A tile wholly before the block's first document is
        skipped (documents only grow along the positions)."""
        start = tl.program_id(0) * BLOCK_M
        queries = start + tl.arange(0, BLOCK_M)
        q = tl.load(Q + queries[:, None] * D + tl.arange(0, D)[None, :])
        targets, documents = tl.load(Targets + queries), tl.load(Docs + queries)
        first_document = tl.load(Docs + start)
        max_z = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: a row with nothing seen yet keeps exp2(0) factors
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

    @triton.jit
    def _copy_scores_dq_kernel(Q, K, Tokens, Targets, Docs, LogZ, LogHits, GradZ, GradHits, DQ, SCALE: tl.constexpr,
                               BAND: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The query gradients of one block of BLOCK_M queries, from the scores recomputed over the same key tiles."""
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

    @triton.jit
    def _copy_scores_dk_kernel(Q, K, Tokens, Targets, Docs, LogZ, LogHits, GradZ, GradHits, DK, T, SCALE: tl.constexpr,
                               BAND: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The key gradients of one block of BLOCK_N keys, over the query tiles that can see them: from the key's own
        tile to BAND past the block. A tile whose first query is in a later document than every key is skipped."""
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


# The copy pointer kernels' launch shapes: the forward's key tiles, and the backward's query and key blocks.
COPY_FWD_BLOCKS, COPY_BWD_BLOCKS, COPY_WARPS = (128, 64), (64, 64), 8


class _CopyScores(torch.autograd.Function):
    """copy_log_probs with the Triton kernels: the forward keeps two floats per query (log_z and log_hits) and no
    scores; the backward recomputes each tile's scores twice, once for the query gradients (a kernel over query
    blocks) and once for the key gradients (a kernel over key blocks), so neither adds into the other's output."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, sink: Tensor, tokens: Tensor, targets: Tensor, documents: Tensor,
                band: int) -> tuple[Tensor, Tensor]:
        """sink: float32 [T], each query's sink score."""
        T, d = q.shape
        log_z = q.new_empty(T, dtype=torch.float32)
        log_hits = torch.empty_like(log_z)
        block_m, block_n = COPY_FWD_BLOCKS
        _copy_scores_kernel[(T // block_m,)](q, k, tokens, targets, documents, sink, log_z, log_hits, d ** -0.5,
                                             BAND=band, D=d, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=COPY_WARPS)
        ctx.save_for_backward(q, k, sink, tokens, targets, documents, log_z, log_hits)
        ctx.band = band
        return log_hits - log_z, sink - log_z

    @staticmethod
    def backward(ctx, grad_copy: Tensor, grad_sink: Tensor):
        q, k, sink, tokens, targets, documents, log_z, log_hits = ctx.saved_tensors
        T, d = q.shape
        grad_copy = grad_copy.float() if grad_copy is not None else torch.zeros_like(log_z)
        grad_sink = grad_sink.float() if grad_sink is not None else torch.zeros_like(log_z)
        grad_z = -(grad_copy + grad_sink)  # log_copy = log_hits - log_z, log_sink = sink - log_z
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        block_m, block_n = COPY_BWD_BLOCKS
        args = (tokens, targets, documents, log_z, log_hits, grad_z, grad_copy)
        _copy_scores_dq_kernel[(T // block_m,)](q, k, *args, dq, d ** -0.5, BAND=ctx.band, D=d, BLOCK_M=block_m,
                                                BLOCK_N=block_n, num_warps=COPY_WARPS)
        _copy_scores_dk_kernel[(T // block_n,)](q, k, *args, dk, T, d ** -0.5, BAND=ctx.band, D=d, BLOCK_M=block_m,
                                                BLOCK_N=block_n, num_warps=COPY_WARPS)
        return dq, dk, grad_sink + grad_z * torch.exp(sink - log_z), None, None, None, None


if triton is not None:
    @triton.jit
    def _sorted_rows_add_kernel(Grads, SortedRows, Order, Out, T, dim, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
        """Out[SortedRows[j]] += Grads[Order[j]] for CHUNK consecutive j of the row indices sorted (Order: their
        positions in Grads). A run of equal rows is summed in registers and added with one atomic add."""
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

    @triton.jit
    def _gather_rows_kernel(Table, Indices, Out, T, dim, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """Out[t] = Table[Indices[t]] in Out's dtype, for a [BLOCK_T, BLOCK_D] tile of Out."""
        positions = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        inside = (positions < T)[:, None] & (cols < dim)[None, :]
        rows = tl.load(Indices + positions, mask=positions < T, other=0).to(tl.int64)
        values = tl.load(Table + rows[:, None] * dim + cols[None, :], mask=inside)
        tl.store(Out + positions[:, None].to(tl.int64) * dim + cols[None, :], values.to(Out.dtype.element_ty), mask=inside)

# The row-gradient kernel's launch shape: at one packed forward on one H100 it adds the token, value and bigram
# tables' rows about 3x as fast as index_add_, and the shape matters little (bench/bench_rows.py,
# docs/performance.md).
ROWS_CHUNK, ROWS_BLOCK_D, ROWS_WARPS = 64, 512, 4


def gather_rows(table: Tensor, indices: Tensor, dtype: torch.dtype, use_triton: bool) -> Tensor:
    """table[indices] as dtype. The kernel converts as it copies: torch would write the rows in the table's
    dtype and convert them in a second pass."""
    if not use_triton or dtype == table.dtype:
        return F.embedding(indices, table).to(dtype)
    T, dim = indices.numel(), table.size(1)
    out = table.new_empty(T, dim, dtype=dtype)
    _gather_rows_kernel[(triton.cdiv(T, 16), triton.cdiv(dim, 256))](table, indices, out, T, dim, BLOCK_T=16,
                                                                      BLOCK_D=256, num_warps=4)
    return out


def add_rows_(tables_grads: list[Tensor], indices: Tensor, row_grads: list[Tensor], use_triton: bool) -> None:
    """tables_grads[i][indices[t]] += row_grads[i][t] for every position t: the gradient of looking the rows up.

    torch's index_add_ (what a sparse embedding gradient added into a dense .grad runs) makes one atomic add
    per position and column, many of them on the same rows: a frequent token appears thousands of times in
    a forward. The kernel sorts the indices once for all tables and sums each run of equal rows before adding
    it."""
    if not use_triton:
        for grad, rows in zip(tables_grads, row_grads):
            grad.index_add_(0, indices, rows.to(grad.dtype))
        return
    sorted_rows, order = torch.sort(indices)
    T = indices.numel()
    for grad, rows in zip(tables_grads, row_grads):
        rows = rows.contiguous()
        dim = rows.size(1)
        grid = (triton.cdiv(T, ROWS_CHUNK), triton.cdiv(dim, ROWS_BLOCK_D))
        _sorted_rows_add_kernel[grid](rows, sorted_rows, order, grad, T, dim, CHUNK=ROWS_CHUNK,
                                      BLOCK_D=ROWS_BLOCK_D, num_warps=ROWS_WARPS)


if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def _relu2_epilogue(acc, post_desc, out_desc, row0, col0, GRAD: tl.constexpr):
        if GRAD:
            acc = acc * 2.0 * tl.sqrt(post_desc.load([row0, col0]).to(tl.float32))
        else:
            acc = tl.maximum(acc, 0.0)
            acc = acc * acc
        out_desc.store([row0, col0], acc.to(out_desc.dtype))

    @triton.jit
    def _relu2_matmul_kernel(a_desc, b_desc, out_desc, post_desc, M, N, K, GRAD: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, SPLIT: tl.constexpr, PROGRAMS: tl.constexpr):
        """A [M, K] @ B [N, K]^T with the MLP's activation in the epilogue: relu(.)^2, or with GRAD the gradient
        through it, . * 2 sqrt(post) where post = relu(h)^2 is the forward's output (relu(h) = sqrt(post)).
        Persistent: PROGRAMS programs walk the tiles, GROUP_M row blocks per column block so that the tiles in
        flight share their operands in L2; the operands come in by TMA (tensor descriptors). SPLIT=2 finishes
        each tile in two halves (half the registers and staging memory for the epilogue)."""
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

    # The op's namespace follows the module's name: run as a script and imported, the file is two modules.
    @torch.library.custom_op(f"{__name__.replace('.', '_')}::relu2_matmul", mutates_args=())
    def relu2_matmul(a: Tensor, b: Tensor, post: Tensor | None = None) -> Tensor:
        """relu(a @ b^T)^2, or given post (that of the forward) the gradient through the activation,
        (a @ b^T) * 2 sqrt(post): _relu2_matmul_kernel; a [M, K] and b [N, K] contiguous. A custom op, so that
        torch.compile calls it as it is instead of tracing the tensor descriptors."""
        M, K = a.shape
        N = b.size(0)
        out = a.new_empty(M, N)
        block_m, block_n, block_k, group_m, split, warps, stages = RELU2_MM_CONFIG
        tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
        sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
        programs = min(tiles, sms)
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

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT, warps, stages) of the MLP kernel, forward and backward: on one H100, at
# [65536, 768] @ [768, 3072], no other tile that fits in shared memory is faster in both directions, nor 2 programs
# per SM with smaller tiles (bench/bench_mlp.py, docs/performance.md).
RELU2_MM_CONFIG = (128, 256, 64, 8, 2, 8, 3)


class _FusedReLU2MLP(torch.autograd.Function):
    """relu(x @ fc_w^T)^2 @ proj_w with the activation in the epilogues of two Triton matmuls (the speedrun
    fused its MLP likewise in 2025; the kernel is ours): the forward's fc matmul writes relu(h)^2 and nothing
    else, which the backward keeps (relu(h) is its square root), and the backward's first matmul multiplies
    by the activation's derivative as it writes. No separate elementwise pass reads or writes a [T, hidden]
    tensor. The other four matmuls are cuBLAS's."""

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
