"""Which tensors a forward keeps for backward, and what becomes of each.

:func:`saved_tensors` runs a function (or module) once under three observers:

* a :class:`~remat.memory.MemoryTracker` with source capture, so every
  storage made inside has its producing op, module path and user line;
* an outermost ``saved_tensors_hooks`` pair that sees what autograd saves
  outside any checkpointed region (fate ``kept``);
* the engine's saved-tensor observer, which sees inside remat regions and
  ``remat.offload`` (fates ``dropped``, ``policy_saved``,
  ``policy_offloaded``, ``offloaded``); inner hooks take precedence over
  ours, which is why the observer exists.

A tensor saved several times, or through several views of one storage, is
listed once per fate, with ``times_saved``; a storage some other way holds
(a policy cache, a region's inputs, an offload copy) is never ``dropped``. Fates are defined in
``docs/design/memory.md`` ("Saved-tensor fates").

Example:
    >>> import torch
    >>> from remat.memory import saved_tensors
    >>> x = torch.randn(64, 64, requires_grad=True)
    >>> report = saved_tensors(lambda t: torch.sigmoid(t @ t), x)
    >>> sorted({(s.op, s.fate) for s in report.tensors})
    [('(input)', 'kept'), ('aten.sigmoid.default', 'kept')]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from remat._scope import SavedTensorEvent, observe_saved_tensors
from remat.errors import CheckpointTypeError
from remat.memory._report import OUTSIDE_MODULES
from remat.memory._tracker import MemoryTracker, StorageRecord

__all__ = ["FATES", "Fate", "SavedTensor", "SavedTensorReport", "saved_tensors"]

Fate = Literal[
    "kept", "dropped", "policy_saved", "policy_offloaded", "offloaded", "policy_compressed", "compressed"
]
FATES: tuple[Fate, ...] = (
    "kept", "policy_saved", "policy_compressed", "compressed", "policy_offloaded", "offloaded", "dropped"
)
"""Every fate, in the order reports list them."""

_EVENT_FATES: dict[SavedTensorEvent, Fate] = {
    "region_saved": "dropped",
    "policy_saved": "policy_saved",
    "policy_offloaded": "policy_offloaded",
    "offloaded": "offloaded",
    "policy_compressed": "policy_compressed",
    "compressed": "compressed",
}


@dataclass(frozen=True)
class SavedTensor:
    """One storage that the forward saved for backward, with one fate.

    Attributes:
        shape: shape of the (first) saved tensor.
        dtype: its dtype, e.g. ``"torch.float32"``.
        storage_bytes: bytes of its storage.
        op: the aten op that made it, ``"(parameter)"`` for a parameter or
            buffer of the module, ``"(input)"`` for anything made before.
        module: path of the module that made it (``""`` is the module itself),
            or ``"(outside modules)"``.
        source: ``file:line`` of the user's code that made it, when known.
        fate: what happens to it until backward (see :data:`FATES`).
        times_saved: how many times autograd saved this storage with this fate.
    """

    shape: tuple[int, ...]
    dtype: str
    storage_bytes: int
    op: str
    module: str
    source: str | None
    fate: Fate
    times_saved: int

    @property
    def is_parameter(self) -> bool:
        """Parameters and buffers are kept anyway: saving them costs nothing."""
        return self.op == "(parameter)"


@dataclass(frozen=True)
class SavedTensorReport:
    """Every tensor a forward saved for backward, in order of first save.

    Example:
        >>> import torch
        >>> from remat.memory import saved_tensors
        >>> report = saved_tensors(torch.sin, torch.randn(8, requires_grad=True))
        >>> report.bytes_by_fate()["kept"]      # the input, saved by sin
        32
    """

    tensors: tuple[SavedTensor, ...]

    def bytes_by_fate(self, *, include_parameters: bool = False) -> dict[Fate, int]:
        """Storage bytes per fate (parameters excluded unless asked)."""
        totals: dict[Fate, int] = dict.fromkeys(FATES, 0)
        for saved in self.tensors:
            if include_parameters or not saved.is_parameter:
                totals[saved.fate] += saved.storage_bytes
        return totals

    def device_bytes_by_module(self, depth: int | None = None) -> dict[str, int]:
        """Bytes kept on the device for backward (``kept`` and ``policy_saved``,
        parameters excluded) per module path, cut to ``depth`` components."""
        totals: dict[str, int] = {}
        for saved in self.tensors:
            if saved.is_parameter or saved.fate not in ("kept", "policy_saved"):
                continue
            path = saved.module
            if depth is not None and path != OUTSIDE_MODULES:
                path = ".".join(path.split(".")[:depth])
            totals[path] = totals.get(path, 0) + saved.storage_bytes
        return totals


def saved_tensors(fn_or_module: Callable[..., Any], *args: Any, **kwargs: Any) -> SavedTensorReport:
    """Run ``fn_or_module(*args, **kwargs)`` once and list what it saves for backward.

    Like JAX's ``print_saved_residuals``: each entry has shape, dtype, bytes,
    producing op, module path, user source line and fate. Pass an
    ``nn.Module`` to get module paths (its parameters show as
    ``"(parameter)"``). The forward runs with grad enabled; its output is
    dropped, so nothing stays alive afterwards.

    Example:
        >>> import torch, remat
        >>> from remat.memory import saved_tensors
        >>> x = torch.randn(32, 32, requires_grad=True)
        >>> report = saved_tensors(lambda t: remat.checkpoint(lambda u: u.sin().cos(), t), x)
        >>> [(s.op, s.fate) for s in report.tensors]
        [('(input)', 'kept'), ('aten.sin.default', 'dropped')]
    """
    if not callable(fn_or_module):
        raise CheckpointTypeError(
            "remat.memory.saved_tensors: the first argument must be a function or an "
            f"nn.Module to run, got {type(fn_or_module).__name__}. Pass it first, then its "
            "inputs: saved_tensors(model, x)."
        )
    model = fn_or_module if isinstance(fn_or_module, nn.Module) else None
    collector = _Collector(MemoryTracker(model, capture_source=True))
    with (
        collector.tracker,
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(collector.pack, _unpack),
        observe_saved_tensors(collector.observe),
    ):
        output = fn_or_module(*args, **kwargs)
    del output  # frees the graph and what it saved
    return SavedTensorReport(collector.entries())


class _Collector:
    """Saved tensors by (storage, fate), in order of first save."""

    def __init__(self, tracker: MemoryTracker) -> None:
        self.tracker = tracker
        # key -> [first tensor's metadata..., count]; the key is the tracker's
        # record (unique per storage for its whole life) or, for storages made
        # before the block, the storage itself kept alive here.
        self._seen: dict[tuple[object, Fate], list[Any]] = {}
        self._keys_by_fate: dict[Fate, set[object]] = {fate: set() for fate in FATES}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._add(tensor, "kept")
        # Detached (same storage and version counter): a saved output that
        # held itself would tie its autograd node into a cycle gc cannot free.
        return tensor.detach()

    def observe(self, event: SavedTensorEvent, tensor: torch.Tensor) -> None:
        self._add(tensor, _EVENT_FATES[event])

    def _add(self, tensor: torch.Tensor, fate: Fate) -> None:
        record = self.tracker._record_of(tensor)
        key: object = record if record is not None else tensor.untyped_storage()
        entry = self._seen.get((key, fate))
        if entry is not None:
            entry[-1] += 1
            return
        self._keys_by_fate[fate].add(key)
        self._seen[(key, fate)] = [_describe(tensor, record), 1]

    def entries(self) -> tuple[SavedTensor, ...]:
        # "dropped" means backward gets the storage back by recomputing it. If
        # anything else holds the storage (a policy's cache, the region's own
        # inputs, an offload copy, a save outside the region), it is not
        # recomputed: that other fate is the true one.
        overridden: set[object] = set()
        for fate in FATES:
            if fate != "dropped":
                overridden |= self._keys_by_fate[fate]
        result = []
        for (key, fate), (fields, count) in self._seen.items():
            if fate == "dropped" and key in overridden:
                continue
            result.append(SavedTensor(**fields, fate=fate, times_saved=count))
        return tuple(result)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _describe(tensor: torch.Tensor, record: StorageRecord | None) -> dict[str, Any]:
    if record is None:
        op, module, source = "(input)", OUTSIDE_MODULES, None
    elif record.op is None:
        op, module, source = "(parameter)", record.module, None
    else:
        op, module, source = str(record.op), record.module, record.source
    return {
        "shape": tuple(tensor.shape),
        "dtype": str(tensor.dtype),
        "storage_bytes": tensor.untyped_storage().nbytes(),
        "op": op,
        "module": module,
        "source": source,
    }
