"""See the memory a training step uses.

``track()`` counts the bytes of tensor storages created inside a ``with``
block (forward and backward), their peak, and named marks. Data only:
nothing here prints.

Example:
    >>> import torch
    >>> from remat.memory import track
    >>> with track() as t:
    ...     x = torch.zeros(256, 256)            # float32: 262144 bytes
    ...     t.mark("forward_end")
    >>> t.marks["forward_end"], t.peak_bytes
    (262144, 262144)
"""

from remat.memory._tracker import MemoryTracker, track

__all__ = ["MemoryTracker", "track"]
