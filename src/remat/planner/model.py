"""The planner's data: options, measured costs, the chain problem, plans.

Everything here is plain data (frozen dataclasses, no torch), so the solvers
can be tested on hand-built tables and a :class:`Plan` can be printed,
compared and stored without a model at hand. The cost model that turns a
:class:`Profile` into a :class:`ChainProblem` is written down in
``docs/design/planner.md`` ("Cost model").

Example:
    >>> from remat.planner.model import KEEP, CHECKPOINT, ChainProblem
    >>> problem = ChainProblem(
    ...     options=(KEEP, CHECKPOINT),
    ...     retained_bytes=((100, 10), (100, 10)),
    ...     local_bytes=((150, 110), (150, 110)),
    ...     time_s=((1.0, 1.5), (1.0, 1.5)),
    ...     tail_bytes=0, floor_bytes=0,
    ... )
    >>> problem.peak_bytes((0, 1)), problem.step_time_s((0, 1))
    (210, 2.5)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from remat._units import format_bytes
from remat.errors import CheckpointTypeError, CheckpointUsageError

__all__ = [
    "CHECKPOINT",
    "CHECKPOINT_OFFLOAD",
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
    "format_bytes",
    "parse_budget",
]

Kind = Literal["keep", "checkpoint", "offload"]


@dataclass(frozen=True)
class Option:
    """One way to run a region: keep its activations, checkpoint it, or offload them.

    ``policy`` names a built-in policy of :mod:`remat.policies` (for example
    ``"save_matmuls"``) used by a checkpointed region; ``None`` recomputes
    everything. ``offload_inputs`` sends what a checkpointed region keeps
    (its inputs, and the outputs its policy saves) to host memory.

    Example:
        >>> Option("checkpoint", policy="save_matmuls").name
        'checkpoint:save_matmuls'
        >>> Option("checkpoint", offload_inputs=True).name
        'checkpoint+offload'
    """

    kind: Kind
    policy: str | None = None
    offload_inputs: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("keep", "checkpoint", "offload"):
            raise CheckpointUsageError(
                f"remat.planner.Option: kind must be 'keep', 'checkpoint' or 'offload', "
                f"got {self.kind!r}."
            )
        if self.policy is not None and self.kind != "checkpoint":
            raise CheckpointUsageError(
                f"remat.planner.Option: only 'checkpoint' takes a policy, got kind "
                f"{self.kind!r} with policy {self.policy!r}."
            )
        if self.offload_inputs and self.kind != "checkpoint":
            raise CheckpointUsageError(
                f"remat.planner.Option: offload_inputs is for 'checkpoint' (what the checkpoint "
                f"keeps goes to the host); kind {self.kind!r} would use 'offload' itself."
            )

    @property
    def name(self) -> str:
        """``kind``, ``kind:policy`` for a selective checkpoint, ``+offload`` for offloaded inputs."""
        name = self.kind if self.policy is None else f"{self.kind}:{self.policy}"
        return f"{name}+offload" if self.offload_inputs else name


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
    """

    retained_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    backward_delta_bytes: int
    time_s: float
    output_release: Literal["own", "next", "other"] = "other"
    backward_peak_after_input_free_bytes: int | None = None


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


def _peak_rise(link: int, cost: OptionCost) -> int:
    """How far a region's backward peak rises when its input outlives it by ``link`` bytes.

    Only what ran after the measured free of the input runs with it still
    alive; unmeasured, the whole tensor.
    """
    after = cost.backward_peak_after_input_free_bytes
    if link <= 0:
        return 0
    if after is None:
        return link
    return max(0, after + link - cost.backward_peak_bytes)


