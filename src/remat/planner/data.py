"""The planner's data: options, measured costs, the chain problem, plans.

Everything here is plain data (frozen dataclasses, no torch and no cost
formula), so the solvers can be tested on hand-built tables and a plan can
be printed, compared and stored without a model at hand. What the numbers
add up to, a choice's peak and time and the chain problem a :class:`Profile`
poses, is :mod:`remat.planner.cost` (``docs/design/planner.md``, "Cost model").

Example:
    >>> from remat.planner.data import KEEP, CHECKPOINT, ChainProblem
    >>> problem = ChainProblem(
    ...     options=(KEEP, CHECKPOINT),
    ...     retained_bytes=((100, 10), (100, 10)),
    ...     local_bytes=((150, 110), (150, 110)),
    ...     time_s=((1.0, 1.5), (1.0, 1.5)),
    ...     tail_bytes=0, floor_bytes=0,
    ... )
    >>> problem.size, problem.options[1].name
    (2, 'checkpoint')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from remat.errors import CheckpointUsageError

__all__ = [
    "CHECKPOINT",
    "CHECKPOINT_OFFLOAD",
    "COMPILED_BUDGETS",
    "DEFAULT_OPTIONS",
    "KEEP",
    "OFFLOAD",
    "SAVE_MATMULS",
    "ChainProblem",
    "Decision",
    "HeadCost",
    "Option",
    "OptionCost",
    "ParetoPoint",
    "Profile",
    "RegionCost",
    "SharedInput",
    "Solution",
]

Kind = Literal["keep", "checkpoint", "offload", "budget"]


@dataclass(frozen=True)
class Option:
    """One way to run a region: keep its activations, checkpoint it, or offload them;
    keeping and checkpointing may keep what they keep compressed.

    ``policy`` names a built-in policy of :mod:`remat.policies` (for example
    ``"save_matmuls"``) used by a checkpointed region; ``None`` recomputes
    everything. ``offload_inputs`` sends what a checkpointed region keeps
    (its inputs, and the outputs its policy saves) to host memory. Kind
    ``"budget"`` is for compiled regions: the compiler decides what the
    region keeps under ``memory_budget`` (torch's per-region activation
    memory budget, ``[0, 1]``; torch 2.13 and newer). ``compress`` (a format
    name) keeps what the option keeps compressed: every activation of a kept
    region, the inputs (and the policy's saves) of a checkpointed one; the
    gradients become approximate, so the planner offers such options only
    when asked, with a gradient-error tolerance.

    Example:
        >>> Option("checkpoint", policy="save_matmuls").name
        'checkpoint:save_matmuls'
        >>> Option("checkpoint", offload_inputs=True).name
        'checkpoint+offload'
        >>> Option("budget", memory_budget=0.25).name
        'budget:0.25'
    """

    kind: Kind
    policy: str | None = None
    offload_inputs: bool = False
    memory_budget: float | None = None
    compress: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("keep", "checkpoint", "offload", "budget"):
            raise CheckpointUsageError(
                f"remat.planner.Option: kind must be 'keep', 'checkpoint', 'offload' or "
                f"'budget', got {self.kind!r}."
            )
        budget = self.memory_budget
        if (self.kind == "budget") != (budget is not None):
            raise CheckpointUsageError(
                "remat.planner.Option: kind 'budget' takes a memory_budget in [0, 1] and no other "
                f"kind does; got kind {self.kind!r} with memory_budget {budget!r}."
            )
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 <= budget <= 1.0
        ):
            raise CheckpointUsageError(
                f"remat.planner.Option: memory_budget must be a number in [0, 1], got {budget!r}."
            )
        if self.policy is not None and self.kind != "checkpoint":
            raise CheckpointUsageError(
                f"remat.planner.Option: only 'checkpoint' takes a policy, got kind "
                f"{self.kind!r} with policy {self.policy!r}."
            )
        if self.compress is not None and (self.kind not in ("keep", "checkpoint") or self.offload_inputs):
            raise CheckpointUsageError(
                f"remat.planner.Option: compress is for 'keep' (every activation compressed) and "
                f"'checkpoint' (what it keeps compressed), without offload; got kind {self.kind!r}"
                f"{' with offload_inputs' if self.offload_inputs else ''}."
            )
        if self.offload_inputs and self.kind != "checkpoint":
            raise CheckpointUsageError(
                f"remat.planner.Option: offload_inputs is for 'checkpoint' (what the checkpoint "
                f"keeps goes to the host); kind {self.kind!r} would use 'offload' itself."
            )

    @property
    def name(self) -> str:
        """``kind``, ``kind:policy`` for a selective checkpoint, ``+offload`` for offloaded
        inputs, ``budget:fraction`` for a compiler budget."""
        if self.memory_budget is not None:
            return f"budget:{self.memory_budget:g}"
        name = self.kind if self.policy is None else f"{self.kind}:{self.policy}"
        if self.compress is not None:
            return f"{name}+compress:{self.compress}"
        return f"{name}+offload" if self.offload_inputs else name

    def compressed(self, format: str) -> Option:
        """This option with what it keeps compressed in ``format`` (``+compress:<format>``).

        Example:
            >>> SAVE_MATMULS.compressed("fp8").name
            'checkpoint:save_matmuls+compress:fp8'
        """
        return Option(self.kind, self.policy, self.offload_inputs, self.memory_budget, format)


KEEP = Option("keep")
"""Run the region as is: every activation stays for backward."""
CHECKPOINT = Option("checkpoint")
"""Keep only the region's inputs; recompute the rest in backward."""
SAVE_MATMULS = Option("checkpoint", policy="save_matmuls")
"""Checkpoint, but keep matmul and attention outputs (:data:`remat.policies.save_matmuls`)."""
OFFLOAD = Option("offload")
"""Keep the region's saved tensors on the host (accelerators only)."""
CHECKPOINT_OFFLOAD = Option("checkpoint", offload_inputs=True)
"""Checkpoint, and keep the region's inputs on the host until its backward (accelerators only)."""
DEFAULT_OPTIONS: tuple[Option, ...] = (KEEP, CHECKPOINT, SAVE_MATMULS)
"""What :func:`remat.planner.plan` chooses from; the two offload options join them on accelerators."""
COMPILED_BUDGETS: tuple[Option, ...] = tuple(
    Option("budget", memory_budget=fraction) for fraction in (0.2, 0.4, 0.6, 0.8, 0.95)
)
"""What compiled planning adds (torch 2.13 and newer): the compiler's knapsack
for the region under these per-region activation memory budgets. torch's
scale is not the bytes it keeps (on the embedded GPT, 0.75 to 0.97 all keep
the same 70% of the unchecked activations, and 1 keeps them all), so the
fractions are spread over the range, with one close to 1."""


@dataclass(frozen=True)
class OptionCost:
    """What one region costs under one option, measured in one profiled step.

    All byte counts are live tensor bytes (as counted by
    :func:`remat.memory.track`), relative to the live bytes when the phase
    started.

    Attributes:
        retained_bytes: left alive by the region's forward (its saved
            tensors and output) until its backward.
        forward_peak_bytes: highest point during its forward.
        backward_peak_bytes: highest point during its backward, recomputation
            included, above the live bytes when its backward started.
        backward_delta_bytes: change of live bytes over its backward
            (negative: it frees what it kept; gradients of parameters remain).
        time_s: forward plus backward wall time (recomputation included).
        output_release: in whose backward the region's output was freed when
            every region ran this option: ``"own"`` (this region holds it,
            e.g. a selective policy saved the matmul that made it), ``"next"``
            (the next region held it longer) or ``"other"``.
        backward_peak_after_input_free_bytes: when this region's backward
            freed its input (the previous region's output released
            ``"next"``), the highest point after that free, above the live
            bytes when its backward started; None otherwise or unknown.
        gradient_error: with this region alone under this option (the others
            kept), ``||g' - g|| / ||g||`` over every parameter gradient: 0 for
            an exact option, measured for a compressing one.
    """

    retained_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    backward_delta_bytes: int
    time_s: float
    output_release: Literal["own", "next", "other"] = "other"
    backward_peak_after_input_free_bytes: int | None = None
    gradient_error: float = 0.0


@dataclass(frozen=True)
class RegionCost:
    """The measured costs of one candidate region (a module), per option name.

    Example:
        >>> cost = OptionCost(100, 120, 80, -90, 0.01, "next")
        >>> RegionCost("blocks.0", 64, 64, {"keep": cost}).costs["keep"].retained_bytes
        100
    """

    name: str
    input_bytes: int
    output_bytes: int
    costs: dict[str, OptionCost] = field(hash=False)


@dataclass(frozen=True)
class HeadCost:
    """What the model's head (output layer and loss) costs when run in ``chunks`` slices.

    Measured relative to the same step with the unchunked head (``chunks=1``,
    whose entry is all zeros): the head's peak and the bytes alive when the
    blocks' backward starts move by these amounts, and its time is its own.

    Attributes:
        chunks: slices of :func:`remat.losses.chunked_loss` (1: not chunked).
        tail_peak_shift_bytes: change of the peak after the last region.
        backward_start_shift_bytes: change of the live bytes when the last
            region's backward starts.
        time_s: the head's forward plus backward time (loss included).

    Example:
        >>> HeadCost(chunks=8, tail_peak_shift_bytes=-3_000_000, backward_start_shift_bytes=0,
        ...          time_s=0.004).chunks
        8
    """

    chunks: int
    tail_peak_shift_bytes: int
    backward_start_shift_bytes: int
    time_s: float


@dataclass(frozen=True)
class SharedInput:
    """Tensors made before the first region and taken by several (a mask, position tables).

    Which regions keep them alive depends on the options: a checkpointed
    region saves its inputs, a kept one often lets them die with the model's
    forward. They live until the backward of the first region that keeps
    them (``docs/design/planner.md``, "Shared inputs").

    Attributes:
        nbytes: their bytes.
        takers: the regions (indices) that take them as inputs.
        kept_under: the options (names) under which those regions keep them
            until their backward.

    Example:
        >>> mask = SharedInput(1024, takers=(0, 1, 2), kept_under=("checkpoint",))
        >>> mask.kept_by(1, CHECKPOINT), mask.kept_by(1, KEEP)
        (True, False)
    """

    nbytes: int
    takers: tuple[int, ...]
    kept_under: tuple[str, ...]

    def kept_by(self, region: int, option: Option) -> bool:
        """Whether ``region`` under ``option`` keeps these tensors until its backward."""
        return region in self.takers and option.name in self.kept_under


@dataclass(frozen=True)
class Profile:
    """One profiled training step of a model, for one input shape.

    The step is: ``prefix`` (whatever runs before the first region), the
    regions in execution order, ``suffix`` (after the last region, the loss
    included), then backward in reverse. The prefix and suffix fields are
    the largest measured over the options (they hardly depend on them).
    :func:`remat.planner.cost.chain_problem` turns it into the problem the
    solvers solve.

    Attributes:
        key: input shapes and dtypes this profile belongs to.
        options: the options measured, in order.
        regions: one entry per candidate region, in execution order.
        prefix_bytes: live bytes when the first region starts, the shared
            inputs left out (as in every byte count of the profile).
        tail_peak_bytes: peak after the last region's forward and before its
            backward (loss, its backward), above the live bytes when the last
            region's forward ended; only up to the return of the model's
            forward when ``tail_after_model_bytes`` is known.
        backward_start_bytes: per option of the last region, live bytes when
            its backward starts minus those when its forward ended (whether
            its output outlives the loss depends on the option).
        prefix_backward_peak_bytes: peak during the prefix's backward, above
            the live bytes when it started.
        other_time_s: step time outside the regions.
        unchecked_peak_bytes: peak of the whole step with every region kept.
        unchecked_step_s: median wall time of that step.
        heads: when the planner was given a ``Head``, its options, the
            unchecked head (``chunks=1``) first; the other fields describe
            the step with that first one.
        tail_after_model_bytes: the rest of the tail peak, once the model's
            forward returned (the loss and its backward), on the same
            reference; None when not split (a planned head).
        shared_input_bytes: tensors made before the first region and taken
            by several (a mask, position tables), alive when the last
            region's forward ended (``docs/design/planner.md``, "Shared
            inputs").
        shared_inputs: those tensors, grouped by who takes them and under
            which options those keep them.
        estimated_with: None when every figure was measured here; else the
            profile was estimated (bytes on the tensors given, fake ones for a
            model too large to run; times from a time model) and this names
            the device rates of its times (``profile_model(..., estimate=...)``).
        step_noise_s: the standard error of a plan's predicted step time, in
            seconds: each region's time is a median of timed samples, whose
            spread bounds how well it is known (``docs/design/planner.md``,
            "Ties"). 0.0 when no time was sampled twice (one round of
            distinct blocks, or times from a time model). Plans whose
            predicted times lie this close count as equally fast.
    """

    key: tuple[Any, ...]
    options: tuple[Option, ...]
    regions: tuple[RegionCost, ...]
    prefix_bytes: int
    tail_peak_bytes: int
    backward_start_bytes: dict[str, int] = field(hash=False)
    prefix_backward_peak_bytes: int
    other_time_s: float
    unchecked_peak_bytes: int
    unchecked_step_s: float
    heads: tuple[HeadCost, ...] = ()
    tail_after_model_bytes: int | None = None
    shared_input_bytes: int = 0
    shared_inputs: tuple[SharedInput, ...] = ()
    estimated_with: str | None = None
    step_noise_s: float = 0.0


@dataclass(frozen=True)
class ChainProblem:
    """A chain of regions, each to run under one of ``options``; torch-free.

    Each table says what a region costs under each option (the index into
    ``options``); how the tables add up to a choice's peak and time, the peak
    terms, is :mod:`remat.planner.cost` (``docs/design/planner.md``, "Cost
    model"). Hand-built tables may leave the optional ones empty.

    Attributes:
        options: what the option indices mean.
        retained_bytes: ``[region][option]`` bytes kept from the region's
            forward until its backward.
        local_bytes: ``[region][option]`` highest point while the region's
            backward runs, above what the earlier regions retain and the later
            ones leave behind.
        time_s: ``[region][option]`` forward + backward time.
        tail_bytes: peak of the part after the last region, above what the
            regions retain.
        floor_bytes: peak contributions no choice changes.
        residue_bytes: ``[region][option]`` bytes a region leaves alive after
            its backward (parameter gradients, caches); empty means zeros.
        forward_bytes: ``[region][option]`` forward peak above what the
            earlier regions retain; empty means covered by ``local_bytes``.
        link_bytes: ``[region][previous option][option]`` correction to a
            region's residue for the tensor it shares with the previous region
            (whose backward frees it depends on both options); empty means zeros.
        link_peak_bytes: ``[region][previous option][option]`` rise of the
            region's backward peak for the same pairing (the shared tensor
            still alive where the measurement had freed it); empty means
            ``max(link, 0)``, the bound for a tensor freed before the peak.
        shared: the inputs several regions share (a mask, position
            tables), and which regions keep them under which options.
        tail_after_bytes: peak of the part after the last region once the
            model's forward returned and let go of the shared inputs no
            region keeps, above what the regions retain; None when
            ``tail_bytes`` covers the whole part.
        base_time_s: time outside the regions.
        names: region names, for messages.
        gradient_error: ``[region][option]`` relative gradient error of the
            region alone under the option (0 for exact options); empty means
            zeros. A choice's error adds them in quadrature
            (:func:`remat.planner.cost.gradient_error`).
        time_tolerance_s: step times within this many seconds of the fastest
            feasible one count as equal, and of those the solvers take the
            plan with the smallest predicted peak (``docs/design/planner.md``,
            "Ties"); :func:`remat.planner.cost.chain_problem` sets it to the
            profile's ``step_noise_s``. 0.0 (hand-built tables): only times
            equal up to float rounding tie.
    """

    options: tuple[Option, ...]
    retained_bytes: tuple[tuple[int, ...], ...]
    local_bytes: tuple[tuple[int, ...], ...]
    time_s: tuple[tuple[float, ...], ...]
    tail_bytes: int
    floor_bytes: int
    residue_bytes: tuple[tuple[int, ...], ...] = ()
    forward_bytes: tuple[tuple[int, ...], ...] = ()
    link_bytes: tuple[tuple[tuple[int, ...], ...], ...] = ()
    link_peak_bytes: tuple[tuple[tuple[int, ...], ...], ...] = ()
    shared: tuple[SharedInput, ...] = ()
    tail_after_bytes: int | None = None
    base_time_s: float = 0.0
    names: tuple[str, ...] = ()
    gradient_error: tuple[tuple[float, ...], ...] = ()
    time_tolerance_s: float = 0.0
    # keeps[k][o]: bitmask of the shared groups region k keeps under option o.
    _keeps: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tolerance = self.time_tolerance_s
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0.0 <= tolerance < float("inf"):
            raise CheckpointUsageError(
                f"ChainProblem: time_tolerance_s must be a finite number of seconds >= 0, got {tolerance!r}."
            )
        width = len(self.options)
        zeros = tuple((0,) * width for _ in self.retained_bytes)
        if not self.residue_bytes:
            object.__setattr__(self, "residue_bytes", zeros)
        if not self.forward_bytes:
            object.__setattr__(self, "forward_bytes", zeros)
        if not self.gradient_error:
            object.__setattr__(self, "gradient_error", tuple((0.0,) * width for _ in self.retained_bytes))
        if not self.link_bytes:
            square = tuple((0,) * width for _ in range(width))
            object.__setattr__(self, "link_bytes", tuple(square for _ in self.retained_bytes))
        if not self.link_peak_bytes:
            bound = tuple(
                tuple(tuple(max(value, 0) for value in entry) for entry in table)
                for table in self.link_bytes
            )
            object.__setattr__(self, "link_peak_bytes", bound)
        for group in self.shared:
            if any(not 0 <= k < len(self.retained_bytes) for k in group.takers):
                raise CheckpointUsageError(
                    f"ChainProblem: a shared input names regions {group.takers}, outside the "
                    f"chain of {len(self.retained_bytes)}."
                )
        keeps = tuple(
            tuple(
                sum(1 << g for g, group in enumerate(self.shared) if group.kept_by(k, option))
                for option in self.options
            )
            for k in range(len(self.retained_bytes))
        )
        object.__setattr__(self, "_keeps", keeps)
        for name in ("link_bytes", "link_peak_bytes"):
            for row in getattr(self, name):
                if len(row) != width or any(len(entry) != width for entry in row):
                    raise CheckpointUsageError(
                        f"ChainProblem: {name} needs a {width}x{width} table per region."
                    )
        tables: dict[str, tuple[tuple[Any, ...], ...]] = {
            "retained_bytes": self.retained_bytes,
            "local_bytes": self.local_bytes,
            "time_s": self.time_s,
            "residue_bytes": self.residue_bytes,
            "forward_bytes": self.forward_bytes,
            "link_bytes": self.link_bytes,
            "link_peak_bytes": self.link_peak_bytes,
            "gradient_error": self.gradient_error,
        }
        lengths = {name: len(table) for name, table in tables.items()}
        if len(set(lengths.values())) != 1:
            raise CheckpointUsageError(
                f"ChainProblem: the tables must have one row per region, got lengths {lengths}."
            )
        for name, table in tables.items():
            for row in table:
                if len(row) != width:  # link rows were checked above
                    raise CheckpointUsageError(
                        f"ChainProblem: every row of {name} needs one entry per option "
                        f"({width}), got {len(row)}."
                    )

    @property
    def size(self) -> int:
        """Number of regions."""
        return len(self.retained_bytes)

    @property
    def approximate(self) -> bool:
        """Whether some option makes the gradients approximate (a compressing one)."""
        return any(error for row in self.gradient_error for error in row)

    def link(self, k: int, previous: int | None, option: int) -> int:
        """``link_bytes[k][previous][option]``, or 0 for the first region."""
        return 0 if k == 0 or previous is None else self.link_bytes[k][previous][option]

    def link_peak(self, k: int, previous: int | None, option: int) -> int:
        """``link_peak_bytes[k][previous][option]``, or 0 for the first region."""
        return 0 if k == 0 or previous is None else self.link_peak_bytes[k][previous][option]

    def keeps(self, k: int, option: int) -> int:
        """Bitmask of the ``shared`` groups region ``k`` keeps under option index ``option``."""
        return self._keeps[k][option]

    def held_bytes(self, mask: int) -> int:
        """Bytes of the ``shared`` groups in a bitmask."""
        return sum(group.nbytes for g, group in enumerate(self.shared) if mask >> g & 1)


@dataclass(frozen=True)
class Solution:
    """A solver's answer for one budget.

    Attributes:
        choice: option index per region.
        peak_bytes: predicted peak (:func:`remat.planner.cost.peak_bytes`).
        step_s: predicted step time.
        solver: ``"dp"``, ``"milp"``, ``"greedy"``, ``"enumerate"`` (or ``"keep"``: nothing
            checkpointed, since keeping every region fits).
        optimal: whether the solver proved the choice optimal for the model.
        gap: relative distance to the best lower bound found (0.0 when optimal).
        solve_s: wall time of the solve.
        gradient_error: the choice's predicted relative gradient error
            (:func:`remat.planner.cost.gradient_error`; 0 for exact options).
    """

    choice: tuple[int, ...]
    peak_bytes: int
    step_s: float
    solver: str
    optimal: bool
    gap: float
    solve_s: float
    gradient_error: float = 0.0


@dataclass(frozen=True)
class Decision:
    """What the plan does with one region, and what that was predicted to cost.

    Example:
        >>> Decision("blocks.0", CHECKPOINT, retained_bytes=64, time_s=0.002).option.name
        'checkpoint'
    """

    region: str
    option: Option
    retained_bytes: int
    time_s: float
    gradient_error: float = 0.0


@dataclass(frozen=True)
class ParetoPoint:
    """The fastest plan within ``budget_bytes``: its predicted peak and step time.

    ``head_chunks`` is the slice count of the head for that plan (1 without
    a planned head).
    """

    budget_bytes: int
    peak_bytes: int
    step_s: float
    choice: tuple[int, ...]
    head_chunks: int = 1
