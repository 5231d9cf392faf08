"""Planning compiled training: remat.plan(..., compile=True), blocks compiled one by one.

The profile measures every option with the regions compiled as users compile
them (``fullgraph=True``, inductor) and counts bytes with the allocator
(inductor's buffers included). What a plan predicts must hold when the
planned model is compiled: its measured peak, its fit under the budget, and
gradients equal to the compiled unplanned model's (bitwise on the CPU).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import remat
from remat._compat.modules import compiled_call
from remat._compat.partitioner import region_memory_budgets_available
from remat._compat.versions import dynamo_traces_policy_objects
from remat.errors import CheckpointUsageError, InfeasibleBudgetError, UnsupportedCheckpointError
from remat.models import GPT, GPTConfig, lm_loss, make_batch
from remat.placement import BlockSetting, CompileSpec, place
from remat.planner import Planner, plan
from remat.planner.cost import chain_problem, peak_bytes
from remat.planner.data import CHECKPOINT, KEEP, Option
from remat.planner.profile import default_options

pytestmark = [
    pytest.mark.compile,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.xdist_group("planner_compiled"),  # one compiled profile (``planner``), one xdist worker
]

CONFIG = GPTConfig(n_layers=3, seq_len=32, d_model=64, n_heads=4, d_ff=256)


class _Case:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.base = GPT(CONFIG)
        idx, targets = make_batch(CONFIG, 2, torch.Generator().manual_seed(0))
        self.inputs = (idx,)
        self.loss_fn: Callable[[Any], torch.Tensor] = lambda logits: lm_loss(logits, targets)

    def model(self) -> GPT:
        return copy.deepcopy(self.base)

    def grads(self, model: torch.nn.Module) -> list[torch.Tensor]:
        for _ in range(2):  # the first step compiles
            model.zero_grad(set_to_none=True)
            self.loss_fn(model(*self.inputs)).backward()
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def case() -> _Case:
    return _Case()


@pytest.fixture(scope="module")
def planner(case: _Case) -> Planner:
    planner = Planner(case.model(), loss_fn=case.loss_fn, compile=True, repeats=1)
    planner.profile(case.inputs)
    return planner


def _budgets(planner: Planner, case: _Case) -> list[int]:
    profile = planner.profile(case.inputs)
    problem = chain_problem(profile, 0)
    low = peak_bytes(problem, (problem.options.index(CHECKPOINT),) * problem.size)
    high = profile.unchecked_peak_bytes
    return [int(low + share * (high - low)) for share in (0.0, 0.3, 0.7, 1.0)]


def test_compiled_plans_predict_their_compiled_peak(planner: Planner, case: _Case) -> None:
    measured = []
    for budget in _budgets(planner, case):
        chosen = planner.plan(case.inputs, budget=budget)
        assert chosen.compile == CompileSpec()
        peak = chosen.verify(planner.model, case.inputs, loss_fn=case.loss_fn)
        assert peak <= budget
        assert abs(chosen.predicted_peak_bytes - peak) <= 0.02 * peak
        measured.append(peak)
    assert measured == sorted(measured)  # more bytes never buy a higher peak


def test_the_compiled_menu_has_the_compilers_own_budgets_where_torch_has_them(
    planner: Planner, case: _Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = [o.name for o in planner.profile(case.inputs).options]
    assert names[:2] == ["keep", "checkpoint"]
    assert ("checkpoint:save_matmuls" in names) == dynamo_traces_policy_objects()
    assert any(name.startswith("budget:") for name in names) == region_memory_budgets_available()
    monkeypatch.setattr("remat.planner.profile.region_memory_budgets_available", lambda: False)
    assert not any(o.kind == "budget" for o in default_options(case.base, case.inputs, CompileSpec()))
    assert not any(o.kind == "budget" for o in default_options(case.base, case.inputs))


def test_an_applied_compiled_plan_compiles_its_regions_and_trains_like_the_unplanned_one(
    planner: Planner, case: _Case
) -> None:
    chosen = planner.plan(case.inputs, budget=_budgets(planner, case)[1])
    unplanned = case.model()
    place(unplanned, {f"blocks.{i}": BlockSetting(checkpoint=False, compile=CompileSpec()) for i in range(3)})
    model = case.model()
    handle = chosen.apply(model)
    assert all(compiled_call(block) is not None for block in model.blocks)
    expected, got = case.grads(unplanned), case.grads(model)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    handle.remove()
    assert all(compiled_call(block) is None and "forward" not in vars(block) for block in model.blocks)


def test_a_saved_compiled_plan_applies_the_same_everywhere(
    planner: Planner, case: _Case, tmp_path: Any
) -> None:
    chosen = planner.plan(case.inputs, budget=_budgets(planner, case)[1])
    path = chosen.save(tmp_path / "plan.toml")
    assert "compile = { fullgraph = true, backend = \"inductor\" }" in path.read_text()
    config = remat.config_from_toml(path)
    assert config.compile == CompileSpec() and config == chosen.to_config()
    applied, planned = case.model(), case.model()
    remat.apply_config(applied, config)
    chosen.apply(planned)
    assert all(compiled_call(block) is not None for block in applied.blocks)
    assert all(
        torch.equal(a, b) for a, b in zip(case.grads(applied), case.grads(planned), strict=True)
    )


def test_a_budget_no_compiled_option_reaches_says_the_smallest_peak(planner: Planner, case: _Case) -> None:
    with pytest.raises(InfeasibleBudgetError) as caught:
        planner.plan(case.inputs, budget=1000)
    assert caught.value.min_peak_bytes > 1000


class _Breaks(torch.nn.Module):
    """A block torch.compile cannot take whole: its forward reads a value in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y * 2 if float(y.sum()) > 0 else y  # a graph break


