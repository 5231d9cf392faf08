"""Saved tensors kept elsewhere or smaller: the ``remat.offload`` and ``remat.compress`` contexts.

Two storage choices beside keeping and recomputing, each with two ways in and
one mechanism (a stash, :mod:`remat._engine.transfer`):

* ``with remat.offload(): ...`` offloads every saved tensor above a size; a
  selective policy answering ``CheckpointPolicy.MUST_OFFLOAD`` offloads one
  op's output inside a checkpointed region;
* ``with remat.compress("fp8"): ...`` keeps every saved activation above a
  size compressed on its device; a policy answering
  :class:`remat.policies.Compress` compresses one op's output
  (``docs/design/compression.md``).

Offload's pack: a saved tensor of at least ``min_bytes`` that is not a
parameter (or a view of one) starts its copy to the host
(:class:`~remat._engine.transfer.HostTransfer`) and autograd keeps only the
host copy. Unpack: it comes back to its device. Smaller tensors and
parameters are kept as they are (detached, sharing the version counter, so
autograd's in-place check still applies and a saved output does not
reference its own node: a cycle that gc cannot collect).

Compress's pack is offload's with a stricter rule for what changes: only
activations (tensors with autograd history: never parameters, buffers,
inputs, or the non-differentiable statistics a norm saves), of a float dtype
the format makes smaller, and not saved inside an :class:`exact` block.

Inside a checkpointed region (forward or recomputation) the contexts stand
aside: the region already decides every saved tensor's fate. Wrap the region
instead (``with remat.offload(): remat.checkpoint(block, x)``) to offload the
region's inputs, the classic pairing of checkpointing with offload. A
``remat.compress`` block keeps a region's inputs exact (its recomputation
would otherwise start from approximate values); a region compresses them
only when asked (``compress_inputs=``).

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
from typing import TYPE_CHECKING

import torch
from typing_extensions import Self

from remat._compat.autograd import base_of
from remat._compat.tracers import (
    graph_hook,
    graph_saved_tensor_hooks_inline,
    inlining_saved_tensor_hook,
    inside_compiled_function,
)
from remat._engine.scope import SAVING_REGION_INPUTS, current_observer, in_region
from remat._engine.transfer import HostCopy, HostTransfer, Stash, StoredTensor
from remat.errors import CheckpointTypeError, CheckpointUsageError, UnsupportedCheckpointError

if TYPE_CHECKING:
    from remat.compression import Compression, Scale

__all__ = ["HostCopy", "HostTransfer", "compress", "compressible", "exact", "no_offload", "offload"]


def _is_parameter_storage(tensor: torch.Tensor) -> bool:
    """Parameters (and views of them, e.g. a transposed weight) live anyway."""
    if isinstance(tensor, torch.nn.Parameter):
        return True
    base = base_of(tensor)
    return base is not tensor and (isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad))


def _check_size(api: str, min_bytes: object) -> int:
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int):
        raise CheckpointTypeError(f"{api}: min_bytes must be an int, got {min_bytes!r}.")
    if min_bytes < 0:
        raise CheckpointUsageError(f"{api}: min_bytes must be >= 0, got {min_bytes}.")
    return min_bytes


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
        _check_size("remat.offload", min_bytes)
        for name, value in (("prefetch", prefetch), ("stash_bytes", stash_bytes)):
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


class compress(_SavedTensorsContext):  # lower case: used like torch.no_grad
    """Keep activations saved for backward inside the block compressed on their device.

    remat's fourth storage choice beside keeping, recomputing and offloading.
    Every tensor autograd saves in the block that is an activation (it has
    autograd history), of a float dtype the format makes smaller, of at least
    ``min_bytes``, and not marked :func:`exact`, is kept compressed and
    decompressed when backward reads it. Parameters, buffers, inputs, integer
    and bool tensors, a norm's statistics and tensors saved inside an
    :class:`exact` block are kept as they are. The
    forward's values are unchanged: only what backward reads is approximate.
    Views of one storage are compressed once. Inside a checkpointed region the
    context stands aside (the region decides), and it keeps a region's inputs
    exact. See ``docs/design/compression.md`` for the formats, the error and
    the bytes.

    Args:
        format: ``"bf16"``, ``"fp16"`` (casts of float32), ``"fp8"`` (e4m3),
            ``"fp8_e5m2"``, ``"int8"``, or a :class:`~remat.compression.Compression`.
        scale: ``"row"`` (default for fp8 and int8) or ``"tensor"``.
        min_bytes: smaller saved tensors stay as they are.

    After the block, ``original_bytes`` and ``stored_bytes`` say what the
    compressed tensors took before and take now (each storage once).

    Example:
        >>> import torch, remat
        >>> layer = torch.nn.Linear(64, 64)
        >>> x = torch.randn(32, 64, requires_grad=True)
        >>> with remat.compress("fp8") as block:
        ...     y = torch.relu(layer(x)) * 2
        >>> y.sum().backward()
        >>> block.original_bytes, block.stored_bytes     # relu's output: fp32 -> fp8 with row scales
        (8192, 2176)
    """

    _api = "remat.compress"

    def __init__(self, format: Compression | str, *, scale: Scale | None = None, min_bytes: int = 1024) -> None:
        from remat.compression import compression  # loaded with the first compress block

        super().__init__()
        self.format = compression(format, scale=scale, api="remat.compress")
        self.min_bytes = _check_size("remat.compress", min_bytes)
        self._stash: Stash | None = None

    @property
    def original_bytes(self) -> int:
        """Bytes the compressed tensors took (each storage once), in the last entry of the block."""
        return getattr(self._stash, "original_bytes", 0)

    @property
    def stored_bytes(self) -> int:
        """Bytes they take compressed."""
        return getattr(self._stash, "stored_bytes", 0)

    @property
    def bytes_by_dtype(self) -> dict[torch.dtype, tuple[int, int]]:
        """``{dtype: (original bytes, stored bytes)}`` of the compressed tensors."""
        return dict(getattr(self._stash, "bytes_by_dtype", {}))

    def _make_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        from remat._engine.compressed import Compressor  # loaded with the first compress block

        compressor = self._stash = Compressor(self.format)
        format, min_bytes = self.format, self.min_bytes
        observer = current_observer()

        inline = graph_saved_tensor_hooks_inline()

        def pack(tensor: torch.Tensor) -> StoredTensor | torch.Tensor | tuple[torch.Tensor, ...]:
            if inline and inlining_saved_tensor_hook():
                # AOTAutograd traces this hook into a compiled graph, for the
                # intermediates the graph saves (graph_hook): the arithmetic
                # becomes part of the graph (docs/design/compression.md).
                return _compressed_in_graph(tensor, format)
            if not compressible(tensor, format, min_bytes):
                if not inline and tensor.grad_fn is None and inside_compiled_function():
                    raise _compiled_before_inlining()
                return _keep(tensor)
            if observer is not None:
                observer("compressed", tensor)
            return compressor.store(tensor)

        def unpack(packed: object) -> torch.Tensor:
            if isinstance(packed, tuple):
                return _restored_in_graph(packed, format)
            return _unpack(packed)

        return torch.autograd.graph.saved_tensors_hooks(graph_hook(pack), graph_hook(unpack))


def _compressed_in_graph(tensor: torch.Tensor, format: Compression) -> tuple[torch.Tensor, ...]:
    """What a compiled graph keeps of an intermediate: the compressed values, their scales
    (an empty tensor for a cast), and two empty tensors carrying the dtype and the shape."""
    if not format.applies_to(tensor.dtype):
        return (tensor,)
    row = tensor.shape[-1] if tensor.dim() else 0
    payload, scales = format.compress(tensor.reshape(-1), row)
    none = payload.new_empty(0) if scales is None else scales
    return payload, none, tensor.new_empty(0), torch.empty(tensor.shape, device="meta")


def _restored_in_graph(packed: tuple[torch.Tensor, ...], format: Compression) -> torch.Tensor:
    if len(packed) == 1:
        return packed[0]
    payload, scales, dtype, shape = packed
    row = shape.shape[-1] if shape.dim() else 0
    restored = format.decompress(payload, None if format.casts else scales, dtype.dtype, row)
    return restored.reshape(shape.shape)


def _compiled_before_inlining() -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(
        f"remat.compress around a region compiled by torch.compile needs torch 2.11 or newer, where "
        f"the compiler takes saved-tensor hooks into its graphs; this is torch {torch.__version__}, "
        "whose compiled regions save their intermediates where remat cannot tell them from buffers. "
        "Upgrade torch, run the compressed part eagerly, or compile without remat.compress "
        "(docs/design/compression.md, 'Under torch.compile')."
    )


def compressible(tensor: torch.Tensor, format: Compression, min_bytes: int = 1024) -> bool:
    """Whether a ``remat.compress`` block compresses ``tensor`` when autograd saves it.

    The one rule (tools that measure compression ask it too): an activation
    (autograd history: not a parameter or a view of one, a buffer, an input
    or a norm's statistics), of a float dtype ``format`` makes smaller, of at
    least ``min_bytes``, and not a region's input.

    Example:
        >>> import torch
        >>> from remat.compression import compression
        >>> x = torch.randn(64, 64, requires_grad=True)
        >>> compressible(x, compression("fp8")), compressible(x * 2, compression("fp8"))
        (False, True)
    """
    return (
        tensor.grad_fn is not None  # autograd history: made by the forward
        and format.applies_to(tensor.dtype)
        and tensor.numel() * tensor.element_size() >= min_bytes
        and not _is_parameter_storage(tensor)  # a view of a parameter has a history too
        and not SAVING_REGION_INPUTS.get()
    )


class exact(no_offload):  # lower case: used like torch.no_grad
    """Keep tensors saved inside the block exactly as they are: not compressed, not offloaded.

    The way to mark tensors exact inside a ``remat.compress`` (or
    ``remat.offload``) block: the innermost block decides, as for
    :class:`no_offload`, which it is. Inside a checkpointed region, a policy
    decides instead: keep such tensors with ``first_of(save_only_names(...),
    compressed(...))``.

    Example:
        >>> import torch, remat
        >>> x = torch.randn(32, 64, requires_grad=True)
        >>> with remat.compress("int8") as block:
        ...     with remat.exact():
        ...         logits = x.exp()          # saved by exp: kept as it is
        ...     y = logits.sin()              # saved by sin: compressed
        >>> block.original_bytes
        8192
    """

    _api = "remat.exact"
