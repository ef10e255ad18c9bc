"""Byte counts for people: decimal for sizes on disk and the hub, binary for memory being read in."""

from __future__ import annotations

_BINARY_UNITS = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}


def format_bytes(n: int) -> str:
    """Decimal units, as the hub and disk vendors show sizes (104.2 GB)."""
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def format_binary_bytes(count: float) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if count >= _BINARY_UNITS[unit]:
            return f"{count / _BINARY_UNITS[unit]:.1f} {unit}"
    return f"{count:.0f} B"
