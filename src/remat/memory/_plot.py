"""Plots of memory reports (matplotlib, optional: ``pip install remat[plot]``).

Figures are built on matplotlib's object API with the Agg canvas: no pyplot,
no global backend switch, never a window. Each function returns the
``Figure`` and, given ``path``, writes a PNG there.

Example:
    >>> import torch
    >>> from remat.memory import plot_timeline, track
    >>> with track() as t:
    ...     x = torch.ones(1024)
    >>> figure = plot_timeline({"demo": t.report()})  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from remat.errors import UnsupportedCheckpointError
from remat.memory._report import MemoryReport
from remat.memory._saved import SavedTensorReport

__all__ = ["plot_saved_by_module", "plot_timeline"]

_MIB = 2**20


def _figure(width: float, height: float) -> Any:
    """A matplotlib Figure attached to an Agg canvas, or a clear error."""
    try:
        figure_module = importlib.import_module("matplotlib.figure")
        agg = importlib.import_module("matplotlib.backends.backend_agg")
    except ImportError as error:
        raise UnsupportedCheckpointError(
            "remat.memory plots need matplotlib, which is not installed; install it with "
            "`pip install remat[plot]` (or `pip install matplotlib`)."
        ) from error
    figure = figure_module.Figure(figsize=(width, height), dpi=110, layout="constrained")
    agg.FigureCanvasAgg(figure)
    return figure


def _save(figure: Any, path: str | Path | None) -> Any:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path)
    return figure


def plot_timeline(
    reports: Mapping[str, MemoryReport],
    path: str | Path | None = None,
    *,
    title: str = "Live tensor memory over a training step",
) -> Any:
    """One line per report: live MiB against progress through the step.

    Steps with different numbers of events are stretched to the same width
    (x is the fraction of the step's events); a dot marks each end of
    forward, a triangle each peak.

    Example:
        >>> figure = plot_timeline({"none": report_a, "remat": report_b}, "timeline.png")  # doctest: +SKIP
    """
    if not reports:
        raise UnsupportedCheckpointError("plot_timeline: give at least one report to plot.")
    figure = _figure(8.0, 4.5)
    axes = figure.add_subplot()
    for label, report in reports.items():
        events = [e for e in report.timeline if e.delta_bytes or e.index in (0, report.forward_end_index)]
        last = max(len(report.timeline) - 1, 1)
        xs = [e.index / last for e in events]
        ys = [e.live_bytes / _MIB for e in events]
        (line,) = axes.step(xs, ys, where="post", label=label, linewidth=1.4)
        color = line.get_color()
        forward_end = report.timeline[report.forward_end_index]
        axes.plot(forward_end.index / last, forward_end.live_bytes / _MIB, "o", color=color)
        axes.plot(report.peak_index / last, report.peak_bytes / _MIB, "^", color=color)
    axes.set_xlabel("progress through the step (fraction of events)    o end of forward   ^ peak")
    axes.set_ylabel("live tensor memory (MiB)")
    axes.set_title(title)
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="upper left", fontsize="small")
    return _save(figure, path)


def plot_saved_by_module(
    reports: Mapping[str, SavedTensorReport],
    path: str | Path | None = None,
    *,
    depth: int = 2,
    title: str = "Memory kept for backward, by module",
) -> Any:
    """Grouped horizontal bars: bytes each module keeps on the device for backward.

    Module paths are cut to ``depth`` components (``blocks.3.attn.qkv`` at
    depth 2 is ``blocks.3``); one bar per report in each group. Counts the
    ``kept`` and ``policy_saved`` fates, parameters excluded.

    Example:
        >>> figure = plot_saved_by_module({"none": saved_a, "remat": saved_b}, "saved.png")  # doctest: +SKIP
    """
    if not reports:
        raise UnsupportedCheckpointError("plot_saved_by_module: give at least one report to plot.")
    totals = {label: report.device_bytes_by_module(depth) for label, report in reports.items()}
    modules: list[str] = []
    for by_module in totals.values():
        modules += [m for m in by_module if m not in modules]
    figure = _figure(8.0, 1.2 + 0.32 * max(len(modules), 1) * max(len(reports), 1) ** 0.5)
    axes = figure.add_subplot()
    height = 0.8 / len(reports)
    for i, (label, by_module) in enumerate(totals.items()):
        ys = [row + i * height for row in range(len(modules))]
        axes.barh(ys, [by_module.get(m, 0) / _MIB for m in modules], height=height, label=label)
    axes.set_yticks([row + 0.4 - height / 2 for row in range(len(modules))])
    axes.set_yticklabels([m or "(root)" for m in modules], fontsize="small")
    axes.invert_yaxis()
    axes.set_xlabel("MiB kept for backward (kept + policy-saved, parameters excluded)")
    axes.set_title(title)
    axes.grid(True, axis="x", alpha=0.3)
    axes.legend(loc="lower right", fontsize="small")
    return _save(figure, path)
