"""Plans that persist and plans for sharded training.

* ``Plan.save`` writes TOML that ``remat.apply_config`` applies: the same
  checkpoints as ``Plan.apply``, the same gradients, on another model object.
* ``remat.planner.ranks`` merges the ranks' profiles (measured figures by
  maximum, everything else must agree).
* An unsharded model is planned by the calling rank alone: one rank can plan
  while the others wait for its decisions.
* A LoRA model's frozen base gets no gradients, and the plan counts none.

``remat plan --world-size 2 --fsdp`` on two real gloo ranks is a command test
(``tests/cli/test_plan.py``).
"""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import pytest
import torch

import remat
from helpers import launch_on_ranks, tiny_llama_config
from remat.errors import CheckpointUsageError
from remat.models import GPT, GPTConfig, lm_loss, make_batch
from remat.planner import plan
from remat.planner.data import CHECKPOINT, KEEP, SAVE_MATMULS, SharedInput
from remat.planner.ranks import widest


def _gpt() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    config = GPTConfig(n_layers=4, seq_len=32, d_model=64, n_heads=4)
    idx, targets = make_batch(config, 4, torch.Generator().manual_seed(1))
    return GPT(config), idx, targets


def _grads(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    lm_loss(model(idx), targets).backward()
    return {name: p.grad.clone() for name, p in model.state_dict(keep_vars=True).items()
            if isinstance(p, torch.nn.Parameter) and p.grad is not None}


def test_a_saved_plan_applies_with_apply_config(tmp_path: pathlib.Path) -> None:
    model, idx, targets = _gpt()
    fresh = copy.deepcopy(model)
    chosen = plan(model, (idx,), budget="85%", loss_fn=lambda out: lm_loss(out, targets), repeats=1)
    assert {d.option for d in chosen.decisions} - {KEEP} <= {CHECKPOINT, SAVE_MATMULS}
    path = chosen.save(tmp_path / "plans" / "gpt.toml")
    text = path.read_text()
    assert "[activation_checkpoint.regions]" in text and '"blocks.0" = ' in text
    assert f"budget_bytes = {chosen.budget_bytes}" in text and "world_size = 1" in text
    config = remat.config_from_toml(path)
    assert config == chosen.to_config()
    changed = remat.apply_config(fresh, config).blocks
    assert changed and changed == tuple(d.region for d in chosen.decisions if d.option != KEEP)
    plain = _grads(copy.deepcopy(model), idx, targets)
    with chosen.apply(model):
        applied = _grads(model, idx, targets)
    loaded = _grads(fresh, idx, targets)
    assert plain.keys() == applied.keys() == loaded.keys()
    for name in plain:
        assert torch.equal(applied[name], plain[name]), name
        assert torch.equal(loaded[name], plain[name]), name
    # The same memory as the plan applied by the planner.
    with remat.memory.track() as tracked:
        lm_loss(fresh(idx), targets).backward()
    assert tracked.peak_bytes <= chosen.budget_bytes


def test_region_options_of_a_config() -> None:
    model, idx, targets = _gpt()
    changed = remat.apply_config(
        model, {"regions": {"blocks.0": "checkpoint+offload", "blocks.1": "offload", "blocks.3": "keep"}}
    ).blocks
    assert changed == ("blocks.0", "blocks.1")
    assert "forward" in vars(model.blocks[0]) and "forward" in vars(model.blocks[1])
    lm_loss(model(idx), targets).backward()  # runs (offload on the CPU moves nothing)
    with pytest.raises(CheckpointUsageError, match="not one of 'keep'"):
        remat.CheckpointConfig(regions={"blocks.0": "recompute"})
    with pytest.raises(CheckpointUsageError, match="has no submodule"):
        remat.apply_config(_gpt()[0], {"regions": {"blocks.9": "checkpoint"}})
    with pytest.raises(CheckpointUsageError, match=r"\['every'\] do not apply"):
        remat.CheckpointConfig(every=2, regions={"blocks.0": "checkpoint"})


def test_profiles_merge_measured_figures_by_maximum() -> None:
    shared = [SharedInput(512, (0, 1), ("checkpoint",)), SharedInput(768, (0, 1), ("checkpoint",))]
    assert widest(shared) == SharedInput(768, (0, 1), ("checkpoint",))
    with pytest.raises(CheckpointUsageError, match="the ranks profiled different steps"):
        widest([SharedInput(512, (0, 1), ()), SharedInput(512, (0, 2), ())])

    from remat.planner.data import OptionCost

    costs = [
        OptionCost(100, 10, 50, -40, 0.5, "own", None),
        OptionCost(120, 9, 55, -30, 0.7, "own", None),
    ]
    assert widest(costs) == OptionCost(120, 10, 55, -30, 0.7, "own", None)
    with pytest.raises(CheckpointUsageError, match="output_release differs"):
        widest([costs[0], OptionCost(100, 10, 50, -40, 0.5, "next", None)])


def plan_on_rank_zero(payload: object) -> tuple[list[tuple[str, str]], int]:
    """Rank 0 plans an unsharded model alone and broadcasts its decisions (as under DDP)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[
        torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 32))
        for _ in range(4)
    ])
    box: list[object] = [None]
    if dist.get_rank() == 0:
        chosen = plan(model, (torch.randn(256, 32),), budget="70%", repeats=1)
        box = [([(d.region, d.option.kind) for d in chosen.decisions], chosen.world_size)]
    dist.broadcast_object_list(box, src=0)
    decisions, world_size = box[0]  # type: ignore[misc]
    return decisions, world_size


def test_one_rank_plans_an_unsharded_model_alone() -> None:
    # An implicit collective inside plan() would wait for rank 1, which waits in
    # the broadcast: both would hang until the collective timeout.
    results = launch_on_ranks(2, plan_on_rank_zero, timeout_s=100)
    (decisions, world_size), other = results
    assert other == results[0] and world_size == 1
    assert any(kind != "keep" for _, kind in decisions)


def test_a_plan_for_another_model_is_refused(tmp_path: pathlib.Path) -> None:
    model, idx, targets = _gpt()
    chosen = plan(model, (idx,), budget="85%", loss_fn=lambda out: lm_loss(out, targets), repeats=1)
    other = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    path = chosen.save(tmp_path / "plan.toml")
    with pytest.raises(CheckpointUsageError, match="has no submodule"):
        remat.apply_config(other, remat.config_from_toml(path))
    assert all("forward" not in vars(m) for m in other.modules())  # nothing changed


def test_a_plan_for_a_lora_model_counts_no_gradients_for_the_frozen_base() -> None:
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = tiny_llama_config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, use_cache=False)
    ids = torch.randint(config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)  # next tokens; none for the last

    def loss_fn(output: Any) -> torch.Tensor:
        return lm_loss(output.logits, targets)

    plans = {}
    for lora in (None, 4):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).train()
        if lora is not None:  # adapters on every linear layer but the output; the rest frozen
            adapters = peft.LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear")
            peft.inject_adapter_in_model(adapters, model)
        args = (ids,)
        chosen = plan(model, args, budget="70%", loss_fn=loss_fn, repeats=1)
        measured = chosen.verify(model, args, loss_fn=loss_fn)
        # Within the budget; with a frozen embedding the cost model can count
        # one hidden state too many where a kept block precedes a checkpoint
        # (conservative: never under).
        assert measured <= chosen.predicted_peak_bytes <= chosen.budget_bytes
        with chosen.apply(model):
            model.zero_grad(set_to_none=True)
            loss_fn(model(*args)).backward()
        with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        assert with_grad == trainable
        plans[lora] = chosen
    # Frozen weights get no gradients: the step's own peak is lower for the same activations.
    assert plans[4].unchecked_peak_bytes < plans[None].unchecked_peak_bytes
