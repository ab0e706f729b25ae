"""The accuracy experiment's results: summary over seeds, the printed table and the figure.

Rows (``accuracy`` verb, ``rows.csv``): one per configuration x seed x bucket with ``accuracy``,
``mean_budget``, ``coverage``, ``cpu_time_s``, ``sim_speedup``. The summary has one row per
configuration x bucket: means over seeds with 95 % t intervals and per-seed min/max
(:mod:`sparsebalance.analysis.stats`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sparsebalance.analysis.stats import fmt_ci, summarize

METRICS = ("accuracy", "sim_speedup", "mean_budget", "coverage", "cpu_time_s")


def summarize_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (config, anchor, p, bucket), in the rows' order."""
    return summarize(rows, ["config", "anchor", "p", "bucket"], [m for m in METRICS if m in rows])


def format_summary(s: pd.DataFrame) -> str:
    """Plain-text table: one line per configuration, accuracy per bucket with [95 % CI]."""
    buckets = sorted(s.bucket.unique())
    head = f"{'config':<9}" + "".join(f" {'acc@' + str(b):>22}" for b in buckets) + \
        f" {'sim speedup':>22} {'budget':>7} {'coverage':>8} {'CPU s':>7} {'seeds':>5}"
    lines = [head]
    for cfg, g in s.groupby("config", sort=False):
        g = g.set_index("bucket")
        first = g.iloc[0]
        accs = "".join(f" {fmt_ci(g.loc[b, 'accuracy'], g.loc[b, 'accuracy_ci_lo'], g.loc[b, 'accuracy_ci_hi'], 3):>22}"
                       for b in buckets)
        sp = fmt_ci(first["sim_speedup"], first["sim_speedup_ci_lo"], first["sim_speedup_ci_hi"], 3)
        lines.append(f"{cfg:<9}{accs} {sp:>22} {first['mean_budget']:>7.2f} {first['coverage']:>8.3f} "
                     f"{first['cpu_time_s']:>7.0f} {int(first['n_seeds']):>5}")
    lines.append("accuracy: held-out answers right, MoBA at k0; [95 % CI over seeds, Student t]")
    return "\n".join(lines)


def plot_accuracy_vs_speedup(s: pd.DataFrame, path: Path, title: str = "") -> None:
    """Accuracy vs simulated speedup, one panel per bucket, error bars = 95 % CI over seeds (both
    axes); PNG + SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = sorted(s.bucket.unique())
    fig, axes = plt.subplots(1, len(buckets), figsize=(4.2 * len(buckets), 3.8), squeeze=False)
    marks = {"mean": "o", "min": "v", "max": "^"}
    for ax, b in zip(axes[0], buckets, strict=True):
        g = s[s.bucket == b]
        for _, r in g.iterrows():
            def err(col, r=r):
                lo, hi = r[f"{col}_ci_lo"], r[f"{col}_ci_hi"]
                return None if np.isnan(lo) else [[r[col] - lo], [hi - r[col]]]
            anchor = r["anchor"] if isinstance(r["anchor"], str) else None
            ax.errorbar(r["sim_speedup"], r["accuracy"], xerr=err("sim_speedup"), yerr=err("accuracy"),
                        fmt=marks.get(anchor, "s"), capsize=3, ms=6,
                        color="k" if anchor is None else None, label=r["config"])
            ax.annotate(r["config"], (r["sim_speedup"], r["accuracy"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_title(f"held-out length {b}")
        ax.set_xlabel("simulated speedup vs fixed k0 (H200, DP2 x PP4)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (95% CI over seeds)")
    fig.suptitle(title or "Recall accuracy vs simulated speedup (tiny Qwen2 + MoBA, CPU)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path.with_suffix(".png"), dpi=130)
    fig.savefig(path.with_suffix(".svg"))
    plt.close(fig)
