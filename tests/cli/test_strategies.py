"""The strategies the commands put on a model's blocks (remat/cli/strategies.py): they pick
the blocks the planner and ``apply_config`` pick, on models the loader builds."""

from __future__ import annotations

import pathlib

import pytest
import torch

import remat
from helpers import NO_BLOCKS_RULE, NoBlocks, tiny_llama_config
from remat._blocks import find_blocks
from remat.cli.loader import LoadedModel, ModelRequest, load_model
from remat.cli.strategies import apply_strategy
from remat.errors import CheckpointUsageError
from remat.models import GPTConfig
from remat.planner.profile import find_candidates


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
        request = ModelRequest(command="test", model="helpers:with_heads")
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


def test_a_strategy_on_a_model_without_blocks_says_the_one_rule() -> None:
    # The rule every entry point states (remat._blocks.require_blocks; tests/test_blocks.py).
    x = torch.randn(2, 4)
    with pytest.raises(CheckpointUsageError) as raised:
        apply_strategy(LoadedModel(NoBlocks(), (x,), title="NoBlocks"), "remat", "remat report")
    assert str(raised.value).startswith(f"remat report: --strategy remat: {NO_BLOCKS_RULE}"), str(raised.value)
