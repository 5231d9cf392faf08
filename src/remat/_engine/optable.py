"""Operator facts and policy decisions, worked out once per operator and shared.

Layer: engine (imports ``_compat``, ``policies`` and ``names`` only).

A selective region's two dispatch modes look at every operator the region
runs, in the forward and again in the recomputation. What they need to know
about an operator never changes (ignored by policies, an in-place view op,
writes its arguments, a view), and neither does the decision of a policy that
decides by the operator alone (``save_matmuls``, op lists). An
:class:`OpTable` keeps both per operator for one policy, and every region of
that policy shares it: a region of a few ops asks the policy nothing after
the first region (docs/design/performance.md, "Per-op cost of selective
checkpointing").

Operators are found by ``id()``: an ``OpOverload`` hashes through a Python
method, paid on every dict lookup keyed by it. The table holds each operator
it has seen, so an id stays that operator's while its entry exists, and each
lookup checks the entry's operator by identity.

Example:
    >>> import torch
    >>> from remat.policies import save_matmuls
    >>> table = OpTable(save_matmuls)
    >>> info = table.info(torch.ops.aten.mm.default)
    >>> info.ignored, info.mutates, info.is_view
    (False, False, False)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from remat._compat.dispatch import writes_arguments
from remat.names import NAMED_OP
from remat.policies import (
    CheckpointPolicy,
    Decision,
    Policy,
    SelectiveCheckpointContext,
    ask_policy,
)

__all__ = ["SAC_IGNORED_OPS", "OpInfo", "OpTable"]

SAC_IGNORED_OPS: frozenset[Any] = frozenset(
    {
        # Checkpointing itself adds detaches; metadata queries differ between runs.
        torch.ops.aten.detach.default,
        torch.ops.prim.device.default,
        torch.ops.aten.size.default,
        torch.ops.aten.sym_size.default,
        torch.ops.aten.stride.default,
        torch.ops.aten.sym_stride.default,
        torch.ops.aten.numel.default,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.dim.default,
        torch.ops.aten.storage_offset.default,
        torch.ops.aten.sym_storage_offset.default,
        torch.ops.aten.is_contiguous.default,
        torch.ops.aten.is_contiguous.memory_format,
        torch.ops.aten.is_strides_like_format.default,
        torch.ops.aten.is_non_overlapping_and_dense.default,
    }
)
"""Ops that policies never see and that are never cached."""


class OpInfo:
    """What a selective region needs to know about one operator.

    ``decision`` is the policy's answer when the policy decides by the
    operator alone (filled in the first time it is asked), else None.
    Instances are also the keys of a region's cache entries (hashed by
    identity, in C).
    """

    __slots__ = ("decision", "ignored", "inplace_view", "is_view", "keeps", "mutates", "op", "passes")

    def __init__(self, op: Any) -> None:
        tags = getattr(op, "tags", ())
        self.op = op
        self.ignored = op in SAC_IGNORED_OPS
        self.inplace_view = torch.Tag.inplace_view in tags
        self.mutates = bool(writes_arguments(op)) if not self.ignored else False
        self.is_view = bool(getattr(op, "is_view", False))
        self.decision: Decision | None = None
        self.passes = self.ignored
        """Both modes let the op run as it is, with nothing to note or look up:
        an ignored op, or one the policy reruns by the op alone and that writes
        nothing (see :meth:`OpTable.decide`). Asked first, on every op."""
        self.keeps = False
        """The policy keeps the op's output on its device as it is, by the op alone, and
        the op writes nothing and is no view: the modes' short way for it
        (``RecordOps``, ``ReplayOps``). Asked second."""


class OpTable:
    """:class:`OpInfo` per operator, for the regions of one policy (see the module docstring)."""

    __slots__ = ("_lock", "by_op", "infos", "passing", "policy", "records_saved_only", "tracks_names")

    def __init__(self, policy: Callable[..., Any]) -> None:
        self.policy = policy
        self.by_op = isinstance(policy, Policy) and policy.decides_by_op_only()
        """The policy decides by the operator alone: its answers are kept."""
        self.infos: dict[int, OpInfo] = {}  # by id() of the operator (held by its OpInfo)
        self.passing: set[int] = set()  # id() of the operators whose OpInfo passes (asked first)
        self._lock = threading.Lock()
        # Where a tensor was made is tracked so that a name's decision can move
        # to the op that made it; a policy with no opinion on names needs none.
        self.tracks_names = not self.by_op or (
            ask_policy(policy, SelectiveCheckpointContext(is_recompute=False), NAMED_OP, (), {})
            is not CheckpointPolicy.PREFER_RECOMPUTE
        )
        self.records_saved_only = self.by_op and not self.tracks_names
        """Only saved outputs get cache entries (see :meth:`unrecorded`)."""

    def info(self, op: Any) -> OpInfo:
        """The facts of ``op`` (worked out the first time it is asked for)."""
        info = self.infos.get(id(op))
        if info is not None and info.op is op:
            return info
        with self._lock:  # one OpInfo per operator: regions key their entries by it
            info = self.infos.get(id(op))
            if info is None or info.op is not op:
                info = self.infos[id(op)] = OpInfo(op)
                if info.passes:
                    self.passing.add(id(op))
            return info

    def unrecorded(self, info: OpInfo) -> bool:
        """Whether calls of ``info.op`` get no cache entry: the policy decides by
        the op alone and reruns it (or the op writes its arguments, which always
        reruns). The recorder skips them and the replay runs them as they come,
        so both ask this one question: an op known to rerun costs no entry (and
        no list that lives until backward).
        """
        decision = info.decision
        return self.records_saved_only and decision is not None and (info.mutates or not decision.saves)

    def decide(
        self, info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> Decision:
        """The policy's decision for a call of ``info.op`` in a forward."""
        decision = info.decision
        if decision is not None:
            return decision
        if self.by_op:
            decision = ask_policy(self.policy, SelectiveCheckpointContext(is_recompute=False), info.op, args, kwargs)
            info.decision = decision
            info.passes = self.unrecorded(info) and not info.mutates
            if info.passes:
                self.passing.add(id(info.op))
            info.keeps = (
                self.records_saved_only
                and decision.saves
                and not decision.offloads
                and decision.compression is None
                and not (info.mutates or info.is_view or info.op is NAMED_OP)
            )
            return decision
        ctx = SelectiveCheckpointContext(is_recompute=False, op_output=out)
        return ask_policy(self.policy, ctx, info.op, args, kwargs)
