"""The min-cut partitioner's settings (what a compiled graph's forward saves
for backward) and torch's per-region activation memory budgets.

remat compiles every block under torch's default partitioner settings, and
warns when the process's differ. Private names used: ``torch._functorch.config``
(its settings, its ``patch``, and the tables its defaults are declared in).
``torch.autograd.graph.region_activation_memory_budget`` is public (a
prototype, torch 2.13 and newer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "partitioner_changes",
    "partitioner_defaults",
    "partitioner_settings",
    "region_memory_budget",
    "region_memory_budgets_available",
]


_PARTITIONER_SETTINGS = (
    "activation_memory_budget",
    "activation_memory_budget_runtime_estimator",
    "activation_memory_budget_solver",
    "_sync_decision_cross_ranks",
    "aggressive_recomputation",
    "ban_recompute_long_fusible_chains",
    "ban_recompute_materialized_backward",
    "ban_recompute_not_in_allowlist",
    "ban_recompute_reductions",
    "ban_recompute_used_far_apart",
    "cse",
    "enable_activation_offloading",
    "max_dist_from_bw",
    "recompute_views",
    "treat_parameters_as_free_to_save",
)
"""The settings in ``torch._functorch.config`` that change what the min-cut
partitioner saves for backward (read from ``partitioners.py`` and
``_activation_checkpointing/``, 2.4.1-2.15.0; a name a release lacks is
skipped). Debug outputs (pareto plots, logs) are left out: they change no graph."""


def partitioner_defaults() -> dict[str, Any]:
    """torch's declared default of every partitioner setting this torch has.

    The partitioner reads process-wide settings in the private
    ``torch._functorch.config`` when it splits a compiled graph, and Dynamo
    does not recompile when they change. The defaults come from the config
    module's private tables: ``_default`` (2.4) or each ``_ConfigEntry``'s
    ``default`` (2.5 and newer; checked 2.4.1, 2.7.1, 2.11.0, 2.13.0, 2.15.0).
    """
    import torch._functorch.config as config

    table: dict[str, Any] = getattr(config, "_config")  # noqa: B009 (private, not in the stubs)
    old_defaults: dict[str, Any] | None = getattr(config, "_default", None)
    defaults = {}
    for name in _PARTITIONER_SETTINGS:
        if name not in table:
            continue
        entry = table[name]
        defaults[name] = old_defaults[name] if old_defaults is not None else entry.default
    return defaults


def partitioner_changes(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The partitioner settings whose process-wide value differs from ``settings``, by value now."""
    import torch._functorch.config as config

    changed = {}
    for name, value in settings.items():
        now = getattr(config, name)
        if now != value:
            changed[name] = now
    return changed


def partitioner_settings(settings: Mapping[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """Set the partitioner settings to ``settings`` for a while (``config.patch``, private; checked 2.4.1-2.15.0)."""
    import torch._functorch.config as config

    manager: contextlib.AbstractContextManager[Any] = config.patch(**settings)
    return manager


def region_memory_budget(budget: float) -> contextlib.AbstractContextManager[Any] | None:
    """torch's activation memory budget for the compiled region traced inside, or None.

    ``torch.autograd.graph.region_activation_memory_budget`` (public, a
    prototype; torch 2.13 and newer): the min-cut partitioner's knapsack
    under ``budget`` for the graph of the region traced under it. None where
    this torch has no such API (2.11 and older: only the process-wide
    ``torch._functorch.config.activation_memory_budget``).
    """
    api = getattr(torch.autograd.graph, "region_activation_memory_budget", None)
    if api is None:
        return None
    manager: contextlib.AbstractContextManager[Any] = api(budget)
    return manager


def region_memory_budgets_available() -> bool:
    """Whether this torch has per-region compile budgets (see :func:`region_memory_budget`)."""
    return hasattr(torch.autograd.graph, "region_activation_memory_budget")
