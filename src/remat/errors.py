"""The one exception hierarchy of remat.

Every error remat raises on purpose is a :class:`RematError`, and also an
instance of the builtin a user would naturally catch, so code written for
``torch.utils.checkpoint`` keeps catching what it caught before::

    RematError (Exception)
    ├── CheckpointError (RuntimeError)        recompute differs, double unpack, ...
    │   └── RecomputeMismatchError            structured fields: index, op, shapes
    ├── CheckpointStateError (RuntimeError)   used out of order: GraphExecGroups nested, ...
    ├── CheckpointUsageError (ValueError)     wrong argument value or combination
    │   └── InfeasibleBudgetError             no plan fits the budget: min_peak_bytes
    ├── CheckpointTypeError (TypeError)       wrong argument type
    ├── CheckpointKeyError (KeyError)         a name that is none of the known ones
    ├── PolicyError (RuntimeError)            a policy's answer is not a decision
    ├── UnsupportedCheckpointError (NotImplementedError)
    │   └── FrontierTooLargeError             the planner's DP outgrew its state cap
    ├── DeviceStateError (RuntimeError)       device initialized inside a region
    ├── ModelLoadError (RuntimeError)         the remat command could not build its model
    ├── RankError (RuntimeError)              a rank of a local multi-process run failed
    └── WorkerError (RuntimeError)            a forked copy simulating ranks failed

Messages say which API, which argument, what was received and what to do.

Internal control flow (stopping a recomputation early) does not use this
hierarchy: it derives from :class:`BaseException` so a user's
``except Exception`` inside a checkpointed function cannot swallow it.

Example:
    >>> import remat
    >>> issubclass(remat.CheckpointError, RuntimeError)
    True
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CheckpointError",
    "CheckpointKeyError",
    "CheckpointStateError",
    "CheckpointTypeError",
    "CheckpointUsageError",
    "DeviceStateError",
    "FrontierTooLargeError",
    "InfeasibleBudgetError",
    "ModelLoadError",
    "PolicyError",
    "RankError",
    "RecomputeMismatchError",
    "RematError",
    "UnsupportedCheckpointError",
    "WorkerError",
]


class RematError(Exception):
    """Base class of every error remat raises on purpose."""


class CheckpointError(RematError, RuntimeError):
    """A checkpointed region could not run or be replayed correctly.

    The recomputation differs from the forward, a saved tensor is unpacked
    twice, backward reaches a region with nothing to differentiate, a
    ``context_fn`` context swallows the forward's exception. Same role as
    ``torch.utils.checkpoint.CheckpointError`` (also a ``RuntimeError``).
    """


@dataclass(frozen=True)
class SavedTensorMeta:
    """Shape, dtype and device of one tensor saved for backward."""

    shape: tuple[int, ...]
    dtype: str
    device: str

    def __str__(self) -> str:
        return f"shape={list(self.shape)}, dtype={self.dtype}, device={self.device}"


class RecomputeMismatchError(CheckpointError):
    """The recomputation saved different tensors than the original forward.

    Besides the message, the fields say what differed: ``index`` of the saved
    tensor (in save order), ``forward`` and ``recompute`` metadata (``None``
    when one side saved fewer tensors), and ``op_hint``, when the debug log was
    on, the first differing operator with its source line (the recomputation's,
    or the forward's that the recomputation did not run).
    """

    def __init__(
        self,
        message: str,
        *,
        index: int | None = None,
        forward: SavedTensorMeta | None = None,
        recompute: SavedTensorMeta | None = None,
        op_hint: str | None = None,
    ) -> None:
        super().__init__(message)
        self.index = index
        self.forward = forward
        self.recompute = recompute
        self.op_hint = op_hint


class CheckpointUsageError(RematError, ValueError):
    """An argument has a value (or combination) remat cannot honour."""


class InfeasibleBudgetError(CheckpointUsageError):
    """No checkpoint plan keeps the step's peak within the memory budget (``remat.planner``).

    Fields: ``budget_bytes``, the budget asked for, and ``min_peak_bytes``,
    the smallest peak any plan reaches (the budget to ask for instead); the
    message says both.
    """

    def __init__(self, message: str, *, budget_bytes: int = 0, min_peak_bytes: int = 0) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes


class CheckpointTypeError(RematError, TypeError):
    """An argument has the wrong type."""


class CheckpointKeyError(RematError, KeyError):
    """A name that is none of the known ones (a memory report's category, ...).

    A ``KeyError``, as for a lookup in a mapping; unlike a bare ``KeyError``,
    its text is the message itself, not the message's ``repr``.

    Example:
        >>> print(CheckpointKeyError("unknown category 'x'; expected one of ['params']"))
        unknown category 'x'; expected one of ['params']
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CheckpointStateError(RematError, RuntimeError):
    """An object was used out of order.

    A :class:`remat.GraphExecGroup` entered inside another, a region entered
    twice or ended before it started.
    """


class PolicyError(RematError, RuntimeError):
    """A selective-checkpoint policy returned no decision, or raised a ``TypeError``.

    Not a ``TypeError`` on purpose: policies run inside a dispatch mode, under
    Tensor operators such as ``a @ b``, and Python turns a ``TypeError`` raised
    there into ``NotImplemented`` ("unsupported operand type(s) for @"), hiding
    the real message. Fields: ``policy``, ``op`` and ``value`` (what the policy
    returned; ``None`` when it raised, the ``TypeError`` is then ``__cause__``).
    """

    def __init__(self, message: str, *, policy: object, op: object, value: object) -> None:
        super().__init__(message)
        self.policy = policy
        self.op = op
        self.value = value


class UnsupportedCheckpointError(RematError, NotImplementedError):
    """A valid request that this front-end does not support (e.g. reentrant hooks)."""


class FrontierTooLargeError(UnsupportedCheckpointError):
    """The planner's dynamic program kept more partial plans than its cap.

    Raised by ``remat.planner.solvers.solve_dp`` called directly; ``solve``
    (and so ``remat.plan``) catches it and hands the chain to the MILP. Fields:
    ``states``, the partial plans at the region where it stopped, and
    ``max_states``, the cap.
    """

    def __init__(self, message: str, *, states: int = 0, max_states: int = 0) -> None:
        super().__init__(message)
        self.states = states
        self.max_states = max_states


class DeviceStateError(RematError, RuntimeError):
    """A device's RNG could not be preserved (first initialized inside a region)."""


class ModelLoadError(RematError, RuntimeError):
    """The model named on the ``remat`` command line could not be built or run (exit status 1).

    The factory's module does not import, the factory raises or returns the
    wrong shape, a HuggingFace config is missing, unreadable or not a causal
    language model, or the model cannot run where the command needs it (on
    meta tensors for ``remat estimate``). Not a usage error: the flags were
    well formed.
    """


class WorkerError(RematError, RuntimeError):
    """A task run in a forked copy of this process (ranks simulated in parallel) failed
    with an exception that cannot be rebuilt here (the message carries its traceback),
    or the copy ended without a result (killed, out of memory)."""


class RankError(RematError, RuntimeError):
    """A rank of a local multi-process run (``remat plan --world-size``,
    ``remat estimate --measure``) failed, hung or could not start.

    ``rank`` is the first rank that failed (None: the launch itself failed);
    ``killed_by`` the signal that ended it (a crash in native code), or None;
    the message carries the end of its traceback or output.
    """

    def __init__(self, message: str, rank: int | None = None, killed_by: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.killed_by = killed_by


class StopRecompute(BaseException):
    """Internal signal: every tensor the backward needs is recomputed.

    Derives from ``BaseException`` so that ``except Exception`` in user code
    cannot swallow it; the engine catches it right where recompute starts.
    """
