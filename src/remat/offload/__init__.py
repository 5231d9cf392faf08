"""Offload saved tensors to host memory: the ``remat.offload`` context and its transfers.

Two ways in, one mechanism (:mod:`remat._engine.transfer`):

* ``with remat.offload(): ...`` offloads every saved tensor above a size;
* a selective policy answering ``CheckpointPolicy.MUST_OFFLOAD`` offloads
  one op's output inside a checkpointed region.

Pack: a saved tensor of at least ``min_bytes`` that is not a parameter (or a
view of one) starts its copy to the host (:class:`~remat._engine.transfer.HostTransfer`)
and autograd keeps only the host copy. Unpack: it comes back to its device.
Smaller tensors and parameters are kept as they are (detached, sharing the
version counter, so autograd's in-place check still applies and a saved
output does not reference its own node: a cycle that gc cannot collect).

Inside a checkpointed region (forward or recomputation) the context stands
aside: the region already decides every saved tensor's fate. Wrap the region
instead (``with remat.offload(): remat.checkpoint(block, x)``) to offload the
region's inputs, the classic pairing of checkpointing with offload.

Example:
    >>> import torch, remat
    >>> x = torch.randn(64, 64, requires_grad=True)
    >>> with remat.offload(min_bytes=0):
    ...     y = (x @ x).tanh()
    >>> y.sum().backward()
"""

from __future__ import annotations

import functools
from types import TracebackType

import torch
from typing_extensions import Self

from remat._compat import base_of
from remat._engine.scope import current_observer, in_region
from remat._engine.transfer import HostCopy, HostTransfer, StoredTensor
from remat.errors import CheckpointTypeError, CheckpointUsageError

__all__ = ["HostCopy", "HostTransfer", "no_offload", "offload"]


def _is_parameter_storage(tensor: torch.Tensor) -> bool:
    """Parameters (and views of them, e.g. a transposed weight) live anyway."""
    if isinstance(tensor, torch.nn.Parameter):
        return True
    base = base_of(tensor)
    return base is not tensor and (isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad))


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach() if tensor.requires_grad else tensor


def _unpack(packed: object) -> torch.Tensor:
    if isinstance(packed, StoredTensor):
        return packed.restore()
    assert isinstance(packed, torch.Tensor), "remat bug: unknown packed value in offload"
    return packed


class _SavedTensorsContext:
    """Pushes saved-tensor hooks on enter, unless inside a region (then nothing)."""

    _api = ""

    def __init__(self) -> None:
        self._entered = False
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _make_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        raise NotImplementedError("remat bug: subclasses build their hooks")

    def __enter__(self) -> Self:
        if self._entered:
            raise CheckpointUsageError(f"{self._api}: this context is already active; create a new one.")
        self._entered = True
        # Under torch.compile (and strict export) the compiler decides what a
        # graph saves: offload decisions are kept on the device there, as a
        # policy's are (docs/design/compile.md), and the context is inert.
        self._hooks = None if torch.compiler.is_compiling() or in_region() else self._make_hooks()
        if self._hooks is not None:
            self._hooks.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        hooks, self._hooks, self._entered = self._hooks, None, False
        if hooks is not None:
            hooks.__exit__(kind, exc, tb)


class offload(_SavedTensorsContext):  # lower case: used like torch.no_grad
    """Offload tensors saved for backward to host memory inside the block.

    Every tensor autograd saves in the block that has at least ``min_bytes``
    bytes and is not a parameter is copied to host memory (pinned, on a side
    stream, when it lives on a CUDA device) and copied back when backward
    needs it, with the next few prefetched so the copies overlap compute.
    Gradients are unchanged. On CPU tensors the copy saves nothing but runs
    end to end. Use :func:`no_offload` for a part that must stay on device.

    Args:
        min_bytes: smaller saved tensors stay where they are (copies of tiny
            tensors cost more than they save).
        pin_memory: pin host buffers (default: for CUDA tensors).
        use_streams: overlap CUDA copies with compute on side streams.
        prefetch: tensors to start copying back ahead of backward's need.
        stash_bytes: device bytes allowed to wait for their host copy in the
            forward before it blocks (bounds the extra memory of overlap).

    Example:
        >>> import torch, remat
        >>> layer = torch.nn.Linear(64, 64)
        >>> x = torch.randn(32, 64, requires_grad=True)
        >>> with remat.offload(min_bytes=1024):
        ...     y = layer(x).relu()
        >>> y.sum().backward()
    """

    def __init__(
        self,
        *,
        min_bytes: int = 1024,
        pin_memory: bool | None = None,
        use_streams: bool = True,
        prefetch: int = 2,
        stash_bytes: int = 1 << 30,
    ) -> None:
        for name, value in (("min_bytes", min_bytes), ("prefetch", prefetch), ("stash_bytes", stash_bytes)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise CheckpointTypeError(f"remat.offload: {name} must be an int, got {value!r}.")
            if value < 0:
                raise CheckpointUsageError(f"remat.offload: {name} must be >= 0, got {value}.")
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise CheckpointTypeError(f"remat.offload: pin_memory must be a bool or None, got {pin_memory!r}.")
        super().__init__()
        self.min_bytes = min_bytes
        self._new_transfer = functools.partial(
            HostTransfer,
            pin_memory=pin_memory,
            use_streams=use_streams,
            prefetch=prefetch,
            stash_bytes=stash_bytes,
        )

    _api = "remat.offload"

    def _make_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        # One transfer per entry: its save order drives prefetch in backward.
        transfer = self._new_transfer()
        min_bytes = self.min_bytes
        observer = current_observer()

        def pack(tensor: torch.Tensor) -> HostCopy | torch.Tensor:
            if tensor.numel() * tensor.element_size() < min_bytes or _is_parameter_storage(tensor):
                return _keep(tensor)
            if observer is not None:
                observer("offloaded", tensor)
            return transfer.to_host(tensor)

        return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)


class no_offload(_SavedTensorsContext):  # lower case: used like torch.no_grad
    """Keep tensors saved inside the block on their device, even under :class:`offload`.

    Example:
        >>> import torch, remat
        >>> x = torch.randn(256, requires_grad=True)
        >>> with remat.offload():
        ...     with remat.no_offload():
        ...         y = x.exp()            # kept on its device
        >>> y.sum().backward()
    """

    _api = "remat.no_offload"

    def _make_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(_keep, _unpack)
