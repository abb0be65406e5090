"""--fa3_symbolic_window on the CPU, with a stand-in for FlashAttention-3 built as FA3 is (a custom op taking the
window and max_seqlen as ints): the compiled model makes two graphs for four window pairs where the static
compile makes one per pair, with eager's losses; the real FA3: bench/fa3_window_probe.py and tests/gpu."""
import dataclasses

import pytest
import torch
import torch._dynamo

import train_gpt as tg
from helpers import BOS, TINY, cu_seqlens_of, random_tiny_model
from test_mudd import random_batch


SDPA = tg.SdpaAttention()


def _windowed_attention(q, k, v, cu_seqlens, window: int):
    """The SDPA backend's attention with FA3's semantics: causal, inside each document, over the last `window` keys."""
    return SDPA(q, k, v, SDPA.prepare(q.size(0), cu_seqlens, {"S": window})["S"]).contiguous()


@torch.library.custom_op("speedrun_test::varlen_window", mutates_args=())
def varlen_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                  window: int) -> torch.Tensor:
    return _windowed_attention(q, k, v, cu_seqlens, window)


@varlen_window.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, window):
    return torch.empty_like(q)


def _save(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, window = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens)
    ctx.window = window


def _backward(ctx, grad):
    q, k, v, cu_seqlens = ctx.saved_tensors
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        y = _windowed_attention(q, k, v, cu_seqlens, ctx.window)
        return (*torch.autograd.grad(y, (q, k, v), grad), None, None, None)


varlen_window.register_autograd(_backward, setup_context=_save)


class StandIn:
    """flash_attn_interface's varlen call, as FlashAttention3 makes it."""
    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                               window_size):
        return varlen_window(q, k, v, cu_seqlens_q, max_seqlen_q, window_size[0] + 1)


def test_symbolic_windows_compile_two_graphs_for_all_window_pairs():
    """Four window pairs: the first compiles with its ints static, the second recompiles with them symbolic, and that
    graph serves the other two (static, each pair is a graph: 4, measured as this test was written)."""
    cfg, _ = tg.parse_cli(["--device=cpu", *TINY, "--paired_head_layers=", "--fa3_symbolic_window=1"])
    cfg = dataclasses.replace(cfg, num_layers=2, attn_layout="SL", value_embed_layout="..", skip_from=0, skip_to=1,
                              backout_from=1)
    model = random_tiny_model(cfg)
    model.attend = tg.FlashAttention3(StandIn, cfg.max_doc_len)
    for block in model.blocks:
        block.attend = model.attend
    tokens, targets, bigrams = random_batch(cfg)
    cu_seqlens = cu_seqlens_of(tokens, BOS)
    windows = [(16, 32), (32, 64), (48, 96), (64, 128)]
    eager = [model(tokens, targets, model.prepare_masks(tokens, cu_seqlens, w), bigrams).item() for w in windows]
    torch._dynamo.reset()
    try:
        tg.compile_model(model, dataclasses.replace(cfg, compile=True), tg.Comm(), torch.device("cpu"))
        before = tg.compiled_graph_count()
        losses = []
        for w in windows:
            loss = model(tokens, targets, model.prepare_masks(tokens, cu_seqlens, w), bigrams)
            loss.backward()
            losses.append(loss.item())
        graphs = tg.compiled_graph_count() - before
    finally:
        torch._dynamo.reset()
    assert graphs == 2
    assert losses == pytest.approx(eager, rel=1e-5)
