"""The old home of the saved-tensor contexts, kept so that its imports go on working.

Layer: storage's front (re-exports only). Offload, compression and ``exact``
live in :mod:`remat.storage`, named for what they share: where a saved tensor
lives. ``from remat.offload import offload`` and the other names below are the
same objects as ``remat.storage``'s.

Example:
    >>> import remat.storage
    >>> from remat.offload import compress, offload
    >>> compress is remat.storage.compress and offload is remat.storage.offload
    True
"""

from remat.storage import HostCopy, HostTransfer, compress, compressible, exact, no_offload, offload

__all__ = ["HostCopy", "HostTransfer", "compress", "compressible", "exact", "no_offload", "offload"]
