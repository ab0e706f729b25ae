"""Sweep results: one tidy table (run x metric), speedups against a baseline, the Pareto figure.

The table ``results.csv`` has one row per (run, metric): ``run_id``, the run's grid coordinates
(``batching``, ``tuning``, ``anchor``, ``p``, ``seed``, ``dp``, ``pp``, ...), ``metric``, ``value``.
Speedup is derived, never stored by a worker, so a resumed sweep recomputes it over all rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sparsebalance.fsutil import atomic_savefig

METRICS = ("iteration_time_s", "imbalance", "mean_budget", "mean_coverage", "floor_share")
"""Per-run metrics (means over iterations) a sweep records; ``speedup`` is added by
:func:`with_speedup`. Deterministic: the same config gives the same numbers."""
TIMING = ("decision_ms",)
"""Wall-clock means a sweep records apart (``timing.csv``), with the run's ``wall_s``."""

POLICY_KEYS = ("batching", "tuning", "anchor", "anchor_scope", "p", "per_layer", "packer")
"""Coordinates that name a policy; all other coordinates (seed, cluster shape...) pair a run with its
baseline."""


def summarize(metrics: pd.DataFrame, names=METRICS) -> dict[str, float]:
    """Per-run means of a loop's per-iteration metrics table (``names``: METRICS or TIMING)."""
    out = {}
    for m in names:
        col = m if m in metrics else f"tuning_{m}"
        out[m] = float(metrics[col].mean()) if col in metrics else 0.0
    return out


def tidy(records) -> pd.DataFrame:
    """Store records (``analysis.store.RunRecord``) -> the tidy table: run_id, coordinates, metric,
    value (one row per run x metric)."""
    rows = [{"run_id": r.run_id, **r.coords, "metric": m, "value": v}
            for r in records for m, v in r.metrics.items()]
    return pd.DataFrame(rows)


def timing_table(records) -> pd.DataFrame:
    """One row per run: run_id, coordinates and its wall-clock columns (decision_ms, wall_s)."""
    return pd.DataFrame([{"run_id": r.run_id, **r.coords, **r.timing} for r in records])


def wide(results: pd.DataFrame) -> pd.DataFrame:
    """One row per run, one column per metric."""
    coords = [c for c in results.columns if c not in ("metric", "value")]
    return results.pivot_table(index=coords, columns="metric", values="value",
                               dropna=False).reset_index().dropna(subset=["iteration_time_s"])


def with_speedup(results: pd.DataFrame, baseline: dict[str, object]) -> pd.DataFrame:
    """Add ``speedup`` rows: the baseline run's iteration time / this run's, pairing runs that share
    every non-policy coordinate (seed, cluster shape, ...). Runs without a baseline get NaN."""
    results = results[results.metric != "speedup"]
    w = wide(results)
    coords = [c for c in results.columns if c not in ("metric", "value", "run_id")]
    pair = [c for c in coords if c not in POLICY_KEYS]
    is_base = np.ones(len(w), dtype=bool)
    for k, v in baseline.items():
        if k in w:
            is_base &= (w[k].astype(str) == str(v)).to_numpy()
    if pair:
        base = w[is_base][pair + ["iteration_time_s"]].drop_duplicates(subset=pair)
        base = base.rename(columns={"iteration_time_s": "_base"})
        m = w.merge(base, on=pair, how="left")
    else:
        bt = w.loc[is_base, "iteration_time_s"]
        m = w.assign(_base=bt.iloc[0] if len(bt) else np.nan)
    rows = m[["run_id"] + coords].copy()
    rows["metric"] = "speedup"
    rows["value"] = m["_base"] / m["iteration_time_s"]
    return pd.concat([results, rows[results.columns]], ignore_index=True)


def pareto_front(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Indices of points not dominated (higher x and higher y are both better), sorted by x."""
    order = np.lexsort((-y, -x))
    front, best = [], -np.inf
    for i in order:
        if y[i] > best:
            front.append(i)
            best = y[i]
    return np.array(sorted(front, key=lambda i: x[i]), dtype=int)


def plot_pareto(w: pd.DataFrame, path: Path, *, label_cols=("anchor", "p"), title: str = "") -> None:
    """Speedup (y) vs mean coverage (x) per run, the non-dominated runs joined; PNG + SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparsebalance.analysis.figures import label_points

    w = w.dropna(subset=["speedup", "mean_coverage"])
    fig, ax = plt.subplots(figsize=(7, 4.8))
    groups = w.groupby(label_cols[0]) if label_cols and label_cols[0] in w else [("runs", w)]
    for name, g in groups:
        ax.scatter(g["mean_coverage"], g["speedup"], label=str(name), s=36, zorder=3)
    x, y = w["mean_coverage"].to_numpy(float), w["speedup"].to_numpy(float)
    if len(w):
        f = pareto_front(x, y)
        ax.plot(x[f], y[f], "k--", lw=1, label="Pareto front", zorder=2)
        # room around the points for their labels
        ax.margins(x=0.12, y=0.12)
    ax.set_xlabel("mean routing coverage C(k) (1 = dense)")
    ax.set_ylabel("speedup vs baseline")
    ax.set_title(title or "speedup vs coverage")
    ax.grid(alpha=0.3)
    # the legend outside the axes: it never covers a point or a label
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    texts = [" ".join(f"{row[c]}" for c in label_cols if c in row) for _, row in w.iterrows()]
    label_points(ax, x, y, texts)
    path = Path(path)
    atomic_savefig(fig, path.with_suffix(".png"), dpi=130)
    atomic_savefig(fig, path.with_suffix(".svg"))
    plt.close(fig)
