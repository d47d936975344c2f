"""Human-readable units for reports and tables."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float) -> str:
    """Bytes in decimal units: 0 B, 512 B, 1.2 kB, 3.4 MB, 1.0 GB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    raise AssertionError("unreachable")
