"""Byte counts as people read them (remat/_units.py, exported as remat.memory.format_bytes)."""

from __future__ import annotations

from remat.memory import format_bytes


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(262144) == "256.0 KiB"
    assert format_bytes(50 * 2**20) == "50.0 MiB"
    assert format_bytes(5 * 2**40) == "5120.0 GiB"
