"""The cost model: a choice's peak as labelled terms, defined once; its step time.

Layer: above :mod:`~remat.planner.data` (the data), below the solvers; no
torch. Every solver reads the peak from here: :func:`peak_bytes` evaluates
the terms for one choice (enumeration, greedy, every solver's answer), the
MILP turns each term into one constraint row of the same label, and the DP's
incremental recurrence is tested against them (``docs/design/planner.md``,
"Cost model").

For a choice ``c`` (one option index per region of ``n``), the step's peak
is the largest of::

    backward[k]   P(k) + local[k] + M(k) + H(k) + S(k)    region k's backward
    forward[k]    P(k) + forward[k]                       region k's forward
    tail          tail_bytes + P(n)                       after the last region
    after_model   tail_after_bytes + P(n) + S(n - 1)      after the model's forward returned
    floor         floor_bytes + H(-1)                     what no region's choice removes

where ``P(k)`` is what regions ``0..k-1`` retain, ``M(k)`` the rise of region
``k``'s backward peak for the tensor it shares with region ``k - 1`` (the
link peak), ``H(k)`` what regions ``k+1..n-1`` leave behind after their
backward (residue plus link), ``S(k)`` the shared inputs that some region up
to ``k`` keeps until its backward. Each term is a constant plus
:class:`Span` sums over one table each; ``after_model`` exists only when the
tail is split where the model's forward returns.

Example:
    >>> from remat.planner.data import KEEP, CHECKPOINT, ChainProblem
    >>> problem = ChainProblem(
    ...     options=(KEEP, CHECKPOINT),
    ...     retained_bytes=((100, 10), (100, 10)),
    ...     local_bytes=((150, 110), (150, 110)),
    ...     time_s=((1.0, 1.5), (1.0, 1.5)),
    ...     tail_bytes=0, floor_bytes=0,
    ... )
    >>> term_bytes(problem, (0, 1))
    {'backward[0]': 150, 'forward[0]': 0, 'backward[1]': 210, 'forward[1]': 100, 'tail': 110, 'floor': 0}
    >>> peak_bytes(problem, (0, 1)), step_time_s(problem, (0, 1))
    (210, 2.5)
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from remat.errors import CheckpointUsageError
from remat.planner.data import ChainProblem, OptionCost, Profile

__all__ = [
    "OPTION_TABLES",
    "PAIR_TABLES",
    "PeakTerm",
    "Span",
    "chain_problem",
    "EXACT_TIE",
    "gradient_error",
    "option_table",
    "pair_table",
    "peak_bytes",
    "peak_terms",
    "preferred",
    "step_time_s",
    "term_bytes",
    "tied_time_s",
]

OptionTable = Literal["retained", "local", "forward", "residue"]
PairTable = Literal["link", "link_peak"]
Table = Literal["retained", "local", "forward", "residue", "link", "link_peak", "held"]

OPTION_TABLES: tuple[OptionTable, ...] = ("retained", "local", "forward", "residue")
"""Tables with one entry per region and option: ``ChainProblem.<name>_bytes[k][o]``."""
PAIR_TABLES: tuple[PairTable, ...] = ("link", "link_peak")
"""Tables with one entry per region and pair of neighbouring options:
``ChainProblem.<name>_bytes[k][previous][o]``, nothing for the first region."""

TermKind = Literal["backward", "forward", "tail", "after_model", "floor"]


@dataclass(frozen=True)
class Span:
    """A sum over regions ``start..stop-1`` of one table, under the choice.

    ``table`` is one of :data:`OPTION_TABLES` (the entry of each region's
    option), :data:`PAIR_TABLES` (the entry of each region's option after its
    predecessor's; the first region has none) or ``"held"``: the bytes of the
    shared inputs that some region of the span keeps until its backward,
    each group once.
    """

    table: Table
    start: int
    stop: int


@dataclass(frozen=True)
class PeakTerm:
    """One term of the peak: ``constant`` plus the sum of its ``spans``.

    ``region`` is the region a ``backward``/``forward`` term belongs to (None
    for the others); :attr:`label` names it (``"backward[3]"``, ``"tail"``),
    as the MILP names its row.
    """

    kind: TermKind
    region: int | None
    constant: int
    spans: tuple[Span, ...]

    @property
    def label(self) -> str:
        return self.kind if self.region is None else f"{self.kind}[{self.region}]"


def peak_terms(problem: ChainProblem) -> tuple[PeakTerm, ...]:
    """The terms whose largest value is a choice's peak, in order (see the module docstring)."""
    n = problem.size
    terms = []
    for k in range(n):
        before = Span("retained", 0, k)
        after = (Span("residue", k + 1, n), Span("link", k + 1, n))
        own = (Span("local", k, k + 1), Span("link_peak", k, k + 1))
        terms.append(PeakTerm("backward", k, 0, (before, *own, *after, Span("held", 0, k + 1))))
        terms.append(PeakTerm("forward", k, 0, (before, Span("forward", k, k + 1))))
    every = Span("retained", 0, n)
    terms.append(PeakTerm("tail", None, problem.tail_bytes, (every,)))
    if problem.tail_after_bytes is not None:
        terms.append(
            PeakTerm("after_model", None, problem.tail_after_bytes, (every, Span("held", 0, n)))
        )
    residues = (Span("residue", 0, n), Span("link", 0, n))
    terms.append(PeakTerm("floor", None, problem.floor_bytes, residues))
    return tuple(terms)


def option_table(problem: ChainProblem, table: str) -> tuple[tuple[int, ...], ...]:
    """``[region][option]`` entries of one of :data:`OPTION_TABLES`."""
    tables = {
        "retained": problem.retained_bytes,
        "local": problem.local_bytes,
        "forward": problem.forward_bytes,
        "residue": problem.residue_bytes,
    }
    return tables[table]


def pair_table(problem: ChainProblem, table: str) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``[region][previous option][option]`` entries of one of :data:`PAIR_TABLES`."""
    tables = {"link": problem.link_bytes, "link_peak": problem.link_peak_bytes}
    return tables[table]


def _span_sums(problem: ChainProblem, choice: Sequence[int]) -> Callable[[Span], int]:
    """The value of any span under ``choice`` (prefix sums: each span costs O(1))."""
    n = problem.size
    if len(choice) != n or any(not 0 <= o < len(problem.options) for o in choice):
        raise CheckpointUsageError(
            f"remat.planner: a choice needs one option index in [0, {len(problem.options)}) "
            f"per region ({n}), got {tuple(choice)}."
        )
    picked: dict[str, list[int]] = {
        name: [option_table(problem, name)[k][choice[k]] for k in range(n)]
        for name in OPTION_TABLES
    }
    for name in PAIR_TABLES:
        entries = pair_table(problem, name)
        picked[name] = [0] + [entries[k][choice[k - 1]][choice[k]] for k in range(1, n)]
    prefix = {name: list(itertools.accumulate(values, initial=0)) for name, values in picked.items()}
    keeps = [problem.keeps(k, choice[k]) for k in range(n)]
    masks = list(itertools.accumulate(keeps, operator.or_, initial=0))

    def value(span: Span) -> int:
        if span.table == "held":
            if span.start == 0:
                return problem.held_bytes(masks[span.stop])
            return problem.held_bytes(functools.reduce(operator.or_, keeps[span.start : span.stop], 0))
        sums = prefix[span.table]
        return sums[span.stop] - sums[span.start]

    return value


def term_bytes(problem: ChainProblem, choice: Sequence[int]) -> dict[str, int]:
    """Each peak term's bytes under ``choice``, by label (the peak is the largest)."""
    value = _span_sums(problem, choice)
    return {
        term.label: term.constant + sum(value(span) for span in term.spans)
        for term in peak_terms(problem)
    }


def peak_bytes(problem: ChainProblem, choice: Sequence[int]) -> int:
    """Predicted peak live bytes of the step for one option index per region."""
    return max(term_bytes(problem, choice).values())


def step_time_s(problem: ChainProblem, choice: Sequence[int]) -> float:
    """Predicted step time for one option index per region."""
    return problem.base_time_s + math.fsum(
        row[o] for row, o in zip(problem.time_s, choice, strict=True)
    )


# -- ties: step time first, then peak bytes ----------------------------------

EXACT_TIE = 1e-9
"""Relative tolerance of a tie when the problem states none (``time_tolerance_s`` 0):
times equal up to float rounding (sums of the same times in another order)."""


def tied_time_s(problem: ChainProblem, fastest_s: float) -> float:
    """The slowest step time that still ties with ``fastest_s``, the fastest feasible one.

    Times within the profile's noise count as equal (``docs/design/planner.md``,
    "Ties"): ``fastest_s`` plus ``problem.time_tolerance_s``, or plus float
    rounding where the problem states no tolerance. Against the fastest
    plan, not pairwise: "within the noise of each other" does not chain, and
    a chain of such steps could drift arbitrarily far from the fastest.

    Example:
        >>> from remat.planner.data import KEEP, ChainProblem
        >>> p = ChainProblem((KEEP,), ((1,),), ((2,),), ((1.0,),), 0, 0, time_tolerance_s=0.25)
        >>> tied_time_s(p, 2.0)
        2.25
    """
    return fastest_s + max(problem.time_tolerance_s, EXACT_TIE * abs(fastest_s))


def preferred(problem: ChainProblem, candidates: Sequence[tuple[float, int]]) -> int:
    """Index of the preferred of ``(step_s, peak_bytes)`` candidates, each feasible.

    The rule every solver follows, and the planner across head options:
    among the candidates tied with the fastest (:func:`tied_time_s`), the
    fewest peak bytes, then the least time, then the first.

    Example:
        >>> from remat.planner.data import KEEP, ChainProblem
        >>> p = ChainProblem((KEEP,), ((1,),), ((2,),), ((1.0,),), 0, 0, time_tolerance_s=0.1)
        >>> preferred(p, [(1.00, 300), (1.05, 200), (1.5, 100)])
        1
    """
    if not candidates:
        raise CheckpointUsageError("remat.planner: preferred() needs at least one candidate.")
    bound = tied_time_s(problem, min(step_s for step_s, _ in candidates))
    tied = [i for i, (step_s, _) in enumerate(candidates) if step_s <= bound]
    return min(tied, key=lambda i: (candidates[i][1], candidates[i][0]))


def gradient_error(problem: ChainProblem, choice: Sequence[int]) -> float:
    """Predicted relative gradient error of one option index per region.

    The regions' own errors (each measured alone) add in quadrature: the
    rounding of different regions' saved tensors is independent, so their
    effects on the gradient add like independent noise
    (``docs/design/planner.md``, "Gradient error"). The solvers bound its
    square, a sum over regions.

    Example:
        >>> from remat.planner.data import KEEP, ChainProblem
        >>> p = ChainProblem((KEEP, KEEP.compressed("fp8")), ((1, 1),) * 2, ((1, 1),) * 2,
        ...                  ((1.0, 1.0),) * 2, 0, 0, gradient_error=((0.0, 0.03),) * 2)
        >>> round(gradient_error(p, (1, 1)), 4)
        0.0424
    """
    return math.sqrt(math.fsum(row[o] ** 2 for row, o in zip(problem.gradient_error, choice, strict=True)))


# -- the chain problem a profile poses ----------------------------------------


def chain_problem(profile: Profile, head: int = 0) -> ChainProblem:
    """The chain problem a profile poses (``docs/design/planner.md``, "Cost model").

    When region ``k``'s backward runs, the earlier regions still hold what
    they retained, region ``k`` holds its retained bytes plus its
    backward's rise, each later region holds what its backward left
    behind (its residue), and the part after the regions holds what its
    backward left. ``head`` picks one of the profile's ``heads`` (an index);
    the head's option shifts the tail, the bytes at the start of the blocks'
    backward and the time outside the regions.
    """
    if profile.heads and not 0 <= head < len(profile.heads):
        raise CheckpointUsageError(
            f"remat.planner: chain_problem's head must index one of the {len(profile.heads)} head options, "
            f"got {head}."
        )
    if not profile.heads and head != 0:
        raise CheckpointUsageError(
            "remat.planner: chain_problem got a head index, but this profile has no head options."
        )
    tail_shift = start_shift = 0
    time_shift = 0.0
    if profile.heads:
        chosen, base = profile.heads[head], profile.heads[0]
        tail_shift = chosen.tail_peak_shift_bytes
        start_shift = chosen.backward_start_shift_bytes
        time_shift = chosen.time_s - base.time_s
    names = [o.name for o in profile.options]
    rows = [[region.costs[name] for name in names] for region in profile.regions]
    starts = [profile.backward_start_bytes[name] for name in names]
    at_backward = profile.prefix_bytes + min(starts) + start_shift
    # The last region's option decides how much of the suffix outlives the
    # loss: charge the excess to that region, in its peak and its residue.
    links, link_peaks = _links(profile, rows)
    shared = profile.shared_input_bytes  # alive through every forward
    extra = [[0] * len(names) for _ in rows]
    if rows:
        extra[-1] = [start - min(starts) for start in starts]
    return ChainProblem(
        options=profile.options,
        retained_bytes=tuple(tuple(c.retained_bytes for c in row) for row in rows),
        local_bytes=tuple(
            tuple(
                at_backward + e + c.retained_bytes + c.backward_peak_bytes
                for c, e in zip(row, more, strict=True)
            )
            for row, more in zip(rows, extra, strict=True)
        ),
        time_s=tuple(tuple(c.time_s for c in row) for row in rows),
        tail_bytes=profile.prefix_bytes + shared + profile.tail_peak_bytes + tail_shift,
        tail_after_bytes=(
            None
            if profile.tail_after_model_bytes is None
            else profile.prefix_bytes + profile.tail_after_model_bytes + tail_shift
        ),
        shared=profile.shared_inputs,
        floor_bytes=at_backward + profile.prefix_backward_peak_bytes,
        residue_bytes=tuple(
            tuple(
                c.retained_bytes + c.backward_delta_bytes + e
                for c, e in zip(row, more, strict=True)
            )
            for row, more in zip(rows, extra, strict=True)
        ),
        forward_bytes=tuple(
            tuple(profile.prefix_bytes + shared + c.forward_peak_bytes for c in row) for row in rows
        ),
        link_bytes=links,
        link_peak_bytes=link_peaks,
        base_time_s=max(0.0, profile.other_time_s + time_shift),
        names=tuple(region.name for region in profile.regions),
        gradient_error=tuple(tuple(c.gradient_error for c in row) for row in rows),
        time_tolerance_s=profile.step_noise_s,
    )


_Square = tuple[tuple[int, ...], ...]


def _links(
    profile: Profile, rows: list[list[OptionCost]]
) -> tuple[tuple[_Square, ...], tuple[_Square, ...]]:
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
    width = len(profile.options)
    square = tuple((0,) * width for _ in range(width))
    residue, peak = [square], [square]
    for k in range(1, len(rows)):
        size = profile.regions[k - 1].output_bytes
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
