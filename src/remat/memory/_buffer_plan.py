"""Inductor's buffer plan for one compiled graph, read as the allocations and frees
its generated code makes.

Layer: ``remat.memory``, on :mod:`remat._compat.inductor`, which runs inductor
up to its buffer plan and reads the plan's lines into plain values
(:class:`~remat._compat.inductor.PlannedLine`). This module follows the names
through those lines: which storage each name holds, and when the last name
holding a storage lets go of it. :class:`remat.memory.BufferPlan` shows the
resulting timeline to the memory trackers (``docs/design/compile.md``,
"Static estimates").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from remat._compat.inductor import PlannedLine, inductor_buffer_plan


def inductor_buffer_timeline(
    graph: torch.fx.GraphModule, example_inputs: Sequence[Any], **graph_kwargs: Any
) -> list[tuple[str, int, int]] | None:
    """What inductor's generated code for one partitioned graph allocates and frees, in order.

    Inductor lowers the graph, fuses and orders its kernels and plans its
    buffers (reusing a freed buffer of the same size) before it writes any
    code; :func:`~remat._compat.inductor.inductor_buffer_plan` runs all of
    that on ``example_inputs`` (fake tensors are enough) and stops once the
    buffer plan is made, so no kernel is compiled. Returns events
    ``("allocate", storage, nbytes)``, ``("free", storage, 0)`` and
    ``("free_input", index, 0)`` (the code drops its reference to input
    ``index``), storages numbered from 0; the storages not freed at the end
    are the graph's outputs. None where inductor writes no Python wrapper
    code (its C++ wrapper is on); inductor's own errors (an op it cannot
    lower on these inputs) propagate. ``graph`` is not changed.
    """
    plan = inductor_buffer_plan(graph, example_inputs, **graph_kwargs)
    if plan is None:
        return None
    inputs, lines = plan
    return _buffer_events(lines, inputs)


def _buffer_events(lines: Sequence[PlannedLine], inputs: Sequence[str]) -> list[tuple[str, int, int]]:
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

    def allocate(storage: tuple[int, int] | None) -> tuple[str, int]:
        number = allocated[0]
        allocated[0] += 1
        events.append(("allocate", number, _buffer_nbytes(storage)))
        return ("buffer", number)

    for index, name in enumerate(inputs):
        bind(name, [("input", index)])
    for line in lines:
        if line.kind == "allocate":
            keys = [allocate(storage) for storage in line.storages]
            if line.outputs:  # a multi-output kernel: one storage per output
                for output, key in zip(line.outputs, keys, strict=True):
                    storages_of_outputs[output] = key[1]
            bind(line.name, keys)
        elif line.kind == "output":
            storage = storages_of_outputs.get(line.name)
            keys = [("buffer", storage)] if storage is not None else list(holders.get(line.source, ()))
            bind(line.name, keys)
        elif line.kind == "alias":
            bind(line.name, list(holders.get(line.source, ())))
        elif line.kind == "free":
            drop(line.name)
    return events


def _buffer_nbytes(storage: tuple[int, int] | None) -> int:
    """Bytes of the storage a buffer owns, from its ``(elements, item size)``; 0 for a
    buffer that owns none (a view of another buffer's storage)."""
    if storage is None:
        return 0
    elements, itemsize = storage
    return elements * itemsize
