"""A simulated rank's collective waits, schedule vote and profiler labels are answered,
and the planner's clock is told of every op, in the memory tracker's own dispatch mode.

They used to be three dispatch modes of their own, which every op of a simulated step
passed through (about a sixth of a pipelined Llama-3.1-8B rank's simulation). These
tests hold what is answered, what is left to the fake kernels, and that the clock sees
as an observer what it saw as a mode.
"""

from __future__ import annotations

import pytest
import torch

from helpers import OpCounter
from remat._compat.dispatch import answering_ops
from remat._compat.distributed import waits_return_their_input
from remat._compat.fake import fake_tensor_mode, is_fake
from remat._compat.pipelining import static_shapes_voted
from remat._compat.profiler import labels_unseen
from remat.errors import CheckpointUsageError
from remat.memory import track
from remat.planner.timing import DeviceRates, ModelledClock


def _wait_op() -> object:
    import torch.distributed._functional_collectives  # registers the functional ops

    namespace = getattr(torch.ops, "_c10d_functional", None)
    packet = getattr(namespace, "wait_tensor", None) if namespace is not None else None
    if packet is None:
        pytest.skip("this torch has no _c10d_functional.wait_tensor")
    return packet.default


def test_a_tracker_answering_a_wait_returns_the_tensor_waited_for_and_counts_nothing() -> None:
    wait = _wait_op()
    answers = waits_return_their_input()
    assert set(answers) == {wait}
    with fake_tensor_mode():
        sent = torch.empty(1024)
        tracker = track()
        tracker.answer_ops(answers)
        with tracker:
            waited = wait(sent)  # type: ignore[operator]
        assert waited is sent
    assert tracker.peak_bytes == 0


def test_an_answering_mode_below_a_tracker_does_the_same() -> None:
    wait = _wait_op()
    with fake_tensor_mode(), answering_ops(waits_return_their_input()):
        sent = torch.empty(1024)
        with track() as tracker:
            assert wait(sent) is sent  # type: ignore[operator]
    assert tracker.peak_bytes == 0


def test_unanswered_a_fake_wait_makes_a_storage_the_real_run_never_makes() -> None:
    # Why the answer exists: the fake kernel's output has a storage of its own.
    wait = _wait_op()
    with fake_tensor_mode():
        sent = torch.empty(1024)
        with track() as tracker:
            waited = wait(sent)  # type: ignore[operator]
        assert waited is not sent
    assert tracker.peak_bytes == 4096


def test_the_vote_reads_one_only_inside_the_schedules_warm_up() -> None:
    schedules_globals: dict[str, object] = {"__name__": "torch.distributed.pipelining.schedules"}
    exec("def _warmup_p2p(flag):\n    return flag.item()\n", schedules_globals)
    exec("def elsewhere(flag):\n    return flag.item()\n", schedules_globals)
    with fake_tensor_mode():
        flag = torch.ones(())
        tracker = track()
        tracker.answer_ops(static_shapes_voted())
        with tracker:
            assert schedules_globals["_warmup_p2p"](flag) == 1  # type: ignore[operator]
            with pytest.raises(Exception, match=r"(?i)data.dependent|item|local_scalar"):
                schedules_globals["elsewhere"](flag)  # type: ignore[operator]
            out = flag * flag  # unanswered ops run their fake kernels
            assert is_fake(out)


def test_answers_and_observers_are_set_before_the_block() -> None:
    tracker = track()
    with tracker:
        pass
    with pytest.raises(CheckpointUsageError, match="before its block"):
        tracker.answer_ops(static_shapes_voted())
    with pytest.raises(CheckpointUsageError, match="before its block"):
        tracker.observe_ops(ModelledClock(DeviceRates.named("h100")))


def _step(width: int) -> None:
    weight = torch.ones(width, width, requires_grad=True)
    x = torch.ones(8, width)
    torch.tanh(x @ weight).view(-1).sum().backward()


def test_a_clock_told_by_the_tracker_times_what_it_times_as_a_mode() -> None:
    rates = DeviceRates.named("a100")
    with fake_tensor_mode():
        as_mode = ModelledClock(rates)
        with track(), as_mode:
            _step(64)
        as_observer = ModelledClock(rates)
        tracker = track()
        tracker.observe_ops(as_observer)
        with tracker:
            _step(64)
    assert as_mode.seconds() > 0
    assert as_observer.seconds() == as_mode.seconds()


def _labelled_step(answers: dict[object, object]) -> tuple[OpCounter, object]:
    """A labelled op under a tracker with ``answers``, a counting mode below the tracker,
    all in a fake mode and a profile: what the mode below saw, and the profile."""
    with torch.profiler.profile() as profile:
        with fake_tensor_mode(), OpCounter() as below:
            tracker = track()
            tracker.answer_ops(answers)  # type: ignore[arg-type]
            with tracker, torch.profiler.record_function("remat-label"):
                made = torch.empty(4)
            assert is_fake(made)
    return below, profile


def test_a_label_is_answered_below_every_mode_and_still_names_its_range_in_a_profile() -> None:
    below, profile = _labelled_step(labels_unseen())
    seen = below.take()
    assert seen["aten.empty.memory_format"] == 1  # the work still reaches the modes below
    assert not [name for name in seen if name.startswith("profiler.")]
    assert "remat-label" in {event.name for event in profile.events()}  # type: ignore[attr-defined]


def test_unanswered_every_mode_sees_a_labels_enter_and_exit() -> None:
    # Why the answer exists: each of these ops takes the fake mode's uncached path.
    below, _ = _labelled_step({})
    seen = below.take()
    assert seen["profiler._record_function_enter_new.default"] == 1
    assert sum(count for name, count in seen.items() if name.startswith("profiler._record_function_exit")) == 1


def test_a_label_opened_with_the_older_tensor_handle_still_closes() -> None:
    # _record_function_enter returns its handle as a tensor (fake here): its exit stays in
    # the fake mode, where a kernel run below the modes could not read that handle.
    with fake_tensor_mode():
        tracker = track()
        tracker.answer_ops(labels_unseen())
        with tracker:
            handle = torch.ops.profiler._record_function_enter("remat-old-label")
            torch.ops.profiler._record_function_exit(handle)
        assert is_fake(handle)
