"""Keep native libraries quiet while remat calls them.

Layer: the bottom (imports nothing of remat). Some native code writes
straight to file descriptors 1 and 2, past Python's ``sys.stdout``: torch's
profiler prints a line when it starts and stops on some builds. Writing to
the user's terminal is not ours to do ("nothing prints" but the ``render_*``
functions), so such calls run with the descriptors pointed at the null
device for their duration.

Example:
    >>> with silenced(1):
    ...     pass
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

__all__ = ["silenced"]


@contextlib.contextmanager
def silenced(*fds: int) -> Iterator[None]:
    """Point the file descriptors ``fds`` at the null device inside the block.

    Python's own buffers are flushed first, so nothing written before the
    block is lost. Where a descriptor cannot be duplicated (a closed or
    unusual one), the block runs without silencing it.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved: list[tuple[int, int]] = []
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        for fd in fds:
            try:
                saved.append((fd, os.dup(fd)))
                os.dup2(null, fd)
            except OSError:
                continue
        yield
    finally:
        for fd, copy in reversed(saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)
