"""The planner choosing compression: options, measured errors, the bound, saved plans.

A small embedded GPT (blocks with attention, norms and residuals). The oracle
for every error is the unchecked step's gradients, from the same RNG state.
"""

from __future__ import annotations

import pytest
import torch

import remat
from remat.errors import CheckpointUsageError, UnsupportedCheckpointError
from remat.models import GPT, GPTConfig
from remat.models.gpt import lm_loss, make_batch
from remat.planner import Planner, plan
from remat.planner.data import CHECKPOINT, DEFAULT_OPTIONS, KEEP, SAVE_MATMULS, Option
from remat.planner.profile import compressed_options

# Every test of one profile with compressed options (``planner``) runs on one xdist worker, which profiles once.
pytestmark = pytest.mark.xdist_group("planner_compression")

CONFIG = GPTConfig(n_layers=3, seq_len=64, d_model=64, n_heads=4, d_ff=256)


@pytest.fixture(scope="module")
def gpt() -> tuple[GPT, torch.Tensor, object]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    idx, targets = make_batch(CONFIG, 4, torch.Generator().manual_seed(0))
    return model, idx, lambda logits: lm_loss(logits, targets)


@pytest.fixture(scope="module")
def planner(gpt: tuple[GPT, torch.Tensor, object]) -> Planner:
    model, _, loss_fn = gpt
    return Planner(model, loss_fn=loss_fn, repeats=1, compress=("fp8", "int8"), max_gradient_error=0.02)  # type: ignore[arg-type]


def test_compressed_options_follow_keep_and_checkpoints() -> None:
    names = [o.name for o in compressed_options(DEFAULT_OPTIONS, ["int8"])]
    assert names == [
        "keep", "checkpoint", "checkpoint:save_matmuls",
        "keep+compress:int8", "checkpoint+compress:int8", "checkpoint:save_matmuls+compress:int8",
    ]
    with pytest.raises(CheckpointUsageError, match="compress is for 'keep'"):
        Option("offload", compress="fp8")
    with pytest.raises(CheckpointUsageError, match="unknown compression format"):
        compressed_options(DEFAULT_OPTIONS, ["fp5"])


def test_each_region_has_its_measured_error(planner: Planner, gpt: tuple[GPT, torch.Tensor, object]) -> None:
    _, idx, _ = gpt
    profile = planner.profile((idx,))
    for region in profile.regions:
        for name, cost in region.costs.items():
            if "+compress:" in name:
                assert 0 < cost.gradient_error < 0.1, (region.name, name)
            else:
                assert cost.gradient_error == 0.0
        # compressed keeps fewer bytes for backward than keeping
        assert region.costs["keep+compress:int8"].retained_bytes < region.costs["keep"].retained_bytes


@pytest.mark.parametrize("fraction", [0.55, 0.7, 0.85])
def test_plans_stay_within_the_bound_and_are_at_least_as_fast_as_exact_ones(
    planner: Planner, gpt: tuple[GPT, torch.Tensor, object], fraction: float
) -> None:
    model, idx, loss_fn = gpt
    allowed = planner.plan((idx,), fraction=fraction)
    exact = planner.plan((idx,), fraction=fraction, max_gradient_error=0.0)
    assert exact.predicted_gradient_error == 0.0
    assert allowed.predicted_gradient_error <= 0.02
    # Same profile, more options: no slower, but for a tie within the profile's noise, which
    # goes to the plan with fewer bytes (docs/design/planner.md, "Ties").
    assert allowed.predicted_step_s <= exact.predicted_step_s + allowed.problem.time_tolerance_s + 1e-12
    measured = allowed.measure_gradient_error(model, (idx,), loss_fn=loss_fn)  # type: ignore[arg-type]
    assert measured == pytest.approx(allowed.predicted_gradient_error, rel=0.5, abs=1e-9)


def test_the_error_model_adds_regions_in_quadrature(gpt: tuple[GPT, torch.Tensor, object], planner: Planner) -> None:
    """Every region compressed: the measured error against the quadrature of the regions alone."""
    from remat.planner.cost import chain_problem, gradient_error

    model, idx, loss_fn = gpt
    problem = chain_problem(planner.profile((idx,)))
    option = problem.options.index(KEEP.compressed("int8"))
    choice = (option,) * problem.size
    predicted = gradient_error(problem, choice)
    with remat.place(model, {name: remat.BlockSetting(checkpoint=False, compress="int8") for name in problem.names}):
        pass  # placing and removing leaves the model as it was
    from remat.planner.data import Decision

    decisions = tuple(Decision(name, problem.options[option], 0, 0.0) for name in problem.names)
    from remat.planner.apply import apply_decisions

    reference = _grads(model, idx, loss_fn)
    with apply_decisions(decisions, model):
        compressed = _grads(model, idx, loss_fn)
    measured = float((compressed - reference).norm() / reference.norm())
    assert measured == pytest.approx(predicted, rel=0.3)


def _grads(model: GPT, idx: torch.Tensor, loss_fn: object) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss_fn(model(idx)).backward()  # type: ignore[operator]
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return grads


def test_a_saved_plan_applies_its_compression(planner: Planner, gpt: tuple[GPT, torch.Tensor, object], tmp_path: object) -> None:
    model, idx, loss_fn = gpt
    chosen = planner.plan((idx,), fraction=0.6)
    forced = type(chosen)(**{**chosen.__dict__, "decisions": tuple(
        type(d)(d.region, SAVE_MATMULS.compressed("fp8") if k == 0 else d.option, d.retained_bytes, d.time_s)
        for k, d in enumerate(chosen.decisions)
    )})
    path = forced.save(tmp_path / "plan.toml")  # type: ignore[operator]
    text = path.read_text()
    assert '"checkpoint:save_matmuls+compress:fp8"' in text and "max_gradient_error = 0.02" in text
    handle = remat.apply_config(model, remat.config_from_toml(path))
    try:
        events: list[str] = []
        from remat._scope import observe_saved_tensors

        with observe_saved_tensors(lambda event, t: events.append(event)):
            loss_fn(model(idx)).backward()  # type: ignore[operator]
        assert "policy_compressed" in events
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)


def test_compression_requests_are_checked(gpt: tuple[GPT, torch.Tensor, object]) -> None:
    model, idx, loss_fn = gpt
    with pytest.raises(CheckpointUsageError, match="pass max_gradient_error"):
        plan(model, idx, budget="60%", compress="fp8")
    with pytest.raises(CheckpointUsageError, match="pass compress="):
        plan(model, idx, budget="60%", max_gradient_error=0.01)
    with pytest.raises(CheckpointUsageError, match="must be a positive number"):
        plan(model, idx, budget="60%", compress="fp8", max_gradient_error=-1)
    with pytest.raises(UnsupportedCheckpointError, match="compress and compile do not combine"):
        plan(model, idx, budget="60%", compress="fp8", max_gradient_error=0.01, compile=True, loss_fn=loss_fn)  # type: ignore[arg-type]


def test_checkpoint_option_names_round_trip() -> None:
    for option in (KEEP.compressed("bf16"), CHECKPOINT.compressed("int8"), SAVE_MATMULS.compressed("fp8")):
        setting = remat.config.region_setting(option.name)
        assert str(setting.compress) == option.compress
        assert setting.checkpoint == (option.kind == "checkpoint")
