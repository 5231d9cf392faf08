"""remat.memory plots: PNG files from reports; a clear error without matplotlib."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import remat
from remat.errors import UnsupportedCheckpointError
from remat.memory import MemoryReport, plot_saved_by_module, plot_timeline, saved_tensors, track

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def _report(checkpointed: bool) -> MemoryReport:
    model = _model()
    x = torch.randn(4, 8, requires_grad=True)
    with track(model) as t:
        y = remat.checkpoint(model, x) if checkpointed else model(x)
        y.sum().backward()
        del y
    return t.report()


def test_plots_write_pngs(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib")
    timeline = tmp_path / "nested" / "timeline.png"
    figure = plot_timeline({"none": _report(False), "remat": _report(True)}, timeline)
    assert timeline.read_bytes().startswith(PNG_MAGIC)
    axes = figure.axes[0]
    assert [text.get_text() for text in axes.get_legend().get_texts()] == ["none", "remat"]

    x = torch.randn(4, 8, requires_grad=True)
    saved = {"none": saved_tensors(_model(), x), "remat": saved_tensors(lambda t: remat.checkpoint(_model(), t), x)}
    bars = tmp_path / "saved.png"
    figure = plot_saved_by_module(saved, bars, depth=1)
    assert bars.read_bytes().startswith(PNG_MAGIC)
    # One labelled group per module that keeps memory, and each bar as long as
    # that module's bytes in its report (a plot with default ticks fails this).
    expected = {label: report.device_bytes_by_module(1) for label, report in saved.items()}
    modules = list(dict.fromkeys(m for by_module in expected.values() for m in by_module))
    assert modules and set(modules) <= {"(outside modules)", "", "0", "1", "2"}
    labels = [label.get_text() for label in figure.axes[0].get_yticklabels()]
    assert labels == [m or "(root)" for m in modules]
    axes = figure.axes[0]
    for container, by_module in zip(axes.containers, expected.values(), strict=True):
        widths = [bar.get_width() * 2**20 for bar in container]
        assert widths == pytest.approx([by_module.get(m, 0) for m in modules])
    # Checkpointing keeps less in the first Linear than the plain run.
    assert expected["remat"].get("0", 0) < expected["none"].get("0", 0)


def test_plot_without_path_returns_a_figure_only(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("matplotlib")
    figure = plot_timeline({"none": _report(False)})
    assert figure.axes and not list(tmp_path.iterdir())


def test_empty_input_is_an_error() -> None:
    with pytest.raises(UnsupportedCheckpointError, match="at least one report"):
        plot_timeline({})
    with pytest.raises(UnsupportedCheckpointError, match="at least one report"):
        plot_saved_by_module({})


def test_missing_matplotlib_gives_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(UnsupportedCheckpointError, match=r"pip install remat\[plot\]"):
        plot_timeline({"none": _report(False)})
