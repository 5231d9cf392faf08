"""The planner's head option: the output layer and loss in slices reach below full checkpointing."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch

from remat.errors import CheckpointTypeError, CheckpointUsageError
from remat.memory import track
from remat.models import GPT, GPTConfig, lm_loss, make_batch
from remat.planner import CHECKPOINT, Head, InfeasibleBudgetError, Planner
from remat.planner.apply import install
from remat.planner.cost import chain_problem, peak_bytes, step_time_s
from remat.planner.data import HeadCost
from remat.planner.step import run_step

# Every test of one profile of the model with its head (``planner``) runs on one xdist worker, which profiles once.
pytestmark = pytest.mark.xdist_group("planner_head")


@pytest.fixture(scope="module")
def lm():  # type: ignore[no-untyped-def]
    # A vocabulary large against the width, as in language models: with every
    # block checkpointed, the head's logits are most of the peak.
    config = GPTConfig(n_layers=4, d_model=32, n_heads=4, d_ff=64, seq_len=64, vocab_size=2048)
    torch.manual_seed(0)
    idx, targets = make_batch(config, 2, torch.Generator().manual_seed(0))
    return GPT(config), idx, targets


@pytest.fixture(scope="module")
def planner(lm) -> Planner:  # type: ignore[no-untyped-def]
    model, idx, targets = lm
    planner = Planner(model, head=Head("head", targets), repeats=1)
    planner.profile((idx,))
    return planner


def full_checkpoint_peak(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> int:
    removers = [install(block, CHECKPOINT) for block in model.blocks]
    try:
        model.zero_grad(set_to_none=True)
        with track() as tracker:
            run_step(model, (idx,), lambda logits: lm_loss(logits, targets))
    finally:
        for remove in removers:
            remove()
        model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def test_budgets_below_full_checkpointing_are_reached(lm, planner) -> None:  # type: ignore[no-untyped-def]
    model, idx, targets = lm
    full = full_checkpoint_peak(model, idx, targets)
    budget = int(0.6 * full)
    with pytest.raises(InfeasibleBudgetError):  # the blocks alone cannot get there
        Planner(model, loss_fn=lambda logits: lm_loss(logits, targets), repeats=1).plan(
            (idx,), budget=budget
        )
    chosen = planner.plan((idx,), budget=budget, verify=True)
    assert chosen.head_chunks > 1
    assert chosen.measured_peak_bytes is not None
    assert chosen.measured_peak_bytes <= budget
    assert chosen.predicted_peak_bytes == chosen.measured_peak_bytes  # the model is exact here
    assert "head head: loss in" in chosen.report()


def test_plan_loss_trains_like_the_unchecked_model(lm, planner) -> None:  # type: ignore[no-untyped-def]
    model, idx, targets = lm
    chosen = planner.plan((idx,), budget=int(0.6 * full_checkpoint_peak(model, idx, targets)))
    reference = copy.deepcopy(model)
    expected = lm_loss(reference(idx), targets)
    expected.backward()
    model.zero_grad(set_to_none=True)
    with chosen.apply(model):
        got = chosen.loss(model, (idx,), targets)
        got.backward()
    torch.testing.assert_close(got, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    model.zero_grad(set_to_none=True)


def test_at_the_unchecked_peak_nothing_changes(lm, planner) -> None:  # type: ignore[no-untyped-def]
    _, idx, _ = lm
    chosen = planner.plan((idx,), budget="100%")
    assert chosen.head_chunks == 1
    assert {d.option.name for d in chosen.decisions} == {"keep"}
    assert "head head: not chunked" in chosen.report()


def test_the_choice_is_the_optimum_over_heads_and_blocks(lm, planner) -> None:  # type: ignore[no-untyped-def]
    model, idx, targets = lm
    profile = planner.profile((idx,))
    assert [h.chunks for h in profile.heads] == [1, 2, 4, 8, 16]
    budget = int(0.5 * full_checkpoint_peak(model, idx, targets))
    chosen = planner.plan((idx,), budget=budget)
    # Every (head option, choice) that fits, by brute force.
    fitting = []
    for index in range(len(profile.heads)):
        problem = chain_problem(profile, index)
        for choice in itertools.product(range(len(problem.options)), repeat=problem.size):
            if (peak := peak_bytes(problem, choice)) <= budget:
                fitting.append((step_time_s(problem, choice), peak))
    assert fitting
    # The rule of docs/design/planner.md, "Ties": times within the profile's
    # noise of the fastest over every head option are equal, and of those the
    # fewest bytes win. Against that one fastest: a head option's own answer is
    # already up to the noise slower than its fastest, and comparing those
    # answers would chain the tolerance (which once chose a plan 1.2 noises slow).
    bound = min(step_s for step_s, _ in fitting) + profile.step_noise_s + 1e-12
    assert chosen.predicted_step_s <= bound
    assert chosen.predicted_peak_bytes == min(peak for step_s, peak in fitting if step_s <= bound)


def test_head_options_shift_the_tail_and_the_time() -> None:
    from remat.planner.data import KEEP, OptionCost, Profile, RegionCost

    cost = OptionCost(100, 120, 80, -90, 0.01)
    profile = Profile(
        key=(), options=(KEEP,), regions=(RegionCost("0", 10, 10, {"keep": cost}),),
        prefix_bytes=5, tail_peak_bytes=1000, backward_start_bytes={"keep": 50},
        prefix_backward_peak_bytes=0, other_time_s=0.5, unchecked_peak_bytes=1200,
        unchecked_step_s=0.6,
        heads=(HeadCost(1, 0, 0, 0.2), HeadCost(4, -800, -20, 0.25)),
    )
    plain, sliced = chain_problem(profile, 0), chain_problem(profile, 1)
    assert sliced.tail_bytes == plain.tail_bytes - 800
    assert sliced.floor_bytes == plain.floor_bytes - 20
    assert sliced.base_time_s == pytest.approx(plain.base_time_s + 0.05)
    with pytest.raises(CheckpointUsageError, match="index one of the 2"):
        chain_problem(profile, 2)
    with pytest.raises(CheckpointUsageError, match="no head options"):
        chain_problem(dataclasses.replace(profile, heads=()), 1)


def test_misuse(lm) -> None:  # type: ignore[no-untyped-def]
    model, idx, targets = lm
    with pytest.raises(CheckpointUsageError, match="not both"):
        Planner(model, loss_fn=lambda out: out.sum(), head=Head("head", targets)).profile((idx,))
    with pytest.raises(CheckpointUsageError, match="no such submodule"):
        Planner(model, head=Head("lm_head", targets)).profile((idx,))
    with pytest.raises(CheckpointUsageError, match="also a candidate"):
        Planner(model, head=Head("blocks.3", targets), candidates=["blocks.2", "blocks.3"]).profile((idx,))
    with pytest.raises(CheckpointTypeError, match=r"remat\.planner\.Head"):
        Planner(model, head="head").profile((idx,))  # type: ignore[arg-type]
    with pytest.raises(CheckpointUsageError, match="ints >= 1"):
        Head("head", targets, chunks=(0,))
    with pytest.raises(CheckpointTypeError, match="submodule name"):
        Head(model.head, targets)  # type: ignore[arg-type]
    plain = Planner(model, loss_fn=lambda logits: lm_loss(logits, targets), repeats=1).plan(
        (idx,), budget="100%"
    )
    with pytest.raises(CheckpointUsageError, match=r"Plan\.loss needs a plan made with head"):
        plain.loss(model, (idx,), targets)


def test_pareto_front_spans_every_head_option(lm, planner) -> None:  # type: ignore[no-untyped-def]
    _, idx, _ = lm
    chosen = planner.plan((idx,), budget="50%")
    front = chosen.pareto(points=6)
    peaks = [point.peak_bytes for point in front]
    times = [point.step_s for point in front]
    assert peaks == sorted(peaks) and times == sorted(times, reverse=True)
    assert len(set(peaks)) == len(peaks)
    # The lowest points need the head in slices; the fastest keeps it whole,
    # when the profile timed the whole head fastest by more than the noise
    # within which each head's front prefers fewer bytes (its timings, not
    # this machine's noise, are what the front is built from).
    assert front[0].head_chunks > 1
    heads = planner.profile((idx,)).heads
    noise = max(problem.time_tolerance_s for _, problem in chosen.head_problems)
    if heads[0].time_s + noise < min(head.time_s for head in heads[1:]):
        assert front[-1].head_chunks == 1
    only_blocks = Planner(planner.model, loss_fn=lambda out: out.sum(), repeats=1)
    assert all(point.head_chunks == 1 for point in only_blocks.plan((idx,), budget="90%").pareto(points=3))


def test_head_options_tie_against_the_fastest_of_all_not_each_others_answers() -> None:
    from remat.planner._planner import _fastest
    from remat.planner.data import CHECKPOINT, KEEP, ChainProblem

    # Unchunked head: fastest 1.00 s keeping the block (300 B), or 1.09 s checkpointing it
    # (200 B), which ties with 1.00 at a noise of 0.1 s and so is that option's answer.
    # A chunked head: 1.15 s and 100 B, tied with 1.09 s but not with the fastest, 1.00 s.
    whole = ChainProblem((KEEP, CHECKPOINT), ((300, 200),), ((0, 0),), ((0.0, 0.09),), 0, 0,
                         base_time_s=1.0, time_tolerance_s=0.1)
    sliced = ChainProblem((KEEP,), ((100,),), ((0,),), ((0.0,),), 0, 0, base_time_s=1.15, time_tolerance_s=0.1)
    index, solution = _fastest([whole, sliced], budget=1000, solver="dp")
    assert (index, solution.choice, solution.peak_bytes) == (0, (1,), 200)
    assert solution.step_s == pytest.approx(1.09)
    # Within the noise of the fastest, the chunked head's fewer bytes win.
    near = dataclasses.replace(sliced, base_time_s=1.08)
    index, solution = _fastest([whole, near], budget=1000, solver="dp")
    assert (index, solution.peak_bytes) == (1, 100)
    # Every exact solver gives the same answer.
    for solver in ("dp", "milp", "enumerate"):
        assert _fastest([whole, sliced], budget=1000, solver=solver)[1].peak_bytes == 200
