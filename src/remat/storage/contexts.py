"""The saved-tensor contexts: ``remat.offload``, ``remat.compress``, ``remat.exact``, ``remat.no_offload``.

Layer: storage (imports ``choice``, ``store``, ``_scope``, ``_compat`` and
``errors``). Each context asks for one :class:`~remat.storage.choice.Storage`
for the tensors autograd saves inside it, outside any checkpointed region:

* ``with remat.offload(): ...``: a host copy (:data:`~remat.storage.choice.HOST`);
* ``with remat.compress("fp8"): ...``: a compressed copy on the device;
* ``with remat.exact():`` / ``remat.no_offload()``: as it is
  (:data:`~remat.storage.choice.DEVICE`), inside one of the others.

Their pack hook is one function for all four (:class:`StorageContext`):
:func:`~remat.storage.choice.decide` says where the tensor lives (a small
tensor, a parameter, a tensor that is no activation for compression stay as
they are), a :class:`~remat.storage.store.Stashes` keeps it; unpack restores
it. Kept tensors are detached, sharing the version counter, so autograd's
in-place check still applies and a saved output does not reference its own
node (a cycle that gc cannot collect).

Inside a checkpointed region (forward or recomputation) the contexts stand
aside: the region already decides every saved tensor's fate. Wrap the region
instead (``with remat.offload(): remat.checkpoint(block, x)``) to offload the
region's inputs, the classic pairing of checkpointing with offload. A
``remat.compress`` block keeps a region's inputs exact (its recomputation
would otherwise start from approximate values); a region compresses them
only when asked (``compress_inputs=``).

Under torch.compile the compiler owns what a graph saves
(:func:`~remat.storage.choice.under_compiler`): entered inside compiled code,
``offload`` and ``exact`` are inert and ``compress`` is refused; a
``remat.compress`` block *around* a compiled call compresses the graph's
saved intermediates inside the graph (torch 2.11 and newer), through the
compressor's graph encoding.

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
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import Self

from remat._compat.tracers import (
    graph_hook,
    graph_saved_tensor_hooks_inline,
    inlining_saved_tensor_hook,
    inside_compiled_function,
)
from remat._scope import current_observer, in_region
from remat.errors import CheckpointTypeError, CheckpointUsageError, UnsupportedCheckpointError
from remat.storage.choice import DEVICE, HOST, Storage, decide, event_of, under_compiler
from remat.storage.host import HostTransfer
from remat.storage.stash import StoredTensor
from remat.storage.store import Stashes

if TYPE_CHECKING:
    from remat.compression import Compression, Scale

__all__ = ["StorageContext", "compress", "exact", "no_offload", "offload", "storing"]


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
    assert isinstance(packed, torch.Tensor), "remat bug: unknown packed value in a storage context"
    return packed


class StorageContext:
    """Saved tensors inside the block live where ``storage`` says (the base of the four contexts).

    Pushes saved-tensor hooks on enter, unless inside a region (then
    nothing). Each entry gets new :class:`~remat.storage.store.Stashes`: a
    host transfer's save order drives its prefetch in backward.
    """

    _api = "remat.storage"

    def __init__(self, storage: Storage, min_bytes: int = 0) -> None:
        self.storage = storage
        self.min_bytes = min_bytes
        self._entered = False
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._stashes: Stashes | None = None

    def _new_host(self) -> HostTransfer:
        return HostTransfer()

    def __enter__(self) -> Self:
        if self._entered:
            raise CheckpointUsageError(f"{self._api}: this context is already active; create a new one.")
        if torch.compiler.is_compiling():
            # The compiler decides what a graph saves: kept there, or refused
            # when it must be compressed (docs/design/compile.md).
            under_compiler(self.storage, self._api, f"a {self._api} block entered inside compiled code")
        self._entered = True
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

    def _make_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        stashes = self._stashes = Stashes(self._new_host)
        asked, min_bytes = self.storage, self.min_bytes
        observer = current_observer()
        # A compressing block's hooks are also traced into compiled graphs
        # that run inside it (torch 2.11 and newer; docs/design/compression.md).
        inline = asked.where == "compressed" and graph_saved_tensor_hooks_inline()

        def pack(tensor: torch.Tensor) -> Any:
            if inline and inlining_saved_tensor_hook():
                if decide(tensor, asked, "graph").where != "compressed":
                    return (tensor,)
                assert asked.format is not None, "remat bug: a compressing context without its format"
                return stashes.compressor(asked.format).pack_in_graph(tensor)
            where = decide(tensor, asked, "context", min_bytes)
            if not where.stored:
                if asked.where == "compressed" and not inline and tensor.grad_fn is None and inside_compiled_function():
                    raise _compiled_before_inlining()
                return _keep(tensor)
            if observer is not None:
                observer(event_of(where, "context"), tensor)  # type: ignore[arg-type]  # stored: an event
            return stashes.store(tensor, where)

        def unpack(packed: object) -> torch.Tensor:
            if isinstance(packed, tuple):
                if len(packed) == 1:
                    return packed[0]  # type: ignore[no-any-return]
                assert asked.format is not None, "remat bug: a graph encoding without its format"
                return stashes.compressor(asked.format).unpack_in_graph(packed)
            return _unpack(packed)

        if inline:
            return torch.autograd.graph.saved_tensors_hooks(graph_hook(pack), graph_hook(unpack))
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class offload(StorageContext):  # lower case: used like torch.no_grad
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

    _api = "remat.offload"

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
        super().__init__(HOST, min_bytes)
        self._host_options = functools.partial(
            HostTransfer,
            pin_memory=pin_memory,
            use_streams=use_streams,
            prefetch=prefetch,
            stash_bytes=stash_bytes,
        )

    def _new_host(self) -> HostTransfer:
        return self._host_options()


class no_offload(StorageContext):  # lower case: used like torch.no_grad
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

    def __init__(self) -> None:
        super().__init__(DEVICE)


class compress(StorageContext):  # lower case: used like torch.no_grad
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

        self.format = compression(format, scale=scale, api="remat.compress")
        super().__init__(Storage.compressed(self.format), _check_size("remat.compress", min_bytes))

    def _counts(self) -> Any:
        stashes = self._stashes
        return stashes.compressor(self.format) if stashes is not None else None

    @property
    def original_bytes(self) -> int:
        """Bytes the compressed tensors took (each storage once), in the last entry of the block."""
        return getattr(self._counts(), "original_bytes", 0)

    @property
    def stored_bytes(self) -> int:
        """Bytes they take compressed."""
        return getattr(self._counts(), "stored_bytes", 0)

    @property
    def bytes_by_dtype(self) -> dict[torch.dtype, tuple[int, int]]:
        """``{dtype: (original bytes, stored bytes)}`` of the compressed tensors."""
        return dict(getattr(self._counts(), "bytes_by_dtype", {}))


def _compiled_before_inlining() -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(
        f"remat.compress around a region compiled by torch.compile needs torch 2.11 or newer, where "
        f"the compiler takes saved-tensor hooks into its graphs; this is torch {torch.__version__}, "
        "whose compiled regions save their intermediates where remat cannot tell them from buffers. "
        "Upgrade torch, run the compressed part eagerly, or compile without remat.compress "
        "(docs/design/compression.md, 'Under torch.compile')."
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


def storing(storage: Storage) -> StorageContext:
    """The context that keeps every tensor saved inside it where ``storage`` says, whatever
    its size (``min_bytes=0``): :class:`offload`, :class:`compress` or :class:`exact`.

    Example:
        >>> storing(HOST).min_bytes, type(storing(DEVICE)).__name__
        (0, 'exact')
    """
    if storage.where == "host":
        return offload(min_bytes=0)
    if storage.where == "compressed":
        assert storage.format is not None, "remat bug: a compressed storage without its format"
        return compress(storage.format, min_bytes=0)
    if storage.where == "device":
        return exact()
    raise AssertionError(f"remat bug: no context stores {storage!r}")
