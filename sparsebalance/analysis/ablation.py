"""The paper's Table I beside ours: the table, the side-by-side text and the bar chart.

Paper numbers (../shared/PAPER.md, from reviews of the full text): one node, Qwen2.5-3B, ChatQA2,
DP2 x PP4, global batch 16. Missing cells are NaN.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from sparsebalance.fsutil import atomic_savefig

CONFIGS = ("baseline", "+DST", "+SAB", "+SAB+DST", "+LBB", "+LBB+DST")
"""Table I rows, in order."""

ROW_POLICIES = {
    "baseline": ("sequential", "fixed"),
    "+DST": ("sequential", "dst"),
    "+SAB": ("sab", "fixed"),
    "+SAB+DST": ("sab", "dst"),
    "+LBB": ("lbb", "fixed"),
    "+LBB+DST": ("lbb", "dst"),
}
"""(batching, tuning) of each row. The ablation's baseline is MoBA at a fixed budget with data-order
packing (``sequential``): the table adds LBB as a row of its own, so LBB cannot be its baseline
(LBB + fixed is the baseline of the paper's end-to-end runs, our ``+LBB`` row)."""

BEYOND_POLICIES = {
    "+DST-CP": ("sequential", "dst-cp"),
    "+SAB+DST-CP": ("sab", "dst-cp"),
}
"""Rows beyond the paper (printed and saved after Table I; not in ``--json``, which stays Table I):
critical-path DST (``sparsebalance.policies.critical``) in place of DST."""

SLOTS_ROW = "+SAB+DST-slots"
"""A row beyond the paper: SAB + DST in fixed slots (``policy.slot_tokens`` = the setting's token cap,
``pp`` slots per rank), as torch's pipelining runs them (torchtitan): every micro-batch padded to
the slot, the pad priced as dense work. What the one-shape constraint costs beside ``+SAB+DST``."""

NAN = float("nan")
PAPER = pd.DataFrame({
    "config": list(CONFIGS),
    "paper_imbalance": [1.81, 1.73, 1.41, 1.34, NAN, NAN],
    "paper_iteration_time_s": [4.202, 3.902, 3.471, 3.108, NAN, NAN],
    "paper_speedup": [1.00, 1.08, 1.21, 1.35, 1.23, 1.28],
    "paper_overhead_ms": [0.0, 37.0, 1.8, 44.0, NAN, NAN],
})

JSON_KEYS = ("config", "imbalance", "imbalance_ci_lo", "imbalance_ci_hi", "iteration_time_s",
             "speedup", "speedup_ci_lo", "speedup_ci_hi", "overhead_ms")
"""Keys of ``ablation --json`` rows (CI bounds are null with one seed)."""

METRICS = ("imbalance", "iteration_time_s", "speedup", "overhead_ms", "mean_budget", "mean_coverage",
           "floor_share")


def paired_speedup(per_seed: pd.DataFrame) -> pd.DataFrame:
    """Add ``speedup`` = the baseline's iteration time of the same seed / the row's."""
    base = per_seed[per_seed.config == "baseline"].set_index("seed")["iteration_time_s"]
    out = per_seed.copy()
    out["speedup"] = base.loc[out["seed"]].to_numpy() / out["iteration_time_s"].to_numpy()
    return out


def summarize_seeds(per_seed: pd.DataFrame) -> pd.DataFrame:
    """One row per config: means over seeds with 95 % CI and per-seed min/max of every metric."""
    from sparsebalance.analysis.stats import summarize

    cols = [c for c in METRICS if c in per_seed]
    extra = [c for c in ("anchor", "p") if c in per_seed]
    out = summarize(per_seed, ["config", *extra] if extra else "config", cols)
    # peak memory: the largest over seeds; iterations over the device memory: summed over seeds
    mem = [c for c in per_seed.columns if c.startswith(("peak_memory_gb", "memory_exceeded"))]
    if mem:
        agg = {c: ("sum" if c.startswith("memory_exceeded") else "max") for c in mem}
        out = out.merge(per_seed.groupby("config", sort=False).agg(agg).reset_index(), on="config")
    return out


def json_safe(rows: list[dict]) -> list[dict]:
    """NaN (no interval with one seed) -> None, so the output is valid JSON."""
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]


