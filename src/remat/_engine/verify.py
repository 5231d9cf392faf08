"""Check that a recomputation saves what the forward saved, and explain when not.

Determinism check (``determinism_check="default"``): every tensor the forward
saves records its (shape, dtype, device); the recomputation compares each
tensor as it is saved and stops at the *first* mismatch, so the error points
at the place the two runs diverged instead of listing everything after it.

Debug log (``debug=True``): a small dispatch mode records every operator of
the forward and of the recomputation with its output metadata and the user's
source line (the innermost stack frame outside torch and remat). Both logs
leave out the ops a selective policy never sees (detaches and metadata
queries): checkpointing detaches the tensors a recomputation saves, so the
recomputation's log would otherwise have entries the forward's lacks. On a
mismatch, the error names the first operator whose recomputed output differs
(or the first one the recomputation did not run) and shows both sides; the
full logs follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from remat._compat.autograd import version_of
from remat._compat.dispatch import TorchDispatchMode
from remat._engine.selective import SAC_IGNORED_OPS
from remat.errors import CheckpointError, RecomputeMismatchError, SavedTensorMeta

__all__ = [
    "DETERMINISM_CHECKS",
    "OpLog",
    "count_mismatch",
    "metadata_mismatch",
    "saved_meta",
    "stale_read",
    "user_line",
]

DETERMINISM_CHECKS = ("default", "none")

_DEBUG_TIP = (
    "Tip: pass debug=True to remat.checkpoint (or run the forward under "
    "remat.set_checkpoint_debug_enabled(True)) to see which operator differs and where."
)
_DEBUG_BLOCKED_TIP = (
    "Tip: debug=True was passed, but remat.set_checkpoint_debug_enabled(False) was in "
    "force when the forward ran, and it overrides the argument. Run the forward outside "
    "that block (or under set_checkpoint_debug_enabled(None) or (True)) to see which "
    "operator differs and where."
)

Meta = tuple[tuple[int, ...], torch.dtype, torch.device]
"""Shape, dtype and device of a saved tensor. A region's forward stores the
shape as a plain tuple (no ``torch.Size``): a tuple of ints and these C types
is one the garbage collector stops tracking, and it compares equal to the
recomputed tensor's ``Size`` (docs/design/performance.md, "Objects a region keeps")."""


def saved_meta(tensor: torch.Tensor) -> Meta:
    """What the default determinism check compares."""
    return (tensor.shape, tensor.dtype, tensor.device)


def _as_meta(meta: Meta) -> SavedTensorMeta:
    return SavedTensorMeta(tuple(meta[0]), str(meta[1]), str(meta[2]))


def user_line() -> str:
    """``file:line in function`` of the innermost frame of user code."""
    from remat._source import user_frame  # debug logs and errors only: keep import remat lean

    frame = user_frame()
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


@dataclass(frozen=True)
class OpRecord:
    """One operator call: name, output metadata, and where the user called it."""

    op: str
    outputs: tuple[SavedTensorMeta, ...]
    source: str

    def __str__(self) -> str:
        outs = "; ".join(str(meta) for meta in self.outputs) or "no tensor output"
        return f"{self.op} -> {outs}\n      at {self.source}"


