"""Dynamo's switches and errors: room for more compiled versions of one code
object, and the exceptions torch.compile raises when it cannot compile a
function as asked (a graph break, or a failure of the compiler).

Private names used: ``torch._dynamo.config`` (``recompile_limit``;
``cache_size_limit`` before torch 2.6) and ``torch._dynamo.exc``. Both are imported on first
use: remat's import must not load Dynamo.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["compile_cache_room", "compile_errors", "graph_break_errors"]


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

