"""Plans that persist and plans for sharded training.

* ``Plan.save`` writes TOML that ``remat.apply_config`` applies: the same
  checkpoints as ``Plan.apply``, the same gradients, on another model object.
* ``remat.planner.ranks`` merges the ranks' profiles (measured figures by
  maximum, everything else must agree).
* ``remat plan --world-size 2 --fsdp`` plans on two real gloo ranks: one plan
  on every rank, measured peak within the per-rank budget on every rank, and
  the saved plan trains with the plain run's gradients.
* An unsharded model is planned by the calling rank alone: one rank can plan
  while the others wait for its decisions.
"""

from __future__ import annotations

import copy
import pathlib

import pytest
import torch

import remat
from helpers import launch_on_ranks, plan_main, tiny_llama_config
from remat._compat import sharding_api_available
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


needs_sharding = pytest.mark.skipif(
    not sharding_api_available(), reason="FSDP2 is public from torch 2.6"
)


@needs_sharding
def test_remat_plan_for_two_fsdp2_ranks(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = tmp_path / "llama.json"
    tiny_llama_config().to_json_file(config_path)
    saved = tmp_path / "plan.toml"
    status = plan_main([
        "--hf-config", str(config_path), "--seq", "32", "--batch", "2", "--budget", "65%",
        "--world-size", "2", "--fsdp", "--repeats", "1", "--steps", "1", "--save", str(saved),
        "--quiet",
    ])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "2 ranks: FSDP2 x 2; budget per rank" in out
    assert "within budget on every rank" in out
    rows = [line.split() for line in out.splitlines() if line[:2] in ("0 ", "1 ")]
    assert [row[0] for row in rows] == ["0", "1"] and all(row[-1] == "yes" for row in rows)
    text = saved.read_text()
    assert "world_size = 2" in text
    regions = remat.config_from_toml(saved).regions
    assert regions is not None and set(regions) == {f"model.layers.{i}" for i in range(3)}
    assert any(option != "keep" for option in regions.values())


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




def test_a_plan_for_a_lora_model_counts_no_gradients_for_the_frozen_base(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("peft")
    from remat.cli.loader import ModelRequest, load_model

    config_path = tmp_path / "llama.json"
    tiny_llama_config(hidden_size=64, intermediate_size=128, num_hidden_layers=4).to_json_file(config_path)
    plans = {}
    for lora in (None, 4):
        loaded = load_model(ModelRequest(command="test", hf_config=config_path, batch=2, seq=64, lora_rank=lora))
        model, loss_fn = loaded.model, loaded.loss_fn
        assert loss_fn is not None
        chosen = plan(model, loaded.args, budget="70%", loss_fn=loss_fn, repeats=1)
        measured = chosen.verify(model, loaded.args, loss_fn=loss_fn)
        # Within the budget; with a frozen embedding the cost model can count
        # one hidden state too many where a kept block precedes a checkpoint
        # (conservative: never under).
        assert measured <= chosen.predicted_peak_bytes <= chosen.budget_bytes
        with chosen.apply(model):
            model.zero_grad(set_to_none=True)
            loss_fn(model(*loaded.args)).backward()
        with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        assert with_grad == trainable
        plans[lora] = chosen
    # Frozen weights get no gradients: the step's own peak is lower for the same activations.
    assert plans[4].unchecked_peak_bytes < plans[None].unchecked_peak_bytes
