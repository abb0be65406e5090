"""The later records' ideas (defaults of the full model, off in the tiny one) on the GPU, compiled into the
whole-model graph with CUDA graphs, on the tiny model: a few steps train, nothing compiles in the timed region, and
the compiled losses follow the eager ones. Skipped without CUDA."""
import numpy as np
import pytest
import torch

import train_gpt as tg
from helpers import TINY

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FLAG_SETS = {
    "later_records": ["--sublayer_scales=1", "--attn_input_from=1", "--xsa_layers=1,3", "--value_gate_reads_embed=1",
                     "--doc_len_schedule=64,128,128", "--muon_qk_blocks=2", "--mudd=1", "--bigram_dims=24",
                     "--bigram_signs=16", "--token_gates=1"],
    "copy_pointer_with_later_records": ["--copy_pointer=1", "--copy_band=128", "--fp8_head=1", "--longest_match=1",
                                       "--copy_sink_key=1", "--sublayer_scales=1",
                                       "--mudd=1", "--token_gates=1", "--xsa_layers=1,3", "--bigram_dims=24",
                                       "--bigram_signs=16"],
    "token_gates_without_mudd": ["--sublayer_scales=1", "--token_gates=1", "--xsa_layers=1,3"],
    "later_records_in_two_graphs": ["--sublayer_scales=1", "--attn_input_from=1", "--xsa_layers=1,3", "--mudd=1",
                                   "--token_gates=1", "--compile_scope=split"],
}


@pytest.mark.parametrize("name", sorted(FLAG_SETS))
def test_flag_set_trains_compiled_with_cuda_graphs_as_eager(tiny_data, tmp_path, name):
    train, val = tiny_data
    losses = {}
    for compiled in (False, True):
        run_id = f"{name}_{'compiled' if compiled else 'eager'}"
        cfg, _ = tg.parse_cli(["--device=cuda", *TINY, f"--train_files={train}", f"--val_files={val}",
                               "--micro_batch_tokens=128", "--num_iterations=6", "--val_loss_every=0",
                               f"--compile={int(compiled)}", "--compile_mode=reduce-overhead", "--tune_kernels=0",
                               f"--log_dir={tmp_path}", f"--run_id={run_id}", *FLAG_SETS[name]])
        log = tg.RunLog(cfg, tg.Comm())
        losses[compiled] = tg.train(cfg, tg.Comm(), log).train_losses
        log.finish()
        if compiled:
            assert "graphs compiled in the timed region: 0" in (tmp_path / f"{run_id}.txt").read_text()
    assert all(np.isfinite(losses[True])) and losses[True][-1] < losses[True][0]
    np.testing.assert_allclose(losses[True][:3], losses[False][:3], rtol=2e-2)  # bf16 kernels fused differently
