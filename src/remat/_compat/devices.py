"""Devices: whether a device backend has a context, and the innermost
``with torch.device(...)`` (a torch-function mode) a recomputation re-enters.

Private names used: a backend module's ``_initialized`` flag,
``torch._C._len_torch_function_stack``,
``torch.overrides._get_current_function_mode_stack`` and
``torch.utils._device.DeviceContext``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["current_device_context", "device_is_initialized", "function_mode_count"]


def device_is_initialized(module: Any) -> bool:
    """Whether a device module (``torch.cuda``, ``torch.xpu``...) has a context.

    Public ``is_initialized()`` where the module has it; some backends only
    expose the private ``_initialized`` flag (checked 2.4.1-2.15.0).
    """
    probe = getattr(module, "is_initialized", None)
    if callable(probe):
        return bool(probe())
    return bool(getattr(module, "_initialized", False))


# How many torch function modes are active (``torch._C._len_torch_function_stack``,
# private, checked 2.4.1-2.15.0): the C function, so that the usual answer (0)
# costs no Python frame.
function_mode_count: Callable[[], int] = torch._C._len_torch_function_stack


def current_device_context() -> Any:
    """The innermost active ``with torch.device(...)`` mode, or None.

    ``torch.device`` as a context manager is a ``DeviceContext`` function mode;
    finding it needs ``torch.overrides._get_current_function_mode_stack`` and
    ``torch.utils._device.DeviceContext`` (both private, checked 2.4.1-2.15.0). The
    recomputation re-enters it so factory calls land on the same device. The
    private ``torch._C._len_torch_function_stack`` (checked 2.4.1-2.15.0) answers
    the usual case, no mode at all, without building the stack.
    """
    # Every region asks: answer the usual case (no function mode at all) from
    # the mode stack's length alone.
    if function_mode_count() == 0:
        return None
    try:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._device import DeviceContext
    except ImportError:
        return None
    for mode in reversed(_get_current_function_mode_stack()):  # type: ignore[no-untyped-call]
        if isinstance(mode, DeviceContext):
            return mode
    return None
