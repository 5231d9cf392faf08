"""Moving saved tensors to host memory and back: the one transfer mechanism.

Both offload paths use it: the ``remat.offload`` context (every saved tensor
above a size) and selective policies that answer ``MUST_OFFLOAD`` /
``PREFER_OFFLOAD`` (one op output). See ``docs/design/offload.md``.

A :class:`HostTransfer` belongs to one forward (one context, or one
selective-checkpoint cache) and hands out :class:`HostCopy` objects in save
order.

* **CPU tensors** are copied into a fresh host buffer and that buffer is
  handed back in backward: no memory is saved, but the whole path (pack,
  copy, version check, restore) runs, which is how it is tested without a GPU.
* **CUDA tensors** are copied into pinned host buffers on a side stream that
  first waits for the compute stream, so the forward is not blocked. The
  device tensor must stay alive until its copy has run: it waits in a
  *stash*, bounded in bytes; when full, the forward waits for the oldest copy.
  In backward the copies come back on a second side stream: unpacking copy
  ``i`` also starts the copies of the next ``prefetch`` tensors backward will
  need (save order reversed), so they overlap the backward compute. The
  compute stream waits on each copy's event before using it, and the restored
  tensor is marked as used by the compute stream so the caching allocator
  does not hand its memory out early.
* **Other devices** (MPS, XPU, ...) copy synchronously: correct, no overlap.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch

from remat._compat import version_witness
from remat.errors import CheckpointError

__all__ = ["HostCopy", "HostTransfer"]

_DEFAULT_STASH_BYTES = 1 << 30
"""At most this many device bytes wait for their host copy before the forward blocks."""


def _host_buffer(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """An empty host tensor for ``tensor``'s values: same strides when they are
    dense (a transposed or channels-last tensor stays so), contiguous otherwise
    (an expanded tensor cannot be written element by element)."""
    return torch.empty_like(tensor, device="cpu", pin_memory=pin)


class HostCopy:
    """A saved tensor's host copy, restored to its device on demand.

    ``restore()`` may be called again (``retain_graph=True``): the host copy
    stays until the graph drops this object.
    """

    __slots__ = ("__weakref__", "_prefetched", "_ready", "device", "host", "index", "transfer", "version", "witness")

    def __init__(self, transfer: HostTransfer, index: int, host: torch.Tensor, original: torch.Tensor) -> None:
        self.transfer = transfer
        self.index = index
        self.host = host
        self.device = original.device
        # Autograd does not check saved tensors for in-place changes when hooks
        # are active; a witness of the original's version counter lets us.
        self.witness = version_witness(original)
        self.version = original._version
        self._ready: Any = None  # CUDA event: the device-to-host copy has run
        self._prefetched: tuple[torch.Tensor, Any] | None = None  # (device tensor, event)

    def restore(self) -> torch.Tensor:
        """The tensor on its original device (waits for any copy in flight).

        Raises ``CheckpointError`` if the original was modified in place after
        it was saved, as autograd does for tensors it keeps itself.
        """
        if self.witness._version != self.version:
            raise CheckpointError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a {tuple(self.host.shape)} {self.host.dtype} tensor saved "
                f"for backward and offloaded to host memory is at version {self.witness._version}; "
                f"expected version {self.version}. Avoid the in-place change, or clone the "
                "tensor before changing it."
            )
        return self.transfer.restore(self)


class HostTransfer:
    """Copies for one forward: see the module docstring.

    Args:
        pin_memory: pin host buffers of accelerator tensors (default: yes when
            the tensor is on CUDA). Pinned memory is what makes the copies
            asynchronous.
        use_streams: copy CUDA tensors on side streams (default: yes).
        prefetch: how many upcoming tensors to start copying back in backward.
        backward_order: the tensors come back in reverse save order (autograd's
            backward); ``False`` for save order (a selective recomputation
            replays its cached outputs forward).
        stash_bytes: device bytes allowed to wait for their copy in forward.
    """

    def __init__(
        self,
        *,
        pin_memory: bool | None = None,
        use_streams: bool = True,
        prefetch: int = 2,
        stash_bytes: int = _DEFAULT_STASH_BYTES,
        backward_order: bool = True,
    ) -> None:
        self.pin_memory = pin_memory
        self.use_streams = use_streams
        self.prefetch = prefetch
        self.stash_bytes = stash_bytes
        self.backward_order = backward_order
        self._copies: list[weakref.ref[HostCopy]] = []
        self._stash: deque[tuple[Any, torch.Tensor]] = deque()
        self._stash_size = 0
        self._by_key: dict[tuple[Any, ...], weakref.ref[HostCopy]] = {}
        self._d2h_stream: Any = None
        self._h2d_stream: Any = None

    # forward ---------------------------------------------------------------

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        """Start copying ``tensor`` to host memory; the copy is ready by backward.

        The same tensor saved twice (an op saving its input and output that
        alias, or two ops saving one tensor) is copied once.
        """
        key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor._version)
        known = self._by_key.get(key)
        copy = known() if known is not None else None
        if copy is not None:
            return copy
        original = tensor
        tensor = tensor.detach()
        device = tensor.device
        if device.type == "cuda" and self.use_streams:
            host, ready = self._copy_to_host_async(tensor)
        else:
            host = _host_buffer(tensor, self.pin_memory if self.pin_memory is not None else device.type == "cuda")
            host.copy_(tensor)
            ready = None
        copy = HostCopy(self, len(self._copies), host, original)
        copy._ready = ready
        self._copies.append(weakref.ref(copy))
        self._by_key[key] = weakref.ref(copy)
        return copy

    def _copy_to_host_async(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        compute = torch.cuda.current_stream(tensor.device)
        if self._d2h_stream is None:
            self._d2h_stream = torch.cuda.Stream(tensor.device)  # type: ignore[no-untyped-call]
        side = self._d2h_stream
        pin = self.pin_memory if self.pin_memory is not None else True
        host = _host_buffer(tensor, pin)
        side.wait_stream(compute)  # the tensor's producer must have run
        with torch.cuda.stream(side):
            host.copy_(tensor, non_blocking=pin)
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(side)
        self._stash_tensor(ready, tensor)
        return host, ready

    def _stash_tensor(self, ready: Any, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` alive until its copy ran; block when too many bytes wait."""
        stash = self._stash
        while stash and stash[0][0].query():
            self._drop_oldest()
        stash.append((ready, tensor))
        self._stash_size += tensor.untyped_storage().nbytes()
        while len(stash) > 1 and self._stash_size > self.stash_bytes:
            stash[0][0].synchronize()
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, tensor = self._stash.popleft()
        self._stash_size -= tensor.untyped_storage().nbytes()

    # backward --------------------------------------------------------------

    def restore(self, copy: HostCopy) -> torch.Tensor:
        """``copy`` back on its device, ready for use on the current stream."""
        if copy.device.type == "cpu":
            return copy.host
        if copy.device.type != "cuda" or not self.use_streams:
            return copy.host.to(copy.device)
        pending = copy._prefetched or self._start_restore(copy)
        copy._prefetched = None
        self._prefetch_after(copy.index)
        tensor, ready = pending
        compute = torch.cuda.current_stream(copy.device)
        compute.wait_event(ready)
        tensor.record_stream(compute)  # allocated on the side stream, used here
        return tensor

    def _start_restore(self, copy: HostCopy) -> tuple[torch.Tensor, Any]:
        if self._h2d_stream is None:
            self._h2d_stream = torch.cuda.Stream(copy.device)  # type: ignore[no-untyped-call]
        side = self._h2d_stream
        with torch.cuda.stream(side):
            if copy._ready is not None:
                side.wait_event(copy._ready)
            tensor = copy.host.to(copy.device, non_blocking=copy.host.is_pinned())
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(side)
        return tensor, ready

    def _prefetch_after(self, index: int) -> None:
        """Start bringing back the tensors needed next (earlier saves in backward order)."""
        started = 0
        upcoming_positions = (
            range(index - 1, -1, -1) if self.backward_order else range(index + 1, len(self._copies))
        )
        for position in upcoming_positions:
            if started >= self.prefetch:
                break
            upcoming = self._copies[position]()
            if upcoming is None or upcoming.device.type != "cuda":
                continue
            if upcoming._prefetched is None:
                upcoming._prefetched = self._start_restore(upcoming)
            started += 1
