"""Plain-text tables of memory reports. The only place (with plots) that formats.

Example:
    >>> from remat.memory import format_bytes
    >>> format_bytes(3 * 2**20)
    '3.0 MiB'
"""

from __future__ import annotations

from collections.abc import Sequence

from remat._units import format_bytes
from remat.memory._compression import CompressionReport
from remat.memory._report import MemoryReport
from remat.memory._saved import FATES, SavedTensorReport

__all__ = ["format_bytes", "format_table", "render_memory_report", "render_saved_tensors"]

ROOT_LABEL = "(root)"
"""How tables show the tracked module itself (module path ``""``)."""


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1) -> str:
    """Align columns: the first ``left`` columns left-aligned, the rest right-aligned.

    Example:
        >>> print(format_table(["name", "bytes"], [["a", "1"], ["bb", "22"]]))
        name  bytes
        a         1
        bb       22
    """
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(padded).rstrip()

    return "\n".join([line(header), *(line(row) for row in rows)])


def _path(path: str) -> str:
    return path or ROOT_LABEL


_SHARDED_ONLY = ("unsharded_parameter", "communication")


def render_memory_report(report: MemoryReport, *, top_modules: int = 10) -> str:
    """Peak, end of forward, bytes by category and the largest modules at the peak.

    Example:
        >>> import torch
        >>> from remat.memory import render_memory_report, track
        >>> with track() as t:
        ...     x = torch.ones(1024)
        >>> print(render_memory_report(t.report()).splitlines()[0])
        peak 4.0 KiB (in forward), end of forward 4.0 KiB, end 4.0 KiB (start 0 B)
    """
    where = "" if report.rank is None else f", rank {report.rank} of {report.world_size}"
    lines = [
        f"peak {format_bytes(report.peak_bytes)} (in {report.timeline[report.peak_index].phase}), "
        f"end of forward "
        f"{format_bytes(report.forward_end_bytes)}, end {format_bytes(report.end_bytes)} "
        f"(start {format_bytes(report.start_bytes)}){where}",
    ]
    if len(report.peak_bytes_by_device) > 1:
        peaks = ", ".join(f"{d} {format_bytes(b)}" for d, b in sorted(report.peak_bytes_by_device.items()))
        lines.append(f"peak by device: {peaks}")
    lines.append("")
    header = ("category", "at peak", "end of forward", "allocated")
    rows = [
        (u.name, format_bytes(u.at_peak_bytes), format_bytes(u.at_forward_end_bytes), format_bytes(u.allocated_bytes))
        for u in report.by_category
        # What only sharded training has is shown only where it held memory.
        if u.name not in _SHARDED_ONLY or u.allocated_bytes or u.at_peak_bytes
    ]
    lines.append(format_table(header, rows))
    modules = [u for u in report.by_module if u.at_peak_bytes or u.allocated_bytes][:top_modules]
    if modules:
        header = ("module", "at peak", "end of forward", "allocated")
        rows = [
            (_path(u.name), format_bytes(u.at_peak_bytes), format_bytes(u.at_forward_end_bytes), format_bytes(u.allocated_bytes))
            for u in modules
        ]
        lines += ["", format_table(header, rows)]
    return "\n".join(lines)


def render_saved_tensors(report: SavedTensorReport, *, limit: int | None = None) -> str:
    """One line per saved tensor (like JAX's ``print_saved_residuals``), then totals.

    Parameters are marked ``param``: they live anyway, so saving them costs
    nothing and totals leave them out. ``limit`` cuts the list (totals stay whole).

    Example:
        >>> import torch
        >>> from remat.memory import render_saved_tensors, saved_tensors
        >>> x = torch.randn(8, requires_grad=True)
        >>> print(render_saved_tensors(saved_tensors(torch.sin, x)).splitlines()[1])
        kept  [8]    float32  32 B   (input)  (outside modules)  -
    """
    header = ("fate", "shape", "dtype", "bytes", "op", "module", "source")
    shown = report.tensors if limit is None else report.tensors[:limit]
    rows = []
    for saved in shown:
        fate = saved.fate + (" param" if saved.is_parameter else "")
        times = f" x{saved.times_saved}" if saved.times_saved > 1 else ""
        rows.append(
            (
                fate,
                str(list(saved.shape)),
                saved.dtype.removeprefix("torch."),
                format_bytes(saved.storage_bytes) + times,
                saved.op,
                _path(saved.module),
                saved.source or "-",
            )
        )
    lines = [format_table(header, rows, left=len(header)) if rows else "(nothing saved)"]
    if limit is not None and len(report.tensors) > limit:
        lines.append(f"... {len(report.tensors) - limit} more")
    totals = report.bytes_by_fate()
    summary = ", ".join(f"{fate} {format_bytes(totals[fate])}" for fate in FATES if totals[fate])
    lines += ["", f"totals (parameters excluded): {summary or 'nothing'}"]
    return "\n".join(lines)


def render_compression_report(report: CompressionReport, *, formats: Sequence[str] = ("bf16", "fp8", "int8")) -> str:
    """The groups, safest to compress first, then the whole step compressed.

    Columns: bytes as they are and compressed, the measured gradient error
    and cosine of that group alone, its sensitivity, and the predicted error
    in each of ``formats``.

    Example:
        >>> import torch
        >>> from remat.memory import compression_report, render_compression_report
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
        >>> x = torch.randn(16, 64)
        >>> text = render_compression_report(compression_report(model, lambda: model(x).sum(), "int8"))
        >>> text.splitlines()[0].split()[:3]
        ['group', 'tensors', 'bytes']
    """
    shown = [name for name in formats if report.groups and name in report.groups[0].predicted_error]
    header = (
        "group", "tensors", "bytes", report.format, "error", "cosine", "sensitivity",
        *(f"pred. {name}" for name in shown),
    )
    rows = [
        (
            _path(group.name),
            str(group.tensors),
            format_bytes(group.original_bytes),
            format_bytes(group.stored_bytes),
            f"{group.relative_error:.2e}",
            f"{group.cosine:.6f}",
            f"{group.sensitivity:.3g}",
            *(f"{group.predicted_error[name]:.2e}" for name in shown),
        )
        for group in report.safest()
    ]
    saved = report.original_bytes - report.stored_bytes
    lines = [
        format_table(header, rows) if rows else "(nothing to compress)",
        "",
        f"all together in {report.format}: {format_bytes(report.original_bytes)} -> "
        f"{format_bytes(report.stored_bytes)} (saves {format_bytes(saved)}), gradient error "
        f"{report.relative_error:.2e}, cosine {report.cosine:.6f}",
        "groups are listed safest first (predicted error per byte saved); error = ||g' - g|| / ||g|| "
        "over every parameter gradient, that group alone compressed",
    ]
    return "\n".join(lines)
