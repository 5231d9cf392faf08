"""remat.memory.saved_tensors: what a forward keeps for backward, and each tensor's fate."""

from __future__ import annotations

import functools
import pathlib

import pytest
import torch
from torch import nn

import remat
from remat import policies
from remat.errors import CheckpointTypeError
from remat.memory import (
    OUTSIDE_MODULES,
    SavedTensorReport,
    render_memory_report,
    render_saved_tensors,
    saved_tensors,
    track,
)
from remat.offload import offload

HERE = pathlib.Path(__file__).name
MAT = 16 * 16 * 4  # bytes of one float32 [16, 16]


class Net(nn.Module):
    """x -> sigmoid(x @ w1) @ w2 -> tanh, written out so source lines are known."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(16, 16))
        self.w2 = nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(x @ self.w1)  # LINE_H
        return torch.tanh(h @ self.w2)  # LINE_OUT


class Outer(nn.Module):
    def __init__(self, checkpoint_fn: object = None) -> None:
        super().__init__()
        self.net = Net()
        self.checkpoint_fn = checkpoint_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_fn is None:
            return self.net(x)
        return self.checkpoint_fn(self.net, x)  # type: ignore[operator, no-any-return]


def _line(marker: str) -> str:
    lines = pathlib.Path(__file__).read_text().splitlines()
    return f"{HERE}:{next(i + 1 for i, text in enumerate(lines) if text.endswith(f'# {marker}'))}"


def _by_op(report: SavedTensorReport) -> dict[tuple[str, str], int]:
    """(op, fate) -> storage bytes, parameters left out."""
    table: dict[tuple[str, str], int] = {}
    for s in report.tensors:
        if not s.is_parameter:
            table[(s.op, s.fate)] = table.get((s.op, s.fate), 0) + s.storage_bytes
    return table


def test_plain_forward_keeps_everything_with_op_module_and_line() -> None:
    x = torch.randn(16, 16, requires_grad=True)
    report = saved_tensors(Outer(), x)
    assert _by_op(report) == {
        ("(input)", "kept"): MAT,  # x, saved by the first mm
        ("aten.sigmoid.default", "kept"): MAT,  # saved by sigmoid's backward and the second mm
        ("aten.tanh.default", "kept"): MAT,
    }
    sigmoid = next(s for s in report.tensors if s.op == "aten.sigmoid.default")
    assert sigmoid.module == "net"
    assert sigmoid.source == _line("LINE_H")
    assert sigmoid.times_saved == 2
    assert (sigmoid.shape, sigmoid.dtype) == ((16, 16), "torch.float32")
    tanh = next(s for s in report.tensors if s.op == "aten.tanh.default")
    assert tanh.source == _line("LINE_OUT")
    params = [s for s in report.tensors if s.is_parameter]
    assert {s.module for s in params} == {"net"} and len(params) == 2  # w1, w2 saved by the mms
    assert report.bytes_by_fate()["kept"] == 3 * MAT
    assert report.bytes_by_fate(include_parameters=True)["kept"] == 5 * MAT
    x_entry = next(s for s in report.tensors if s.op == "(input)")
    assert x_entry.module == OUTSIDE_MODULES and x_entry.source is None


def test_checkpointed_region_drops_its_activations() -> None:
    x = torch.randn(16, 16, requires_grad=True)
    report = saved_tensors(Outer(functools.partial(remat.checkpoint, use_reentrant=False)), x)
    # mm outputs are saved by nobody; sigmoid's and tanh's outputs are, inside the region.
    assert _by_op(report) == {
        ("(input)", "kept"): MAT,  # the region keeps its input
        ("aten.sigmoid.default", "dropped"): MAT,
        ("aten.tanh.default", "dropped"): MAT,
    }
    # The region's input is kept, so it is not also listed as dropped.
    assert [s.fate for s in report.tensors if s.op == "(input)"] == ["kept"]
    assert report.bytes_by_fate()["dropped"] == 2 * MAT


def test_policy_saved_tensors_are_not_dropped() -> None:
    x = torch.randn(16, 16, requires_grad=True)
    checkpoint_fn = functools.partial(remat.checkpoint, policy=policies.save_matmuls)
    report = saved_tensors(Outer(checkpoint_fn), x)
    table = _by_op(report)
    # The policy caches both matmul outputs (backward replays sigmoid and tanh
    # from them); sigmoid's and tanh's outputs are still recomputed.
    assert table[("aten.mm.default", "policy_saved")] == 2 * MAT
    assert table[("aten.sigmoid.default", "dropped")] == MAT
    assert table[("aten.tanh.default", "dropped")] == MAT
    assert ("aten.mm.default", "dropped") not in table
    assert report.bytes_by_fate()["policy_saved"] == 2 * MAT


def test_policy_offload_and_offload_context() -> None:
    x = torch.randn(16, 16, requires_grad=True)
    def offload_mms(ctx: object, op: object, *args: object, **kwargs: object) -> object:
        if op is torch.ops.aten.mm.default:
            return remat.CheckpointPolicy.MUST_OFFLOAD
        return remat.CheckpointPolicy.PREFER_RECOMPUTE

    report = saved_tensors(Outer(functools.partial(remat.checkpoint, policy=offload_mms)), x)
    assert _by_op(report)[("aten.mm.default", "policy_offloaded")] == 2 * MAT

    def offloaded(t: torch.Tensor) -> torch.Tensor:
        with offload(min_bytes=0):
            return torch.sigmoid(t @ t)

    report = saved_tensors(offloaded, x)
    assert _by_op(report) == {("(input)", "offloaded"): MAT, ("aten.sigmoid.default", "offloaded"): MAT}


def test_report_keeps_nothing_alive_and_restores_grad_mode() -> None:
    x = torch.randn(16, 16, requires_grad=True)
    model = Outer()
    with track() as t, torch.no_grad():
        saved_tensors(model, x)
        assert not torch.is_grad_enabled()
    assert t.live_bytes == 0  # the forward's output and saved tensors are gone


def test_bad_first_argument() -> None:
    with pytest.raises(CheckpointTypeError, match=r"function or an nn\.Module"):
        saved_tensors(42)  # type: ignore[arg-type]


def test_render_saved_tensors() -> None:
    x = torch.randn(16, 16, requires_grad=True)
    report = saved_tensors(Outer(functools.partial(remat.checkpoint, use_reentrant=False)), x)
    text = render_saved_tensors(report)
    lines = text.splitlines()
    assert lines[0].split() == ["fate", "shape", "dtype", "bytes", "op", "module", "source"]
    assert any(line.startswith("dropped ") and "aten.tanh.default" in line and _line("LINE_OUT") in line for line in lines)
    assert any(line.startswith("dropped param") for line in lines)
    assert lines[-1] == "totals (parameters excluded): kept 1.0 KiB, dropped 2.0 KiB"
    short = render_saved_tensors(report, limit=1).splitlines()
    assert short[2].startswith("... ") and short[2].endswith(" more")
    assert render_saved_tensors(SavedTensorReport(())).splitlines()[0] == "(nothing saved)"


def test_render_memory_report() -> None:
    model = Outer()
    x = torch.randn(16, 16, requires_grad=True)
    with track(model) as t:
        model(x).sum().backward()
    text = render_memory_report(t.report(), top_modules=2)
    lines = text.splitlines()
    assert lines[0].startswith("peak ") and lines[0].endswith("(start 2.0 KiB)")  # w1, w2
    assert [line.split()[0] for line in lines[2:8]] == [
        "category",
        "parameter",
        "gradient",
        "optimizer_state",
        "activation",
        "temporary",
    ]
    assert lines[9].split()[0] == "module"
    assert len(lines) == 12  # two modules listed
