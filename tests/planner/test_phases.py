"""The planner's windows of a step, read off the tracker's read-only timeline."""

from __future__ import annotations

import itertools

import pytest
import torch

from remat.memory import track
from remat.planner.phases import StepRecorder, instrumented, window_bytes


def test_windows_of_the_timeline_can_leave_storages_out() -> None:
    # The planner's window_bytes, on MemoryTracker.timeline() (it was the tracker's
    # MemoryTracker.live_between).
    with track() as t:
        shared = torch.zeros(1024)  # 4096 bytes, made before the window
        where = t.storage_index(shared)
        t.mark("start")
        x = torch.zeros(512)  # 2048 bytes
        del shared  # freed inside the window
        y = torch.zeros(256)  # 1024 bytes
        t.mark("end")
        del x, y
    timeline = t.timeline()
    marks = dict(timeline.marks)
    start, end = marks["start"] + 1, marks["end"]  # from x's allocation, up to the mark
    assert where is not None
    record = timeline.storages[where]
    assert record.freed is not None
    assert window_bytes(timeline, start, end) == (6144, 3072, 6144)
    # Left out while it lived, nothing once it was freed.
    assert window_bytes(timeline, start, end, excluding=[record]) == (2048, 3072, 3072)
    # From the free on (the tracker's event for it): the highest point after it.
    assert window_bytes(timeline, record.freed, end)[2] == 3072
    with pytest.raises(AssertionError, match="remat bug"):
        window_bytes(timeline, end, start)


def test_a_step_s_windows_cover_its_regions() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    regions = list(model.named_children())
    with track() as tracker:
        recorder = StepRecorder(3, tracker=tracker)
        with instrumented(regions, recorder):
            recorder.start()
            output = model(torch.randn(8, 16, requires_grad=True))
            recorder.model_done()
            loss = output.sum()
            del output
            recorder.loss_done()
            loss.backward()
            recorder.finish()
    recorder.measure()
    timeline = tracker.timeline()
    windows = [*recorder.forward, recorder.suffix_forward, recorder.suffix_backward,
               *reversed(recorder.backward), recorder.prefix_backward]
    # In order, without overlap, each from its start mark to its end mark.
    for earlier, later in itertools.pairwise(windows):
        assert earlier.start_index < earlier.end_index <= later.start_index
    names = {index: name for name, index in timeline.marks}
    assert all(names[w.start_index].startswith("remat.planner:") for w in windows)
    assert all(names[w.end_index].startswith("remat.planner:") for w in windows)
    # Each forward leaves its output (8 x 16 floats) alive; the input Linear saves
    # is the previous output, counted already.
    assert [w.end_bytes - w.start_bytes for w in recorder.forward] == [512, 512, 512]
    assert recorder.suffix_after_model_high is not None
    assert recorder.step_end_s >= recorder.step_start_s > 0
