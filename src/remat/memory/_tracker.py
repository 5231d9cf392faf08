"""Live tensor bytes over a block of code, counted per storage.

A :class:`MemoryTracker` pushes a ``TorchDispatchMode`` that looks at the
outputs of every aten op run inside the block, forward and backward alike
(autograd runs backward ops through the dispatcher, where the mode is active).
Each output storage is counted once, when first seen, and subtracted when it
is freed:

* views share their base's storage, so they cost nothing;
* in-place and ``out=`` ops return a storage that is already counted, or one
  of their inputs' storages; neither is new memory;
* a storage that grows (``resize_``) is re-measured whenever an op returns it;
* storages that existed before the block (parameters, data) are never
  counted, even when an op inside the block returns a view of them.

Frees are seen through ``weakref`` callbacks on the storage's Python object:
since PyTorch 2.0 that object lives exactly as long as the C++ storage, so
the callback fires when the memory is released, not when Python drops its
handle. The tracker holds weak references only, so it keeps nothing alive;
leaving the block drops them, so later frees are not counted.

Example:
    >>> import torch
    >>> from remat.memory import track
    >>> with track() as t:
    ...     x = torch.ones(256, 256)          # float32: 262144 bytes
    ...     y = x.t()                          # a view: no new storage
    ...     t.mark("after_views")
    >>> t.marks["after_views"], t.peak_bytes
    (262144, 262144)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import ExitStack
from functools import partial
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat.errors import CheckpointUsageError

__all__ = ["MemoryTracker", "track"]

_StorageRef = weakref.ReferenceType[torch.UntypedStorage]


class MemoryTracker:
    """Counts bytes of tensor storages created while it is active.

    Use it through :func:`track` (or as a context manager itself); a tracker
    tracks one block only. Its fields stay readable after the block ends.

    Attributes:
        marks: live bytes recorded by :meth:`mark`, by name.

    Example:
        >>> import torch
        >>> from remat.memory import MemoryTracker
        >>> with MemoryTracker() as t:
        ...     a = torch.zeros(1024)               # 4096 bytes
        ...     del a
        >>> t.peak_bytes, t.live_bytes
        (4096, 0)
    """

    def __init__(self) -> None:
        self.marks: dict[str, int] = {}
        self._live_bytes = 0
        self._peak_bytes = 0
        # id(storage) -> (weak reference whose callback subtracts it, counted bytes)
        self._storages: dict[int, tuple[_StorageRef, int]] = {}
        # Frees can arrive on autograd's worker threads, and inside our own
        # bookkeeping (a dealloc in the middle of a dict update): re-entrant.
        self._lock = threading.RLock()
        self._scope: ExitStack | None = None
        self._used = False

    @property
    def live_bytes(self) -> int:
        """Bytes of storages first seen inside the block and not yet freed.

        Frozen at its last value once the block ends.
        """
        return self._live_bytes

    @property
    def peak_bytes(self) -> int:
        """The largest :attr:`live_bytes` seen inside the block."""
        return self._peak_bytes

    @property
    def active(self) -> bool:
        """Whether the tracker is counting right now."""
        return self._scope is not None

    def mark(self, name: str) -> None:
        """Record the current :attr:`live_bytes` under ``marks[name]``.

        Marking a name again overwrites the earlier value.

        Example:
            >>> from remat.memory import track
            >>> with track() as t:
            ...     t.mark("start")
            >>> t.marks
            {'start': 0}
        """
        self.marks[name] = self._live_bytes

    def __enter__(self) -> MemoryTracker:
        if self._used:
            raise CheckpointUsageError(
                "remat.memory: a MemoryTracker tracks one block only and this one "
                "was already used; create a new one with remat.memory.track()."
            )
        self._used = True
        scope = ExitStack()
        scope.enter_context(_TrackingMode(self))
        self._scope = scope
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.close()
        with self._lock:
            # Dropping the weak references cancels their callbacks: frees after
            # the block are not subtracted, and nothing points back at us.
            self._storages.clear()

    def _record(self, inputs: object, outputs: object) -> None:
        """Count the output storages of one op that are new memory."""
        input_ids: set[int] | None = None
        with self._lock:
            for storage in _storages(outputs):
                key = id(storage)
                entry = self._storages.get(key)
                if entry is not None:
                    nbytes = storage.nbytes()
                    if nbytes != entry[1]:  # resized in place
                        self._storages[key] = (entry[0], nbytes)
                        self._add(nbytes - entry[1])
                    continue
                if input_ids is None:
                    input_ids = {id(s) for s in _storages(inputs)}
                if key in input_ids:
                    continue  # aliases an input made before the block (or untracked)
                nbytes = storage.nbytes()
                ref = weakref.ref(storage, partial(self._forget, key))
                self._storages[key] = (ref, nbytes)
                self._add(nbytes)

    def _add(self, nbytes: int) -> None:
        self._live_bytes += nbytes
        if self._live_bytes > self._peak_bytes:
            self._peak_bytes = self._live_bytes

    def _forget(self, key: int, _ref: _StorageRef) -> None:
        """Weakref callback: the storage with this id was freed."""
        with self._lock:
            entry = self._storages.pop(key, None)
            if entry is not None:
                self._live_bytes -= entry[1]


def track() -> MemoryTracker:
    """Track live tensor bytes inside a ``with`` block.

    Returns a fresh :class:`MemoryTracker`; entering it starts counting,
    leaving it stops. Only storages created inside the block count.

    Example:
        >>> import torch
        >>> from remat.memory import track
        >>> w = torch.randn(256, 256, requires_grad=True)
        >>> with track() as t:
        ...     loss = torch.sigmoid(w).sum()   # sigmoid saves its output
        ...     t.mark("forward_end")
        ...     loss.backward()
        >>> t.marks["forward_end"]     # sigmoid(w): 262144 bytes, loss: 4 bytes
        262148
    """
    return MemoryTracker()


# TorchDispatchMode is unannotated in torch, hence the two ignores.
class _TrackingMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Forwards every op unchanged and reports its inputs and outputs."""

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._tracker = tracker

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        self._tracker._record((args, kwargs), out)
        return out


def _storages(tree: object) -> Iterator[torch.UntypedStorage]:
    """The storages of the tensors in a nest of tuples, lists and dicts."""
    if isinstance(tree, torch.Tensor):
        try:
            yield tree.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return  # sparse, nested or wrapper subclasses own no plain storage
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _storages(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _storages(item)
