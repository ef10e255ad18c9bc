"""Byte counts for people: decimal for sizes on disk and the hub, binary for memory being read in."""

from __future__ import annotations

GiB = 1 << 30
MiB = 1 << 20
GB = 1000**3
_BINARY_UNITS = {"GiB": GiB, "MiB": MiB, "KiB": 1 << 10}


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


_DECIMAL_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12, "TB": 10**12}


def parse_bytes(text: str) -> int:
    """`60G`, `60 GB`, `58GiB`, `1500000000` -> bytes (G/GB decimal, as `format_bytes` prints; GiB binary)."""
    cleaned = text.strip().replace(" ", "")
    number = cleaned.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = cleaned[len(number) :]
    scale = _BINARY_UNITS.get(unit) or _DECIMAL_UNITS.get(unit.upper())
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if scale is None or value < 0:
        raise ValueError(f"{text!r} is not a size (examples: 60G, 58GiB, 1500000000)")
    return int(value * scale)
