"""One pipeline rank's search for its plan: which choice to simulate next, given what
was simulated, and the rank's answer (``docs/design/planner.md``, "Predicting the next
try"). Torch-free, so that it is tested on recorded tables
(``tests/planner/test_pipeline_rounds.py``).

Layer: beside the solvers in ``remat.planner``; imports nothing of remat's. The pipeline
planner (:mod:`remat.planner.pipeline`) builds each rank's menu (:func:`interpolated`
between simulated corners), runs one :class:`RankSearch` per rank, and simulates each
choice a search asks for, each rank's as soon as its last result is in.

Example:
    >>> menu = [((0, 0, "keep"), 30.0, 1.0), ((1, 0, "keep"), 20.0, 1.1), ((2, 0, "keep"), 10.0, 1.2)]
    >>> search = RankSearch(menu, {(0, 0, "keep"): (30, 1.0)}, budget_bytes=25, n_blocks=2)
    >>> search.next_try()
    (1, 0, 'keep')
    >>> search.simulated((1, 0, "keep"), (21, 1.1))
    >>> search.next_try() is None, search.answer()
    (True, (1, 0, 'keep'))
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from remat._engine.split import WeightPass

__all__ = ["Choice", "MenuEntry", "RankSearch", "Simulated", "fitting", "interpolated", "next_choice"]

SEARCH_TRIES = 6
"""Simulations a rank's search runs at most; then the rank takes its fastest choice
simulated to fit."""


class RankSearch:
    """One rank's search (``docs/design/planner.md``, "Predicting the next try").

    ``menu`` is the rank's choices with their interpolated peaks and times, fastest first;
    ``known`` its simulated choices (at least every block kept), which
    :meth:`simulated` adds to. :meth:`next_try` says what to simulate next, one choice at
    a time, until the rank has its answer or ``tries`` ran; then, where nothing simulated
    fits, :meth:`frugal_tries` are its most frugal choices (every block fully
    checkpointed, each ``weight_pass``), in case its corners were predicted too high.
    A rank's memory and time depend on its own blocks only, so each rank searches alone.
    """

    def __init__(
        self,
        menu: Sequence[MenuEntry],
        known: Mapping[Choice, tuple[int, float]],
        *,
        budget_bytes: int,
        n_blocks: int,
        weight_passes: Sequence[WeightPass] = ("keep",),
        tries: int = SEARCH_TRIES,
    ) -> None:
        self.menu, self.known, self.budget_bytes = menu, dict(known), budget_bytes
        self.n_blocks, self.weight_passes, self.tries_left = n_blocks, tuple(weight_passes), tries

    def next_try(self) -> Choice | None:
        """The choice to simulate next (its result goes to :meth:`simulated`), or None: the
        search is over."""
        if self.tries_left <= 0:
            return None
        choice = next_choice(self.menu, self.known, self.budget_bytes)
        if choice in self.known:  # the answer: and nothing another rank learns can change it
            self.tries_left = 0
            return None
        self.tries_left -= 1
        return choice

    def frugal_tries(self) -> list[Choice]:
        """Where no simulated choice fits: every block fully checkpointed, with each weight
        pass, those not simulated yet (else none)."""
        if fitting(self.menu, self.known, self.budget_bytes) is not None:
            return []
        return [choice for choice in self._frugal() if choice not in self.known]

    def frugal_peak(self) -> int | None:
        """The smallest simulated peak of the rank's most frugal choices (every block fully
        checkpointed, each weight pass): where nothing fits, its smallest reachable peak,
        once :meth:`frugal_tries` ran. None where none of them was simulated."""
        peaks = [self.known[choice][0] for choice in self._frugal() if choice in self.known]
        return min(peaks) if peaks else None

    def _frugal(self) -> list[Choice]:
        return [(self.n_blocks, 0, weight_pass) for weight_pass in self.weight_passes]

    def simulated(self, choice: Choice, result: tuple[int, float]) -> None:
        """``choice``'s simulated (peak bytes, modelled step seconds)."""
        self.known[choice] = result

    def answer(self) -> Choice | None:
        """The rank's choice (:func:`fitting`), None where no simulated choice fits."""
        return fitting(self.menu, self.known, self.budget_bytes)


Choice = tuple[int, int, "WeightPass"]
"""A rank's choice: how many blocks are fully checkpointed, how many selectively, and its
checkpoints' ``weight_pass``."""


MenuEntry = tuple[Choice, float, float]
"""A rank's choice with its interpolated peak bytes and modelled step seconds."""


Simulated = Mapping[Choice, tuple[int, float]]
"""A rank's simulated choices: each one's (peak bytes, modelled step seconds)."""


