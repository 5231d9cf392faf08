"""What the host transfer needs from a device to copy asynchronously.

Layer: storage (imports only ``torch``; :mod:`remat.storage.host` uses it).

The offload protocol (``docs/design/offload.md``) is written against this
small interface, so that it runs, unchanged, on CUDA and on a simulated
device that completes copies late and out of order
(:mod:`remat.storage.simulated`, the CPU tests). A backend gives:

* **streams**: the compute stream of the device and one side stream per
  direction (``"d2h"``, ``"h2d"``). A stream has ``wait_stream(other)``
  (later work waits for everything queued on ``other`` so far) and
  ``wait_event(event)``;
* **copies**: :meth:`DeviceCopies.copy` queues ``dst.copy_(src)`` on a stream
  and returns an event recorded after it; an event has ``query()`` (done?)
  and ``synchronize()`` (wait on the host);
* **memory**: :meth:`DeviceCopies.keep_until_done` (the caching allocator's
  ``record_stream``: the tensor's memory is not handed out again before the
  work queued on the stream completes), :meth:`DeviceCopies.empty` (a device
  buffer that work on a side stream fills), :meth:`DeviceCopies.allocate_pinned`
  (page-locked host bytes) and a :class:`PinnedPool` of them that reuses a
  buffer only once its last copy's event has completed.

:class:`CudaCopies` is the CUDA backend: each method is one ``torch.cuda``
call.

Example:
    >>> import torch
    >>> from remat.storage.copies import copies_for
    >>> copies_for(torch.device("cpu")) is None  # CPU tensors copy synchronously
    True
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Protocol

import torch

__all__ = ["PINNED_POOL", "CudaCopies", "DeviceCopies", "PinnedPool", "copies_for", "simulate_copies"]


_MiB = 1 << 20


def _allocate_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class PinnedPool:
    """Pinned host buffers, reused across tensors and steps.

    Pinning memory is slow (a driver call that maps pages), so buffers are
    kept: a released buffer waits in a free list of its size class until its
    last copy has finished (an event), then serves the next request of that
    class. Size classes are powers of two up to 1 MiB, then whole MiB: the
    same activation shapes recur every layer and every step.

    Example:
        >>> pool = PinnedPool(lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
        >>> pool.acquire(3000).numel()
        4096
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        self._allocate = allocate if allocate is not None else _allocate_pinned
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        """Bytes of pinned memory this pool ever allocated and still holds (in use or free)."""

    @staticmethod
    def size_class(nbytes: int) -> int:
        if nbytes <= _MiB:
            return 1 << max(nbytes - 1, 0).bit_length()
        return -(-nbytes // _MiB) * _MiB

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A pinned ``uint8`` buffer of at least ``nbytes`` bytes, free to overwrite."""
        size = self.size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                for position, (buffer, last_use) in enumerate(free):
                    if last_use is None or last_use.query():
                        del free[position]
                        return buffer
            self.allocated_bytes += size
        return self._allocate(size)

    def release(self, buffer: torch.Tensor, last_use: Any) -> None:
        """Return ``buffer``; it is reused only once the event ``last_use`` has completed."""
        with self._lock:
            self._free.setdefault(buffer.numel(), []).append((buffer, last_use))

    def clear(self) -> None:
        """Give the free buffers back to the system (in-use ones come back to the pool later)."""
        with self._lock:
            for buffers in self._free.values():
                for buffer, last_use in buffers:
                    if last_use is not None:
                        last_use.synchronize()
                    self.allocated_bytes -= buffer.numel()
            self._free.clear()


PINNED_POOL = PinnedPool()
"""One pool per process, like the allocators it sits on (pinned memory is a process resource)."""


class DeviceCopies(Protocol):
    """The asynchronous-copy backend of one device (see the module docstring)."""

    pool: PinnedPool
    """Where host buffers of copies from this device come from."""

    def compute_stream(self) -> Any:
        """The stream the caller's compute runs on now."""

    def side_stream(self, direction: str) -> Any:
        """The process's side stream for ``"d2h"`` or ``"h2d"`` copies on this device."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> Any:
        """Queue ``dst.copy_(src)`` on ``stream``; return an event recorded after it."""

    def keep_until_done(self, tensor: torch.Tensor, stream: Any) -> None:
        """Do not hand ``tensor``'s memory out again before ``stream``'s queued work is done."""

    def empty(self, length: int, dtype: torch.dtype, stream: Any) -> torch.Tensor:
        """A 1-D device buffer, to be filled by work queued on ``stream``."""

    def allocate_pinned(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of page-locked host memory as a ``uint8`` tensor."""


class CudaCopies:
    """The CUDA backend: streams, events, ``record_stream`` and pinned memory of ``torch.cuda``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = PINNED_POOL
        self._streams: dict[str, Any] = {}
        self._lock = threading.Lock()

    def compute_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def side_stream(self, direction: str) -> Any:
        # Shared by every transfer, so copies in one direction run in the order
        # they were issued, and no stream is created per offload block.
        stream = self._streams.get(direction)
        if stream is None:
            with self._lock:
                stream = self._streams.get(direction)
                if stream is None:
                    stream = self._streams[direction] = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        return stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> Any:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        return done

    def keep_until_done(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def empty(self, length: int, dtype: torch.dtype, stream: Any) -> torch.Tensor:
        with torch.cuda.stream(stream):  # the caching allocator ties the block to the stream
            return torch.empty(length, dtype=dtype, device=self.device)

    def allocate_pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


_CUDA: dict[int | None, CudaCopies] = {}
_CUDA_LOCK = threading.Lock()

# A simulated backend stands in for the device of CPU tensors (tests only).
_SIMULATED: ContextVar[DeviceCopies | None] = ContextVar("remat_simulated_copies", default=None)


def copies_for(device: torch.device) -> DeviceCopies | None:
    """The asynchronous-copy backend for ``device``, or None: copy synchronously.

    CUDA devices have one (:class:`CudaCopies`, one per device index); CPU
    tensors have the simulated one while :func:`simulate_copies` is active;
    other devices have none.
    """
    if device.type == "cuda":
        found = _CUDA.get(device.index)
        if found is None:
            with _CUDA_LOCK:
                found = _CUDA.setdefault(device.index, CudaCopies(device))
        return found
    if device.type == "cpu":
        return _SIMULATED.get()
    return None


class simulate_copies:  # lower case: used like torch.no_grad
    """Inside, CPU tensors are offloaded through ``copies`` as if they lived on a device.

    For tests of the offload protocol without a GPU (``tests/offload/test_offload_protocol.py``).

    Example:
        >>> import torch, remat
        >>> from remat.storage.simulated import SimulatedCopies
        >>> x = torch.randn(64, 64, requires_grad=True)
        >>> with simulate_copies(SimulatedCopies(seed=0)), remat.offload(min_bytes=0):
        ...     y = (x @ x).tanh()
        >>> y.sum().backward()
    """

    def __init__(self, copies: DeviceCopies) -> None:
        self.copies = copies
        self._token: Any = None

    def __enter__(self) -> DeviceCopies:
        self._token = _SIMULATED.set(self.copies)
        return self.copies

    def __exit__(self, *exc: object) -> None:
        _SIMULATED.reset(self._token)
