"""The stashes of one forward: where a decided tensor is handed to be kept.

Layer: storage (imports ``choice``, ``stash``, ``host``; the compressor loads
with the first compressed tensor). :func:`~remat.storage.choice.decide` says
where a saved tensor lives; :meth:`Stashes.store` keeps it there. One
:class:`Stashes` serves one forward (a ``remat.offload`` or ``remat.compress``
block's entry, a selective region's cache, a region's inputs): one host
transfer, one compressor per format, each made when first needed.

Example:
    >>> import torch
    >>> from remat.storage.choice import HOST
    >>> stashes = Stashes()
    >>> copy = stashes.store(torch.randn(4, 4), HOST)
    >>> copy.restore().shape
    torch.Size([4, 4])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from remat.storage.choice import Storage
from remat.storage.host import HostTransfer
from remat.storage.stash import StoredTensor

if TYPE_CHECKING:
    from remat.compression import Compression
    from remat.storage.compressed import Compressor

__all__ = ["Stashes"]


class Stashes:
    """One forward's stashes (see the module docstring).

    Args:
        new_host: makes the host transfer (its options: prefetch order,
            streams, pinning); default :class:`~remat.storage.host.HostTransfer`.
    """

    __slots__ = ("_compressors", "_host", "_new_host")

    def __init__(self, new_host: Callable[[], HostTransfer] = HostTransfer) -> None:
        self._new_host = new_host
        self._host: HostTransfer | None = None
        self._compressors: dict[Compression, Compressor] | None = None

    def store(self, tensor: torch.Tensor, storage: Storage) -> StoredTensor:
        """Keep ``tensor`` where ``storage`` (a decided host or compressed storage) says."""
        if storage.where == "host":
            return self.host.store(tensor)
        assert storage.format is not None, f"remat bug: {storage!r} is kept by no stash"
        return self.compressor(storage.format).store(tensor)

    @property
    def host(self) -> HostTransfer:
        """The host transfer (made on first use)."""
        if self._host is None:
            self._host = self._new_host()
        return self._host

    @property
    def compressors(self) -> tuple[Compressor, ...]:
        """The compressors made so far, one per format."""
        return tuple(self._compressors.values()) if self._compressors else ()

    def compressor(self, format: Compression) -> Compressor:
        """The compressor for ``format`` (made on first use)."""
        compressors = self._compressors
        if compressors is None:
            compressors = self._compressors = {}
        found = compressors.get(format)
        if found is None:
            # Loaded with the first compressed tensor.
            from remat.storage.compressed import Compressor

            found = compressors[format] = Compressor(format)
        return found
