"""Statistics shared by the benchmarks: one percentile definition, and how figures are rounded and printed."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

PERCENTILE = "statistics.quantiles(n=100, method='inclusive')"


def percentile(samples: Sequence[float], pct: int) -> float:
    """The ``pct``-th percentile, ``statistics.quantiles(method="inclusive")``; nan without samples."""
    if not samples:
        return float("nan")
    if len(samples) == 1:
        return float(samples[0])
    return statistics.quantiles(samples, n=100, method="inclusive")[pct - 1]


def ms(value: float) -> float | None:
    """Rounded for the JSON line; nan (no samples) becomes null."""
    return None if value != value else round(value, 2)


def fmt(value: float) -> str:
    """For the printed table; nan (no samples) becomes "-"."""
    return "-" if value != value else f"{value:,.2f}"
