"""Byte counts as people read them: the one formatting every command, report and the engine use."""

from __future__ import annotations


def format_size(n: float) -> str:
    """``1536`` -> ``1.5 KiB``; whole bytes below 1 KiB, binary units up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