@dataclass(frozen=True)
class Profile:
    """One profiled training step of a model, for one input shape.

    The step is: ``prefix`` (whatever runs before the first region), the
    regions in execution order, ``suffix`` (after the last region, the loss
    included), then backward in reverse. The prefix and suffix fields are
    the largest measured over the options (they hardly depend on them).

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

    def _links(
        self, rows: list[list[OptionCost]]
    ) -> tuple[tuple[tuple[tuple[int, ...], ...], ...], tuple[tuple[tuple[int, ...], ...], ...]]:
        """Region k's residue and peak corrections for its input, region k - 1's output.

        Each option was measured with the same option on both sides of the
        boundary. Mixed, the shared tensor is freed in region k's backward
        unless region k - 1 holds it (``"own"``) or region k does not hold
        it either (``"other"``): add it back to the residue where the
        measurement had freed it in region k, take it out where it had not.
        Where it is added back, region k's backward peak rises only by what
        ran after the measured free with the tensor still alive (zero when
        the peak came first); unmeasured, by the whole tensor.
        """
        width = len(self.options)
        square = tuple((0,) * width for _ in range(width))
        residue, peak = [square], [square]
        for k in range(1, len(rows)):
            size = self.regions[k - 1].output_bytes
            release = [cost.output_release for cost in rows[k - 1]]
            table = [
                [
                    size
                    * (
                        int(release[b] == "next")  # freed in region k when measured
                        - int(release[a] != "own" and release[b] != "other")  # mixed
                    )
                    for b in range(width)
                ]
                for a in range(width)
            ]
            residue.append(tuple(tuple(row) for row in table))
            peak.append(
                tuple(
                    tuple(_peak_rise(table[a][b], rows[k][b]) for b in range(width))
                    for a in range(width)
                )
            )
        return tuple(residue), tuple(peak)

    def problem(self, head: int = 0) -> ChainProblem:
        """The chain problem this profile poses (``docs/design/planner.md``, "Cost model").

        When region ``k``'s backward runs, the earlier regions still hold what
        they retained, region ``k`` holds its retained bytes plus its
        backward's rise, each later region holds what its backward left
        behind (its residue), and the part after the regions holds what its
        backward left. ``head`` picks one of :attr:`heads` (an index); the
        head's option shifts the tail, the bytes at the start of the blocks'
        backward and the time outside the regions.
        """
        if self.heads and not 0 <= head < len(self.heads):
            raise CheckpointUsageError(
                f"Profile.problem: head must index one of the {len(self.heads)} head options, "
                f"got {head}."
            )
        if not self.heads and head != 0:
            raise CheckpointUsageError("Profile.problem: this profile has no head options.")
        tail_shift = start_shift = 0
        time_shift = 0.0
        if self.heads:
            chosen, base = self.heads[head], self.heads[0]
            tail_shift = chosen.tail_peak_shift_bytes
            start_shift = chosen.backward_start_shift_bytes
            time_shift = chosen.time_s - base.time_s
        names = [o.name for o in self.options]
        rows = [[region.costs[name] for name in names] for region in self.regions]
        starts = [self.backward_start_bytes[name] for name in names]
        at_backward = self.prefix_bytes + min(starts) + start_shift
        # The last region's option decides how much of the suffix outlives the
        # loss: charge the excess to that region, in its peak and its residue.
        links, link_peaks = self._links(rows)
        shared = self.shared_input_bytes  # alive through every forward
        extra = [[0] * len(names) for _ in rows]
        if rows:
            extra[-1] = [start - min(starts) for start in starts]
        return ChainProblem(
            options=self.options,
            retained_bytes=tuple(tuple(c.retained_bytes for c in row) for row in rows),
            local_bytes=tuple(
                tuple(
                    at_backward + e + c.retained_bytes + c.backward_peak_bytes
                    for c, e in zip(row, more, strict=True)
                )
                for row, more in zip(rows, extra, strict=True)
            ),
            time_s=tuple(tuple(c.time_s for c in row) for row in rows),
            tail_bytes=self.prefix_bytes + shared + self.tail_peak_bytes + tail_shift,
            tail_after_bytes=(
                None
                if self.tail_after_model_bytes is None
                else self.prefix_bytes + self.tail_after_model_bytes + tail_shift
            ),
            shared=self.shared_inputs,
            floor_bytes=at_backward + self.prefix_backward_peak_bytes,
            residue_bytes=tuple(
                tuple(
                    c.retained_bytes + c.backward_delta_bytes + e
                    for c, e in zip(row, more, strict=True)
                )
                for row, more in zip(rows, extra, strict=True)
            ),
            forward_bytes=tuple(
                tuple(self.prefix_bytes + shared + c.forward_peak_bytes for c in row) for row in rows
            ),
            link_bytes=links,
            link_peak_bytes=link_peaks,
            base_time_s=max(0.0, self.other_time_s + time_shift),
            names=tuple(region.name for region in self.regions),
        )


@dataclass(frozen=True)
class ChainProblem:
    """A chain of regions, each to run under one of ``options``; torch-free.

    Peak model (``docs/design/planner.md``, "Cost model"). For a choice ``c``
    (one option index per region), with ``P(k) = sum(retained[j][c[j]] for j < k)``,
    ``L(j) = link[j][c[j-1]][c[j]]``, ``M(j) = link_peak[j][c[j-1]][c[j]]`` (both
    0 for ``j = 0``), ``H(k) = sum(residue[j][c[j]] + L(j) for j > k)`` and
    ``S(k)`` the bytes of the ``shared`` inputs that some region ``j <= k``
    keeps until its backward (``shared[g].kept_by(j, options[c[j]])``), the
    step's peak is the largest of::

        P(k) + local[k][c[k]] + M(k) + H(k) + S(k)   region k's backward, each k
        P(k) + forward[k][c[k]]            region k's forward, each k (if given)
        P(n) + tail_bytes                  after the last region
        P(n) + tail_after_bytes + S(n-1)   after the model's forward returned (if given)
        floor_bytes + H(-1)                what no region's choice removes

    and its time is ``base_time_s + sum(time[j][c[j]])``.

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
    # keeps[k][o]: bitmask of the shared groups region k keeps under option o.
    _keeps: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        width = len(self.options)
        zeros = tuple((0,) * width for _ in self.retained_bytes)
        if not self.residue_bytes:
            object.__setattr__(self, "residue_bytes", zeros)
        if not self.forward_bytes:
            object.__setattr__(self, "forward_bytes", zeros)
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

    def tail_peak(self, retained: int, held: int) -> int:
        """The peak after the last region, on ``retained`` bytes, with ``held`` shared bytes kept."""
        tail = retained + self.tail_bytes
        if self.tail_after_bytes is not None:
            tail = max(tail, retained + self.tail_after_bytes + held)
        return tail

    def peak_bytes(self, choice: Sequence[int]) -> int:
        """Predicted peak live bytes of the step for one option index per region."""
        n = self.size
        links = [self.link(k, choice[k - 1] if k else None, choice[k]) for k in range(n)]
        rises = [self.link_peak(k, choice[k - 1] if k else None, choice[k]) for k in range(n)]
        residues = [self.residue_bytes[k][choice[k]] + links[k] for k in range(n)]
        later = sum(residues)
        peak = self.floor_bytes + later
        prefix = mask = 0
        for k in range(n):
            option = choice[k]
            later -= residues[k]
            mask |= self.keeps(k, option)
            peak = max(
                peak,
                prefix + self.local_bytes[k][option] + rises[k] + later + self.held_bytes(mask),
                prefix + self.forward_bytes[k][option],
            )
            prefix += self.retained_bytes[k][option]
        return max(peak, self.tail_peak(prefix, self.held_bytes(mask)))

    def step_time_s(self, choice: Sequence[int]) -> float:
        """Predicted step time for one option index per region."""
        return self.base_time_s + math.fsum(row[o] for row, o in zip(self.time_s, choice, strict=True))


