"""Predicted (simulator) vs measured (realrun): joined tables, errors, speedups and the y = x plot.

Conventions: ``delta_pct = (predicted - measured) / measured * 100`` (positive = the simulator is
pessimistic); the mean absolute error is a fraction (0.05 = 5 %); times are seconds; a speedup of a
policy is ``mean baseline iteration time / mean policy iteration time`` (> 1 = faster).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np
import pandas as pd

from sparsebalance.errors import ConfigError
from sparsebalance.fsutil import atomic_savefig
from sparsebalance.simulator.engine.trace import WORK_OPS


def _need_columns(df: pd.DataFrame, cols: Seq[str], what: str) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ConfigError(f"{what}: missing column(s) {', '.join(missing)}; "
                          f"columns are {', '.join(map(str, df.columns)) or 'none'}")


def compare(predicted: pd.DataFrame, measured: pd.DataFrame, on: list[str], value: str) -> pd.DataFrame:
    """Rows of ``predicted`` and ``measured`` joined on the key columns ``on``.

    Returns one row per key present on both sides, sorted by key, with columns ``*on, predicted,
    measured, delta_pct``. Keys must be unique on each side (aggregate first); rows whose measured
    value is 0 get ``delta_pct = NaN`` (undefined). No common key is an error.
    """
    on = list(on)
    if not on:
        raise ConfigError("on: give at least one key column (e.g. iteration, or iteration and stage)")
    for df, what in ((predicted, "predicted"), (measured, "measured")):
        _need_columns(df, [*on, value], what)
        if df.duplicated(subset=on).any():
            raise ConfigError(f"{what}: key columns ({', '.join(on)}) are not unique; aggregate "
                              f"{value!r} to one row per key first")
    left = predicted[[*on, value]].rename(columns={value: "predicted"})
    right = measured[[*on, value]].rename(columns={value: "measured"})
    table = left.merge(right, on=on, how="inner")
    if table.empty:
        raise ConfigError(f"on: predicted and measured share no key over ({', '.join(on)})")
    table = table.sort_values(on).reset_index(drop=True)
    pred = table["predicted"].to_numpy(dtype=np.float64)
    meas = table["measured"].to_numpy(dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        table["delta_pct"] = np.where(meas != 0, (pred - meas) / meas * 100.0, np.nan)
    return table


def mean_abs_error(table: pd.DataFrame) -> float:
    """Mean of ``|delta_pct|`` over rows where it is defined, as a fraction (0.05 = 5 %)."""
    _need_columns(table, ["delta_pct"], "table")
    d = table["delta_pct"].to_numpy(dtype=np.float64)
    d = d[np.isfinite(d)]
    if len(d) == 0:
        raise ConfigError("table: no row with a defined delta_pct (all measured values are 0?)")
    return float(np.mean(np.abs(d)) / 100.0)


def iteration_times(trace: pd.DataFrame) -> pd.DataFrame:
    """Per iteration of a trace (shared schema): ``iteration, iteration_time_s`` = last end − first
    start over all ranks, stages and ops of that iteration (seconds)."""
    _need_columns(trace, ["iteration", "start_s", "end_s"], "trace")
    g = trace.groupby("iteration", sort=True)
    out = (g["end_s"].max() - g["start_s"].min()).rename("iteration_time_s").reset_index()
    return out


def stage_busy(trace: pd.DataFrame) -> pd.DataFrame:
    """Per (iteration, dp_rank, stage): ``busy_s`` = summed duration of its F and B (or I, W)
    actions (s)."""
    _need_columns(trace, ["iteration", "dp_rank", "stage", "op", "start_s", "end_s"], "trace")
    fb = trace[trace["op"].isin(WORK_OPS)]
    busy = (fb["end_s"] - fb["start_s"]).groupby(
        [fb["iteration"], fb["dp_rank"], fb["stage"]], sort=True).sum()
    return busy.rename("busy_s").reset_index()


def speedup_table(times: pd.DataFrame, baseline: str, *, policy: str = "policy",
                  predicted: str = "predicted", measured: str = "measured") -> pd.DataFrame:
    """Predicted vs measured speedup of every policy over ``baseline``.

    ``times`` has one row per (policy, iteration) with predicted and measured iteration times
    (seconds), e.g. ``compare(...)`` outputs with a ``policy`` column. Returns one row per policy
    (baseline first) with ``policy, predicted_time_s, measured_time_s`` (means), ``predicted_speedup,
    measured_speedup`` (baseline mean / policy mean), ``delta_pct`` of the speedups and
    ``same_direction`` (both sides agree whether the policy is faster than the baseline).
    """
    _need_columns(times, [policy, predicted, measured], "times")
    means = times.groupby(policy, sort=False)[[predicted, measured]].mean()
    if baseline not in means.index:
        raise ConfigError(f"baseline: {baseline!r} is not among the policies "
                          f"({', '.join(map(str, means.index))})")
    base = means.loc[baseline]
    order = [baseline] + [p for p in means.index if p != baseline]
    out = pd.DataFrame({
        "policy": order,
        "predicted_time_s": means.loc[order, predicted].to_numpy(np.float64),
        "measured_time_s": means.loc[order, measured].to_numpy(np.float64),
    })
    out["predicted_speedup"] = base[predicted] / out["predicted_time_s"]
    out["measured_speedup"] = base[measured] / out["measured_time_s"]
    out["delta_pct"] = (out["predicted_speedup"] - out["measured_speedup"]) / out["measured_speedup"] * 100
    out["same_direction"] = np.sign(out["predicted_speedup"] - 1) == np.sign(out["measured_speedup"] - 1)
    return out


def plot_predicted_vs_measured(table: pd.DataFrame, path: str | Path, title: str = "", *,
                               predicted: str = "predicted", measured: str = "measured",
                               quantity: str = "iteration time", unit: str = "s",
                               label: str | None = None, band_pct: float = 10.0) -> Path:
    """Scatter of predicted (y) against measured (x), one point per row, with the y = x line and a
    ±``band_pct`` % band; writes ``path`` (PNG) and an SVG beside it and returns the PNG path.
    ``label`` names a column whose values annotate the points (e.g. ``policy``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _need_columns(table, [predicted, measured] + ([label] if label else []), "table")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    x = table[measured].to_numpy(np.float64)
    y = table[predicted].to_numpy(np.float64)
    lo = float(min(x.min(), y.min())) if len(x) else 0.0
    hi = float(max(x.max(), y.max())) if len(x) else 1.0
    pad = 0.08 * (hi - lo) if hi > lo else 0.1 * max(abs(hi), 1e-9)
    lo, hi = lo - pad, hi + pad
    fig, ax = plt.subplots(figsize=(5.2, 5.0))
    line = np.array([lo, hi])
    ax.plot(line, line, color="black", lw=1, label="y = x (perfect prediction)")
    ax.fill_between(line, line * (1 - band_pct / 100), line * (1 + band_pct / 100), color="grey",
                    alpha=0.15, label=f"±{band_pct:g} %")
    ax.scatter(x, y, s=28, color="#4C72B0", zorder=3, label=f"{len(x)} points")
    if label:
        for xi, yi, text in zip(x, y, table[label]):
            ax.annotate(str(text), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    suffix = f" ({unit})" if unit else ""
    ax.set_xlabel(f"measured {quantity}{suffix}")
    ax.set_ylabel(f"predicted {quantity}{suffix}")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(title or f"predicted vs measured {quantity}", fontsize=10)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    atomic_savefig(fig, path.with_suffix(".svg"))
    plt.close(fig)
    return path
