"""Human-readable figures for the panels."""

from __future__ import annotations

GB = 1024**3
MB = 1024**2


def fmt_bytes(n: float) -> str:
    """GB when it is at least 0.1 GB, MB below (a 2 MB KV cache is not '0.00 GB')."""
    n = float(n or 0)
    if n >= 0.1 * GB:
        return f"{n / GB:.2f} GB"
    if n >= 0.1 * MB:
        return f"{n / MB:.1f} MB"
    return f"{n / 1024:.0f} KB"


def kv_line(stored: int, uncompressed: int) -> str:
    """'2.10 GB (from 4.20 GB) ×0.50' — the seed's way of showing the compressed cache."""
    ratio = stored / uncompressed if uncompressed else 1.0
    return f"{fmt_bytes(stored)} (from {fmt_bytes(uncompressed)}) ×{ratio:.2f}"


def fmt_tokens(n: int) -> str:
    return f"{n:,}"
