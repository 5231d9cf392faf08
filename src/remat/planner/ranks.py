"""One plan for every rank: profiles agreed across ranks, the plan decided once.

Layer: beside ``apply``, ``render``, ``head`` and ``phases`` in the planner
(it reads the profile data of ``model``); ``torch.distributed`` is used only
when :func:`plans_together` says so, so single-process planning never
touches it.

The ranks plan together when the model is sharded (:func:`plans_together`):
its forward runs collectives (FSDP2's gathers, tensor parallel's reductions),
and so does its recomputation, so every rank must run the same steps in the
same order and make the same decisions. Then every rank profiles, and:

* :func:`agree_profile` replaces each rank's profile by one that every rank
  shares: every measured figure (the fields whose names end in ``_bytes`` or
  ``_s``, the unit convention of the planner's data) becomes its largest
  value over the ranks, so a plan that fits the agreed profile fits every
  rank and is timed as the slowest rank runs. Anything else (names, options,
  region indices) must be equal on every rank, or the ranks profiled
  different models: an error, not a silent pick.
* :func:`share_plan` makes rank 0's plan everyone's, so the ranks cannot
  diverge even where a solver might.
* :func:`largest_over_ranks` is the rank-wide maximum of one number (a
  verified peak), so the verification loop decides alike on every rank.

An unsharded model (DDP, or one rank planning for all) is planned by the
calling process alone, with no collective: a rank that plans while the
others wait (for a broadcast of its plan, say) must not block them.

See ``docs/design/planner.md`` ("Planning sharded training").

Example:
    >>> import torch
    >>> from remat.planner.ranks import agree_profile, plans_together
    >>> plans_together(torch.nn.Linear(4, 4))   # one process, or an unsharded model
    False
    >>> agree_profile("a profile", together=False)   # nothing to agree
    'a profile'
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from torch import nn

from remat._compat.dispatch import wrapped_tensors
from remat._compat.distributed import distributed_rank
from remat.errors import CheckpointUsageError

__all__ = ["agree_profile", "largest_over_ranks", "plans_together", "share_plan", "widest", "world_size"]

T = TypeVar("T")

_MEASURED = ("_bytes", "_s")


def world_size() -> int:
    """Ranks of the default process group (1 without one)."""
    ranks = distributed_rank()
    return 1 if ranks is None else ranks[1]


def plans_together(model: nn.Module) -> bool:
    """Whether every rank must plan ``model`` together: several ranks, and a
    parameter is sharded (a wrapper subclass such as ``DTensor``)."""
    return world_size() > 1 and any(wrapped_tensors(p) is not None for p in model.parameters())


def agree_profile(profile: T, *, together: bool) -> T:
    """The profile every rank plans with: each measured figure at its largest over the ranks."""
    if not together:
        return profile
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, profile)
    agreed: T = widest(gathered)
    return agreed


def share_plan(plan: T, *, together: bool) -> T:
    """Rank 0's plan, on every rank."""
    if not together:
        return plan
    import torch.distributed as dist

    box = [plan]
    dist.broadcast_object_list(box, src=0)
    shared: T = box[0]
    return shared


def largest_over_ranks(value: int, *, together: bool) -> int:
    """The largest ``value`` over the ranks (``value`` itself when not planning together)."""
    if not together:
        return value
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return max(int(v) for v in gathered)


def widest(values: list[Any], name: str = "profile") -> Any:
    """Merge one value per rank: measured fields by maximum, the rest must agree.

    Example:
        >>> from remat.planner.data import SharedInput
        >>> widest([SharedInput(512, (0, 1), ("checkpoint",)), SharedInput(768, (0, 1), ("checkpoint",))])
        SharedInput(nbytes=768, takers=(0, 1), kept_under=('checkpoint',))
    """
    first = values[0]
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        merged = {
            field.name: _merge_field(field.name, [getattr(v, field.name) for v in values])
            for field in dataclasses.fields(first)
            if field.init
        }
        return dataclasses.replace(first, **merged)
    if isinstance(first, dict):
        if any(set(v) != set(first) for v in values):
            raise _differ(name, values)
        return {key: widest([v[key] for v in values], f"{name}[{key!r}]") for key in first}
    if isinstance(first, (tuple, list)):
        if any(len(v) != len(first) for v in values):
            raise _differ(name, values)
        items = [widest([v[i] for v in values], f"{name}[{i}]") for i in range(len(first))]
        return type(first)(items)
    if any(v != first for v in values):
        raise _differ(name, values)
    return first


def _merge_field(name: str, values: list[Any]) -> Any:
    if name.endswith(_MEASURED) or name == "nbytes":
        return _largest(name, values)
    return widest(values, name)


def _largest(name: str, values: list[Any]) -> Any:
    """Maximum of a measured figure, element by element through tuples and dicts."""
    first = values[0]
    if first is None or (isinstance(first, (int, float)) and not isinstance(first, bool)):
        if first is None or any(v is None for v in values):
            if any(v is not None for v in values):
                raise _differ(name, values)
            return None
        return max(values)
    if isinstance(first, dict):
        if any(set(v) != set(first) for v in values):
            raise _differ(name, values)
        return {key: _largest(name, [v[key] for v in values]) for key in first}
    if isinstance(first, (tuple, list)):
        if any(len(v) != len(first) for v in values):
            raise _differ(name, values)
        return type(first)(_largest(name, [v[i] for v in values]) for i in range(len(first)))
    return widest(values, name)


def _differ(name: str, values: list[Any]) -> CheckpointUsageError:
    shown = ", ".join(f"rank {rank}: {value!r}"[:120] for rank, value in enumerate(values[:4]))
    return CheckpointUsageError(
        f"remat.planner: the ranks profiled different steps ({name} differs: {shown}); plan a "
        "model that every rank builds and runs alike (same modules, options and input shapes)."
    )