def test_a_region_that_does_not_compile_whole_is_refused_and_the_model_left_as_it_was() -> None:
    model = torch.nn.Sequential(*[_Breaks() for _ in range(2)])
    x = torch.randn(4, 16)
    with pytest.raises(UnsupportedCheckpointError, match="fullgraph=False"):
        plan(model, (x,), budget="80%", compile=True, repeats=1, options=[KEEP, CHECKPOINT])
    assert all(compiled_call(m) is None and "forward" not in vars(m) for m in model)
    assert all(p.grad is None for p in model.parameters())
    model(x).sum().backward()  # still an ordinary eager model


def test_regions_compiled_already_are_refused_with_what_to_do(case: _Case) -> None:
    model = case.model()
    model.blocks[0].compile(fullgraph=True)
    with pytest.raises(CheckpointUsageError, match="compile=True"):
        plan(model, case.inputs, budget="80%", loss_fn=case.loss_fn, repeats=1)
    with pytest.raises(CheckpointUsageError, match="plan first"):
        plan(model, case.inputs, budget="80%", loss_fn=case.loss_fn, repeats=1, compile=True)


def test_compile_arguments_are_checked() -> None:
    with pytest.raises(remat.errors.CheckpointTypeError, match="CompileSpec"):
        Planner(torch.nn.Linear(2, 2), compile="yes")  # type: ignore[arg-type]
    with pytest.raises(CheckpointUsageError, match="unknown keys"):
        Planner(torch.nn.Linear(2, 2), compile={"fullgraf": True})
    assert Planner(torch.nn.Linear(2, 2), compile={"mode": "max-autotune"}).compile == CompileSpec(
        mode="max-autotune"
    )
    with pytest.raises(CheckpointUsageError, match="memory_budget"):
        Option("keep", memory_budget=0.5)
    with pytest.raises(CheckpointUsageError, match=r"\[0, 1\]"):
        Option("budget", memory_budget=1.5)


def test_a_compile_budget_needs_a_torch_that_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CheckpointUsageError, match="checkpoint=False"):
        BlockSetting(memory_budget=0.5)
    monkeypatch.setattr("remat.placement.region_memory_budgets_available", lambda: False)
    with pytest.raises(UnsupportedCheckpointError, match=r"torch 2\.13"):
        BlockSetting(checkpoint=False, memory_budget=0.5)


