"""The only module that touches torch internals or gates on torch versions.

Each function names the private API it uses, why no public one does the job,
and the versions checked. Checked on torch 2.13.0 (CPU); the fallbacks keep
torch >= 2.4 working with reduced features where an API is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
import torch.utils._pytree as _pytree

__all__ = [
    "current_backward_id",
    "current_device_context",
    "device_is_initialized",
    "get_exec_group",
    "is_checkpoint_valid",
    "on_backward_end",
    "set_exec_group",
    "tree_flatten",
    "tree_unflatten",
]


def current_backward_id() -> int:
    """Id of the autograd graph task running on this thread, or -1 outside backward.

    ``torch._C._current_graph_task_id`` (torch >= 1.13; checked 2.4-2.13) is the
    only way to tell one backward call from another; recomputed tensors are kept
    per backward call so that ``retain_graph=True`` recomputes again.
    """
    return int(torch._C._current_graph_task_id())


def on_backward_end(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the current backward call finishes.

    Uses the engine's ``queue_callback`` (what FSDP and DDP use; there is no
    public spelling). Lets a region drop recomputed tensors that a partial
    backward never consumed. Returns False when unavailable.
    """
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        return False
    queue(callback)
    return True


# Where the current "exec group" lives. torch >= 2.9 keeps it in a C++
# thread-local that the autograd engine propagates to its device threads, which
# a Python ContextVar cannot do; older torch falls back to the ContextVar (right
# for CPU backward, which runs on the calling thread).
_FALLBACK_GROUP: ContextVar[object | None] = ContextVar("remat_exec_group", default=None)
_HAS_NATIVE_GROUP = hasattr(torch._C, "_get_graph_exec_group") and hasattr(
    torch._C, "_set_graph_exec_group"
)


def get_exec_group() -> object | None:
    """The active ``GraphExecGroup`` (torch._C._get_graph_exec_group, torch >= 2.9)."""
    if _HAS_NATIVE_GROUP:
        return torch._C._get_graph_exec_group()
    return _FALLBACK_GROUP.get()


def set_exec_group(group: object | None) -> None:
    """Set the active exec group (torch._C._set_graph_exec_group, torch >= 2.9)."""
    if _HAS_NATIVE_GROUP:
        torch._C._set_graph_exec_group(group)  # type: ignore[arg-type]
    else:
        _FALLBACK_GROUP.set(group)


def is_checkpoint_valid() -> bool:
    """False inside ``torch.autograd.grad`` / ``backward(inputs=...)``.

    ``torch.autograd._is_checkpoint_valid`` (checked 2.4-2.13) is how the
    reentrant variant knows it cannot run a nested ``backward``.
    """
    return bool(torch.autograd._is_checkpoint_valid())  # type: ignore[no-untyped-call]


def device_is_initialized(module: Any) -> bool:
    """Whether a device module (``torch.cuda``, ``torch.xpu``...) has a context.

    Public ``is_initialized()`` where the module has it; some backends only
    expose the private ``_initialized`` flag (checked 2.4-2.13).
    """
    probe = getattr(module, "is_initialized", None)
    if callable(probe):
        return bool(probe())
    return bool(getattr(module, "_initialized", False))


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """Flatten nested containers with torch's pytree registry.

    ``torch.utils._pytree`` is private by name but is the registry that
    libraries (transformers' ModelOutput, ...) register their containers with;
    no public equivalent exists (checked 2.4-2.13).
    """
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    """Inverse of :func:`tree_flatten`."""
    return _pytree.tree_unflatten(leaves, spec)


def detach_sharing_version(tensor: torch.Tensor) -> torch.Tensor:
    """Detach a tensor inside a ``TorchDispatchMode`` keeping its version counter.

    Below autograd the ADInplaceOrView key is excluded, and a plain ``detach()``
    there gets a fresh version counter, so later in-place writes to the
    original would go unnoticed. Re-including the key with the private
    ``_SetExcludeDispatchKeyGuard`` is the only way (checked 2.4-2.13).
    """
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tensor.detach()


def current_device_context() -> Any:
    """The innermost active ``with torch.device(...)`` mode, or None.

    ``torch.device`` as a context manager is a ``DeviceContext`` function mode;
    finding it needs ``torch.overrides._get_current_function_mode_stack`` and
    ``torch.utils._device.DeviceContext`` (both private, checked 2.4-2.13). The
    recomputation re-enters it so factory calls land on the same device.
    """
    try:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._device import DeviceContext
    except ImportError:
        return None
    for mode in reversed(_get_current_function_mode_stack()):  # type: ignore[no-untyped-call]
        if isinstance(mode, DeviceContext):
            return mode
    return None
