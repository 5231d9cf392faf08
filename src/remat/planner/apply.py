"""Put a plan (or one option) in place on a model's modules, reversibly.

A planned region keeps its name and its place in the module tree.
Checkpointed regions go through :func:`remat.composable.checkpoint_module`
with the option's policy from :mod:`remat.policies` (hooks, no wrapper);
offloaded regions run under ``remat.offload.offload()`` through an instance
``forward``, and checkpointed regions whose inputs are offloaded through an
instance ``forward`` that checkpoints inside that context. Removing any of
them restores the module exactly. The profiler installs options the same
way, so what was measured is what runs.

Example:
    >>> import torch
    >>> from remat.planner.apply import install
    >>> from remat.planner.model import CHECKPOINT
    >>> layer = torch.nn.Linear(4, 4)
    >>> remove = install(layer, CHECKPOINT)
    >>> layer(torch.randn(2, 4, requires_grad=True)).sum().backward()
    >>> remove()
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch import nn

from remat import policies
from remat.checkpoint import run_checkpoint
from remat.composable import checkpoint_module, remove_checkpoint_module
from remat.errors import CheckpointUsageError, UnsupportedCheckpointError
from remat.options import CheckpointOptions
from remat.planner.model import Option

if TYPE_CHECKING:
    from remat.planner.result import Plan

__all__ = ["AppliedPlan", "apply_plan", "install", "offload_available"]


def offload_available() -> bool:
    """Whether ``remat.offload.offload`` exists in this installation."""
    try:
        from remat.offload import offload  # noqa: F401
    except ImportError:
        return False
    return True


def _policy(name: str | None) -> Any:
    if name is None:
        return None
    policy = getattr(policies, name, None)
    if not isinstance(policy, policies.Policy):
        raise CheckpointUsageError(
            f"remat.planner: option policy {name!r} is not a built-in policy of "
            "remat.policies (e.g. 'save_matmuls', 'save_matmuls_without_batch_dims')."
        )
    return policy


def _offloaded(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` with every tensor it saves for backward sent to the host."""
    try:
        from remat.offload import offload
    except ImportError as exc:
        raise UnsupportedCheckpointError(
            "remat.planner: the plan offloads a region but remat.offload is not "
            "available in this installation; plan without the offload option."
        ) from exc

    def offloaded(*args: Any, **kwargs: Any) -> Any:
        with offload(min_bytes=0):
            return original(*args, **kwargs)

    return offloaded


def install(module: nn.Module, option: Option) -> Callable[[], None]:
    """Run ``module`` under ``option`` from now on; returns a function that undoes it.

    ``keep`` installs nothing; ``checkpoint`` is
    :func:`remat.composable.checkpoint_module` with the option's policy;
    ``offload`` runs the forward under ``remat.offload.offload()``. A module
    already routed (by an applied plan) is an error: remove that plan first.

    Example:
        >>> import torch
        >>> from remat.planner.model import SAVE_MATMULS
        >>> layer = torch.nn.Linear(4, 4)
        >>> remove = install(layer, SAVE_MATMULS)
        >>> remove()
    """
    if option.kind == "keep":
        return lambda: None
    if "forward" in vars(module):
        raise CheckpointUsageError(
            f"remat.planner: {type(module).__name__} already has its forward replaced on the "
            "instance (a plan is applied, or something else patched it); call remove() on "
            "the applied plan before applying or profiling again."
        )
    if option.kind == "checkpoint" and option.offload_inputs:
        # The offload context is entered first, so the checkpoint's inputs are
        # saved through its hooks (to the host); inside the region it stands
        # aside, and the recompute is the checkpoint's as usual.
        options = CheckpointOptions(api="remat.planner", policy=_policy(option.policy))
        return _route(module, _offloaded(functools.partial(run_checkpoint, options, module.forward)))
    if option.kind == "checkpoint":
        policy = _policy(option.policy)
        if policy is None:
            checkpoint_module(module)
        else:
            checkpoint_module(module, policy=policy)

        def uncheckpoint() -> None:
            if "forward" in vars(module):
                remove_checkpoint_module(module)

        return uncheckpoint
    if option.kind != "offload":
        raise AssertionError(f"remat bug: no routing for option {option.name}")
    return _route(module, _offloaded(module.forward))


def _route(module: nn.Module, routed: Callable[..., Any]) -> Callable[[], None]:
    """Make ``routed`` the module's instance ``forward``; returns what undoes it."""
    module.forward = routed

    def remove() -> None:
        if vars(module).get("forward") is routed:
            del module.forward

    return remove


class AppliedPlan:
    """A plan in place on a model; ``remove()`` (or leaving a ``with`` block) undoes it.

    Example:
        >>> handle = plan.apply(model)       # doctest: +SKIP
        >>> handle.remove()                  # doctest: +SKIP
    """

    def __init__(self, removers: list[Callable[[], None]], routed: dict[str, str]) -> None:
        self._removers = removers
        self.routed = routed
        """Region name -> option name, for the regions that are not kept."""

    def remove(self) -> None:
        """Restore every routed module's own forward."""
        removers, self._removers = self._removers, []
        for remove in reversed(removers):
            remove()

    def __enter__(self) -> AppliedPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _named(model: nn.Module, names: Iterator[str]) -> list[tuple[str, nn.Module]]:
    found = []
    for name in names:
        try:
            found.append((name, model.get_submodule(name)))
        except AttributeError as exc:
            raise CheckpointUsageError(
                f"remat.planner: the plan names region {name!r} but the model has no such "
                "submodule; apply a plan to the model (or a copy of the model) it was made for."
            ) from exc
    return found


def apply_plan(plan: Plan, model: nn.Module) -> AppliedPlan:
    """Checkpoint/offload the regions ``plan`` chose, in place; FQNs do not change.

    Example:
        >>> import torch
        >>> from remat.planner import plan
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> handle = apply_plan(plan(model, (torch.randn(32, 64),), budget="90%"), model)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise CheckpointUsageError(
            f"remat.planner: apply() takes the nn.Module the plan was made for, got "
            f"{type(model).__name__}."
        )
    modules = dict(_named(model, (d.region for d in plan.decisions)))
    removers: list[Callable[[], None]] = []
    routed: dict[str, str] = {}
    try:
        for decision in plan.decisions:
            if decision.option.kind != "keep":
                removers.append(install(modules[decision.region], decision.option))
                routed[decision.region] = decision.option.name
    except BaseException:
        for remove in reversed(removers):
            remove()
        raise
    return AppliedPlan(removers, routed)


