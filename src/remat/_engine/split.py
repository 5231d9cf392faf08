"""A backward split into an input pass and a weight pass: one recomputation per microbatch.

The zero-bubble pipeline schedules (``torch.distributed.pipelining``'s
``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``) run a stage's
backward of one microbatch as an input pass (``torch.autograd.grad`` to the
stage's inputs, graph retained) and later a weight pass (one
``torch.autograd.grad`` per parameter group). Each is its own backward call,
and a region is recomputed once per backward call: once for the input pass
and once more per parameter group. Here the calls of one microbatch share
the region's recomputation instead (``docs/design/pipelining.md``):

* a region entered in a stage's forward belongs to that stage's microbatch,
  a :class:`Microbatch` (found by :func:`microbatch_of_running_stage`, which
  also routes the stage's backward methods through :func:`_around`, once per
  stage);
* while the microbatch's input or weight pass runs, the region's store is
  keyed by the microbatch, not by the backward call (:meth:`Microbatch.key_for`),
  and keeps each recomputed tensor until autograd lets go of its saved
  tensor (``RecomputeStore.keeps``), not only until it is first handed out:
  the weight pass reruns nodes the input pass ran;
* the microbatch ends with its weight pass (or its whole backward), and its
  stores go with it.

What the weight pass reads is the region's choice (``weight_pass``):
``"keep"`` keeps the input pass's recomputation for it (one recomputation;
the block's activations live from the input pass to the weight pass),
``"recompute"`` drops it after the input pass and recomputes once for all the
weight pass's calls (two recomputations; only the inputs live in between).
A whole backward (the 1F1B schedules, and stage 0 under zero bubble) is one
call, as anywhere else.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, Literal

from remat._compat.pipelining import running_stage, wrap_stage_backward

__all__ = ["Microbatch", "WeightPass", "microbatch_of_running_stage"]

WeightPass = Literal["keep", "recompute"]
"""What a region's weight pass reads: see the module docstring."""

Phase = Literal["input", "weight"] | None


class Microbatch:
    """One microbatch of one stage: the key its regions' stores share while it is split.

    ``phase`` is the pass running now (None outside the microbatch's split
    backward); the stores keyed by it are dropped when it ends.
    """

    __slots__ = ("__weakref__", "_cleanups", "phase")

    def __init__(self) -> None:
        self.phase: Phase = None
        self._cleanups: list[Callable[[], None]] = []

    def key_for(self, weight_pass: WeightPass) -> Hashable | None:
        """The store key now of the recomputation of a region with this ``weight_pass``: this
        microbatch, or None (the backward call's own store)."""
        phase = self.phase
        if phase is None or (phase == "input" and weight_pass == "recompute"):
            return None
        return self

    def register_cleanup(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the microbatch ends (a frame drops its store)."""
        self._cleanups.append(callback)

    def end(self) -> None:
        self.phase = None
        cleanups, self._cleanups = self._cleanups, []
        for cleanup in cleanups:
            cleanup()


class _Stage:
    """What remat tracks of one pipeline stage: its microbatches whose backward has not ended."""

    __slots__ = ("microbatches",)

    def __init__(self) -> None:
        self.microbatches: dict[int, Microbatch] = {}


# Pipeline stages whose backward methods are routed through _around (weak: a
# stage dropped by its schedule is forgotten).
_STAGES: weakref.WeakKeyDictionary[Any, _Stage] = weakref.WeakKeyDictionary()


def microbatch_of_running_stage() -> Microbatch | None:
    """The microbatch a region entered now belongs to, or None outside a pipeline stage."""
    found = running_stage()
    if found is None:
        return None
    stage, chunk = found
    tracked = _STAGES.get(stage)
    if tracked is None:
        tracked = _STAGES[stage] = _Stage()
        wrap_stage_backward(stage, _around)
    microbatch = tracked.microbatches.get(chunk)
    if microbatch is None:
        microbatch = tracked.microbatches[chunk] = Microbatch()
    return microbatch


def _around(call: Callable[..., Any], kind: str, chunk: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One of a tracked stage's backward calls, with the microbatch's phase set around it."""
    stage = getattr(call, "__self__", None)
    tracked = _STAGES.get(stage)
    microbatch = tracked.microbatches.get(chunk) if tracked is not None else None
    if microbatch is None:  # no region in this microbatch's forward
        return call(*args, **kwargs)
    if kind == "input":
        microbatch.phase = "input"
        try:
            return call(*args, **kwargs)
        finally:
            microbatch.phase = None
    microbatch.phase = "weight" if kind == "weight" else None
    try:
        return call(*args, **kwargs)
    finally:  # the microbatch's backward is done
        assert tracked is not None, "remat bug: a microbatch without its stage"
        tracked.microbatches.pop(chunk, None)
        microbatch.end()