def side_by_side(ours: pd.DataFrame) -> pd.DataFrame:
    """Our rows (summaries over seeds) joined with the paper's, in Table I order, then any
    BEYOND_POLICIES rows and the fixed-slots row present (paper cells NaN)."""
    order = list(CONFIGS) + [c for c in (*BEYOND_POLICIES, SLOTS_ROW) if c in set(ours["config"])]
    return ours.merge(PAPER, on="config", how="left").set_index("config").loc[order].reset_index()


def format_table(t: pd.DataFrame) -> str:
    """Plain-text Table I: ours [95 % CI over seeds] | paper for each column."""
    from sparsebalance.analysis.stats import fmt_ci

    def f(x, fmt):
        return "-" if pd.isna(x) else format(x, fmt)

    def ci(r, col):
        lo, hi = r.get(f"{col}_ci_lo", float("nan")), r.get(f"{col}_ci_hi", float("nan"))
        return fmt_ci(r[col], lo, hi)

    cov = "mean_coverage" in t
    head = (f"{'config':<12} {'imbalance':>27} {'iteration (s)':>19} {'speedup':>25} "
            f"{'overhead (ms)':>19}" + (f" {'coverage':>9}" if cov else ""))
    sub = f"{'':<12} {'ours [95% CI]':>18} {'paper':>8} {'ours':>9} {'paper':>9} " \
          f"{'ours [95% CI]':>17} {'paper':>7} {'ours':>9} {'paper':>9}" + (f" {'ours':>9}" if cov else "")
    lines = [head, sub]
    for _, r in t.iterrows():
        lines.append(
            f"{r['config']:<12} {ci(r, 'imbalance'):>18} {f(r['paper_imbalance'], '.2f'):>8} "
            f"{f(r['iteration_time_s'], '.3f'):>9} {f(r['paper_iteration_time_s'], '.3f'):>9} "
            f"{ci(r, 'speedup'):>17} {f(r['paper_speedup'], '.2f'):>7} "
            f"{f(r['overhead_ms'], '.2f'):>9} {f(r['paper_overhead_ms'], '.1f'):>9}"
            + (f" {f(r['mean_coverage'], '.4f'):>9}" if cov else ""))
    return "\n".join(lines)


def plot_ablation(t: pd.DataFrame, path: Path, title: str = "") -> None:
    """Grouped bars: speedup and imbalance, ours (error bar = 95 % CI over seeds) vs the paper's;
    PNG + SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(len(t))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    for ax, col, label in ((axes[0], "speedup", "speedup vs baseline"),
                           (axes[1], "imbalance", "imbalance (max / mean micro-batch)")):
        err = None
        if f"{col}_ci_lo" in t and t[f"{col}_ci_lo"].notna().all():
            err = np.vstack([t[col] - t[f"{col}_ci_lo"], t[f"{col}_ci_hi"] - t[col]])
        ax.bar(x - 0.2, t[col], 0.4, yerr=err, capsize=3, label="simulated (ours, 95% CI)")
        ax.bar(x + 0.2, t[f"paper_{col}"].fillna(0), 0.4, label="paper", alpha=0.7)
        # one line per policy part (+SAB / +DST-CP): long names never run into each other
        ax.set_xticks(x, [c.replace("+", "\n+").lstrip("\n") for c in t["config"]], fontsize=8)
        ax.set_ylabel(label)
        ax.axhline(1.0, color="k", lw=0.6)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "Table I ablation: simulated vs paper")
    path = Path(path)
    atomic_savefig(fig, path.with_suffix(".png"), dpi=130)
    atomic_savefig(fig, path.with_suffix(".svg"))
    plt.close(fig)
