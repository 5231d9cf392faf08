"""remat.memory.track: exact storage-level byte counts on small graphs."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from remat.errors import CheckpointUsageError
from remat.memory import MemoryTracker, track

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
