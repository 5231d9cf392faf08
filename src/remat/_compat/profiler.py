"""The profiler: every allocation and free a memory profile saw, with its
address and time (the allocator's view, inductor's buffers included).

Private names used: the profiler's event tree
(``kineto_results.experimental_event_tree()``) and its
``_ExtraFields_Allocation`` fields.
"""

from __future__ import annotations

from typing import Any

__all__ = ["profiler_allocations"]


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
