"""Inductor: its front end run with remat's own inner compiler, and the
buffer plan of the wrapper code it would write for one graph, read without
compiling a kernel.

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
from typing import Any

import torch

__all__ = ["inductor_buffer_timeline", "inductor_front_end"]


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


class _TimelineReady(BaseException):
    """Carries the buffer timeline out of inductor's code generator, which it stops
    before any kernel is compiled (a BaseException: inductor wraps ``Exception``s)."""

    def __init__(self, events: list[tuple[str, int, int]]) -> None:
        super().__init__("remat: inductor's buffer timeline (internal signal)")
        self.events = events


def inductor_buffer_timeline(
    graph: torch.fx.GraphModule, example_inputs: Sequence[Any], **graph_kwargs: Any
) -> list[tuple[str, int, int]] | None:
    """What inductor's generated code for one partitioned graph allocates and frees, in order.

    Inductor lowers the graph, fuses and orders its kernels and plans its
    buffers (reusing a freed buffer of the same size) before it writes any
    code; this runs all of that on ``example_inputs`` (fake tensors are
    enough) and stops once the buffer plan is made, so no kernel is compiled.
    Returns events ``("allocate", storage, nbytes)``, ``("free", storage,
    0)`` and ``("free_input", index, 0)`` (the code drops its reference to
    input ``index``), storages numbered from 0; the storages not freed at the
    end are the graph's outputs. None where inductor's lowering cannot run
    here (an op it cannot lower on these inputs). ``graph`` is not changed.

    Private: ``compile_fx_inner`` and the wrapper's memory-planning lines
    (``torch._inductor.codegen.wrapper``: allocate, free, reuse, reinterpret,
    multi-output), read after ``memory_plan_reuse``. Checked on 2.11.0,
    2.13.0 and 2.15.0 (static estimates need 2.11,
    ``remat._compat.versions.static_compile_supported``).
    """
    import torch._inductor.config as inductor_config
    from torch._inductor import ir
    from torch._inductor.codegen import wrapper as codegen
    from torch._inductor.compile_fx import compile_fx_inner

    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(graph.graph, {}))
    module = torch.fx.GraphModule(graph, copy)  # post-grad passes rewrite the graph they get
    inputs = [node.target for node in copy.nodes if node.op == "placeholder"]
    with _PLANNING_LOCK:  # one patch at a time: a second would restore the first's hook
        planned: Callable[[Any], None] = codegen.PythonWrapperCodegen.memory_plan_reuse

        def stop_after_planning(wrapper: Any) -> None:
            planned(wrapper)
            if _PLANNING_ONLY.get():  # another thread's real compile goes on to its kernels
                raise _TimelineReady(_buffer_events(wrapper.lines, inputs, ir, codegen))

        codegen.PythonWrapperCodegen.memory_plan_reuse = stop_after_planning  # type: ignore[method-assign]
        token = _PLANNING_ONLY.set(True)
        try:
            # A backward graph is compiled when backward first runs, outside the front
            # end's switches: the FX-graph cache would hand back a real compile's code.
            # Unvectorized C++ kernels: vector width changes a kernel's loops, not
            # which buffers it reads and writes, and scalar code is written sooner.
            with inductor_config.patch({"fx_graph_cache": False, "cpp.simdlen": 1}):
                compile_fx_inner(module, list(example_inputs), **graph_kwargs)
        except _TimelineReady as ready:
            return ready.events
        finally:
            _PLANNING_ONLY.reset(token)
            codegen.PythonWrapperCodegen.memory_plan_reuse = planned  # type: ignore[method-assign]
    return None  # no Python wrapper code was written (inductor's C++ wrapper is on)


_PLANNING_LOCK = threading.Lock()


_PLANNING_ONLY: ContextVar[bool] = ContextVar("remat_inductor_planning_only", default=False)
"""Whether inductor's code generator, in this context, stops once its buffers are planned."""


def _buffer_events(lines: Sequence[Any], inputs: Sequence[Any], ir: Any, codegen: Any) -> list[tuple[str, int, int]]:
    """Follow the wrapper's names through its planned lines: which storage each name
    holds, and when the last name holding a storage lets go of it."""
    events: list[tuple[str, int, int]] = []
    holders: dict[str, list[tuple[str, int]]] = {}
    counts: dict[tuple[str, int], int] = {}
    storages_of_outputs: dict[str, int] = {}
    allocated = [0]

    def bind(name: str, keys: list[tuple[str, int]]) -> None:
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
        drop(name)
        holders[name] = keys

    def drop(name: str) -> None:
        for key in holders.pop(name, ()):
            counts[key] -= 1
            if counts[key] == 0:
                events.append(("free_input", key[1], 0) if key[0] == "input" else ("free", key[1], 0))

    def allocate(node: Any) -> tuple[str, int]:
        storage = allocated[0]
        allocated[0] += 1
        events.append(("allocate", storage, _buffer_nbytes(node, ir)))
        return ("buffer", storage)

    for index, name in enumerate(inputs):
        bind(str(name), [("input", index)])
    for line in lines:
        if isinstance(line, codegen.AllocateLine):
            bind(line.node.get_name(), [allocate(line.node)])
        elif isinstance(line, codegen.ExternKernelAllocLine):
            if isinstance(line.node.layout, ir.MultiOutputLayout):
                keys = []
                for output in getattr(line.node, "outputs", ()):
                    if isinstance(output, ir.MultiOutput):
                        key = allocate(output)
                        storages_of_outputs[output.get_name()] = key[1]
                        keys.append(key)
                bind(line.node.get_name(), keys)
            else:
                bind(line.node.get_name(), [allocate(line.node)])
        elif isinstance(line, codegen.MultiOutputLine):
            storage = storages_of_outputs.get(line.result_name)
            keys = [("buffer", storage)] if storage is not None else list(holders.get(line.arg_name, ()))
            bind(line.result_name, keys)
        elif isinstance(line, (codegen.ReuseLine, codegen.ReinterpretLine)):
            old = line.node.get_name()
            bind(line.reused_as.get_name(), list(holders.get(old, ())))
            if isinstance(line, codegen.ReuseLine) and line.delete_old:
                drop(old)
        elif isinstance(line, codegen.FreeIfNotReusedLine):
            if not line.is_reused:
                drop(line.node.get_name())
        elif isinstance(line, codegen.FreeLine):
            drop(line.node.get_name())
    return events


def _buffer_nbytes(node: Any, ir: Any) -> int:
    layout = node.get_layout()
    if not isinstance(layout, ir.Layout) or isinstance(layout, ir.NonOwningLayout):
        return 0
    return int(layout.storage_size()) * int(layout.dtype.itemsize)
