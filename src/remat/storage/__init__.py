"""Where a saved tensor lives: kept, recomputed, copied to the host, or compressed.

Layer: storage, below the engine (imports ``policies``, ``compression``,
``_scope``, ``_compat``, ``errors``). The engine's selective cache, its regions'
inputs, the placement of a plan and the public contexts all keep tensors
through this package, and it decides where each one lives in one function.

Read in this order (one tensor's path: ``docs/design/saved-tensor.md``):

1. ``choice``: :class:`~remat.storage.choice.Storage`, the one value that
   says where a saved tensor lives, and :func:`~remat.storage.choice.decide`,
   the one function that decides it for every path (a policy's outcome, a
   context, a region's inputs, a compiled graph's intermediates);
   :func:`~remat.storage.choice.under_compiler` for code torch.compile
   traces.
2. ``stash``: :class:`~remat.storage.stash.Stash`, the base of every stash:
   saved tensors kept block by block (views of one storage share a block)
   and restored as views.
3. ``host``: :class:`~remat.storage.host.HostTransfer`, copies in host memory
   (pinned buffers, side streams, prefetch in backward).
4. ``compressed``: :class:`~remat.storage.compressed.Compressor`, smaller
   copies on the device, and the one byte rule of compression
   (:func:`~remat.storage.compressed.compressed_bytes`).
5. ``store``: :class:`~remat.storage.store.Stashes`, the stashes of one
   forward, where a decided tensor is handed to be kept.
6. ``contexts``: the public contexts ``offload``, ``compress``, ``exact`` and
   ``no_offload``, and ``storing(storage)`` for a placement.
7. ``copies``: what the host transfer needs from a device (streams, events,
   pinned buffers); CUDA's backend.
8. ``simulated``: a device whose copies land late and out of order, for
   testing the host transfer on a CPU.

Example:
    >>> import torch, remat
    >>> x = torch.randn(64, 64, requires_grad=True)
    >>> with remat.compress("int8") as block:
    ...     y = (x @ x).tanh()
    >>> y.sum().backward()
    >>> block.stored_bytes < block.original_bytes
    True
"""

from remat.storage.choice import DEVICE, HOST, RECOMPUTE, Storage, compressible, decide
from remat.storage.contexts import compress, exact, no_offload, offload, storing
from remat.storage.host import HostCopy, HostTransfer

__all__ = [
    "DEVICE",
    "HOST",
    "RECOMPUTE",
    "HostCopy",
    "HostTransfer",
    "Storage",
    "compress",
    "compressible",
    "decide",
    "exact",
    "no_offload",
    "offload",
    "storing",
]
