"""The measured accuracy experiment's results: speed joined to accuracy, paired by seed, with CIs.

Inputs (``accuracy`` verb, ``accuracy/pipeline.py``): ``iterations`` rows, one per arm x seed x
iteration (``iteration_time_s`` measured on the real run, ``predicted_s`` the simulator's replay of
the same plan and budgets, ``mean_budget``, ``mean_coverage``, ``loss`` and ``answer_accuracy``: the
training answers' mean cross entropy and share predicted exactly, in the very forwards that were
timed, at the budgets chosen), and ``heldout`` rows, one per arm x seed x bucket (``right``,
``total``: after the arm's continuation, MoBA at k0).

**The speed join** (:func:`per_seed`): an arm's measured speedup on a seed is the reference arm's
mean iteration time over the iterations *both* ran (iteration 0 left out: one-off costs) divided by
the arm's mean over the same iterations; every arm of a seed ran the same global batches, interleaved
within seconds of each other, so the pair shares the data and the machine's state. The simulated
speedup is the same ratio of the replays. ``accuracy_vs_fixed``, ``train_accuracy_vs_fixed`` and
``loss_vs_fixed`` are differences to the reference of the same seed (and bucket): the training
answers of an iteration are the same examples for every arm.

:func:`speed_table` gives the same speedups against ``fixed-dense`` too (k0, or dense attention
where the kernel's dense path is no slower): a baseline that does not leave the kernel's dense
shortcut on the table.

**Intervals** (:func:`summary`): 95 % Student t over seeds (``analysis.stats.summarize``: a seed is
the unit of replication), so every difference and speedup interval is a paired one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sparsebalance.analysis.stats import fmt_ci, summarize
from sparsebalance.fsutil import atomic_savefig

REFERENCE = "fixed"
DENSE_REFERENCE = "fixed-dense"
"""The second speed reference: k0, or full attention where predicted no slower (``measured.py``)."""
SPEED = ("measured_speedup", "sim_speedup", "iteration_time_s", "predicted_s", "mean_budget", "coverage",
         "loss", "loss_vs_fixed", "train_accuracy", "train_accuracy_vs_fixed")
ACCURACY = ("accuracy", "accuracy_vs_fixed")
PAPER = pd.DataFrame({
    "label": ["paper MEAN0.1 (LongBench)", "paper MEAN0.1 (NIAH 64K)"],
    "speedup": [1.35, 1.35],
    "accuracy_vs_fixed": [(39.46 - 39.28) / 100, (97.53 - 97.60) / 100],
})
"""The paper's points for the anchor it reports (PAPER.md): SAB + DST (MEAN, p = 0.1) at its ablation's
1.35x, accuracy differences in points / 100 (LongBench 39.28 -> 39.46, needle 97.60 -> 97.53)."""


def per_seed(iterations: pd.DataFrame, reference: str = REFERENCE, skip_first: bool = True) -> pd.DataFrame:
    """One row per (arm, seed): the means over the iterations the arm and the reference both ran
    (iteration 0 left out when ``skip_first``) and the speedups and loss difference to the reference."""
    it = iterations[iterations.iteration > 0] if skip_first else iterations
    ref = it[it.arm == reference].set_index(["seed", "iteration"])
    rows = []
    for (arm, seed), g in it.groupby(["arm", "seed"], sort=False):
        g = g.set_index("iteration")
        both = [i for i in g.index if (seed, i) in ref.index]
        r = ref.loc[[(seed, i) for i in both]] if both else None
        mine = g.loc[both] if both else g
        row = {"arm": arm, "seed": seed, "iterations": len(both),
               "iteration_time_s": float(mine.iteration_time_s.mean()), "predicted_s": float(mine.predicted_s.mean()),
               "mean_budget": float(mine.mean_budget.mean()), "coverage": float(mine.mean_coverage.mean()),
               "loss": float(mine.loss.mean()), "train_accuracy": float(mine.answer_accuracy.mean())}
        if r is not None:
            row |= {"measured_speedup": float(r.iteration_time_s.mean() / mine.iteration_time_s.mean()),
                    "sim_speedup": float(r.predicted_s.mean() / mine.predicted_s.mean()),
                    "loss_vs_fixed": float(mine.loss.mean() - r.loss.mean()),
                    "train_accuracy_vs_fixed": float(mine.answer_accuracy.mean() - r.answer_accuracy.mean())}
        else:
            row |= {"measured_speedup": np.nan, "sim_speedup": np.nan, "loss_vs_fixed": np.nan,
                    "train_accuracy_vs_fixed": np.nan}
        rows.append(row)
    return pd.DataFrame(rows)


def heldout_accuracy(heldout: pd.DataFrame, reference: str = REFERENCE) -> pd.DataFrame:
    """``heldout`` plus ``accuracy`` (right / total) and ``accuracy_vs_fixed`` (minus the reference's
    on the same seed and bucket; NaN where the reference is missing)."""
    out = heldout.copy()
    out["accuracy"] = out.right / out.total.where(out.total > 0)
    ref = out[out.arm == reference].set_index(["seed", "bucket"])["accuracy"]
    keys = pd.MultiIndex.from_arrays([out.seed, out.bucket])
    out["accuracy_vs_fixed"] = out.accuracy.to_numpy() - ref.reindex(keys).to_numpy(dtype=float)
    return out


def summary(iterations: pd.DataFrame, heldout: pd.DataFrame, reference: str = REFERENCE) -> pd.DataFrame:
    """One row per (arm, bucket): accuracy (and its paired difference) per bucket beside the arm's
    speed, budget, coverage and training loss, each a mean over seeds with a 95 % t interval; arms in
    the order they first appear."""
    speed = summarize(per_seed(iterations, reference), "arm", SPEED)
    acc = summarize(heldout_accuracy(heldout, reference), ["arm", "bucket"], ACCURACY)
    speed = speed.drop(columns="n_seeds")
    return acc.merge(speed, on="arm", how="left")


def speed_table(iterations: pd.DataFrame, references: tuple[str, ...] = (REFERENCE, DENSE_REFERENCE)) -> pd.DataFrame:
    """Measured and simulated speedups of every arm against each reference that ran, paired by seed
    (:func:`per_seed`), mean and 95 % t interval over seeds: one row per (reference, arm)."""
    parts = []
    for ref in references:
        if ref in set(iterations.arm):
            t = summarize(per_seed(iterations, ref), "arm", ("measured_speedup", "sim_speedup"))
            t.insert(0, "reference", ref)
            parts.append(t)
    return pd.concat(parts, ignore_index=True)


def target_check(speed: pd.DataFrame, arm: str = "MEAN0.1", reference: str = REFERENCE, goal: float = 1.2,
                 bound: float = 1.15) -> str:
    """One line: does ``arm`` run at least ``goal`` x faster than ``reference``, measured, with a 95 %
    interval above ``bound`` (the issue's target for SAB + DST, MEAN, p = 0.1)?"""
    hit = speed[(speed.reference == reference) & (speed.arm == arm)]
    if hit.empty:
        return f"target: {arm} vs {reference} not run"
    r = hit.iloc[0]
    ok = r["measured_speedup"] >= goal and r["measured_speedup_ci_lo"] > bound
    return (f"target: {arm} vs {reference}, measured {fmt_ci(r['measured_speedup'], r['measured_speedup_ci_lo'], r['measured_speedup_ci_hi'], 3)}"
            f" over {int(r['n_seeds'])} seed(s) (>= {goal}x with the interval above {bound}): "
            f"{'holds' if ok else 'does not hold'}")


def speed_markdown(speed: pd.DataFrame) -> str:
    """One line per arm: measured and simulated speedups against each reference, mean [95 % CI]."""
    refs = list(dict.fromkeys(speed.reference))
    head = ["arm"] + [f"{kind} vs {ref}" for ref in refs for kind in ("measured", "simulated")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = speed.set_index(["reference", "arm"])
    for arm in dict.fromkeys(speed.arm):
        cells = [arm]
        for ref in refs:
            if (ref, arm) not in by.index:
                cells += ["", ""]
                continue
            r = by.loc[(ref, arm)]
            cells += [fmt_ci(r[c], r[f"{c}_ci_lo"], r[f"{c}_ci_hi"], 3) for c in ("measured_speedup", "sim_speedup")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_table(s: pd.DataFrame) -> str:
    """One line per arm: accuracy per bucket, its difference to ``fixed``, measured and simulated
    speedups, budget, coverage, the training loss difference; mean [95 % CI] over seeds."""
    buckets = sorted(s.bucket.unique())

    def ci(r, col: str, digits: int = 3) -> str:
        return fmt_ci(r[col], r[f"{col}_ci_lo"], r[f"{col}_ci_hi"], digits)

    head = (["arm"] + [f"acc @ {b}" for b in buckets] + [f"vs fixed @ {b}" for b in buckets]
            + ["train acc. vs fixed", "measured speedup", "simulated speedup", "mean budget", "coverage",
               "seeds"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, g in s.groupby("arm", sort=False):
        g = g.set_index("bucket")
        first = g.iloc[0]
        ref = arm == REFERENCE
        cells = [arm] + [ci(g.loc[b], "accuracy") for b in buckets]
        cells += ["–" if ref else ci(g.loc[b], "accuracy_vs_fixed") for b in buckets]
        cells += [ci(first, "train_accuracy") if ref else ci(first, "train_accuracy_vs_fixed"),
                  "1 (reference)" if ref else ci(first, "measured_speedup"),
                  "1 (reference)" if ref else ci(first, "sim_speedup"), ci(first, "mean_budget", 1),
                  ci(first, "coverage"), str(int(first["n_seeds"]))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(s: pd.DataFrame, path: Path, title: str = "") -> None:
    """Accuracy difference to ``fixed`` vs measured speedup, one panel per held-out bucket and one for
    the training answers at the budgets chosen, one point per arm with both 95 % intervals; the
    paper's MEAN0.1 points beside ours in every panel; PNG + SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparsebalance.analysis.figures import label_points

    buckets = sorted(s.bucket.unique())
    others = s[s.arm != REFERENCE]
    train = others.groupby("arm", sort=False).first().reset_index()
    panels = [(f"held-out, {b} tokens (MoBA at k0)", others[others.bucket == b], "accuracy_vs_fixed")
              for b in buckets]
    panels.append(("training answers at the budgets chosen", train, "train_accuracy_vs_fixed"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.6), squeeze=False)
    for ax, (name, g, col) in zip(axes[0], panels, strict=True):
        for _, r in g.iterrows():
            def err(c, r=r):
                lo, hi = r[f"{c}_ci_lo"], r[f"{c}_ci_hi"]
                return None if np.isnan(lo) else [[r[c] - lo], [hi - r[c]]]
            mark = "s" if str(r["arm"]).startswith("LBB-") else "o"
            ax.errorbar(r["measured_speedup"], r[col], xerr=err("measured_speedup"), yerr=err(col), fmt=mark,
                        capsize=3, ms=5)
        ax.scatter(PAPER.speedup, PAPER.accuracy_vs_fixed, marker="*", s=140, color="k", zorder=5)
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.axvline(1.0, color="grey", lw=0.8)
        ax.margins(0.15)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("measured speedup vs fixed k0")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accuracy - fixed's (95% CI over seeds)")
    fig.suptitle(title or "Accuracy at speed: DST vs a fixed budget, tiny recall model, real PP 2 run on this CPU")
    fig.tight_layout()
    for ax, (_, g, col) in zip(axes[0], panels, strict=True):
        label_points(ax, list(g["measured_speedup"]) + list(PAPER.speedup), list(g[col]) + list(PAPER.accuracy_vs_fixed),
                     list(g["arm"]) + list(PAPER.label))
    path = Path(path)
    atomic_savefig(fig, path.with_suffix(".png"), dpi=130)
    atomic_savefig(fig, path.with_suffix(".svg"))
    plt.close(fig)
