"""The schedule study's table and figure (``sparsebalance ablation --schedules``): per schedule,
iteration time, bubble share and speedup of SAB + DST and SAB + dst-cp over that schedule's baseline."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sparsebalance.analysis.stats import ci_cell, t_interval
from sparsebalance.fsutil import atomic_savefig

ROWS = ("baseline", "SAB+DST", "SAB+DST-CP")
COLOURS = {"baseline": "C0", "SAB+DST": "C1", "SAB+DST-CP": "C2"}


def summarise(per_seed: pd.DataFrame, schedules: list[str]) -> pd.DataFrame:
    """One row per (schedule, config) from per-seed rows (``schedule, config, seed,
    iteration_time_s, bubble_fraction, mean_coverage, mean_budget``): means over seeds, speedup over
    the schedule's baseline (ratio of the means) with a 95 % t-interval of the per-seed ratios,
    speedup over the 1F1B baseline when 1F1B was run, and ``gain_vs_1f1b``: the per-seed ratio of
    this speedup to the same policy's speedup under 1F1B (paired over seeds: > 1 means the policy
    gains more under this schedule than under 1F1B) with its 95 % t-interval."""
    rows = []
    base_1f1b = per_seed[(per_seed.schedule == "1f1b") & (per_seed.config == "baseline")]

    def ratios(s: str, c: str) -> pd.Series:  # per seed: the schedule's baseline time / the row's
        base = per_seed[(per_seed.schedule == s) & (per_seed.config == "baseline")].set_index("seed")
        d = per_seed[(per_seed.schedule == s) & (per_seed.config == c)].set_index("seed")
        return base.loc[d.index, "iteration_time_s"] / d["iteration_time_s"]

    for s in schedules:
        base = per_seed[(per_seed.schedule == s) & (per_seed.config == "baseline")].set_index("seed")
        for c in ROWS:
            d = per_seed[(per_seed.schedule == s) & (per_seed.config == c)].set_index("seed")
            ratio = ratios(s, c)
            lo, hi = t_interval(ratio.to_numpy())
            gain = ratio / ratios("1f1b", c).loc[ratio.index] if len(base_1f1b) else ratio * np.nan
            glo, ghi = t_interval(gain.to_numpy())
            rows.append({
                "schedule": s, "config": c,
                "iteration_time_s": float(d["iteration_time_s"].mean()),
                "bubble_fraction": float(d["bubble_fraction"].mean()),
                "speedup": float(base["iteration_time_s"].mean() / d["iteration_time_s"].mean()),
                "speedup_ci_low": lo, "speedup_ci_high": hi,
                "gain_vs_1f1b": float(gain.mean()), "gain_ci_low": glo, "gain_ci_high": ghi,
                "speedup_vs_1f1b_baseline": (float(base_1f1b["iteration_time_s"].mean()
                                                   / d["iteration_time_s"].mean())
                                             if len(base_1f1b) else float("nan")),
                "mean_coverage": float(d["mean_coverage"].mean()),
                "mean_budget": float(d["mean_budget"].mean()),
                "seeds": len(d),
            })
    return pd.DataFrame(rows)


def format_table(t: pd.DataFrame) -> str:
    """The schedule study's table as printed."""
    head = (f"{'schedule':<11} {'config':<11} {'iteration (s)':>13} {'bubble':>7} "
            f"{'speedup [95% CI]':>22} {'gain vs 1F1B [95% CI]':>22} {'vs 1F1B base':>12} {'coverage':>9}")
    rows = (f"{r.schedule:<11} {r.config:<11} {r.iteration_time_s:13.4f} {r.bubble_fraction:7.3f} "
            f"{ci_cell(r.speedup, r.speedup_ci_low, r.speedup_ci_high, 6)} "
            f"{ci_cell(r.gain_vs_1f1b, r.gain_ci_low, r.gain_ci_high, 6)} "
            f"{r.speedup_vs_1f1b_baseline:12.3f} {r.mean_coverage:9.4f}" for _, r in t.iterrows())
    return "\n".join([head, *rows])


def plot(t: pd.DataFrame, path: Path, title: str = "") -> None:
    """Three panels per schedule: speedup of each policy over the schedule's baseline (95 % CI bars),
    bubble share of every row, and iteration time relative to the 1F1B baseline; PNG + SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schedules = list(dict.fromkeys(t["schedule"]))
    x = np.arange(len(schedules))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), layout="constrained")
    width = 0.8 / len(ROWS)
    for i, c in enumerate(ROWS):
        d = t[t.config == c].set_index("schedule").loc[schedules]
        off = (i - (len(ROWS) - 1) / 2) * width
        if c != "baseline":
            err = np.vstack([d.speedup - d.speedup_ci_low, d.speedup_ci_high - d.speedup])
            axes[0].bar(x + off, d.speedup, width, yerr=err, capsize=3, label=c, color=COLOURS[c])
        axes[1].bar(x + off, d.bubble_fraction, width, label=c, color=COLOURS[c])
        axes[2].bar(x + off, d.speedup_vs_1f1b_baseline, width, label=c, color=COLOURS[c])
    for ax, label in ((axes[0], "speedup over the schedule's baseline"), (axes[1], "bubble share"),
                      (axes[2], "speedup over the 1F1B baseline")):
        ax.set_xticks(x, schedules, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    for ax in (axes[0], axes[2]):
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_ylim(bottom=0.8)
    axes[1].legend(fontsize=8)
    fig.suptitle(title or "policies under each pipeline schedule", fontsize=10)
    path = Path(path)
    atomic_savefig(fig, path.with_suffix(".png"), dpi=130)
    atomic_savefig(fig, path.with_suffix(".svg"))
    plt.close(fig)
