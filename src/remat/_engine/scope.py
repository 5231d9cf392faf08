"""Whether code runs inside a checkpointed region's forward or recomputation.

Saved-tensor contexts that would steal a region's tensors (``remat.offload``
and its opt-out) consult this when they are entered: inside a region every
saved tensor already belongs to the region, and a context entered there must
stand aside, or the recomputation would save fewer tensors than the forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["in_region", "region_scope"]

_depth: ContextVar[int] = ContextVar("remat_region_depth", default=0)


def in_region() -> bool:
    """True inside a remat region's forward or recomputation."""
    return _depth.get() > 0


@contextlib.contextmanager
def region_scope() -> Iterator[None]:
    """Mark the enclosed code as running inside a region."""
    token = _depth.set(_depth.get() + 1)
    try:
        yield
    finally:
        _depth.reset(token)
