"""remat/_settings.py: the context-local knobs, read once when a region starts."""

from __future__ import annotations

import threading

import torch

import remat


def test_settings_are_context_local() -> None:
    seen: list[bool] = []

    def other_thread() -> None:
        from remat._settings import resolve_early_stop

        seen.append(resolve_early_stop(True))

    with remat.set_checkpoint_early_stop(False):
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert seen == [True]


def test_early_stop_setting_frozen_at_forward() -> None:
    ran: list[str] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        a = t.sin()
        ran.append("after-sin")
        return a * 3  # mul by a python scalar saves nothing

    x = torch.randn(3, requires_grad=True)
    with remat.set_checkpoint_early_stop(True):
        y = remat.checkpoint(fn, x)
    with remat.set_checkpoint_early_stop(False):
        y.sum().backward()
    assert ran == ["after-sin"]  # early stop cut the recompute before the append
