"""Byte counts as people read them. No torch: the planner's solvers use it too.

Example:
    >>> format_bytes(512), format_bytes(15_414_067), format_bytes(3 * 2**30)
    ('512 B', '14.7 MiB', '3.0 GiB')
"""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(nbytes: float) -> str:
    """Bytes in binary units, e.g. ``"14.7 MiB"``; whole bytes below 1 KiB.

    Example:
        >>> format_bytes(262144)
        '256.0 KiB'
    """
    if abs(nbytes) < 1024:
        return f"{nbytes:.0f} B"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"
