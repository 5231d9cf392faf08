"""The pipeline planner's rank searches (``remat.planner.rank_search.RankSearch``) replayed
against every choice of Llama-3.1-8B's four pipeline ranks simulated in full (recorded by
``tests/planner/data/make_pipeline_rounds_table.py``): at every budget the plan fits, is within a small
margin of each rank's fastest fitting choice, and takes few tries. Replayed in rounds (every
rank's next try at once, as two processes would run them side by side), the unit the
figures were first measured in. Design: ``docs/design/planner.md``, "Predicting the next try"."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from remat.planner.rank_search import Choice, MenuEntry, RankSearch

TABLE = Path(__file__).parent / "data" / "llama-3.1-8b-pipeline-rounds.json"
GIB = 1 << 30
BUDGETS_GIB = [half / 2 for half in range(72, 101)]  # 36 to 50 GiB: from no fit on the last rank to few checkpoints


def _table() -> list[tuple[list[MenuEntry], dict[Choice, tuple[int, float]]]]:
    ranks = json.loads(TABLE.read_text())["ranks"]
    return [
        ([((full, selective, "keep"), peak, step_s) for full, selective, peak, step_s in rank["menu"]],
         {(full, selective, "keep"): (peak, step_s) for full, selective, peak, step_s in rank["simulated"]})
        for rank in ranks
    ]


def _replay(budget_bytes: int) -> tuple[int, int, list[Choice | None], list[dict[Choice, tuple[int, float]]]]:
    """Rounds, simulations (in units of one round's slot on 2 processes), each rank's choice."""
    table = _table()
    searches = [RankSearch(menu, {(0, 0, "keep"): simulated[0, 0, "keep"]}, budget_bytes=budget_bytes, n_blocks=8)
                for menu, simulated in table]  # each rank from its keep corner
    rounds = slots = 0
    while tries := [(rank, choice) for rank, search in enumerate(searches)
                    if (choice := search.next_try()) is not None]:
        rounds += 1
        slots += math.ceil(len(tries) / 2)
        for rank, choice in tries:
            searches[rank].simulated(choice, table[rank][1][choice])
    return rounds, slots, [search.answer() for search in searches], [simulated for _, simulated in table]


@pytest.mark.parametrize("budget_gib", BUDGETS_GIB)
def test_each_rank_gets_a_fitting_choice_near_its_fastest(budget_gib: float) -> None:
    budget = int(budget_gib * GIB)
    rounds, _, chosen, truth = _replay(budget)
    assert rounds <= 4
    for rank, choice in enumerate(chosen):
        fitting = [step_s for peak, step_s in truth[rank].values() if peak <= budget]
        if not fitting:  # the last rank at 36.5 GiB or less: nothing fits, and nothing is chosen
            assert choice is None
            continue
        assert choice is not None, f"rank {rank} at {budget_gib} GiB: a choice fits, none was found"
        peak, step_s = truth[rank][choice]
        assert peak <= budget
        # Within the tie (0.5% of the rank's unchecked step, where the fewest bytes win) and
        # what the predictions miss: 0.61% at most on the table written when the clock began
        # to charge a policy's modes (1.87% on the one before), 0.15% on average.
        assert step_s <= 1.025 * min(fitting), (rank, budget_gib, choice)


def test_the_rounds_are_few_on_average() -> None:
    replays = [_replay(int(budget * GIB)) for budget in BUDGETS_GIB]
    # Measured on this table: 1.62 rounds and 2.59 two-process slots on average (on the
    # table before the clock charged a policy's modes, 2.03 and 3.07; with no tie there,
    # 2.62 and 3.83; the rule before that, with a slack of a tenth of a rank's span over
    # the budget, 4.40 and 5.84).
    assert sum(rounds for rounds, *_ in replays) / len(replays) <= 2.5
    assert sum(slots for _, slots, *_ in replays) / len(replays) <= 3.5
    assert _replay(40 * GIB)[:2] == (2, 3)  # the documented 40 GiB plan: 4 and 2 simulations


def test_a_rank_that_fits_nowhere_ends_with_its_frugal_choices_and_names_their_peak() -> None:
    # Llama-3.1-8B's last rank reaches 36.7 GiB at best: at 36 GiB its search simulates its
    # fastest hopes, then every block fully checkpointed, whose peak the plan's error names.
    menu, simulated = _table()[3]
    search = RankSearch(menu, {(0, 0, "keep"): simulated[0, 0, "keep"]}, budget_bytes=36 * GIB, n_blocks=8)
    assert search.frugal_peak() is None
    while (choice := search.next_try()) is not None:
        search.simulated(choice, simulated[choice])
    for choice in search.frugal_tries():
        search.simulated(choice, simulated[choice])
    assert search.answer() is None
    assert search.frugal_peak() == simulated[8, 0, "keep"][0]
    assert search.frugal_tries() == []
