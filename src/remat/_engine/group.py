"""``GraphExecGroup``: recompute each region at most once across several backward calls."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

from remat._compat.autograd import get_exec_group, set_exec_group
from remat.errors import CheckpointStateError

__all__ = ["GraphExecGroup"]


class GraphExecGroup:
    """Share recomputation between backward calls over disjoint parts of a graph.

    Inside the block, a checkpointed region that backward reaches is recomputed
    once for the whole group instead of once per backward call, and its
    recomputed tensors are dropped when the block exits. The backward calls
    must not need the same saved tensor (that is a double unpack and raises
    :class:`remat.CheckpointError`). Groups do not nest. Only the
    non-reentrant variant is affected.

    Example:
        >>> import torch, remat
        >>> x = torch.randn(4, requires_grad=True)
        >>> a, b = remat.checkpoint(lambda t: (t.sin(), t.cos()), x)
        >>> with remat.GraphExecGroup():
        ...     ga, = torch.autograd.grad(a.sum(), x, retain_graph=True)
        ...     gb, = torch.autograd.grad(b.sum(), x)
    """

    def __init__(self) -> None:
        self._cleanups: list[Callable[[], None]] = []

    def register_cleanup(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the group exits (used by frames to drop stores)."""
        self._cleanups.append(callback)

    def __enter__(self) -> GraphExecGroup:
        current = get_exec_group()
        if current is not None:
            raise CheckpointStateError(
                "remat.GraphExecGroup: groups cannot be nested; this block is already "
                f"inside {current!r}. Use one group around all the backward calls."
            )
        set_exec_group(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        set_exec_group(None)
        cleanups, self._cleanups = self._cleanups, []
        for cleanup in cleanups:
            cleanup()
