"""remat.placement: one mechanism puts checkpointing on blocks, one handle takes it off.

Every setting on the embedded GPT's blocks (pre-norm residual blocks with
attention) against the unchecked model: gradients bitwise, backward matmuls
counted, names unchanged, and after ``remove()`` nothing left behind.
"""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import OpCounter
from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.models import GPT, GPTConfig, lm_loss, make_batch
from remat.placement import BlockSetting, install, place
from remat.policies import save_matmuls, save_only_names

CONFIG = GPTConfig(n_layers=3, seq_len=32, d_model=64, n_heads=4)


def gpt() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    idx, targets = make_batch(CONFIG, 2, torch.Generator().manual_seed(1))
    return GPT(CONFIG), idx, targets


def grads_and_backward_matmuls(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model(idx), targets)
    with OpCounter() as counter:
        loss.backward()
    counts = counter.take()
    matmuls = sum(v for k, v in counts.items() if k.split(".")[1] in ("mm", "addmm", "bmm"))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, matmuls


def state(model: torch.nn.Module) -> list[tuple[str, bool, int, int]]:
    """What placement may change on each module: instance forward, hook counts."""
    return [
        (name, "forward" in vars(m), len(m._forward_hooks), len(m._forward_pre_hooks))
        for name, m in model.named_modules()
    ]


SETTINGS = {
    "checkpoint": BlockSetting(),
    "save_matmuls": BlockSetting(policy=save_matmuls),
    "names": BlockSetting(policy=save_only_names("attn"), name_outputs=("attn",)),
    "offload": BlockSetting(checkpoint=False, offload=True),
    "checkpoint+offload": BlockSetting(offload=True),
    # Without a split backward (tests/integration/test_pipelining.py has one) a plain checkpoint.
    "checkpoint weight_pass=recompute": BlockSetting(weight_pass="recompute"),
}


@pytest.mark.parametrize("kind", list(SETTINGS))
def test_each_setting_gives_the_unchecked_gradients_and_comes_off(kind: str) -> None:
    model, idx, targets = gpt()
    reference, plain_matmuls = grads_and_backward_matmuls(copy.deepcopy(model), idx, targets)
    names = [n for n, _ in model.named_parameters()]
    before = state(model)
    handle = place(model, {"blocks.0": SETTINGS[kind], "blocks.1": BlockSetting(checkpoint=False), "blocks.2": SETTINGS[kind]})
    assert handle.blocks == ("blocks.0", "blocks.2")  # the kept block is not changed
    assert [n for n, _ in model.named_parameters()] == names
    got, matmuls = grads_and_backward_matmuls(model, idx, targets)
    assert got.keys() == reference.keys()
    for name, grad in reference.items():
        assert torch.equal(got[name], grad), name
    recomputed = matmuls - plain_matmuls
    if kind in ("checkpoint", "checkpoint+offload", "checkpoint weight_pass=recompute"):
        assert recomputed > 0
    elif kind == "offload":
        assert recomputed == 0
    else:  # a policy keeps the matmuls (all of them, or the named attention's)
        assert 0 <= recomputed < grads_and_backward_matmuls(_checkpointed(), idx, targets)[1] - plain_matmuls
    handle.remove()
    assert state(model) == before
    handle.remove()  # idempotent


def _checkpointed() -> GPT:
    model, _, _ = gpt()
    place(model, {f"blocks.{i}": BlockSetting() for i in (0, 2)})
    return model


def test_a_bad_name_or_setting_changes_nothing() -> None:
    model, _, _ = gpt()
    before = state(model)
    with pytest.raises(CheckpointUsageError, match=r"has no submodule 'blocks\.7'"):
        place(model, {"blocks.0": BlockSetting(), "blocks.7": BlockSetting()})
    with pytest.raises(CheckpointUsageError, match=r"block 'blocks\.1' has no such submodule"):
        place(model, {"blocks.0": BlockSetting(), "blocks.1": BlockSetting(name_outputs=("nope",))})
    with pytest.raises(CheckpointTypeError, match="must be a BlockSetting"):
        place(model, {"blocks.0": "checkpoint"})  # type: ignore[dict-item]
    assert state(model) == before
    with pytest.raises(CheckpointUsageError, match="a policy decides what"):
        BlockSetting(checkpoint=False, policy=save_matmuls)
    with pytest.raises(CheckpointUsageError, match="weight_pass='recompute' is a checkpoint's choice"):
        BlockSetting(checkpoint=False, weight_pass="recompute")
    with pytest.raises(CheckpointUsageError, match="weight_pass must be 'keep' or 'recompute'"):
        BlockSetting(weight_pass="twice")  # type: ignore[arg-type]


def test_a_block_placed_twice_is_refused_and_the_first_stays() -> None:
    model, idx, targets = gpt()
    first = place(model, {"blocks.0": BlockSetting(offload=True)})
    with pytest.raises(CheckpointUsageError, match="already has its forward replaced"):
        place(model, {"blocks.1": BlockSetting(), "blocks.0": BlockSetting()})
    assert "forward" not in vars(model.blocks[1])  # the failed call undid its own changes
    lm_loss(model(idx), targets).backward()
    first.remove()
    undo = install(model.blocks[0], BlockSetting())
    undo()
    assert state(model) == state(gpt()[0])
