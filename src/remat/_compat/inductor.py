"""Inductor: its front end run with remat's own inner compiler, and the
buffer plan of the wrapper code it would write for one graph, read without
compiling a kernel.

remat's reading of that plan (which storage each name holds, and when the
last name holding a storage lets go of it) is :mod:`remat.memory._buffer_plan`;
this module only calls into inductor and reads its objects into plain values
(:class:`PlannedLine`).

Private names used: ``torch._inductor.compile_fx`` (``compile_fx``,
``compile_fx_inner``), ``torch._inductor.config``,
``torch._functorch.config.enable_autograd_cache``,
``torch._inductor.codegen.wrapper`` (``PythonWrapperCodegen.memory_plan_reuse``
and its memory-planning line classes) and ``torch._inductor.ir`` (layouts,
multi-output nodes). All are imported on first use: remat's import must not
load inductor.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch

__all__ = ["PlannedLine", "inductor_buffer_plan", "inductor_front_end"]


def inductor_front_end(
    graph: torch.fx.GraphModule, example_inputs: Sequence[Any], inner_compile: Callable[..., Any]
) -> Callable[..., Any]:
    """Compile a Dynamo graph as inductor does up to its code generation: ``inner_compile``
    gets each partitioned graph instead of inductor's kernel generator.

    Inductor's ``compile_fx`` decomposes the graph with inductor's own table,
    runs its joint-graph passes and its min-cut partitioner (what the
    forward saves for backward is decided there), then hands the forward
    and the backward graph to ``inner_compile`` (its keyword argument, whose
    default generates the kernels). A static estimate passes its own, which
    runs no code generator and needs no real tensor (``docs/design/compile.md``,
    "Static estimates"). ``torch._inductor.compile_fx`` is private; the
    keyword and the graphs it receives (aten graphs whose nodes carry fake
    values) were checked on 2.4.1, 2.7.1, 2.11.0, 2.13.0 and 2.15.0.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    # The compile caches would serve a graph compiled for real before (same
    # graph, same settings) with its kernels, and never call inner_compile:
    # the "static" block would run real code. Their switches are private
    # configs (enable_autograd_cache from 2.5; fx_graph_cache in every
    # checked release).
    caches_off = {"fx_graph_cache": False}
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(caches_off))
        if hasattr(functorch_config, "enable_autograd_cache"):
            stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        compiled: Any = compile_fx(graph, list(example_inputs), inner_compile=inner_compile)
    assert callable(compiled), "remat bug: inductor's front end returned no callable"
    return compiled  # type: ignore[no-any-return]


class PlannedLine(NamedTuple):
    """What one memory-planning line of inductor's wrapper code does to the names
    that hold storages, in plain values.

    ``kind`` is one of:

    * ``"allocate"``: ``name`` holds new storages, one per entry of
      ``storages``: the ``(elements, item size)`` of the storage it owns, or
      None where its layout owns none (a view of another buffer). A kernel
      with several outputs allocates one per output; ``outputs`` names them,
      in the same order;
    * ``"output"``: ``name`` is an output of the multi-output kernel ``source``;
    * ``"alias"``: ``name`` holds what ``source`` holds (a buffer reused or
      reinterpreted under a new name);
    * ``"free"``: the code drops ``name``.
    """

    kind: str
    name: str
    source: str = ""
    storages: tuple[tuple[int, int] | None, ...] = ()
    outputs: tuple[str, ...] = ()


class _PlanReady(BaseException):
    """Carries the planned lines out of inductor's code generator, which it stops
    before any kernel is compiled (a BaseException: inductor wraps ``Exception``s)."""

    def __init__(self, lines: list[PlannedLine]) -> None:
        super().__init__("remat: inductor's buffer plan (internal signal)")
        self.lines = lines


