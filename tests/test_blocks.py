"""One block finder (remat._blocks.find_blocks) behind every entry point.

By pattern (glob or regex), by structure, by the chain a forward runs, and
by what several chains keep for backward; the planner and ``apply_config``
ask it, so they checkpoint the same blocks (the commands' strategies ask it
too: ``tests/cli/test_strategies.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import remat
from helpers import NO_BLOCKS_RULE, NoBlocks, tiny_llama_config, with_heads
from remat._blocks import find_blocks
from remat.errors import CheckpointUsageError
from remat.models import GPT, GPTConfig, make_batch
from remat.planner.profile import find_candidates


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


def built(source: str) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """A model with a stack of 3 blocks, its inputs and keywords, built without the command
    line: the embedded GPT, a tiny Hugging Face Llama, or blocks beside a larger list of heads."""
    if source == "llama":
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config(use_cache=False))
        return model, (torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(0)),), {}
    if source == "heads":
        return with_heads()
    config = GPTConfig(n_layers=3, seq_len=16)
    torch.manual_seed(0)
    idx, _ = make_batch(config, 2, torch.Generator().manual_seed(0))
    return GPT(config), (idx,), {}


@pytest.mark.parametrize("source", ["gpt", "llama", "heads"])
def test_config_and_planner_pick_the_blocks_the_finder_picks(source: str) -> None:
    model, args, kwargs = built(source)
    found = tuple(n for n, _ in find_blocks(model, inputs=args, kwargs=kwargs))
    planner = tuple(n for n, _ in find_candidates(model, None, args))
    if kwargs:  # the planner gets the keywords bound (as `remat plan` binds them)
        planner = tuple(n for n, _ in find_blocks(model, inputs=args, kwargs=kwargs))
    assert found == planner and len(found) == 3
    assert remat.apply_config(built(source)[0], {"blocks": f"re:({'|'.join(found)})"}).blocks == found


def test_embedded_gpt_blocks_are_its_blocks() -> None:
    config = GPTConfig(n_layers=4, seq_len=16)
    idx, _ = make_batch(config, 2, torch.Generator().manual_seed(0))
    assert [n for n, _ in find_blocks(GPT(config), inputs=(idx,))] == [f"blocks.{i}" for i in range(4)]


def test_every_entry_point_says_the_one_rule_when_a_model_has_no_blocks() -> None:
    # remat._blocks.require_blocks: one message, the rule find_blocks applies.
    from remat.memory._sharded import _blocks_of

    x = torch.randn(2, 4)
    calls = {
        "remat.apply_config": lambda: remat.apply_config(NoBlocks(), {"mode": "full"}),
        "remat.planner": lambda: remat.plan(NoBlocks(), x, budget="50%", repeats=1),
        "remat.memory.shard_model": lambda: _blocks_of(NoBlocks(), None, "remat.memory.shard_model"),
    }
    rule = NO_BLOCKS_RULE
    for api, call in calls.items():
        with pytest.raises(CheckpointUsageError) as raised:
            call()
        assert str(raised.value).startswith(f"{api}: {rule}"), str(raised.value)
    # The rule as stated: a ModuleList of one module is a stack of blocks.
    one = nn.Sequential(nn.ModuleList([nn.Linear(4, 4)]))
    assert [n for n, _ in find_blocks(one)] == ["0.0"]
