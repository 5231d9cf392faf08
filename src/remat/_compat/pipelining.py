"""torch.distributed.pipelining: the stage a forward runs in, and the stage's backward calls.

A pipeline schedule runs each stage's forward and backward microbatch by
microbatch through the stage's methods: ``forward_one_chunk(fwd_chunk_id,
...)``, ``backward_one_chunk(bwd_chunk_id, loss, full_backward,
last_backward)`` (with ``full_backward=False`` the zero-bubble schedules'
input pass, ``stage_backward_input``) and
``backward_weight_one_chunk(bwd_chunk_id, last_backward)`` (the weight pass,
one ``torch.autograd.grad`` per parameter group). No public API says which
stage and microbatch a forward belongs to, nor when a backward is split:
these are the methods of the private ``_PipelineStageBase``, with the same
names and argument names on every release that splits backward (checked
2.7.1, 2.11.0, 2.13.0, 2.15.0). 2.4.1 has pipelining without a split backward
(no ``backward_weight_one_chunk``): there no stage is found, and regions are
ordinary ones. On a simulated rank, a stage's private
``_output_slot_is_releasable`` is answered as for plain tensors
(:func:`release_fake_outputs_as_plain`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from types import CodeType
from typing import Any

import torch

from remat._compat.dispatch import OpAnswer

__all__ = [
    "is_multi_stage",
    "release_fake_outputs_as_plain",
    "running_stage",
    "schedule_class",
    "static_shapes_voted",
    "wrap_stage_backward",
]

_STAGE_MODULE = "torch.distributed.pipelining.stage"


@functools.cache
def _forward_code() -> CodeType | None:
    """The code of ``_PipelineStageBase.forward_one_chunk``; None where stages never split
    their backward (no ``backward_weight_one_chunk``: torch 2.4), so nothing is tracked."""
    base = getattr(sys.modules[_STAGE_MODULE], "_PipelineStageBase", None)
    if not hasattr(base, "backward_weight_one_chunk"):
        return None
    forward = getattr(base, "forward_one_chunk", None)
    return getattr(forward, "__code__", None)


def running_stage() -> tuple[Any, int] | None:
    """The pipeline stage whose ``forward_one_chunk`` is running on this thread, and its
    microbatch; None outside one (and always where pipelining was never imported).

    A stage calls its module's forward from ``forward_one_chunk`` on the thread
    that runs the schedule, so the Python stack holds that frame; its locals give
    the stage (``self``) and the microbatch (``fwd_chunk_id``).
    """
    if _STAGE_MODULE not in sys.modules:
        return None
    code = _forward_code()
    if code is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            local = frame.f_locals
            chunk: int = local["fwd_chunk_id"]
            return local["self"], chunk
        frame = frame.f_back  # type: ignore[assignment]
    return None


def wrap_stage_backward(
    stage: Any,
    around: Callable[[Callable[..., Any], str, int, tuple[Any, ...], dict[str, Any]], Any],
) -> None:
    """Route ``stage``'s two backward methods through ``around(call, kind, chunk, args, kwargs)``,
    on this stage object only (instance attributes shadow the class's methods, which
    the schedules call through the instance).

    ``kind`` is ``"input"`` for ``backward_one_chunk(..., full_backward=False)``,
    ``"full"`` for a whole backward, ``"weight"`` for ``backward_weight_one_chunk``;
    ``chunk`` is the microbatch.
    """
    backward, weight = stage.backward_one_chunk, stage.backward_weight_one_chunk

    def backward_one_chunk(*args: Any, **kwargs: Any) -> Any:
        chunk = kwargs["bwd_chunk_id"] if "bwd_chunk_id" in kwargs else args[0]
        full = kwargs["full_backward"] if "full_backward" in kwargs else (args[2] if len(args) > 2 else True)
        return around(backward, "full" if full else "input", chunk, args, kwargs)

    def backward_weight_one_chunk(*args: Any, **kwargs: Any) -> Any:
        chunk = kwargs["bwd_chunk_id"] if "bwd_chunk_id" in kwargs else args[0]
        return around(weight, "weight", chunk, args, kwargs)

    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def release_fake_outputs_as_plain(stage: Any) -> None:
    """On a simulated rank, let ``stage`` drop a fake output once its send is waited, as it
    drops the plain tensor that output stands for on a real rank.

    From torch 2.15 a stage lets go of a forward output when the send of it completes
    (``release_fwd_send_outputs``; backward starts from the output's gradient edge), but
    only of an output whose type is exactly ``torch.Tensor``
    (``_PipelineStageBase._output_slot_is_releasable``, private). A ``FakeTensor`` fails that
    test, so a simulated stage kept every sent output until its backward: one stage output
    per microbatch in flight more than the real rank (rank 0 of GPipe over 2 ranks, 16 KiB
    of the embedded GPT, measured). The stage's own decision still runs, on a plain
    stand-in of no data: its other reasons to keep outputs (last stage, DDP, a custom
    ``dw_builder``) hold as on a real rank. torch 2.11 and 2.13 have no such method (they
    keep outputs until backward for every type): there this does nothing (checked 2.11.0,
    2.13.0, 2.15.0).
    """
    decide = getattr(stage, "_output_slot_is_releasable", None)
    if decide is None:
        return
    from remat._compat.fake import is_fake, outside_fake_mode

    with outside_fake_mode():  # made before the step is tracked, on no device's memory
        plain = torch.empty(0, device="meta")

    def releasable(output: Any) -> Any:
        return decide(plain if is_fake(output) else output)

    stage._output_slot_is_releasable = releasable


def schedule_class(name: str) -> type | None:
    """``torch.distributed.pipelining.schedules.<name>`` (e.g. ``"Schedule1F1B"``), or None
    where this torch lacks it (the zero-bubble schedules are newer than 2.4;
    ``ScheduleDualPipeV`` is in 2.8 and newer)."""
    from torch.distributed.pipelining import schedules

    found = getattr(schedules, name, None)
    return found if isinstance(found, type) else None


def is_multi_stage(schedule: type) -> bool:
    """Whether a schedule runs several stages on each rank (``PipelineScheduleMulti``)."""
    from torch.distributed.pipelining import schedules

    return issubclass(schedule, schedules.PipelineScheduleMulti)


def _answer_the_vote(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    from remat._compat.fake import is_fake  # only simulations load the fake-tensor module

    if is_fake(args[0]) and _inside_the_vote():
        return 1
    return NotImplemented


def _inside_the_vote() -> bool:
    """Whether the schedules' warm-up vote (``_warmup_p2p``) is on this thread's stack."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_warmup_p2p" and frame.f_globals.get("__name__") == _SCHEDULES_MODULE:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


_SCHEDULES_MODULE = "torch.distributed.pipelining.schedules"


def static_shapes_voted() -> dict[Any, OpAnswer]:
    """On a simulated rank (fake tensors, a process group that moves no data), the
    ranks' vote on static shapes reads as "static": answers
    (``remat._compat.dispatch.OpAnswer``) for the rank's tracker.

    On its first step a schedule of torch 2.13 all-reduces a flag saying every stage
    knows its shapes and reads it with ``.item()`` (``_warmup_p2p``), which a fake
    tensor cannot answer. Every simulated rank builds its stages with example inputs
    and outputs, so every rank votes static, and 1 is the vote's value. torch 2.11 has
    no vote and 2.15 skips it under the "fake" backend (checked 2.11.0, 2.13.0,
    2.15.0); there it is never asked. Only a read inside ``_warmup_p2p`` is
    answered: a model that reads a fake tensor's value is still refused.
    """
    return {torch.ops.aten._local_scalar_dense.default: _answer_the_vote}
