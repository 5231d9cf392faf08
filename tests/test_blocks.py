"""One block finder (remat._blocks.find_blocks) behind every entry point.

By pattern (glob or regex), by structure, by the chain a forward runs, and
by what several chains keep for backward; the ``remat`` commands, the
planner and ``apply_config`` all ask it, so they checkpoint the same blocks.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from torch import nn

import remat
from helpers import tiny_llama_config
from remat._blocks import find_blocks
from remat.cli.loader import LoadedModel, ModelRequest, load_model
from remat.cli.strategies import apply_strategy
from remat.errors import CheckpointUsageError
from remat.models import GPT, GPTConfig, make_batch
from remat.planner.profile import find_candidates


class WithHeads(nn.Module):
    """A stack of 3 blocks and a larger list of 6 heads applied to the stack's output."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3))
        self.heads = nn.ModuleList(nn.Linear(16, 64) for _ in range(6))

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return torch.stack([head(x) for head in self.heads]).sum(0) * scale


def with_heads() -> tuple[nn.Module, tuple[torch.Tensor], dict[str, Any]]:
    torch.manual_seed(0)
    return WithHeads(), (torch.randn(4, 16),), {"scale": 0.5}


def test_pattern_structure_and_chain() -> None:
    model, (x,), kwargs = with_heads()
    assert [n for n, _ in find_blocks(model, "heads.*")][:2] == ["heads.0", "heads.1"]
    assert [n for n, _ in find_blocks(model, r"re:blocks\.\d")] == ["blocks.0", "blocks.1", "blocks.2"]
    with pytest.raises(CheckpointUsageError, match="no module name matches"):
        find_blocks(model, "decoder.*")
    with pytest.raises(CheckpointUsageError, match="not a regex"):
        find_blocks(model, "re:(")
    # By structure alone the larger list wins; the forward shows which one is a chain.
    assert find_blocks(model)[0][0] == "heads.0"
    assert [n for n, _ in find_blocks(model, inputs=(x,), kwargs=kwargs)] == ["blocks.0", "blocks.1", "blocks.2"]
    assert find_blocks(nn.Linear(2, 2)) == []
    # A one-layer model still has its list of blocks.
    assert [n for n, _ in find_blocks(GPT(GPTConfig(n_layers=1, seq_len=8)))] == ["blocks.0"]


def _report_blocks(loaded: LoadedModel) -> tuple[str, ...]:
    placed = apply_strategy(loaded, "remat", "remat report")
    assert placed is not None
    return placed.blocks


@pytest.mark.parametrize("source", ["gpt", "llama", "heads"])
def test_report_config_and_plan_pick_the_same_blocks(source: str, tmp_path: pathlib.Path) -> None:
    if source == "llama":
        path = tmp_path / "llama.json"
        tiny_llama_config().to_json_file(path)
        request = ModelRequest(command="test", hf_config=path, batch=2, seq=16)
    elif source == "heads":
        request = ModelRequest(command="test", model=f"{__name__}:with_heads")
    else:
        request = ModelRequest(command="test", gpt=GPTConfig(n_layers=3, seq_len=16), batch=2)
    report = _report_blocks(load_model(request))
    loaded = load_model(request)
    planner = tuple(n for n, _ in find_candidates(loaded.model, None, loaded.args))
    if loaded.kwargs:  # the planner gets the keywords bound (as `remat plan` binds them)
        planner = tuple(
            n for n, _ in find_blocks(loaded.model, inputs=loaded.args, kwargs=loaded.kwargs)
        )
    assert report == planner and len(report) == 3
    assert remat.apply_config(load_model(request).model, {"blocks": f"re:({'|'.join(report)})"}).blocks == report


def test_embedded_gpt_blocks_are_its_blocks() -> None:
    config = GPTConfig(n_layers=4, seq_len=16)
    idx, _ = make_batch(config, 2, torch.Generator().manual_seed(0))
    assert [n for n, _ in find_blocks(GPT(config), inputs=(idx,))] == [f"blocks.{i}" for i in range(4)]
