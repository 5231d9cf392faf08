"""remat.memory.track: exact storage-level byte counts on small graphs."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import weakref

import pytest
import torch

from helpers import REPO
from remat.errors import CheckpointUsageError
from remat.memory import MemoryReport, MemoryTracker, track

MAT = 256 * 256 * 4  # bytes of a float32 [256, 256]


def test_new_tensor_counted_once_with_views() -> None:
    with track() as t:
        x = torch.ones(256, 256)
        views = [x.t(), x[1:], x.view(-1), x.reshape(256, 256), x.detach(), x.unsqueeze(0)]
        t.mark("after_views")
    assert t.marks == {"after_views": MAT}
    assert t.live_bytes == MAT
    assert t.peak_bytes == MAT
    del views, x


def test_freed_tensors_are_subtracted_and_peak_kept() -> None:
    with track() as t:
        a = torch.ones(256, 256)
        b = torch.ones(256, 256)
        t.mark("two")
        del a
        t.mark("one")
        view = b[0]
        del b
        t.mark("view_keeps_storage")
        del view
        t.mark("none")
    assert t.marks == {"two": 2 * MAT, "one": MAT, "view_keeps_storage": MAT, "none": 0}
    assert t.peak_bytes == 2 * MAT
    assert t.live_bytes == 0


def test_inplace_ops_add_nothing() -> None:
    with track() as t:
        a = torch.zeros(256, 256)
        a.add_(1).mul_(2)
        a.sin_()
        torch.add(a, 1, out=a)
    assert t.live_bytes == MAT
    assert t.peak_bytes == MAT


def test_storages_from_before_the_block_are_not_counted() -> None:
    w = torch.zeros(256, 256)
    with track() as t:
        w.add_(1)
        v = w.t()[3:]
        v.mul_(2)
        y = w + 1
    assert t.live_bytes == MAT  # only y
    del v, y


def test_resize_grows_the_count() -> None:
    with track() as t:
        a = torch.empty(256, 256)
        a.resize_(512, 256)
        t.mark("grown")
        del a
    assert t.marks["grown"] == 2 * MAT
    assert t.peak_bytes == 2 * MAT
    assert t.live_bytes == 0


def test_multiple_outputs_and_dtypes() -> None:
    with track() as t:
        x = torch.ones(64, 32, dtype=torch.float64)  # 16384 bytes
        values, indices = x.max(dim=1)  # 64 * 8 + 64 * 8 (int64)
        chunks = x.chunk(4)  # views
    assert t.live_bytes == 16384 + 512 + 512
    del values, indices, chunks


def test_backward_ops_are_seen() -> None:
    w = torch.randn(256, 256, requires_grad=True)
    with track() as t:
        y = torch.sigmoid(w)  # saved for backward
        loss = y.sum()
        t.mark("forward_end")
        del y
        loss.backward()
        t.mark("backward_end")
    assert w.grad is not None
    assert t.marks["forward_end"] == MAT + 4  # sigmoid output + scalar loss
    # Backward freed the saved sigmoid output and made w.grad (by sigmoid_backward).
    assert t.marks["backward_end"] == MAT + 4
    # Peak inside backward: saved output + loss + ones_like(loss) + w.grad.
    assert t.peak_bytes == 2 * MAT + 8


def test_backward_alone_counts_only_what_backward_makes() -> None:
    w = torch.randn(256, 256, requires_grad=True)
    loss = torch.sigmoid(w).sum()  # graph and saved tensor built before the block
    with track() as t:
        loss.backward()
    assert w.grad is not None
    assert t.peak_bytes == 4 + MAT  # ones_like(loss) + w.grad
    assert t.live_bytes == MAT  # w.grad


def test_grad_accumulation_into_existing_grad_is_in_place() -> None:
    w = torch.randn(256, 256, requires_grad=True)
    torch.sigmoid(w).sum().backward()
    with track() as t:
        torch.sigmoid(w).sum().backward()
    assert t.live_bytes == 0  # the new gradient was added into w.grad and freed
    assert t.peak_bytes >= 2 * MAT  # saved sigmoid output + the new gradient


def test_exit_stops_tracking_and_keeps_nothing_alive() -> None:
    with track() as t:
        a = torch.ones(256, 256)
        ref = weakref.ref(a.untyped_storage())
    assert t.live_bytes == MAT
    assert not t.active
    del a
    gc.collect()
    assert ref() is None  # the tracker held no strong reference
    assert t.live_bytes == MAT  # frees after the block are not subtracted
    torch.ones(256, 256)  # ops after the block are not seen
    assert t.peak_bytes == MAT


def test_tracker_is_not_kept_alive_by_storages() -> None:
    with track() as t:
        a = torch.ones(16)
    tracker_ref = weakref.ref(t)
    del t
    gc.collect()
    assert tracker_ref() is None
    del a


def test_tensors_freed_inside_block_are_released() -> None:
    refs = []
    with track() as t:
        for _ in range(3):
            a = torch.ones(256, 256)
            refs.append(weakref.ref(a.untyped_storage()))
            del a
    gc.collect()
    assert all(r() is None for r in refs)
    assert t.live_bytes == 0
    assert t.peak_bytes == MAT


def test_nested_trackers_both_count() -> None:
    with track() as outer:
        a = torch.ones(256, 256)
        with track() as inner:
            b = torch.ones(256, 256)
        c = torch.ones(256, 256)
    assert inner.live_bytes == MAT
    assert outer.live_bytes == 3 * MAT
    del a, b, c


def test_exception_inside_block_stops_tracking() -> None:
    t = MemoryTracker()
    with pytest.raises(ZeroDivisionError), t:
        kept = torch.ones(4)
        raise ZeroDivisionError
    assert not t.active
    assert t.live_bytes == 16
    del kept


def test_tracker_is_single_use() -> None:
    t = track()
    with t:
        pass
    with pytest.raises(CheckpointUsageError, match="one block only"), t:
        pass


def test_mark_overwrites() -> None:
    with track() as t:
        t.mark("m")
        x = torch.ones(10)
        t.mark("m")
    assert t.marks == {"m": 40}
    del x


def test_frees_on_another_thread_are_subtracted() -> None:
    box = []
    with track() as t:
        box.append(torch.ones(256, 256))
        worker = threading.Thread(target=box.clear)
        worker.start()
        worker.join()
    assert t.live_bytes == 0
    assert t.peak_bytes == MAT


def test_meta_tensors_are_counted_without_memory() -> None:
    with track() as t:
        x = torch.empty(1024, 1024, device="meta")
        y = x @ x
    assert t.live_bytes == 2 * 1024 * 1024 * 4
    del x, y


# -- report: timeline, phases, modules, categories ----------------------------

# nn.Sequential(Linear(4, 8), ReLU(), Linear(8, 2)) on a [3, 4] float32 batch:
PARAM_BYTES = (8 * 4 + 8 + 2 * 8 + 2) * 4  # 232
HIDDEN = 3 * 8 * 4  # 96: one [3, 8] activation


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _tracked_mlp_step() -> tuple[torch.nn.Sequential, MemoryReport]:
    model = _mlp()
    x = torch.randn(3, 4)  # made before the block: not counted
    with track(model) as t:
        loss = model(x).sum()
        t.mark("forward_end")
        loss.backward()
        del loss
    return model, t.report()


def test_model_parameters_count_from_the_start() -> None:
    _, report = _tracked_mlp_step()
    assert report.start_bytes == PARAM_BYTES
    assert report.category("parameter").at_peak_bytes == PARAM_BYTES
    assert report.category("parameter").allocated_bytes == 0
    # End of forward: parameters + relu output (saved) + the scalar loss.
    assert report.forward_end_bytes == PARAM_BYTES + HIDDEN + 4
    assert report.category("activation").at_forward_end_bytes == HIDDEN + 4
    # After backward: parameters and their gradients, nothing else.
    assert report.end_bytes == 2 * PARAM_BYTES
    assert report.category("gradient").at_end_bytes == PARAM_BYTES
    assert report.category("activation").at_end_bytes == 0
    assert report.category("temporary").at_end_bytes == 0


def test_peak_is_exact_and_categories_sum_to_it() -> None:
    _, report = _tracked_mlp_step()
    # Peak, inside ReLU's backward: parameters, relu output, loss, seed grad (4),
    # grad of relu output (96), grads of the second Linear (64 + 8), and the
    # threshold_backward output (96).
    assert report.peak_bytes == PARAM_BYTES + HIDDEN + 4 + 4 + HIDDEN + 72 + HIDDEN
    assert sum(u.at_peak_bytes for u in report.by_category) == report.peak_bytes
    assert sum(u.at_peak_bytes for u in report.by_module) == report.peak_bytes
    assert report.timeline[report.peak_index].live_bytes == report.peak_bytes
    assert max(e.live_bytes for e in report.timeline) == report.peak_bytes


def test_module_attribution_forward_and_backward() -> None:
    _, report = _tracked_mlp_step()
    relu, second, first = report.module("1"), report.module("2"), report.module("0")
    # relu: its output (forward) and threshold_backward's output (backward).
    assert relu.allocated_bytes == 2 * HIDDEN
    assert relu.at_forward_end_bytes == HIDDEN
    # Linear 2: its output (24) in forward; grad input (96), weight grad (64),
    # bias grad (8) in its backward. Parameters + gradients stay with it.
    assert second.allocated_bytes == 24 + HIDDEN + 64 + 8
    assert second.at_end_bytes == 2 * (64 + 8)
    assert first.at_end_bytes == 2 * (128 + 32)
    assert report.module("(outside modules)").allocated_bytes == 8  # loss + seed grad
    assert report.module("no.such.module").at_peak_bytes == 0


def test_timeline_has_phases_and_module_markers_in_order() -> None:
    _, report = _tracked_mlp_step()
    markers = [(e.kind, e.name) for e in report.timeline if e.kind in ("enter", "exit", "phase")]
    assert markers == [
        ("enter", ""),
        ("enter", "0"),
        ("exit", "0"),
        ("enter", "1"),
        ("exit", "1"),
        ("enter", "2"),
        ("exit", "2"),
        ("exit", ""),
        ("phase", "backward"),
    ]
    backward = [e.name for e in report.timeline if e.kind == "backward_enter"]
    assert backward == ["2", "1", "0"]  # innermost module of each gradient, in order
    allocs = [e for e in report.timeline if e.kind == "alloc" and e.phase == "backward"]
    assert {e.module for e in allocs} == {"0", "1", "2"}
    assert report.timeline[0].kind == "start"
    for before, after in zip(report.timeline, report.timeline[1:], strict=False):
        assert after.live_bytes == before.live_bytes + after.delta_bytes


def test_forward_end_without_mark_is_where_backward_starts() -> None:
    model = _mlp()
    x = torch.randn(3, 4)
    with track(model) as t:
        model(x).sum().backward()
    report = t.report()
    # The seed gradient (ones_like, 4 bytes) is made before the engine runs.
    assert report.forward_end_bytes == PARAM_BYTES + HIDDEN + 4 + 4
    assert report.timeline[report.forward_end_index + 1].kind == "phase"


def test_optimizer_phase_and_state() -> None:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with track(model, optimizer=optimizer) as t:
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
    report = t.report()
    phases = [e.name for e in report.timeline if e.kind == "phase"]
    assert phases == ["backward", "other", "optimizer", "other"] or phases[:3] == [
        "backward",
        "optimizer",
        "other",
    ]
    # SGD momentum: one buffer per parameter, created in the first step.
    assert report.category("optimizer_state").at_end_bytes == PARAM_BYTES
    assert report.category("gradient").at_end_bytes == PARAM_BYTES
    # A second step counts the existing state from the start.
    with track(model, optimizer=optimizer) as t2:
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
    assert t2.report().start_bytes == 3 * PARAM_BYTES  # params, grads, momentum


def test_recomputation_in_backward_counts_as_activation() -> None:
    import remat

    torch.manual_seed(0)
    inner = _mlp()
    model = torch.nn.Sequential(inner)
    x = torch.randn(3, 4, requires_grad=True)
    with track(model) as t:
        remat.checkpoint(inner, x).sum().backward()
    report = t.report()
    recomputed = [
        e for e in report.timeline if e.kind == "alloc" and e.phase == "backward" and e.name == "aten.relu.default"
    ]
    assert len(recomputed) == 1
    assert recomputed[0].module == "0.1"
    # Nothing made inside the region survives forward: relu's output is recomputed.
    assert report.category("activation").at_forward_end_bytes == 8  # loss + seed gradient


def test_bad_model_and_optimizer_types() -> None:
    from remat.errors import CheckpointTypeError

    with pytest.raises(CheckpointTypeError, match=r"nn\.Module"):
        track(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(CheckpointTypeError, match="Optimizer"):
        track(_mlp(), optimizer=object())


def test_hooks_are_removed_after_the_block() -> None:
    model = _mlp()
    with track(model):
        pass
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert all(not m._forward_hooks for m in model.modules())
    with track() as t:
        model(torch.randn(3, 4)).sum().backward()
    assert [e.kind for e in t.report().timeline].count("enter") == 0


def test_fake_tensors_match_real_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.models import GPT, GPTConfig, lm_loss

    config = GPTConfig(n_layers=2, seq_len=32)

    def step() -> MemoryReport:
        torch.manual_seed(0)
        model = GPT(config)
        idx = torch.zeros(2, 32, dtype=torch.long)
        with track(model) as t:
            loss = lm_loss(model(idx), idx)
            t.mark("forward_end")
            loss.backward()
            del loss
        return t.report()

    real = step()
    with FakeTensorMode():
        fake = step()
    assert fake.peak_bytes == real.peak_bytes
    assert fake.forward_end_bytes == real.forward_end_bytes
    assert fake.end_bytes == real.end_bytes
    assert [u.at_peak_bytes for u in fake.by_category] == [u.at_peak_bytes for u in real.by_category]


_RSS_CHILD = """
import os, torch
from remat.memory import track

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

