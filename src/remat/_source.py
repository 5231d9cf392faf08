"""Which line of the user's code is running: for debug op logs and memory records.

A frame is library code when the module it runs belongs to torch, to the
Python standard library or to remat itself (remat's embedded demo model is
code a user runs, so its lines are shown). The test is the module's name
(``__name__`` in the frame's globals), not its file's path: a package that
pip installed outside a virtual environment lives under the standard
library's directory (``/usr/local/lib/python3.11/site-packages``), and a
path prefix would count it, and the user's own installed code, as the
standard library.

Layer: the bottom (``docs/design/architecture.md``); imports nothing of remat.

Example:
    >>> frame = user_frame()
    >>> frame is None or frame.f_lineno > 0
    True
"""

from __future__ import annotations

import sys
from types import FrameType

__all__ = ["is_library_module", "user_frame", "user_stacklevel"]

# Top-level packages whose frames are never "the user's line".
_LIBRARY_PACKAGES = frozenset({"torch", "functorch", "remat", "typing_extensions"}) | frozenset(
    sys.stdlib_module_names
)
_USER_CODE_IN_REMAT = "remat.models"
"""The models package: a line of a model there is the user's line, not remat's."""


def is_library_module(module_name: str | None, filename: str = "") -> bool:
    """Whether code of module ``module_name`` (from ``filename``) is library code.

    Example:
        >>> is_library_module("torch.nn.modules.module"), is_library_module("mypkg.model")
        (True, False)
    """
    if module_name is None:  # code without a module (exec'd strings, frozen bootstrap)
        return filename.startswith("<frozen")
    if module_name == _USER_CODE_IN_REMAT or module_name.startswith(_USER_CODE_IN_REMAT + "."):
        return False
    top = module_name.partition(".")[0]
    return top in _LIBRARY_PACKAGES or top.startswith("_frozen")


def user_frame() -> FrameType | None:
    """The innermost calling frame outside library code, or None."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if not is_library_module(frame.f_globals.get("__name__"), frame.f_code.co_filename):
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
