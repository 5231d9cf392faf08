"""Which line of the user's code is running: for debug op logs and memory records.

Example:
    >>> frame = user_frame()
    >>> frame is None or frame.f_lineno > 0
    True
"""

from __future__ import annotations

import os
import sys
import sysconfig
from types import FrameType

import torch

__all__ = ["user_frame", "user_stacklevel"]

# Library code: torch, the standard library, remat itself (but remat's embedded
# demo model is code a user runs, so its lines are the ones to show).
_LIBRARY_DIRS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.normpath(sysconfig.get_paths()["stdlib"]) + os.sep,
    "<frozen",
)
_REMAT_DIR = os.path.dirname(__file__) + os.sep
_REMAT_USER_CODE = os.path.join(_REMAT_DIR, "_demo.py")


def user_frame() -> FrameType | None:
    """The innermost calling frame outside library code, or None."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_LIBRARY_DIRS) and (
            not filename.startswith(_REMAT_DIR) or filename == _REMAT_USER_CODE
        ):
            return frame
        frame = frame.f_back
    return None


def user_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` made by the caller, pointing at user code.

    The depth varies with the torch release (``autograd.Function.apply`` gained
    and lost Python frames), so it is counted rather than hard-coded.
    """
    target = user_frame()
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame is not target:
        frame = frame.f_back
        level += 1
    return level if frame is not None else 1
