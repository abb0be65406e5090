"""The tiny model on the GPU, compiled into the whole-model graph with CUDA graphs: a few steps train, nothing compiles
in the timed region, and the compiled losses follow the eager ones. Skipped without CUDA."""
import numpy as np
import pytest
import torch

import train_gpt as tg
from helpers import TINY

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FLAG_SETS = {
    "defaults_with_the_fp8_head": ["--fp8_head=1"],
    "paired_heads_on_both_windows": ["--fp8_head=1", "--paired_head_layers=0,1"],
    "ablations_off": ["--copy_pointer=0", "--longest_match=0", "--bigram_rows=0"],
}


@pytest.mark.parametrize("name", sorted(FLAG_SETS))
def test_flag_set_trains_compiled_with_cuda_graphs_as_eager(tiny_data, tmp_path, name):
    train, val = tiny_data
    losses = {}
    for compiled in (False, True):
        run_id = f"{name}_{'compiled' if compiled else 'eager'}"
        cfg, _ = tg.parse_cli(["--device=cuda", *TINY, f"--train_files={train}", f"--val_files={val}",
                               "--micro_batch_tokens=128", "--num_iterations=6", "--val_loss_every=0",
                               f"--compile={int(compiled)}", "--cuda_graphs=1",
                               f"--log_dir={tmp_path}", f"--run_id={run_id}", *FLAG_SETS[name]])
        log = tg.RunLog(cfg, tg.Comm())
        losses[compiled] = tg.train(cfg, tg.Comm(), log).train_losses
        log.finish()
        if compiled:
            assert "graphs compiled in the timed region: 0" in (tmp_path / f"{run_id}.txt").read_text()
    assert all(np.isfinite(losses[True])) and losses[True][-1] < losses[True][0]
    np.testing.assert_allclose(losses[True][:3], losses[False][:3], rtol=2e-2)  # bf16 kernels fused differently
