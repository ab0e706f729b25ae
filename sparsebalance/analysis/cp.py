"""The context-parallel studies' tables and figure (``sparsebalance ablation --cp`` and ``--cp-split``):
per row, iteration time and speedups paired by seed with their 95 % Student-t intervals
(:func:`.stats.t_interval`), the CP group's figures (``simulator/cost/cp/trace.py``: worker and
step imbalance, exposed communication, ring efficiency), coverage, budget and peak memory. The
studies' settings and rows: ``commands/ablation_cp.py``, ``commands/ablation_cp_split.py``."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from sparsebalance.analysis.stats import ci_cell, t_interval
from sparsebalance.fsutil import atomic_savefig
from sparsebalance.simulator.cost.cp.trace import FIGURES as CP_FIGURES


def summarise(per_seed: pd.DataFrame, rows: Iterable[str], baseline: str, mtraining: str) -> pd.DataFrame:
    """One row per config of ``rows``: means over seeds; speedup over the dense ring (``baseline``)
    and over the MTraining-like row (``mtraining``; ratios of the means), each with a 95 % t-interval
    of the per-seed ratios (paired by seed)."""
    base = per_seed[per_seed.config == baseline].set_index("seed")
    mt = per_seed[per_seed.config == mtraining].set_index("seed")
    out = []
    for row in rows:
        d = per_seed[per_seed.config == row].set_index("seed")
        ratio = base.loc[d.index, "iteration_time_s"] / d["iteration_time_s"]
        lo, hi = t_interval(ratio.to_numpy())
        vs = mt.loc[d.index, "iteration_time_s"] / d["iteration_time_s"]
        vlo, vhi = t_interval(vs.to_numpy())
        out.append({"config": row, "iteration_time_s": float(d["iteration_time_s"].mean()),
                    "speedup": float(base["iteration_time_s"].mean() / d["iteration_time_s"].mean()),
                    "speedup_ci_low": lo, "speedup_ci_high": hi,
                    "vs_mtraining": float(mt["iteration_time_s"].mean() / d["iteration_time_s"].mean()),
                    "vs_mtraining_ci_low": vlo, "vs_mtraining_ci_high": vhi,
                    "speedup_min": float(ratio.min()), "speedup_max": float(ratio.max()),
                    **{f: float(d[f].mean()) for f in (*CP_FIGURES, "mean_coverage", "mean_budget")},
                    "peak_memory_gb": float(d["peak_memory_gb"].max()), "seeds": len(d)})
    return pd.DataFrame(out)


def format_table(t: pd.DataFrame) -> str:
    """The CP study's table as printed."""
    head = (f"{'config':<30}{'iteration (s)':>14}{'vs dense [95% CI]':>24}{'vs MTraining-like':>24}"
            f"{'worker imb':>11}{'step imb':>9}{'exposed ms':>11}{'ring eff':>9}{'coverage':>9}{'budget':>8}"
            f"{'mem GB':>8}")
    rows = (f"{r.config:<30}{r.iteration_time_s:14.3f}{ci_cell(r.speedup, r.speedup_ci_low, r.speedup_ci_high, 8)}"
            f"{ci_cell(r.vs_mtraining, r.vs_mtraining_ci_low, r.vs_mtraining_ci_high, 8)}{r.cp_worker_imbalance:11.3f}"
            f"{r.cp_step_imbalance:9.3f}{1e3 * r.cp_exposed_s:11.3f}{r.cp_efficiency:9.3f}"
            f"{r.mean_coverage:9.4f}{r.mean_budget:8.1f}{r.peak_memory_gb:8.1f}" for _, r in t.iterrows())
    return "\n".join([head, *rows])


def plot(t: pd.DataFrame, path: Path, title: str) -> None:
    """Speedup over the dense ring (95 % CI bars) and worker / step imbalance per row; PNG + SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(len(t))
    err = np.vstack([t.speedup - t.speedup_ci_low, t.speedup_ci_high - t.speedup]).clip(min=0)
    a.bar(x, t.speedup, yerr=err, capsize=4, color=[f"C{i}" for i in range(len(t))])
    a.axhline(1.0, color="k", lw=0.8)
    a.set(xticks=x)
    a.set_ylabel("speedup vs the dense ring (95 % CI)", fontsize=8)
    a.set_xticklabels(t.config, rotation=15, ha="right", fontsize=8)
    b.bar(x - 0.2, t.cp_worker_imbalance, 0.4, label="worker imbalance")
    b.bar(x + 0.2, t.cp_step_imbalance, 0.4, label="step imbalance")
    b.set(xticks=x, ylabel="max / mean (1 = balanced)", ylim=(0.9, None))
    b.set_xticklabels(t.config, rotation=15, ha="right", fontsize=8)
    b.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    atomic_savefig(fig, path.with_suffix(".png"), dpi=130)
    atomic_savefig(fig, path.with_suffix(".svg"))
    plt.close(fig)


def summarise_split(per_seed: pd.DataFrame, rows: Iterable[str], baseline: str,
                    pairs: dict[str, str]) -> pd.DataFrame:
    """The CP-split study: one row per config of ``rows``: means over seeds; speedup over
    ``baseline`` and (per-sequence rows) over the same policies' whole split (``pairs``: per-sequence
    row -> its whole-split row), each ratio of the means with a 95 % t-interval of the per-seed ratios."""
    by = {row: per_seed[per_seed.config == row].set_index("seed") for row in rows}
    out = []
    for row, d in by.items():
        rec = {"config": row, "iteration_time_s": float(d["iteration_time_s"].mean())}
        for name, ref in (("speedup", baseline), ("vs_whole", pairs.get(row))):
            if ref is None:
                rec |= {name: np.nan, f"{name}_ci_low": np.nan, f"{name}_ci_high": np.nan}
                continue
            ratio = by[ref].loc[d.index, "iteration_time_s"] / d["iteration_time_s"]
            lo, hi = t_interval(ratio.to_numpy())
            rec |= {name: float(by[ref]["iteration_time_s"].mean() / d["iteration_time_s"].mean()),
                    f"{name}_ci_low": lo, f"{name}_ci_high": hi}
        rec |= {f: float(d[f].mean()) for f in ("cp_worker_imbalance", "cp_efficiency", "mean_coverage",
                                                 "mean_budget")}
        rec |= {"peak_memory_gb": float(d["peak_memory_gb"].max()), "seeds": len(d)}
        out.append(rec)
    return pd.DataFrame(out)


def format_split_table(t: pd.DataFrame) -> str:
    """The CP-split study's table as printed."""
    def ci(name: str) -> list[str]:
        return ["–" if np.isnan(r[name]) else f"{r[name]:.3f} [{r[name + '_ci_low']:.3f}, {r[name + '_ci_high']:.3f}]"
                for _, r in t.iterrows()]

    return pd.DataFrame({"config": t.config, "iteration (s)": t.iteration_time_s.round(3),
                         "vs baseline [95% CI]": ci("speedup"), "vs whole split [95% CI]": ci("vs_whole"),
                         "worker imb": t.cp_worker_imbalance.round(3), "coverage": t.mean_coverage.round(4),
                         "budget": t.mean_budget.round(1), "mem GB": t.peak_memory_gb.round(1)}).to_string(index=False)
