"""Selective checkpointing: keep some op outputs from the forward, rerun the rest.

Two small dispatch modes share one :class:`OpCache`:

* :class:`RecordOps` runs in the forward. For each operator it asks the
  policy; a "save" decision stores the output (detached, sharing the version
  counter so later in-place writes are detected) under ``(op, n-th call)``.
* :class:`ReplayOps` runs in the recomputation. The n-th call of an op whose
  output was saved returns the stored value instead of running; the entry is
  then dropped, so each saved output is freed as soon as backward used it.

In-place *metadata* ops (``squeeze_``, ``t_``... tagged ``inplace_view``) bump
the version counter without touching data; ``torch.matmul`` on a vector does
exactly that to its own ``mm`` output. The recorder re-reads the version after
such an op instead of calling it a user mutation (torch 2.13 raises a false
"mutated" error there).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat._compat import detach_sharing_version, tree_flatten, tree_unflatten
from remat.errors import CheckpointError, CheckpointTypeError
from remat.policies import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checked_ops,
    normalize_decision,
)

__all__ = ["SAC_IGNORED_OPS", "OpCache", "RecordOps", "ReplayOps", "create_selective_checkpoint_contexts"]

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


def _to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.device]:
    """A host copy of a saved output (pinned when it comes from an accelerator)."""
    pin = tensor.device.type not in ("cpu", "meta")
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    host.copy_(tensor, non_blocking=pin)
    return host, tensor.device


class _Saved:
    """One cached op output: the detached value and the versions it had.

    An offloaded output is a host copy taken in the forward; it is copied back
    to its device when the recomputation asks for it. A copy cannot see later
    in-place writes to the original, and needs not: it holds the forward value.
    """

    __slots__ = ("devices", "tensors", "value", "versions")

    def __init__(self, out: Any, offload: bool) -> None:
        leaves, spec = tree_flatten(out)
        self.devices: list[torch.device] | None = None
        if offload:
            moved = [_to_host(x) if isinstance(x, torch.Tensor) else (x, None) for x in leaves]
            leaves = [value for value, _ in moved]
            self.devices = [device for _, device in moved if device is not None]
            self.tensors: list[torch.Tensor] = []
        else:
            leaves = [detach_sharing_version(x) if isinstance(x, torch.Tensor) else x for x in leaves]
            self.tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        self.value = tree_unflatten(leaves, spec)
        self.versions = [x._version for x in self.tensors]

    def restore(self) -> Any:
        """The saved value, on its original device."""
        if self.devices is None:
            return self.value
        leaves, spec = tree_flatten(self.value)
        devices = iter(self.devices)
        leaves = [
            x.to(next(devices), non_blocking=True) if isinstance(x, torch.Tensor) else x
            for x in leaves
        ]
        return tree_unflatten(leaves, spec)

    def refresh_if_aliased(self, tensor: torch.Tensor) -> None:
        """Accept the version bump of an in-place *metadata* op on ``tensor``.

        The bump happens in the ADInplaceOrView kernel, above this dispatch
        mode, right after the op returns: hence ``+ 1``.
        """
        storage = tensor.untyped_storage().data_ptr()
        for position, cached in enumerate(self.tensors):
            if cached.untyped_storage().data_ptr() == storage:
                self.versions[position] = cached._version + 1

    def mutated(self) -> bool:
        return any(x._version != v for x, v in zip(self.tensors, self.versions, strict=True))


_RECOMPUTE = "recompute"
_CONSUMED = "consumed"


class OpCache:
    """Outputs saved by :class:`RecordOps`, replayed by :class:`ReplayOps`."""

    def __init__(self, allow_mutation: bool) -> None:
        self.allow_mutation = allow_mutation
        self.entries: dict[Any, list[_Saved | str]] = {}
        self.recent: deque[_Saved] = deque(maxlen=4)


class RecordOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Forward half of selective checkpointing: ask the policy, save outputs."""

    def __init__(self, policy: Callable[..., Any], cache: OpCache) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.policy = policy
        self.cache = cache

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in SAC_IGNORED_OPS:
            return out
        cache = self.cache
        if torch.Tag.inplace_view in func.tags and args and isinstance(args[0], torch.Tensor):
            for saved in cache.recent:
                saved.refresh_if_aliased(args[0])
        ctx = SelectiveCheckpointContext(is_recompute=False, op_output=out)
        decision = normalize_decision(self.policy(ctx, func, *args, **kwargs), self.policy, func)
        entry: _Saved | str = _RECOMPUTE
        if decision.saves:
            entry = _Saved(out, offload=decision.offloads)
            cache.recent.append(entry)
        cache.entries.setdefault(func, []).append(entry)
        return out


class ReplayOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Recompute half of selective checkpointing: serve saved outputs once."""

    def __init__(self, cache: OpCache) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cache = cache
        self.calls: dict[Any, int] = {}

    def __enter__(self) -> ReplayOps:
        self.calls = {}  # each recomputation counts op calls from zero
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        index = self.calls.get(func, 0)
        self.calls[func] = index + 1
        recorded = self.cache.entries.get(func)
        if recorded is None or index >= len(recorded):
            raise CheckpointError(
                f"selective checkpoint: the recomputation ran {func} (call #{index}) that the "
                "forward did not run. The checkpointed function must run the same ops when "
                "recomputed (no randomness or global state that changes the control flow)."
            )
        entry = recorded[index]
        if entry is _RECOMPUTE:
            return func(*args, **kwargs)
        if entry is _CONSUMED:
            raise CheckpointError(
                f"selective checkpoint: the saved output of {func} was already used by an "
                "earlier backward. A region under a selective policy supports one backward "
                "through each saved op; for several backward calls use retain_graph with "
                "plain checkpointing, or GraphExecGroup for disjoint parts of the graph."
            )
        assert isinstance(entry, _Saved), "remat bug: unknown selective cache entry"
        if not self.cache.allow_mutation and entry.mutated():
            raise CheckpointError(
                f"selective checkpoint: the output of {func} saved in the forward was modified "
                "in place afterwards, so backward would use the wrong value. Avoid the "
                "in-place op, save a different op, or pass allow_cache_entry_mutation=True "
                "if the mutation is intended."
            )
        recorded[index] = _CONSUMED
        return entry.restore()


def create_selective_checkpoint_contexts(
    policy_fn_or_list: Callable[..., Any] | list[Any],
    allow_cache_entry_mutation: bool = False,
) -> tuple[RecordOps, ReplayOps]:
    """The two contexts (forward, recompute) that make a checkpoint selective.

    Args:
        policy_fn_or_list: a policy ``(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool``,
            or a list of ``OpOverload``s to save (everything else is recomputed).
        allow_cache_entry_mutation: do not raise when a saved output was
            modified in place after it was saved.

    Example:
        >>> import functools, torch, remat
        >>> ops = [torch.ops.aten.mm.default]
        >>> context_fn = functools.partial(remat.create_selective_checkpoint_contexts, ops)
        >>> x = torch.randn(4, 4, requires_grad=True)
        >>> y = remat.checkpoint(lambda t: (t @ t).sigmoid(), x, context_fn=context_fn)
    """
    if isinstance(policy_fn_or_list, list):
        saved = checked_ops(policy_fn_or_list, "create_selective_checkpoint_contexts")

        def policy(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

        chosen: Callable[..., Any] = policy
    elif callable(policy_fn_or_list):
        chosen = policy_fn_or_list
    else:
        raise CheckpointTypeError(
            "create_selective_checkpoint_contexts: policy_fn_or_list must be a policy function "
            "(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool, or a list of OpOverloads; "
            f"got {type(policy_fn_or_list).__name__}."
        )
    cache = OpCache(allow_mutation=allow_cache_entry_mutation)
    return RecordOps(chosen, cache), ReplayOps(cache)
