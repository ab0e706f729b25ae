"""The accuracy experiment's results: summary over seeds, the printed table and the figure.

Rows (``accuracy`` verb, ``rows.csv``): one per configuration x seed x bucket with ``accuracy``,
``mean_budget``, ``coverage``, ``cpu_time_s``, ``sim_speedup``. The summary has one row per
configuration x bucket: means over seeds with 95 % t intervals and per-seed min/max
(:mod:`sparsebalance.analysis.stats`), and ``accuracy_vs_fixed``: the accuracy difference to the
``fixed`` configuration paired by seed and bucket (same seeds, data order and held-out examples, so
the pair's shared noise cancels), with its own interval.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sparsebalance.analysis.stats import fmt_ci, summarize
from sparsebalance.fsutil import atomic_savefig

METRICS = ("accuracy", "accuracy_vs_fixed", "sim_speedup", "mean_budget", "coverage", "cpu_time_s")


def paired_vs_fixed(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` plus ``accuracy_vs_fixed`` = accuracy - the ``fixed`` row's of the same seed and
    bucket (NaN where ``fixed`` was not run for that seed)."""
    ref = rows[rows.config == "fixed"].set_index(["seed", "bucket"])["accuracy"]
    out = rows.copy()
    keys = pd.MultiIndex.from_arrays([out.seed, out.bucket])
    out["accuracy_vs_fixed"] = out["accuracy"].to_numpy() - ref.reindex(keys).to_numpy(dtype=float)
    return out


def summarize_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (config, anchor, p, bucket), in the rows' order."""
    rows = paired_vs_fixed(rows)
    return summarize(rows, ["config", "anchor", "p", "bucket"], [m for m in METRICS if m in rows])


def markdown_table(s: pd.DataFrame) -> str:
    """The summary as a Markdown table: one line per configuration; accuracy per bucket and its
    paired difference to ``fixed``, mean [95 % CI]."""
    buckets = sorted(s.bucket.unique())

    def ci(r, col: str, digits: int = 3) -> str:
        return fmt_ci(r[col], r[f"{col}_ci_lo"], r[f"{col}_ci_hi"], digits)

    head = (["config"] + [f"acc @ {b}" for b in buckets] + [f"vs fixed @ {b}" for b in buckets]
            + ["sim. H200 speedup", "mean budget", "coverage", "CPU s / run", "seeds"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cfg, g in s.groupby("config", sort=False):
        g = g.set_index("bucket")
        first = g.iloc[0]
        cells = [cfg] + [ci(g.loc[b], "accuracy") for b in buckets]
        cells += ["–" if cfg == "fixed" else ci(g.loc[b], "accuracy_vs_fixed") for b in buckets]
        cells += [ci(first, "sim_speedup"), ci(first, "mean_budget", 2), ci(first, "coverage"),
                  f"{first['cpu_time_s']:.0f}", str(int(first["n_seeds"]))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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

    from sparsebalance.analysis.figures import label_points

    buckets = sorted(s.bucket.unique())
    fig, axes = plt.subplots(1, len(buckets), figsize=(5.0 * len(buckets), 4.4), squeeze=False)
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
        ax.margins(0.15)
        ax.set_title(f"held-out length {b}")
        ax.set_xlabel("simulated speedup vs fixed k0 (H200, DP2 x PP4)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy (95% CI over seeds)")
    fig.suptitle(title or "Recall accuracy vs simulated speedup (tiny Qwen2 + MoBA, CPU)")
    fig.tight_layout()
    for ax, b in zip(axes[0], buckets, strict=True):  # after the layout: labels placed in final pixels
        g = s[s.bucket == b]
        label_points(ax, g["sim_speedup"], g["accuracy"], g["config"])
    path = Path(path)
    atomic_savefig(fig, path.with_suffix(".png"), dpi=130)
    atomic_savefig(fig, path.with_suffix(".svg"))
    plt.close(fig)