def next_choice(menu: Sequence[MenuEntry], known: Simulated, budget_bytes: int) -> Choice:
    """The choice to simulate next, or the rank's answer (a simulated choice) when no other
    is worth simulating.

    Worth simulating: not simulated yet, predicted to fit (or to miss the budget by less
    than :data:`NEAR_MISS`, closer than a prediction can tell), and faster than every
    choice simulated to fit by more than the tie (:func:`tie_s`). Of those, the ones tied with
    the fastest, and of these the one predicted to need the fewest bytes: the one most
    likely to fit, and the one the tie rule prefers (``docs/design/planner.md``, "Ties").

    A prediction is the interpolated peak, moved by the interpolation's errors where
    choices with the same weight pass were simulated (each one's simulated peak less its
    interpolated one), weighted by the inverse square of their distance in blocks
    changed. (A plane fitted to the errors predicted better near the anchors and worse
    far from them; a slack that let a prediction exceed the budget, to try faster choices
    far from any simulated one, cost more rounds than it gained speed:
    ``docs/design/planner.md``, "Predicting the next try".)
    """
    tie = tie_s(menu)
    at = {choice: peak for choice, peak, _ in menu}  # each choice's interpolated peak
    fits = [step_s for peak, step_s in known.values() if peak <= budget_bytes]
    faster_than = min(fits) - tie if fits else float("inf")
    hopeful = []
    for choice, peak, step_s in menu:
        if step_s >= faster_than:
            break  # fastest first: no later choice is faster either
        if choice in known:
            continue
        anchors = _anchors(choice, known)
        weights = [1.0 / distance**2 for _, distance in anchors]
        error = sum(weight * (known[anchor][0] - at[anchor])
                    for weight, (anchor, _) in zip(weights, anchors, strict=True)) / sum(weights)
        if peak + error <= budget_bytes * (1 + NEAR_MISS):
            hopeful.append((step_s, peak + error, choice))
    if hopeful:
        quickest = hopeful[0][0]
        return min((predicted, step_s, choice) for step_s, predicted, choice in hopeful
                   if step_s <= quickest + tie)[2]
    found = fitting(menu, known, budget_bytes)
    if found is not None:
        return found
    return min(menu, key=lambda entry: entry[1])[0]  # none fits: try the most frugal


NEAR_MISS = 0.0025
"""A choice predicted to exceed the budget by less than this fraction of it is still tried.
A prediction next to a simulated choice is off by about 0.1-0.2% of the peak on
Llama-3.1-8B's ranks; without this, a choice that fits by half a megabyte (rank 0's
fastest at 46 GiB) was predicted 0.07 GiB over and the plan took one block more (2.6%
slower). Replayed over 29 budgets: the same 1.62 rounds on average, 2.59 slots against
2.55 (``docs/design/planner.md``, "Predicting the next try")."""

TIE = 0.005
"""Modelled step times closer than this fraction of a rank's unchecked step are ties."""


def tie_s(menu: Sequence[MenuEntry]) -> float:
    """A rank's tie in modelled seconds: :data:`TIE` of its unchecked step (its fastest).

    The modelled clock is deterministic, so no noise tells times apart; its model is
    not that exact (it overlaps nothing, caches nothing), and under it one fully
    checkpointed block costs about what two selective ones do: Llama-3.1-8B's last rank
    has choices 0.17% apart along such lines, whose peaks differ by up to a gigabyte.
    Chasing those cost rounds of simulations for no time that the model can vouch for.
    """
    return TIE * menu[0][2]


def _anchors(choice: Choice, known: Simulated) -> list[tuple[Choice, int]]:
    """The simulated choices with ``choice``'s weight pass (or with nothing checkpointed,
    which has none), each with how many blocks apart it is (at least 1: ``choice`` is
    not simulated)."""
    full, selective, weight_pass = choice
    return [(other, abs(other[0] - full) + abs(other[1] - selective)) for other in known
            if other[2] == weight_pass or other[0] + other[1] == 0]


def fitting(menu: Sequence[MenuEntry], known: Simulated, budget_bytes: int) -> Choice | None:
    """The rank's answer: of the choices simulated to fit, those tied with the fastest
    (:func:`tie_s`), and of these the one with the smallest simulated peak; None where
    none fits."""
    fits = [(known[choice][1], known[choice][0], choice) for choice, _, _ in menu
            if choice in known and known[choice][0] <= budget_bytes]
    if not fits:
        return None
    fastest = min(step_s for step_s, _, _ in fits)
    return min((peak, step_s, choice) for step_s, peak, choice in fits if step_s <= fastest + tie_s(menu))[2]


def interpolated(n_blocks: int, uniform: Sequence[tuple[int, float]]) -> list[tuple[int, int, float, float]]:
    """Every ``(full, selective, predicted peak, predicted step seconds)`` of a rank.

    ``uniform`` is the rank's (peak, time) with every block kept, selective, full; a
    choice's peak and time are interpolated: each block moves its share of the way.
    """
    (keep_peak, keep_s), (selective_peak, selective_s), (full_peak, full_s) = uniform
    found = []
    for full, selective in itertools.product(range(n_blocks + 1), repeat=2):
        if full + selective > n_blocks:
            continue
        peak = keep_peak + (full * (full_peak - keep_peak) + selective * (selective_peak - keep_peak)) / n_blocks
        step_s = keep_s + (full * (full_s - keep_s) + selective * (selective_s - keep_s)) / n_blocks
        found.append((full, selective, peak, step_s))
    return found
