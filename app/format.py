"""Human-readable figures for the panels."""

from __future__ import annotations

GB = 1024**3
MB = 1024**2


def _unit(n: float) -> tuple[float, str, int]:
    if n >= 0.1 * GB:
        return GB, "GB", 2
    if n >= 0.1 * MB:
        return MB, "MB", 1
    return 1024, "KB", 0


def pages(n: int) -> str:
    return f"{n} page" if n == 1 else f"{n} pages"


def fmt_bytes(n: float, like: float | None = None) -> str:
    """GB from 0.1 GB up, MB below (a 2 MB KV cache is not '0.00 GB'); `like` picks the unit of another figure."""
    n = float(n or 0)
    scale, unit, digits = _unit(float(like) if like is not None else n)
    return f"{n / scale:.{digits}f} {unit}"


def kv_line(stored: int, uncompressed: int) -> str:
    """'2.10 GB (from 4.20 GB) ×0.50' — the compressed cache, what it stands for and the ratio."""
    ratio = stored / uncompressed if uncompressed else 1.0
    unit_of = min(stored, uncompressed) or max(stored, uncompressed)  # one unit for both, precise for the smaller
    return f"{fmt_bytes(stored, unit_of)} (from {fmt_bytes(uncompressed, unit_of)}) ×{ratio:.2f}"


def fmt_tokens(n: int) -> str:
    return f"{n:,}"


def ratio_line(report) -> str:
    """'target 0.50 · now ×0.21 — threshold 0.10 removed more': the slider's ratio, the cache's, and why they
    differ (the engine's words, MemoryReport.kv_ratio_reason)."""
    if report.kv_target_ratio is None or not report.tokens_seen:
        return ""
    text = f"Compression: target {report.kv_target_ratio:.2f} · now ×{report.compression_ratio:.2f}"
    return text + (f" — {report.kv_ratio_reason}" if report.kv_ratio_reason else "")
