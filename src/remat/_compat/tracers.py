"""Tracers and transforms a region's code or its saved-tensor hooks may run
under: functorch's transforms (``torch.func``), compiled autograd, and
AOTAutograd tracing saved-tensor hooks into the graphs it compiles; and how a
hook runs as plain Python where Dynamo traces its caller.

Private names used: ``torch._C._functorch.peek_interpreter_stack``,
``torch._dynamo.compiled_autograd``'s module flags, and
``torch._functorch._aot_autograd`` (``utils.saved_tensors_hooks_are_inlineable``,
``graph_compile._get_saved_tensor_hook_context``, the location of its runtime
wrappers). Dynamo itself is imported on first use only: remat's import must not
load it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = [
    "compiled_autograd_active",
    "functorch_transform",
    "functorch_transforms",
    "tracked_below_transforms",
    "graph_hook",
    "graph_saved_tensor_hooks_inline",
    "inlining_saved_tensor_hook",
    "inside_compiled_function",
    "outside_compiler",
    "outside_dynamo",
]

F = TypeVar("F", bound=Callable[..., Any])


def functorch_transform() -> str | None:
    """The innermost active ``torch.func`` transform, lower case (``"grad"``,
    ``"vmap"``, ``"jvp"``, ``"functionalize"``), or None outside any.

    ``torch._C._functorch.peek_interpreter_stack`` (private; the only way to
    ask, checked 2.4.1-2.15.0); grad, vjp, jacrev and hessian all run functorch's
    ``Grad`` transform. Asked once per region that saves for backward.
    """
    interpreter = _peek_interpreter()
    return None if interpreter is None else str(interpreter.key().name).lower()


_peek_interpreter: Callable[[], Any] = torch._C._functorch.peek_interpreter_stack


def functorch_transforms() -> tuple[str, ...]:
    """Every active ``torch.func`` transform, outermost first, lower case (empty outside any).

    ``torch._C._functorch.get_interpreter_stack`` (private; checked 2.4.1,
    2.13.0, 2.15.0; None when empty). ``remat.name`` asks it: under a forward-mode
    level (``jvp``, ``jacfwd``, ``hessian``) its operator would drop the tangent.
    """
    stack = _interpreter_stack()
    return () if not stack else tuple(str(level.key().name).lower() for level in stack)


_interpreter_stack: Callable[[], Any] = torch._C._functorch.get_interpreter_stack


def tracked_below_transforms(tensors: list[torch.Tensor]) -> bool:
    """Whether plain autograd tracks one of ``tensors`` beneath every ``torch.func``
    wrapper (``torch.func.grad`` inside a ``loss.backward()`` would differentiate
    what the transform's backward computes).

    ``torch._C._functorch.is_functorch_wrapped_tensor`` and ``get_unwrapped``
    (private; the only way to see through the wrappers; checked 2.4.1, 2.13.0,
    2.15.0, on grad and vmap wrappers).
    """
    for tensor in tensors:
        while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
            tensor = torch._C._functorch.get_unwrapped(tensor)
        if tensor.requires_grad:
            return True
    return False


def compiled_autograd_active() -> bool:
    """Whether compiled autograd is on: Dynamo may then trace or compile the
    saved-tensor hooks a backward runs.

    Compiled autograd (``torch._dynamo.compiled_autograd``, private) puts
    unpack hooks into the backward graph it hands to Dynamo, and Dynamo
    compiles the hooks' frames when the graph calls them. Its module flags
    ``compiled_autograd_enabled`` (2.4.1-2.15.0) and ``in_compiled_autograd_region``
    (2.7.1-2.15.0) say so; a process that never imported the module has it
    off. Asked once per unpack: two dictionary reads where it is off.
    """
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and bool(
        module.compiled_autograd_enabled or getattr(module, "in_compiled_autograd_region", False)
    )


def outside_compiler(function: Callable[[Any], Any], argument: Any) -> Any:
    """``function(argument)``, run as Python even where Dynamo traces the caller.

    Compiled autograd hands the backward graph, saved-tensor unpack hooks
    included, to Dynamo; a hook that recomputes a region must run eagerly
    there, as an opaque call in the graph. ``torch.compiler.disable`` is
    public (torch >= 2.1; checked 2.4.1-2.15.0); it imports Dynamo, so the
    disabled call is made on first use, not when remat is imported. Called
    only under compiled autograd, so an eager backward never pays for the
    disabled wrapper's extra frames.
    """
    return _disabled_call()(function, argument)


def outside_dynamo(function: F) -> F:
    """``function``, run with Dynamo's frame evaluation off (once Dynamo is loaded).

    Why: where Dynamo gives a frame back to eager Python (a graph break, an
    error it cannot trace), it goes on compiling each Python frame that frame
    calls, one by one. remat's eager engine is not written for that: compiled
    piecewise, the stores of a region's compressed inputs gave silently wrong
    gradients (torch 2.13). torch's own checkpoint code is on Dynamo's skip
    list; remat's cannot be (Dynamo must trace ``remat.checkpoint`` to reach
    the compiler's door), so the eager path itself turns Dynamo off with
    ``torch.compiler.disable`` (public). A program that never loads Dynamo
    pays one dictionary lookup. Checked 2.4.1-2.15.0.

    Example:
        >>> import torch
        >>> double = outside_dynamo(lambda t: t * 2)
        >>> double(torch.ones(2))
        tensor([2., 2.])
    """

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:  # nothing has compiled: no frame is evaluated
            return function(*args, **kwargs)
        return _disabled_call()(function, *args, **kwargs)

    return run  # type: ignore[return-value]


@functools.cache
def _disabled_call() -> Callable[..., Any]:
    def call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    disabled: Callable[..., Any] = torch.compiler.disable(call)  # type: ignore[no-untyped-call]
    return disabled


def graph_saved_tensor_hooks_inline() -> bool:
    """Whether AOTAutograd inlines saved-tensor hooks that are ``torch.fx.GraphModule``\\ s into
    the graphs it compiles (``torch._functorch._aot_autograd.utils.saved_tensors_hooks_are_inlineable``,
    private; present in 2.11.0 and 2.15.0, absent in 2.4.1 and 2.7.1, checked).

    Where it does, a ``remat.compress`` block compresses a compiled region's
    saved activations inside its compiled graphs (:func:`graph_hook`).
    """
    return _GRAPH_HOOKS_INLINE


def _graph_hooks_inline() -> bool:
    try:
        from torch._functorch._aot_autograd import utils
    except ImportError:
        return False
    return hasattr(utils, "saved_tensors_hooks_are_inlineable")


_GRAPH_HOOKS_INLINE = _graph_hooks_inline()


class _GraphHook(torch.fx.GraphModule):
    """A saved-tensor hook AOTAutograd takes for a graph: an (empty) ``GraphModule``
    whose call is a Python function.

    AOTAutograd checks ``isinstance(hook, GraphModule)`` and then traces the hook
    with ``make_fx`` on each intermediate a compiled graph saves, inlining the
    traced work into the forward and backward graphs (checked 2.11.0, 2.13.0,
    2.15.0); eager autograd calls it as the function. ``GraphModule`` calls a
    subclass's own ``__call__`` (its per-instance class defers to it).
    """

    def __init__(self, function: Callable[..., Any]) -> None:
        graph = torch.fx.Graph()
        graph.output(graph.placeholder("saved"))
        super().__init__({}, graph)
        self.function = function

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)


def inlining_saved_tensor_hook() -> bool:
    """Whether AOTAutograd is tracing a saved-tensor hook into a compiled graph right now.

    It sets a thread-local state around those calls, read by the private
    ``torch._functorch._aot_autograd.graph_compile._get_saved_tensor_hook_context``
    (checked 2.11.0, 2.13.0, 2.15.0; False where it is missing). A hook also runs
    under a tracer when a user traces an eager step (``make_fx``): there it
    must decide as in eager.
    """
    if not _GRAPH_HOOKS_INLINE:
        return False
    from torch._functorch._aot_autograd import graph_compile

    return graph_compile._get_saved_tensor_hook_context() is not None


def inside_compiled_function() -> bool:
    """Whether the caller runs inside the autograd Function of a region compiled by
    torch.compile (AOTAutograd's runtime wrappers are on the Python stack).

    A saved-tensor hook asks it where torch does not inline graph hooks
    (before 2.11): there a compiled graph's saved intermediates reach the hook
    without autograd history. The modules live under
    ``torch/_functorch/_aot_autograd/`` (checked 2.4.1, 2.7.1). It walks the
    Python stack, so it is asked only for such a tensor.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if "_aot_autograd" in frame.f_code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def graph_hook(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` as a saved-tensor hook that compiled graphs inline where torch does
    (:func:`graph_saved_tensor_hooks_inline`), else ``function`` itself."""
    return _GraphHook(function) if _GRAPH_HOOKS_INLINE else function
