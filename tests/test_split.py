"""--compile_scope=split's premise on the CPU: the model's forward in two halves is the same function, and Muon's
first group, the last layers' matrices, has its reduce-scatter launched before any matrix of the first half has its
gradient (the compiled halves and their graphs: tests/test_compile.py and tests/gpu)."""
import re

import pytest

import train_gpt as tg
from helpers import TINY, random_tiny_model
from test_mudd import loss_of, random_batch


def test_the_last_layers_reduce_scatter_starts_before_the_first_layers_have_gradients():
    cfg, _ = tg.parse_cli(["--device=cpu", *TINY, "--sublayer_scales=1", "--mudd=1", "--token_gates=1"])
    assert cfg.front_layers == 2 and cfg.num_layers == 4
    model = random_tiny_model(cfg)
    muon = tg.build_optimizers(model, cfg)[0]
    front = {id(p) for block in model.blocks[:2] for p in (block.attn.qkvo_w, block.mlp.fc_w, block.mlp.proj_w)}
    launches = []
    launch = muon.grad_hooks.launch

    def record(group):
        done = [p for block in model.blocks[:2] for p in block.parameters() if p.grad is not None]
        launches.append(([id(p) in front for p in group.params], len(done)))
        launch(group)
    muon.grad_hooks.launch = record
    muon.before_last_backward()
    loss_of(model, cfg, random_batch(cfg)).backward()
    assert [len(flags) for flags, _ in launches] == [6, 6]
    (first, front_grads_then), (second, _) = launches
    assert not any(first) and front_grads_then == 0  # layers 2 and 3 only, launched before layers 0-1 had any
    assert all(second)


@pytest.mark.parametrize("value", [4, -1])
def test_split_layer_is_checked_and_defaults_to_half_the_layers(value):
    assert tg.Config().front_layers == 5 and tg.Config(split_layer=3).front_layers == 3
    message = f"--split_layer={value}: use a layer 1 .. num_layers-1 (3), or 0 for num_layers // 2"
    with pytest.raises(tg.UserError, match=re.escape(message)):
        tg.validate_config(tg.parse_cli(["--device=cpu", *TINY, f"--split_layer={value}"])[0])
