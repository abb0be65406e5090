"""--fp8_head: the lm_head's matmuls in FP8. On the CPU, the plain-torch path (the same quantised arithmetic
as the CUDA kernels) against a float64 reference whose softcapped cross-entropy gradient comes from autograd,
and a tiny model trained with it at world sizes 1 and 2. tests/gpu checks the CUDA kernels."""
import dataclasses

import numpy as np
import pytest
import torch

import train_gpt as tg
from helpers import fp8_head_reference, relative_error, run_on_ranks, unquantised_head_reference
from test_train import _train_on_rank, tiny_config


def head_inputs(rows=96, dim=64, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = tg.rms_norm(torch.randn(rows, dim, generator=g))
    weight = torch.randn(vocab, dim, generator=g) * 0.3
    targets = torch.randint(0, vocab, (rows,), generator=g)
    return x, weight, targets


def run_head(x, weight, targets, grad_loss: float, cap=30.0):
    """The head's mean loss and its gradients for an upstream gradient of grad_loss, on the plain-torch path."""
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = tg._Fp8SoftcappedHead.apply(x, weight, targets, (cap, 0.0, cap / 4), False, None, 0)
    loss.backward(torch.tensor(grad_loss))
    return loss.detach(), x.grad, weight.grad


def test_plain_fp8_head_matches_the_float64_reference():
    x, weight, targets = head_inputs()
    loss, grad_x, grad_w = run_head(x, weight, targets, 0.7)
    per_row = torch.full((x.size(0),), 0.7 / x.size(0))  # the mean's upstream gradient, row by row
    ref_losses, ref_x, ref_w = fp8_head_reference(x, weight, targets, 30.0, per_row)
    torch.testing.assert_close(loss.double(), ref_losses.mean(), rtol=1e-5, atol=1e-5)
    assert relative_error(grad_x, ref_x) < 1e-3  # a few e5m2 roundings may land on the other side
    assert relative_error(grad_w, ref_w) < 1e-3
    # and FP8 stays close to the unquantised head: a wrong scale anywhere would be far off
    exact, exact_x, exact_w = unquantised_head_reference(x, weight, targets, 30.0, per_row)
    assert relative_error(loss, exact.mean()) < 2e-2
    assert relative_error(grad_x, exact_x) < 0.15 and relative_error(grad_w, exact_w) < 0.15


def test_plain_fp8_head_takes_its_weight_gradient_from_every_kth_row():
    """wgrad_rows=4 (--head_wgrad_rows): the input gradient as with every row; the weight gradient is the float64
    reference's with rows 0, 4, 8, ... at 4 times their upstream gradient and the others at none, which differs from
    the whole sum."""
    x, weight, targets = head_inputs()
    rows, cap = x.size(0), (30.0, 0.0, 7.5)
    xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
    tg._Fp8SoftcappedHead.apply(xs, ws, targets, cap, False, None, 0, 0, None, None, 4).backward(torch.tensor(0.7))
    every = torch.full((rows,), 0.7 / rows)
    sampled = torch.zeros(rows)
    sampled[::4] = 4 * 0.7 / rows
    _, ref_x, whole_w = fp8_head_reference(x, weight, targets, 30.0, every)
    _, _, ref_w = fp8_head_reference(x, weight, targets, 30.0, sampled)
    assert relative_error(xs.grad, ref_x) < 1e-3 and relative_error(ws.grad, ref_w) < 1e-3
    assert relative_error(ws.grad, whole_w) > 0.05


def test_plain_fp8_head_with_multi_token_weights_matches_the_float64_reference():
    """Three offsets weighted 1 : 0.5 : 0.25 normalised, micro-batches of 32 rows, the speedrun's
    23 * sigmoid((x + 5) / 7.5): the plain-torch path of the FP8 head against the float64 reference with the same
    quantisation; without the terms past the next token's the loss is far off."""
    x, weight, targets = head_inputs(seed=2)
    weights, period, cap = torch.tensor([1.0, 0.5, 0.25]) / 1.75, 32, (23.0, 5.0, 7.5)
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = tg._Fp8SoftcappedHead.apply(x, weight, targets, cap, False, weights, period)
    loss.backward(torch.tensor(0.7))
    per_row = torch.full((x.size(0),), 0.7 / x.size(0))
    ref_losses, ref_x, ref_w = fp8_head_reference(x, weight, targets, 23.0, per_row, offset=5.0, divisor=7.5,
                                                  mtp=(weights, period))
    torch.testing.assert_close(loss.detach().double(), ref_losses.mean(), rtol=1e-5, atol=1e-5)
    assert relative_error(x.grad, ref_x) < 1e-3 and relative_error(weight.grad, ref_w) < 1e-3
    next_only, _, _ = fp8_head_reference(x, weight, targets, 23.0, per_row, offset=5.0, divisor=7.5)
    assert abs(next_only.mean().item() - loss.item()) > 1e-2


def test_fp8_head_gradient_scale_follows_the_upstream_gradient():
    """The e5m2 gradient is quantised once, in the forward, for a fixed upstream gradient; the real one only
    scales the backward's matmuls, so tiny and huge loss scales give proportional gradients: none flushed to
    zero, none infinite."""
    x, weight, targets = head_inputs(seed=1)
    grads = {}
    for scale in (1e-12, 1.0, 1e6):
        _, grad_x, grad_w = run_head(x, weight, targets, scale)
        assert torch.isfinite(grad_x).all() and torch.isfinite(grad_w).all()
        assert (grad_w != 0).float().mean() > 0.99
        grads[scale] = (grad_x / scale, grad_w / scale)
    for scale in (1e-12, 1e6):
        for got, want in zip(grads[scale], grads[1.0]):
            assert relative_error(got, want.double()) < 1e-3


def test_tiny_model_trains_with_the_fp8_head_on_one_and_two_processes(tiny_data, tmp_path):
    cfg = tiny_config(*tiny_data, num_iterations=3, val_loss_every=0, log_dir=str(tmp_path), run_id="fp8w1",
                      micro_batch_tokens=128, fp8_head=True)
    single = tg.train(cfg, tg.Comm(), tg.RunLog(cfg, tg.Comm())).train_losses
    two = run_on_ranks(_train_on_rank, 2, dataclasses.replace(cfg, run_id="fp8w2"))
    assert single[0] > single[-1]
    np.testing.assert_allclose(two[0], single, rtol=1e-5)


def test_gpus_without_fp8_matmuls_or_tma_are_told_which_kernel_to_turn_off(monkeypatch):
    """The FP8 head and the fused MLP are on by default; on a GPU older than Ada/Hopper (FP8 matmuls) or Hopper (the
    MLP kernel's TMA loads) the check before a launch names the GPU and the flag, instead of a kernel failing deep
    inside the first forward."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    cfg = tg.Config()
    assert cfg.fp8_head and cfg.fused_mlp
    cuda = torch.device("cuda", 0)

    def check_gpu_features(config):  # with the kernels that a run on that GPU chooses
        tg.check_gpu_features(config, cuda, tg.choose_kernels(config, cuda))

    with pytest.raises(tg.UserError, match=r"A100.*pass --fp8_head=0"):
        check_gpu_features(cfg)
    no_fp8 = dataclasses.replace(cfg, fp8_head=False)
    if tg.triton is not None:
        with pytest.raises(tg.UserError, match=r"A100.*pass --fused_mlp=0"):
            check_gpu_features(no_fp8)
    check_gpu_features(dataclasses.replace(no_fp8, fused_mlp=False))  # bf16 head, unfused MLP: fine
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))  # Ada: FP8, no TMA
    check_gpu_features(dataclasses.replace(cfg, fused_mlp=False))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_gpu_features(cfg)