with track():  # warm up: the first tracked op loads code and caches (not tensors)
    torch.ones(1) * 2
before = rss()
with track() as t:
    a = torch.ones(40_000_000)      # 160 MB, pages touched
    b = a * 2                       # another 160 MB
    c = b[::2]                      # a view: nothing new
    del a
    d = torch.full((20_000_000,), 3.0)  # 80 MB
after = rss()
print(t.live_bytes, t.peak_bytes, after - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_live_bytes_match_the_process_rss() -> None:
    src = str(REPO / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD], capture_output=True, text=True, check=True, env=env, timeout=120
    ).stdout
    live, peak, rss_delta = (int(v) for v in out.split())
    assert live == 240_000_000
    assert peak == 320_000_000
    assert abs(rss_delta - live) <= 0.1 * live


def test_peak_by_device_keeps_meta_and_cpu_apart() -> None:
    with track() as t:
        a = torch.ones(256, 256)
        m = torch.empty(1024, 1024, device="meta")
        del a
        b = torch.ones(128, 256)
    report = t.report()
    assert report.peak_bytes_by_device == {"cpu": MAT, "meta": 4 * 2**20}
    assert report.peak_bytes == MAT + 4 * 2**20
    del m, b


def test_device_filter_counts_one_device_type() -> None:
    from remat.errors import CheckpointTypeError

    with track(device="cuda") as accelerator_only:
        kept = torch.zeros(1024)  # a host tensor: not counted
    with track(device="cpu") as host:
        also = torch.zeros(1024)
    assert accelerator_only.peak_bytes == 0 and accelerator_only.live_bytes == 0
    assert host.peak_bytes == 4096
    del kept, also
    with pytest.raises(CheckpointTypeError, match="device type"):
        track(device=0)  # type: ignore[arg-type]


def test_the_timeline_is_a_read_only_snapshot() -> None:
    import dataclasses

    with track() as t:
        x = torch.zeros(16)
        where = t.storage_index(x)
        assert where is not None and t.timeline().storages[where].freed is None
        del x
        freed = t.timeline().storages[where].freed
        assert freed is not None
        # From the free on (the tracker's event for it): nothing is live.
        assert max(t.timeline().live_bytes[freed:]) == 0
        assert t.storage_index(torch.ones(()).expand(4)) is not None  # counted when made here
    outside = torch.zeros(4)
    assert t.storage_index(outside) is None  # made after the block: not counted
    timeline = t.timeline()
    with pytest.raises(dataclasses.FrozenInstanceError):
        timeline.storages[where].freed = None  # type: ignore[misc]
    assert len(timeline.live_bytes) == len(t.report().timeline)
    assert [index for _, index in timeline.marks] == []
