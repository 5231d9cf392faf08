"""Whether code runs inside a checkpointed region's forward or recomputation.

Saved-tensor contexts that would steal a region's tensors (``remat.offload``
and its opt-out) consult this when they are entered: inside a region every
saved tensor already belongs to the region, and a context entered there must
stand aside, or the recomputation would save fewer tensors than the forward.

"Inside a region" is exactly "a region's saved-tensor hooks are active", so
the hooks themselves mark it (:class:`RegionHooks`); nothing else is pushed.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any

import torch

__all__ = ["RegionHooks", "in_region"]

_inside: ContextVar[bool] = ContextVar("remat_inside_region", default=False)


def in_region() -> bool:
    """True inside a remat region's forward or recomputation."""
    return _inside.get()


class RegionHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks of a region; while active, :func:`in_region` is True."""

    _token: Token[bool] | None = None

    def __enter__(self) -> None:
        super().__enter__()
        self._token = _inside.set(True)

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            _inside.reset(self._token)
            self._token = None
        super().__exit__(*exc)
