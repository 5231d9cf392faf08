"""Automatic planning: the fastest checkpoint plan that fits a memory budget.

``plan(model, example_inputs, budget=...)`` profiles the model's repeated
blocks under each option (keep, checkpoint, checkpoint with a selective
policy, offload), solves for the fastest choice whose predicted peak fits,
and returns a :class:`Plan`; ``plan.apply(model)`` puts it in place and
``plan.report()`` describes it. Design: ``docs/design/planner.md``.

Layers, top to bottom (an import-linter contract in ``pyproject.toml``):
``_command`` (``remat plan``), ``_planner`` (profile once, solve, build the
plan), ``result`` (:class:`Plan` with ``apply``/``report``/``pareto``),
``profile`` (measure the options), ``apply`` and ``render`` (consume a plan),
``head`` (the planned output layer and loss), ``phases`` (one step's phases
and their bytes), ``solvers`` (torch-free, on plain data), ``model`` (the data).

Example:
    >>> import torch
    >>> from remat.planner import plan
    >>> model = torch.nn.Sequential(*[
    ...     torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 32))
    ...     for _ in range(6)])
    >>> p = plan(model, torch.randn(512, 32), budget="70%", repeats=1)
    >>> handle = p.apply(model)
    >>> model(torch.randn(512, 32)).sum().backward()
    >>> handle.remove()
"""

from remat.planner._planner import Planner, plan
from remat.planner.apply import apply_plan
from remat.planner.head import Head
from remat.planner.model import (
    CHECKPOINT,
    CHECKPOINT_OFFLOAD,
    DEFAULT_OPTIONS,
    KEEP,
    OFFLOAD,
    SAVE_MATMULS,
    ChainProblem,
    Decision,
    HeadCost,
    Option,
    OptionCost,
    ParetoPoint,
    Profile,
    RegionCost,
    SharedInput,
    Solution,
    parse_budget,
)
from remat.planner.profile import profile_model
from remat.planner.render import render_pareto_plot, render_plan
from remat.planner.result import Plan
from remat.planner.solvers import InfeasibleBudget

__all__ = [
    "CHECKPOINT",
    "CHECKPOINT_OFFLOAD",
    "ChainProblem",
    "DEFAULT_OPTIONS",
    "Decision",
    "Head",
    "HeadCost",
    "InfeasibleBudget",
    "KEEP",
    "OFFLOAD",
    "Option",
    "OptionCost",
    "ParetoPoint",
    "Plan",
    "Planner",
    "Profile",
    "RegionCost",
    "SAVE_MATMULS",
    "SharedInput",
    "Solution",
    "apply_plan",
    "parse_budget",
    "plan",
    "profile_model",
    "render_pareto_plot",
    "render_plan",
]
