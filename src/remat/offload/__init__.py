"""Offload saved tensors to host memory: the ``remat.offload`` context and its transfers.

Two ways in, one mechanism (:mod:`remat._engine.transfer`):

* ``with remat.offload(): ...`` offloads every saved tensor above a size;
* a selective policy answering ``CheckpointPolicy.MUST_OFFLOAD`` offloads
  one op's output inside a checkpointed region.

Example:
    >>> import torch, remat
    >>> x = torch.randn(64, 64, requires_grad=True)
    >>> with remat.offload(min_bytes=0):
    ...     y = (x @ x).tanh()
    >>> y.sum().backward()
"""

from remat._engine.transfer import HostCopy, HostTransfer
from remat.offload._context import no_offload, offload

__all__ = ["HostCopy", "HostTransfer", "no_offload", "offload"]
