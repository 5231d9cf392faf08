"""``torch.nn.Module``'s private hooks and call slots: state-dict hooks on
torch 2.4 (public from 2.5), and the compiled call ``Module.compile()`` stores
(``_compiled_call_impl``) beside the call it compiles (``_call_impl``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "compiled_call",
    "module_call",
    "register_load_state_dict_pre_hook",
    "register_state_dict_post_hook",
    "set_compiled_call",
]


def register_state_dict_post_hook(module: torch.nn.Module, hook: Callable[..., Any]) -> None:
    """``module.register_state_dict_post_hook(hook)``, also on torch 2.4.

    The public method arrived in torch 2.5 (checked 2.5.1-2.15.0); 2.4 has the
    same hook, with the same ``(module, state_dict, prefix, local_metadata)``
    arguments, under the private ``_register_state_dict_hook`` (checked 2.4.1).
    """
    register = getattr(module, "register_state_dict_post_hook", None)
    if register is None:
        register = module._register_state_dict_hook
    register(hook)


def register_load_state_dict_pre_hook(module: torch.nn.Module, hook: Callable[..., Any]) -> None:
    """``module.register_load_state_dict_pre_hook(hook)``, also on torch 2.4.

    The public method arrived in torch 2.5 (checked 2.5.1-2.15.0); on 2.4 the
    private ``_register_load_state_dict_pre_hook(hook, with_module=True)`` calls
    the hook with the same arguments, module first (checked 2.4.1).
    """
    register = getattr(module, "register_load_state_dict_pre_hook", None)
    if register is None:
        module._register_load_state_dict_pre_hook(hook, with_module=True)  # type: ignore[no-untyped-call]
    else:
        register(hook)


def set_compiled_call(module: torch.nn.Module, call: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """Make ``module(...)`` run ``call`` instead of its hooks and forward; returns what was there.

    ``nn.Module.compile()`` stores its compiled ``_call_impl`` in the private
    attribute ``_compiled_call_impl``, which ``Module.__call__`` runs when it
    is set (checked 2.4.1-2.15.0; the attribute exists since 2.2). A planner
    compiling blocks the way users do, with markers around each compiled
    call, sets it through here; None restores the eager call.
    """
    previous: Callable[..., Any] | None = module.__dict__.get("_compiled_call_impl")
    module._compiled_call_impl = call
    return previous


def compiled_call(module: torch.nn.Module) -> Callable[..., Any] | None:
    """What ``module(...)`` runs instead of its hooks and forward when it is compiled, or None.

    The private ``_compiled_call_impl`` that ``nn.Module.compile()`` sets
    (see :func:`set_compiled_call`; checked 2.4.1-2.15.0).
    """
    call: Callable[..., Any] | None = module.__dict__.get("_compiled_call_impl")
    return call


def module_call(module: torch.nn.Module) -> Callable[..., Any]:
    """The function ``Module.compile()`` compiles: the module's hooks and forward.

    ``nn.Module._call_impl`` (private; checked 2.4.1-2.15.0).
    """
    call: Callable[..., Any] = module._call_impl
    return call