@dataclass(frozen=True)
class Solution:
    """A solver's answer for one budget.

    Attributes:
        choice: option index per region.
        peak_bytes: predicted peak (:meth:`ChainProblem.peak_bytes`).
        step_s: predicted step time.
        solver: ``"dp"``, ``"milp"``, ``"greedy"`` or ``"enumerate"``.
        optimal: whether the solver proved the choice optimal for the model.
        gap: relative distance to the best lower bound found (0.0 when optimal).
        solve_s: wall time of the solve.
    """

    choice: tuple[int, ...]
    peak_bytes: int
    step_s: float
    solver: str
    optimal: bool
    gap: float
    solve_s: float


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


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_budget(
    budget: object, reference_bytes: int | None = None, *, fraction: float | None = None
) -> int:
    """Turn a budget into bytes: an int, ``"300MiB"``/``"6GiB"``/``"1.5GB"``, or ``"50%"``.

    A fraction of ``reference_bytes`` (the unchecked step's peak) is asked
    for explicitly: ``"50%"``, or ``fraction=0.5`` with ``budget=None``. A
    bare float is refused: ``1`` is one byte, and ``1.0`` would have meant
    the whole unchecked peak. Anything else raises ``CheckpointUsageError``
    or ``CheckpointTypeError``.

    Example:
        >>> parse_budget("300MiB"), parse_budget(4096), parse_budget("50%", 1000)
        (314572800, 4096, 500)
        >>> parse_budget(None, 1000, fraction=0.25)
        250
    """
    api = "remat.planner: budget"
    if fraction is not None:
        if budget is not None:
            raise CheckpointUsageError(f"{api}: pass budget= or fraction=, not both.")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise CheckpointTypeError(
                f"remat.planner: fraction must be a number in (0, 1], got {type(fraction).__name__}."
            )
        return _fraction_of(float(fraction), reference_bytes, f"fraction={fraction}")
    if budget is None:
        raise CheckpointUsageError(
            f"{api} is missing: give bytes (an int or '300MiB'), a percentage ('50%') or "
            "fraction=0.5."
        )
    if isinstance(budget, bool):
        raise CheckpointTypeError(f"{api} must be bytes (int or '300MiB') or '50%', got a bool.")
    if isinstance(budget, int):
        if budget <= 0:
            raise CheckpointUsageError(f"{api} must be positive, got {budget} bytes.")
        return budget
    if isinstance(budget, float):
        hint = f"'{budget * 100:g}%' or fraction={budget}" if 0 < budget <= 1 else "'50%'"
        raise CheckpointTypeError(
            f"{api}: a float is ambiguous ({budget!r}: bytes or a fraction?). Give bytes as an int "
            f"or a string with a unit ('300MiB'), or a fraction of the unchecked peak as {hint}."
        )
    if isinstance(budget, str):
        text = budget.strip().lower().replace(" ", "")
        if text.endswith("%"):
            try:
                percent = float(text[:-1])
            except ValueError:
                percent = math.nan
            return _fraction_of(percent / 100, reference_bytes, repr(budget))
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(digits):] or "b"
        try:
            value = float(digits)
        except ValueError:
            value = math.nan
        if not text[len(digits):] and math.isfinite(value) and value != int(value):
            raise CheckpointUsageError(
                f"{api}: {budget!r} has no unit and is not a whole number of bytes. Write a "
                f"fraction of the unchecked peak as a percentage ('{value * 100:g}%'), or bytes "
                "with a unit ('300MiB')."
            )
        if unit not in _UNITS or not math.isfinite(value) or value <= 0:
            raise CheckpointUsageError(
                f"{api}: cannot read {budget!r}; write a positive number with a unit among "
                f"{sorted(_UNITS, key=_UNITS.__getitem__)} (e.g. '300MiB', '6GiB'), or a "
                "percentage of the unchecked peak ('50%')."
            )
        return max(1, int(value * _UNITS[unit]))
    raise CheckpointTypeError(
        f"{api} must be an int (bytes), a string such as '300MiB' or '50%', got "
        f"{type(budget).__name__}."
    )


def _fraction_of(value: float, reference_bytes: int | None, given: str) -> int:
    api = "remat.planner: budget"
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise CheckpointUsageError(
            f"{api}: {given} must be a fraction in (0, 1] (a percentage in (0%, 100%]) of the "
            "unchecked peak."
        )
    if reference_bytes is None:
        raise CheckpointUsageError(f"{api}: a fraction needs the unchecked peak to refer to.")
    return max(1, int(value * reference_bytes))