class OpLog(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records each operator that runs while active (debug mode only)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.records: list[OpRecord] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in SAC_IGNORED_OPS:
            return out
        results = out if isinstance(out, (tuple, list)) else (out,)
        metas = tuple(
            _as_meta(saved_meta(value)) for value in results if isinstance(value, torch.Tensor)
        )
        self.records.append(OpRecord(str(func), metas, user_line()))
        return out


def _first_divergence(
    forward: list[OpRecord], recompute: list[OpRecord]
) -> tuple[str, OpRecord | None]:
    """Text about the first operator that differs, and that operator's recompute record."""
    for position, (before, after) in enumerate(zip(forward, recompute, strict=False)):
        if before.op != after.op or before.outputs != after.outputs:
            text = (
                f"First operator that differs (#{position}):\n"
                f"  forward:   {before}\n  recompute: {after}"
            )
            return text, after
    if len(recompute) > len(forward):
        extra = recompute[len(forward)]
        return f"The recomputation ran an extra operator (#{len(forward)}):\n  recompute: {extra}", extra
    if len(forward) > len(recompute):
        missing = forward[len(recompute)]
        return (
            f"The recomputation did not run operator #{len(recompute)} of the forward:\n"
            f"  forward:   {missing}",
            missing,
        )
    return "Every operator the recomputation ran matches the forward's (same op and outputs).", None


def _render_log(title: str, records: list[OpRecord]) -> str:
    lines = [f"{title} ({len(records)} operators):"]
    lines += [f"  #{position} {record}" for position, record in enumerate(records)]
    return "\n".join(lines)


def explain(
    forward: OpLog | None, recompute: OpLog | None, debug_blocked: bool = False
) -> tuple[str, str | None]:
    """Debug text to append to a mismatch error, and the first differing op.

    ``debug_blocked``: ``debug=True`` was passed but the context setting turned it off.
    """
    if forward is None or recompute is None:
        return _DEBUG_BLOCKED_TIP if debug_blocked else _DEBUG_TIP, None
    divergence, differing = _first_divergence(forward.records, recompute.records)
    text = "\n\n".join(
        [
            divergence,
            _render_log("Operators of the original forward", forward.records),
            _render_log("Operators of the recomputation", recompute.records),
        ]
    )
    return text, None if differing is None else str(differing)


def metadata_mismatch(
    index: int,
    forward_meta: Meta,
    recompute_meta: Meta,
    logs: tuple[OpLog | None, OpLog | None],
    debug_blocked: bool = False,
) -> RecomputeMismatchError:
    """The error for a saved tensor whose metadata changed in recomputation."""
    before, after = _as_meta(forward_meta), _as_meta(recompute_meta)
    detail, op_hint = explain(*logs, debug_blocked)
    return RecomputeMismatchError(
        "remat.checkpoint: the recomputation saved a tensor with different metadata than "
        f"the original forward (saved tensor #{index}).\n"
        f"  forward:   {before}\n  recompute: {after}\n"
        "The checkpointed function must run the same operations on the same shapes "
        "when it is recomputed in backward (no data-dependent control flow on values "
        "that change, no global state that differs). Pass determinism_check='none' to "
        f"skip this check if the difference is intended.\n{detail}",
        index=index,
        forward=before,
        recompute=after,
        op_hint=op_hint,
    )


def count_mismatch(
    forward_count: int,
    recompute_count: int,
    logs: tuple[OpLog | None, OpLog | None],
    debug_blocked: bool = False,
) -> RecomputeMismatchError:
    """The error for a recomputation that saved more or fewer tensors."""
    relation = "more" if recompute_count > forward_count else "fewer"
    detail, op_hint = explain(*logs, debug_blocked)
    return RecomputeMismatchError(
        f"remat.checkpoint: the recomputation saved {relation} tensors for backward than "
        f"the original forward ({recompute_count} vs {forward_count}). The checkpointed "
        "function must run the same operations when it is recomputed in backward.\n"
        f"{detail}",
        index=min(forward_count, recompute_count),
        op_hint=op_hint,
    )


def stale_read(
    api: str, index: int, tensor: torch.Tensor, saved_version: int, source: str | None
) -> CheckpointError:
    """The error for a tensor the region read from outside and that changed in place."""
    meta = _as_meta(saved_meta(tensor))
    where = (
        f" It was saved at {source}."
        if source is not None
        else " Pass debug=True to see the source line that saved it."
    )
    return CheckpointError(
        f"{api}: a tensor that the checkpointed function read without receiving it as an "
        f"argument ({meta}; saved tensor #{index}) was modified by an inplace operation "
        f"after the forward (version {saved_version}, now {version_of(tensor)}).{where} The "
        "recomputation in backward would read the new values and compute wrong gradients "
        "(without checkpointing, autograd raises here too). Typical cause: an optimizer "
        "step or a weight update between the forward and backward; run backward first, "
        "or update a copy (w = w.clone()) instead of the tensor itself."
    )