class _Gelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.up, self.down = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _saved_bytes(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes the block's compiled graph saves for backward (the partitioner's choice)."""
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x).sum().backward()
    return sum(saved)


# The min-cut partitioner without inductor: compiles in a second, reads the
# same torch._functorch.config settings as inductor's partitioning does.
_PARTITIONING = CompileSpec(backend="aot_eager_decomp_partition")


def test_a_process_wide_partitioner_budget_does_not_reach_the_blocks_remat_compiles() -> None:
    import torch._functorch.config as functorch_config

    x = torch.randn(8, 32, requires_grad=True)

    def placed_bytes() -> int:
        torch.compiler.reset()
        block = _Gelu()
        with place(block, {"": BlockSetting(checkpoint=False, compile=_PARTITIONING)}):
            return _saved_bytes(block, x)

    def torch_bytes() -> int:
        torch.compiler.reset()
        block = _Gelu()
        block.compile(**_PARTITIONING.arguments())
        return _saved_bytes(block, x)

    default_placed, default_torch = placed_bytes(), torch_bytes()
    with functorch_config.patch(activation_memory_budget=0.0):
        with pytest.warns(UserWarning, match="activation_memory_budget=0.0"):
            budgeted_placed = placed_bytes()
        budgeted_torch = torch_bytes()
    assert budgeted_torch < default_torch  # the setting changes what torch's own compile saves
    assert budgeted_placed == default_placed  # but not what remat's compiled block saves
    # Set after the block compiled: a recompile (a new input shape) still splits its graph
    # under torch's defaults.
    wider = torch.randn(16, 32, requires_grad=True)

    def recompiled_bytes(budget: float) -> int:
        torch.compiler.reset()
        block = _Gelu()
        with place(block, {"": BlockSetting(checkpoint=False, compile=_PARTITIONING)}):
            _saved_bytes(block, x)
            with functorch_config.patch(activation_memory_budget=budget):
                return _saved_bytes(block, wider)

    assert recompiled_bytes(0.0) == recompiled_bytes(1.0) > default_placed


@pytest.mark.slow
def test_a_compiled_plan_made_under_a_process_wide_budget_fits_and_runs_as_measured(
    planner: Planner, case: _Case
) -> None:
    import torch._functorch.config as functorch_config

    options = [o for o in planner.profile(case.inputs).options if o.kind != "budget"]
    with functorch_config.patch(activation_memory_budget=0.5), pytest.warns(UserWarning, match="0.5"):
        under = Planner(case.model(), loss_fn=case.loss_fn, compile=True, repeats=1, options=options)
        profile = under.profile(case.inputs)
        reference = planner.profile(case.inputs)
        for mine, theirs in zip(profile.regions, reference.regions, strict=True):
            for option in options:
                assert mine.costs[option.name].retained_bytes == theirs.costs[option.name].retained_bytes
        budget = _budgets(planner, case)[1]
        chosen = under.plan(case.inputs, budget=budget)
        peak = chosen.verify(under.model, case.inputs, loss_fn=case.loss_fn)
    assert peak <= budget
    assert abs(chosen.predicted_peak_bytes - peak) <= 0.02 * peak


def test_a_compiler_failure_is_not_called_a_graph_break() -> None:
    from torch._dynamo import register_backend

    @register_backend(name="remat_test_failing_backend")  # type: ignore[misc]
    def failing(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        raise RuntimeError("the backend gave up")

    model = torch.nn.Sequential(*[_Gelu() for _ in range(2)])
    spec = CompileSpec(backend="remat_test_failing_backend")
    with pytest.raises(UnsupportedCheckpointError, match="not a graph break") as caught:
        plan(model, (torch.randn(4, 32),), budget="80%", compile=spec, repeats=1, options=[KEEP, CHECKPOINT])
    assert "the backend gave up" in str(caught.value)
    assert all(compiled_call(m) is None for m in model)
