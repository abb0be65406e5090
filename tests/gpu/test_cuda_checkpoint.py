"""A checkpoint resumed on the GPU, compiled with CUDA graphs: the weights and optimizer state go into the tensors
the recorded graphs read, and the run goes on as if never stopped. Skipped without CUDA."""
import dataclasses

import numpy as np
import pytest
import torch

import sample
import train_gpt as tg
from helpers import TINY

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run(cfg):
    log = tg.RunLog(cfg, tg.Comm())
    result = tg.train(cfg, tg.Comm(), log)
    log.finish()
    return result


def test_a_resumed_compiled_run_trains_as_one_never_stopped(tiny_data, tmp_path):
    train, val = tiny_data
    cfg, _ = tg.parse_cli(["--device=cuda", *TINY, f"--train_files={train}", f"--val_files={val}",
                           "--micro_batch_tokens=128", "--num_iterations=8", "--val_loss_every=4", "--compile=1",
                           "--cuda_graphs=1", f"--log_dir={tmp_path}",
                           "--run_id=whole", f"--save_checkpoint={tmp_path / 'final.pt'}", "--checkpoint_every=4"])
    whole = run(cfg)
    resumed = run(dataclasses.replace(cfg, run_id="resumed", resume=str(tmp_path / "final_step000004.pt"),
                                      save_checkpoint="", checkpoint_every=0))
    assert resumed.train_losses[:4] == whole.train_losses[:4]
    np.testing.assert_allclose(resumed.train_losses, whole.train_losses, rtol=1e-4)
    np.testing.assert_allclose([v for _, v in resumed.val_losses], [v for _, v in whole.val_losses], rtol=1e-4)
    assert "graphs compiled in the timed region: 0" in (tmp_path / "resumed.txt").read_text()
    # the same checkpoint validated alone (compiled) and continued greedily, on the GPU
    final = dataclasses.replace(cfg, run_id="eval", eval_only=True, init_from=str(tmp_path / "final.pt"),
                                save_checkpoint="", checkpoint_every=0)
    assert tg.evaluate_checkpoint(final, tg.Comm(), lambda line: None) == pytest.approx(whole.val_losses[-1][1], rel=1e-4)
    codec = (lambda text: list(text.encode("latin-1")), lambda tokens: bytes(tokens).decode("latin-1"))
    options = dict(init_from=final.init_from, prompt=bytes([30, 31, 32]).decode("latin-1"), tokens=8, temperature=0.0,
                   seed=0, device="cuda")
    assert len(sample.sample(options, lambda line: None, codec)) == 8
