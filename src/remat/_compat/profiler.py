"""The profiler: every allocation and free a memory profile saw, with its
address and time (the allocator's view, inductor's buffers included); and
``record_function``'s ops, run where no dispatch mode sees them.

Private names used: the profiler's event tree
(``kineto_results.experimental_event_tree()``) and its
``_ExtraFields_Allocation`` fields; ``torch._C._DisableTorchDispatch``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from remat._compat.dispatch import OpAnswer

__all__ = ["labels_unseen", "profiler_allocations"]


def profiler_allocations(profiler: Any, prefix: str) -> list[tuple[int, int, int, int, str, str]]:
    """What a finished ``torch.profiler.profile(profile_memory=True)`` saw, in time order.

    One tuple per event: ``(time_ns, order, address, signed bytes, device
    type, name)``: an allocation (positive bytes) or a free (negative) with
    ``name == ""``, or a ``record_function`` range whose name starts with
    ``prefix`` (bytes 0, address 0). ``order`` is the event's position in the
    profiler's tree, which breaks ties of equal times.

    The public ``profile.events()`` folds each allocation into the op that
    made it and gives no address; what an allocation meter needs (every
    allocation and free, its address and time, inductor's buffers included)
    is only in the profiler's event tree: ``kineto_results
    .experimental_event_tree()`` and its ``_ExtraFields_Allocation`` fields
    ``ptr``, ``alloc_size``, ``device`` (checked 2.4.1, 2.7.1, 2.11.0, 2.13.0,
    2.15.0).
    """
    events: list[tuple[int, int, int, int, str, str]] = []
    stack = list(reversed(profiler.profiler.kineto_results.experimental_event_tree()))
    while stack:
        node = stack.pop()
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            events.append(
                (node.start_time_ns, len(events), int(fields.ptr), int(fields.alloc_size),
                 fields.device.type, "")
            )
        elif node.name.startswith(prefix):
            events.append((node.start_time_ns, len(events), 0, 0, "", node.name))
        stack.extend(reversed(node.children))
    events.sort()
    return events


def labels_unseen() -> dict[Any, OpAnswer]:
    """``torch.profiler.record_function``'s ops, run below every dispatch mode: answers
    (``remat._compat.dispatch.OpAnswer``) for a simulated rank's tracker.

    A label (FSDP2's hooks, the pipeline stages', the optimizer's step) enters and leaves
    through the ops ``profiler._record_function_enter_new`` and
    ``profiler._record_function_exit``, which every dispatch mode sees. Under a fake mode
    each one takes its uncached path (about 240 us on 2 cores) to hand back a handle that
    holds no tensor: some 700 ops in one Llama-3.1-8B pipeline rank's step. With Python
    dispatch off (``torch._C._DisableTorchDispatch``, private, what
    ``torch.utils._mode_utils.no_dispatch`` uses) the kernel hands back the same handle
    and a running profiler still records the label. Only that pair is answered: the older
    ``_record_function_enter`` returns its handle as a tensor, which a fake mode makes
    fake, so its exit (``_record_function_exit.default``) stays in the fake mode too. The
    ops and their overloads are the same on 2.4.1, 2.11.0, 2.13.0 and 2.15.0.
    """
    ops = torch.ops.profiler
    return {op: _unseen(op) for op in (ops._record_function_enter_new.default, ops._record_function_exit._RecordFunction)}


def _unseen(op: Any) -> OpAnswer:
    def answer(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        with torch._C._DisableTorchDispatch():
            return op(*args, **kwargs)

    return answer
