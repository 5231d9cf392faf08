"""Dynamo's switches and errors: room for more compiled versions of one code
object, and the exceptions torch.compile raises when it cannot compile a
function as asked (a graph break, or a failure of the compiler).

Private names used: ``torch._dynamo.config`` (``recompile_limit``;
``cache_size_limit`` before torch 2.6) and ``torch._dynamo.exc``. Both are imported on first
use: remat's import must not load Dynamo.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["compile_cache_room", "compile_errors", "graph_break_errors", "outside_dynamo"]

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def compile_cache_room(entries: int) -> Iterator[None]:
    """Let torch.compile keep ``entries`` compiled versions of one function for a while.

    Blocks compiled with ``module.compile()`` share one code object
    (``nn.Module._call_impl``), and Dynamo keeps at most ``recompile_limit``
    (``cache_size_limit`` before 2.6) versions of a code object; a planner
    that compiles every option of a block in one process needs more for the
    length of its profile. Its private config is the only switch (checked
    2.4.1, 2.7.1, 2.11.0, 2.13.0, 2.15.0).
    """
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    with dynamo_config.patch(**{name: max(entries, getattr(dynamo_config, name))}):
        yield


def compile_errors() -> tuple[type[BaseException], ...]:
    """The exceptions torch.compile raises when it cannot compile a function as asked.

    ``torch._dynamo.exc.TorchDynamoException`` is the base of Dynamo's
    errors (graph breaks under ``fullgraph=True``, backend failures); its
    module is private (checked 2.4.1-2.15.0).
    """
    from torch._dynamo.exc import TorchDynamoException

    return (TorchDynamoException,)


def graph_break_errors() -> tuple[type[BaseException], ...]:
    """The compile errors that are graph breaks: Dynamo could not trace the code (``fullgraph=True``).

    ``torch._dynamo.exc.Unsupported`` and ``UserError`` (private module;
    checked 2.4.1-2.15.0). ``UserError`` subclasses ``Unsupported`` up to 2.11
    but not from 2.13, where a Python branch on a tensor's value (``float(t) >
    0``) is captured as an unbacked scalar and refused as ``UserError``: the
    same break in the traced code. Every other :func:`compile_errors` error is
    a failure of the compiler (a backend or inductor error).
    """
    from torch._dynamo.exc import Unsupported, UserError

    return (Unsupported, UserError)


def outside_dynamo(function: F) -> F:
    """``function``, run with Dynamo's frame evaluation off (once Dynamo is loaded).

    Why: where Dynamo gives a frame back to eager Python (a graph break, an
    error it cannot trace), it goes on compiling each Python frame that frame
    calls, one by one. remat's eager engine is not written for that: compiled
    piecewise, the stores of a region's compressed inputs gave silently wrong
    gradients (torch 2.13). torch's own checkpoint code is on Dynamo's skip
    list; remat's cannot be (Dynamo must trace ``remat.checkpoint`` to reach
    the compiler's door), so the eager path itself turns Dynamo off, the way
    ``torch.compiler.disable`` does (public; Dynamo loaded on first use, and
    never for a program that does not compile). Checked 2.4.1-2.15.0.

    Example:
        >>> import torch
        >>> double = outside_dynamo(lambda t: t * 2)
        >>> double(torch.ones(2))
        tensor([2., 2.])
    """
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:  # nothing has compiled: no frame is evaluated
            return function(*args, **kwargs)
        if not disabled:
            import torch.compiler

            disabled.append(torch.compiler.disable(function))  # type: ignore[no-untyped-call]
        return disabled[0](*args, **kwargs)

    return run  # type: ignore[return-value]
