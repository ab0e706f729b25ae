"""Confidence intervals over seeds: what every headline number carries (the one Student-t interval
of the package: :func:`mean_ci`; the studies' tables and validate's measured speedup use it).

A seed is the unit of replication (a different data draw and order); iterations within one seed
share its data and are not independent replicates. So a result is reported as the mean over seeds,
the per-seed spread (min, max) and a 95 % confidence interval of the mean from Student's t with
``n - 1`` degrees of freedom: ``mean +- t_{0.975, n-1} * s / sqrt(n)``. With 3 seeds t = 4.30, so the
interval is wide on purpose; one seed gives no interval (NaN).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pandas as pd

CONFIDENCE = 0.95


def mean_ci(values: Iterable[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """``(mean, lo, hi)`` of the t interval; ``lo = hi = NaN`` for fewer than two values."""
    x = np.asarray([float(v) for v in values], dtype=np.float64)
    x = x[~np.isnan(x)]
    if x.size == 0:
        return math.nan, math.nan, math.nan
    m = float(x.mean())
    if x.size < 2:
        return m, math.nan, math.nan
    from scipy.stats import t

    half = float(t.ppf(0.5 + confidence / 2, x.size - 1)) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return m, m - half, m + half


def t_interval(values: Iterable[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """``(lo, hi)`` of :func:`mean_ci` (NaN for fewer than two values)."""
    _, lo, hi = mean_ci(values, confidence)
    return lo, hi


def summarize(per_seed: pd.DataFrame, by: str | list[str], cols: Iterable[str]) -> pd.DataFrame:
    """One row per group of ``by``: for each column ``c`` of ``cols`` the mean over the group's rows
    (seeds) as ``c``, and ``c_ci_lo``, ``c_ci_hi`` (95 % t interval), ``c_min``, ``c_max`` (per-seed
    spread); plus ``n_seeds``. Groups keep their first-appearance order."""
    keys = [by] if isinstance(by, str) else list(by)
    rows = []
    for key, g in per_seed.groupby(keys, sort=False, dropna=False):
        row = dict(zip(keys, key if isinstance(key, tuple) else (key,), strict=True))
        row["n_seeds"] = len(g)
        for c in cols:
            m, lo, hi = mean_ci(g[c])
            row |= {c: m, f"{c}_ci_lo": lo, f"{c}_ci_hi": hi,
                    f"{c}_min": float(g[c].min()), f"{c}_max": float(g[c].max())}
        rows.append(row)
    return pd.DataFrame(rows)


def fmt_ci(mean: float, lo: float, hi: float, digits: int = 2) -> str:
    """``"1.25 [1.21, 1.29]"``, or the mean alone without an interval."""
    if math.isnan(lo):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def ci_cell(value: float, lo: float, hi: float, width: int) -> str:
    """A printed table's cell of a ratio and its interval: the value at 3 decimals right-aligned in
    ``width`` columns, then ``[lo, hi]`` right-aligned in 15."""
    return f"{value:{width}.3f} {f'[{lo:.3f}, {hi:.3f}]':>15}"


def over_seeds(summary: pd.DataFrame, values: Iterable[str], metrics: Iterable[str] = ("speedup", "imbalance"),
               seed: str = "seed") -> pd.DataFrame | None:
    """A sweep's per-run summary -> one row per grid point: :func:`summarize` of ``metrics`` over
    its seeds. Grid points are the columns that are neither ``values`` (every metric column) nor
    ``seed`` nor ``run_id``. None when there is no seed axis."""
    if seed not in summary:
        return None
    values = set(values)
    coords = [c for c in summary.columns if c not in values | {seed, "run_id"}]
    # NaN coordinates (p of fixed-budget runs) form a group of their own (dropna=False)
    return summarize(summary, coords, [m for m in metrics if m in summary])