def inductor_buffer_plan(
    graph: torch.fx.GraphModule, example_inputs: Sequence[Any], **graph_kwargs: Any
) -> tuple[list[str], list[PlannedLine]] | None:
    """The names of one partitioned graph's inputs, and the memory-planning lines of
    the wrapper code inductor would write for it, in order.

    Inductor lowers the graph, fuses and orders its kernels and plans its
    buffers (reusing a freed buffer of the same size) before it writes any
    code; this runs all of that on ``example_inputs`` (fake tensors are
    enough) and stops once the buffer plan is made, so no kernel is compiled.
    None where inductor writes no Python wrapper code (its C++ wrapper is on);
    inductor's own errors (an op it cannot lower on these inputs) propagate.
    ``graph`` is not changed.

    Private: ``compile_fx_inner``, and the wrapper's memory-planning lines
    (``torch._inductor.codegen.wrapper``: allocate, free, reuse, reinterpret,
    multi-output), read after ``PythonWrapperCodegen.memory_plan_reuse``,
    which is replaced for the call by one that reads them and stops, under a
    lock, and restored after it. Checked on 2.11.0, 2.13.0 and 2.15.0 (static
    estimates need 2.11, ``remat._compat.versions.static_compile_supported``).
    """
    import torch._inductor.config as inductor_config
    from torch._inductor import ir
    from torch._inductor.codegen import wrapper as codegen
    from torch._inductor.compile_fx import compile_fx_inner

    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(graph.graph, {}))
    module = torch.fx.GraphModule(graph, copy)  # post-grad passes rewrite the graph they get
    inputs = [str(node.target) for node in copy.nodes if node.op == "placeholder"]
    with _PLANNING_LOCK:  # one patch at a time: a second would restore the first's hook
        planned: Callable[[Any], None] = codegen.PythonWrapperCodegen.memory_plan_reuse

        def stop_after_planning(wrapper: Any) -> None:
            planned(wrapper)
            if _PLANNING_ONLY.get():  # another thread's real compile goes on to its kernels
                raise _PlanReady(_planned_lines(wrapper.lines, ir, codegen))

        codegen.PythonWrapperCodegen.memory_plan_reuse = stop_after_planning  # type: ignore[method-assign]
        token = _PLANNING_ONLY.set(True)
        try:
            # A backward graph is compiled when backward first runs, outside the front
            # end's switches: the FX-graph cache would hand back a real compile's code.
            # Unvectorized C++ kernels: vector width changes a kernel's loops, not
            # which buffers it reads and writes, and scalar code is written sooner.
            with inductor_config.patch({"fx_graph_cache": False, "cpp.simdlen": 1}):
                compile_fx_inner(module, list(example_inputs), **graph_kwargs)
        except _PlanReady as ready:
            return inputs, ready.lines
        finally:
            _PLANNING_ONLY.reset(token)
            codegen.PythonWrapperCodegen.memory_plan_reuse = planned  # type: ignore[method-assign]
    return None  # no Python wrapper code was written (inductor's C++ wrapper is on)


_PLANNING_LOCK = threading.Lock()
_PLANNING_ONLY: ContextVar[bool] = ContextVar("remat_inductor_planning_only", default=False)
"""Whether inductor's code generator, in this context, stops once its buffers are planned."""


def _planned_lines(lines: Sequence[Any], ir: Any, codegen: Any) -> list[PlannedLine]:
    """The wrapper's lines that allocate, alias or free buffers, as :class:`PlannedLine`\\ s.

    A reuse line whose old name is deleted also frees that name; a
    free-if-not-reused line frees only a buffer no later one reuses.
    """
    planned: list[PlannedLine] = []
    for line in lines:
        if isinstance(line, codegen.AllocateLine):
            planned.append(PlannedLine("allocate", line.node.get_name(), storages=(_owned_storage(line.node, ir),)))
        elif isinstance(line, codegen.ExternKernelAllocLine):
            if isinstance(line.node.layout, ir.MultiOutputLayout):
                outputs = [output for output in getattr(line.node, "outputs", ()) if isinstance(output, ir.MultiOutput)]
                planned.append(PlannedLine(
                    "allocate", line.node.get_name(),
                    storages=tuple(_owned_storage(output, ir) for output in outputs),
                    outputs=tuple(output.get_name() for output in outputs),
                ))
            else:
                planned.append(PlannedLine("allocate", line.node.get_name(), storages=(_owned_storage(line.node, ir),)))
        elif isinstance(line, codegen.MultiOutputLine):
            planned.append(PlannedLine("output", line.result_name, line.arg_name))
        elif isinstance(line, (codegen.ReuseLine, codegen.ReinterpretLine)):
            old = line.node.get_name()
            planned.append(PlannedLine("alias", line.reused_as.get_name(), old))
            if isinstance(line, codegen.ReuseLine) and line.delete_old:
                planned.append(PlannedLine("free", old))
        elif isinstance(line, codegen.FreeIfNotReusedLine):
            if not line.is_reused:
                planned.append(PlannedLine("free", line.node.get_name()))
        elif isinstance(line, codegen.FreeLine):
            planned.append(PlannedLine("free", line.node.get_name()))
    return planned


def _owned_storage(node: Any, ir: Any) -> tuple[int, int] | None:
    """(elements, item size) of the storage an inductor buffer's layout owns; None where
    it owns none (a ``NonOwningLayout``, a view of another buffer's storage, or an
    output spec that is no ``Layout``)."""
    layout = node.get_layout()
    if not isinstance(layout, ir.Layout) or isinstance(layout, ir.NonOwningLayout):
        return None
    return int(layout.storage_size()), int(layout.dtype.itemsize)
