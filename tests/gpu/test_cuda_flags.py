"""The later records' ideas (flags off by default) on the GPU, compiled into the whole-model graph with CUDA graphs,
on the tiny model: a few steps train, nothing compiles in the timed region, and the compiled losses follow the
eager ones. Skipped without CUDA."""
import re

import numpy as np
import pytest
import torch

import train_gpt as tg
from helpers import TINY

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FLAG_SETS = {
    "record_ideas": ["--sublayer_scales=1", "--attn_input_from=1", "--xsa_layers=1,3", "--value_gate_reads_embed=1",
                     "--doc_len_schedule=64,128,128", "--muon_qk_blocks=2", "--mudd=1", "--bigram_dims=24",
                     "--bigram_signs=16", "--token_gates=1"],
    "token_gates_without_mudd": ["--sublayer_scales=1", "--token_gates=1", "--xsa_layers=1,3"],
    "record_ideas_in_two_graphs": ["--sublayer_scales=1", "--attn_input_from=1", "--xsa_layers=1,3", "--mudd=1",
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


def test_fa3_symbolic_windows_compile_once_for_all_window_pairs(tiny_data, tmp_path):
    """FA3 (where it imports) with --fa3_symbolic_window under CUDA graphs: the tiny schedule's four training window
    pairs and its final validation's take at most two graphs and train as the static FA3 graphs do."""
    pytest.importorskip("flash_attn_interface", reason="FlashAttention-3 is not installed")
    train, val = tiny_data
    runs = {}
    for symbolic in (False, True):
        run_id = f"fa3_symbolic_{int(symbolic)}"
        cfg, _ = tg.parse_cli(["--device=cuda", *TINY, f"--train_files={train}", f"--val_files={val}",
                               "--micro_batch_tokens=128", "--num_iterations=6", "--val_loss_every=0", "--compile=1",
                               "--compile_mode=reduce-overhead", "--tune_kernels=0", "--attn_backend=fa3",
                               f"--fa3_symbolic_window={int(symbolic)}", f"--log_dir={tmp_path}", f"--run_id={run_id}"])
        log = tg.RunLog(cfg, tg.Comm())
        runs[symbolic] = tg.train(cfg, tg.Comm(), log)
        log.finish()
        text = (tmp_path / f"{run_id}.txt").read_text()
        assert "graphs compiled in the timed region: 0" in text
        runs[symbolic, "graphs"] = int(re.search(r"^compile_time:\S+ graphs:(\d+)", text, re.M).group(1))
    assert runs[True, "graphs"] <= 2 < runs[False, "graphs"]
    np.testing.assert_allclose(runs[True].train_losses, runs[False].train_losses, rtol=1e-2)
    np.testing.assert_allclose(runs[True].val_losses[-1][1], runs[False].val_losses[-1][1], rtol=1e-2)
