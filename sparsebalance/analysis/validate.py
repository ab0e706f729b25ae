"""Predicted vs measured tables of one ``sparsebalance validate`` run (pure pandas, no torch).

Inputs are the shared trace schema and per-iteration metrics of each side: the measured ones from a
realrun directory (``metrics.csv``, ``measured_trace.csv``), the predicted ones from replaying that
run's exact plans and budgets through the simulator. ``delta_pct = (predicted - measured) / measured``
x 100 (positive = the simulator is pessimistic), as in :mod:`sparsebalance.analysis.compare`.

Warm-up: iteration 0 of a real run pays one-off costs the profile never sees (first autograd graph,
allocator growth, lazy imports, first gloo connection use), so the headline error and the speedups
exclude it whenever a run has more than one iteration; the tables keep it, flagged ``warmup``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from sparsebalance.analysis.compare import compare, mean_abs_error, speedup_table, stage_busy
from sparsebalance.fsutil import atomic_savefig
from sparsebalance.simulator.engine.trace import NESTED_OPS, WORK_OPS

OPS = ("F", "B", "I", "W", "P2P", "ALLREDUCE", "OPTIM", "CP_COMM")
"""Trace ops compared; a measured P2P row is a receive *wait* (idle included), a predicted one the
transfer; a measured CP_COMM row a CP collective's call (the wait for the group's slowest rank
included), a predicted one the transfer. CP_COMM lies inside F/B actions (NESTED_OPS): not traced
time of its own."""


@dataclass(kw_only=True, slots=True)
class Side:
    """One policy's run seen from both sides (seconds throughout)."""

    policy: str
    """Label, e.g. ``baseline`` or ``sab+dst``."""
    predicted_metrics: pd.DataFrame
    """One row per iteration: ``iteration, iteration_time_s, tokens``."""
    measured_metrics: pd.DataFrame
    """metrics.csv of the real run: ``iteration, iteration_time_s, tokens, ...``."""
    predicted_trace: pd.DataFrame
    """Simulator trace of the replay (TRACE_COLUMNS)."""
    measured_trace: pd.DataFrame
    """measured_trace.csv of the real run (TRACE_COLUMNS)."""
    round: int = 0
    """Which of the interleaved rounds of real runs this is (0-based; see commands/validate.py)."""


def _tag(df: pd.DataFrame, side: Side, warmup_excluded: bool) -> pd.DataFrame:
    df.insert(0, "policy", side.policy)
    df.insert(1, "round", side.round)
    df["warmup"] = (df["iteration"] == 0) & warmup_excluded
    return df


def iteration_table(side: Side, *, warmup_excluded: bool) -> pd.DataFrame:
    """``policy, iteration, predicted, measured, delta_pct, predicted_tokens, measured_tokens,
    warmup``: iteration times (s) and the tokens each side processed (equal when the replay ran the
    run's own plans)."""
    t = compare(side.predicted_metrics, side.measured_metrics, ["iteration"], "iteration_time_s")
    tok = side.predicted_metrics[["iteration", "tokens"]].rename(columns={"tokens": "predicted_tokens"})
    t = t.merge(tok, on="iteration").merge(
        side.measured_metrics[["iteration", "tokens"]].rename(columns={"tokens": "measured_tokens"}),
        on="iteration")
    return _tag(t, side, warmup_excluded)


def stage_table(side: Side, *, warmup_excluded: bool) -> pd.DataFrame:
    """Per (iteration, dp_rank, stage): F + B busy seconds predicted vs measured."""
    t = compare(stage_busy(side.predicted_trace), stage_busy(side.measured_trace),
                ["iteration", "dp_rank", "stage"], "busy_s")
    return _tag(t, side, warmup_excluded)


def _op_sums(trace: pd.DataFrame, iteration_time: pd.Series) -> pd.DataFrame:
    """Per (iteration, dp_rank, stage, op) summed seconds, plus two derived ops: ``idle`` = iteration
    time minus F + B (+ I + W; comparable on both sides: the simulator's bubble vs the real P2P waits,
    all-reduce, optimizer and overheads) and ``untraced`` = iteration time minus every traced second
    (in a real run: Python and framework work between actions, coverage, sends; in the simulator:
    pipeline idle, since it has no wait rows)."""
    d = trace.assign(seconds=trace["end_s"] - trace["start_s"])
    s = d.groupby(["iteration", "dp_rank", "stage", "op"], sort=True)["seconds"].sum()
    full = s.unstack("op").reindex(columns=list(OPS)).fillna(0.0)
    traced = full[[op for op in OPS if op not in NESTED_OPS]].sum(axis=1)
    its = full.index.get_level_values("iteration")
    total = iteration_time.reindex(its).to_numpy()
    full["idle"] = total - full[list(WORK_OPS)].sum(axis=1).to_numpy()
    full["untraced"] = total - traced.to_numpy()
    return full.stack().rename("seconds").reset_index()


def op_table(side: Side, *, warmup_excluded: bool) -> pd.DataFrame:
    """Per (iteration, dp_rank, stage, op): seconds predicted vs measured; ops F, B, P2P, ALLREDUCE,
    OPTIM, CP_COMM, ``idle`` and ``untraced`` (see :func:`_op_sums`)."""
    pm = side.predicted_metrics.set_index("iteration")["iteration_time_s"]
    mm = side.measured_metrics.set_index("iteration")["iteration_time_s"]
    t = compare(_op_sums(side.predicted_trace, pm), _op_sums(side.measured_trace, mm),
                ["iteration", "dp_rank", "stage", "op"], "seconds")
    return _tag(t, side, warmup_excluded)


def action_table(side: Side, *, warmup_excluded: bool) -> pd.DataFrame:
    """Row for row: every F and B action (iteration, dp_rank, stage, microbatch, op) predicted vs
    measured seconds, with its tokens and budget from the measured trace, and where realrun
    recorded them the thread's CPU and system seconds and minor page faults of the action."""
    key = ["iteration", "dp_rank", "stage", "microbatch", "op"]

    def dur(tr: pd.DataFrame) -> pd.DataFrame:
        fb = tr[tr["op"].isin(WORK_OPS)]
        return fb.assign(seconds=fb["end_s"] - fb["start_s"])[[*key, "seconds", "tokens", "budget"]]

    meas = dur(side.measured_trace)
    t = compare(dur(side.predicted_trace), meas, key, "seconds")
    t = t.merge(meas[[*key, "tokens", "budget"]], on=key)
    if "cpu_s" in side.measured_trace:  # the worker thread's CPU seconds: the action without waits
        cpu = side.measured_trace[[*key, *[c for c in ("cpu_s", "sys_s", "minflt", "nivcsw")
                                          if c in side.measured_trace]]]
        t = t.merge(cpu.rename(columns={"cpu_s": "measured_cpu", "sys_s": "measured_sys"}), on=key,
                    how="left")
    return _tag(t, side, warmup_excluded)


def headline(iterations: pd.DataFrame, baseline: str, policy: str, *, warmup_excluded: bool) -> dict:
    """The summary over counted iterations (warm-up excluded when flagged) of every round.

    * ``mean_abs_error`` (fraction): per (policy, iteration), predicted and measured times are first
      averaged over the rounds (the simulator predicts an expected time; repeated real runs of the
      same plan estimate it), then the mean |Δ| over both policies' iterations. With one round this
      is the plain per-iteration error.
    * ``mean_abs_error_per_run``: the mean |Δ| over every (round, iteration) row, i.e. including the
      run-to-run noise of single iterations; ``..._with_warmup``: the headline with iteration 0.
    * speedup = mean baseline time / mean policy time over all counted rows, predicted and measured,
      and per round (``measured_speedup_by_round``); ``ranking_agrees``: both on the same side of 1.
    * ``rounds_to_resolve``: rounds whose interval would exclude 1 for the predicted speedup at this
      call's round-to-round spread (:func:`.uncertainty.rounds_to_resolve`; None with one round).
    """
    counted = iterations[~iterations["warmup"]]
    sp = speedup_table(counted, baseline)
    row = sp[sp["policy"] == policy].iloc[0]
    pred, meas = float(row["predicted_speedup"]), float(row["measured_speedup"])
    pooled, pooled_all = round_means(counted), round_means(iterations)
    per_policy = {p: mean_abs_error(g) for p, g in pooled.groupby("policy", sort=False)}
    by_round = {}
    for r, g in counted.groupby("round", sort=True) if "round" in counted else ():
        if set(g["policy"]) >= {baseline, policy}:
            by_round[int(r)] = float(speedup_table(g, baseline).set_index("policy")
                                     .loc[policy, "measured_speedup"])
    from sparsebalance.analysis.uncertainty import rounds_to_resolve, speedup_ci

    ci = speedup_ci(list(by_round.values()))
    resolved = None if ci["lo"] is None else bool(ci["lo"] > 1.0 or ci["hi"] < 1.0)
    return {
        "mean_abs_error": mean_abs_error(pooled),
        "mean_abs_error_by_call_round": _error_by_round(counted),
        "mean_abs_error_per_run": mean_abs_error(counted),
        "mean_abs_error_with_warmup": mean_abs_error(pooled_all),
        "mean_abs_error_by_policy": per_policy,
        "warmup_excluded": bool(warmup_excluded),
        "predicted_speedup": pred,
        "measured_speedup": meas,
        "measured_speedup_by_round": by_round,
        "measured_speedup_ci95": None if ci["lo"] is None else [ci["lo"], ci["hi"]],
        "measured_speedup_se_log": ci["se_log"],
        "ranking_resolved": resolved,
        "rounds_to_resolve": rounds_to_resolve(list(by_round.values()), pred),
        "speedup_delta_pct": (pred - meas) / meas * 100.0,
        "ranking_agrees": bool(np.sign(pred - 1.0) == np.sign(meas - 1.0)),
        "baseline": baseline,
        "policy": policy,
        "rounds": int(counted["round"].nunique()) if "round" in counted else 1,
        "iterations_counted": int(counted["iteration"].nunique()),
    }


def _error_by_round(counted: pd.DataFrame) -> dict[int, float]:
    """Mean |delta| of each round's counted iterations (both policies): the spread over rounds."""
    if "round" not in counted:
        return {}
    return {int(r): mean_abs_error(g) for r, g in counted.groupby("round", sort=True)}


def tables_and_headline(sides: list[Side], loads: list[dict], baseline: str, policy: str, *,
                        warmup_excluded: bool) -> tuple[dict[str, pd.DataFrame], dict]:
    """Every table of a validate call (iterations, stages, ops, actions, runs, op_summary, speedup)
    and its :func:`headline`, from its sides (baseline first) and the runs' host-load records."""
    kw = {"warmup_excluded": warmup_excluded}
    tables = {
        "iterations": pd.concat([iteration_table(s, **kw) for s in sides], ignore_index=True),
        "stages": pd.concat([stage_table(s, **kw) for s in sides], ignore_index=True),
        "ops": pd.concat([op_table(s, **kw) for s in sides], ignore_index=True),
        "actions": pd.concat([action_table(s, **kw) for s in sides], ignore_index=True),
        "runs": run_table(sides, loads, **kw),
    }
    tables["op_summary"] = op_summary(tables["ops"])
    its = tables["iterations"]
    tables["speedup"] = speedup_table(its[~its["warmup"]], baseline)
    return tables, headline(its, baseline, policy, **kw)


def run_table(sides: list[Side], loads: list[dict], *, warmup_excluded: bool) -> pd.DataFrame:
    """One row per real run: mean counted iteration time measured and predicted, the host's load
    during it (``foreign_cores``: other processes' CPU, ``steal_cores``), and from the measured
    trace the F/B actions' CPU share of their wall time (``cpu_busy``: 1 = never descheduled),
    system share of that CPU and minor page faults per action (see kernels/cpuclock.py)."""
    rows = []
    load = {(d["policy"], d["round"]): d for d in loads}
    for sd in sides:
        mm, pm = sd.measured_metrics, sd.predicted_metrics
        keep = (mm["iteration"] > 0) if (warmup_excluded and len(mm) > 1) else mm["iteration"] >= 0
        tr = sd.measured_trace
        fb = tr[tr["op"].isin(["F", "B"]) & ((tr["iteration"] > 0) if warmup_excluded and len(mm) > 1
                                             else tr["iteration"] >= 0)]
        wall = float((fb["end_s"] - fb["start_s"]).sum())
        has_cpu = "cpu_s" in fb and fb["cpu_s"].notna().any()
        rows.append({
            "policy": sd.policy, "round": sd.round,
            "measured_s": float(mm.loc[keep, "iteration_time_s"].mean()),
            "predicted_s": float(pm.loc[keep.to_numpy(), "iteration_time_s"].mean()),
            "cpu_busy": float(fb["cpu_s"].sum() / wall) if has_cpu and wall > 0 else np.nan,
            "sys_share": float(fb["sys_s"].sum() / fb["cpu_s"].sum()) if has_cpu else np.nan,
            "minflt_per_action": float(fb["minflt"].mean()) if has_cpu else np.nan,
            "nivcsw_per_action": float(fb["nivcsw"].mean()) if has_cpu and "nivcsw" in fb else np.nan,
            **{k: v for k, v in load.get((sd.policy, sd.round), {}).items() if k not in ("policy", "round")},
        })
    t = pd.DataFrame(rows)
    t["delta_pct"] = (t["predicted_s"] - t["measured_s"]) / t["measured_s"] * 100.0
    return t


def host_summary(runs: pd.DataFrame) -> dict:
    """The machine's state over the call: other processes' load (mean, max over runs) and how much
    of the F/B wall time the workers actually ran (``cpu_busy``)."""
    def stat(col: str, fn) -> float | None:
        return float(fn(runs[col])) if col in runs and runs[col].notna().any() else None

    return {"foreign_cores_mean": stat("foreign_cores", np.nanmean),
            "foreign_cores_max": stat("foreign_cores", np.nanmax),
            "steal_cores_mean": stat("steal_cores", np.nanmean),
            "cpu_busy_mean": stat("cpu_busy", np.nanmean), "cpu_busy_min": stat("cpu_busy", np.nanmin)}


def round_means(iterations: pd.DataFrame) -> pd.DataFrame:
    """Per (policy, iteration): predicted and measured iteration times averaged over the rounds,
    with ``delta_pct`` of the means and ``rounds`` (how many were averaged)."""
    g = iterations.groupby(["policy", "iteration"], sort=False)
    t = g[["predicted", "measured"]].mean()
    t["rounds"] = g.size()
    t = t.reset_index()
    t["delta_pct"] = (t["predicted"] - t["measured"]) / t["measured"] * 100.0
    return t


def op_summary(ops: pd.DataFrame) -> pd.DataFrame:
    """Per (policy, stage, op) over counted iterations: mean predicted and measured seconds per
    iteration and the Δ % of those means (where the error comes from)."""
    counted = ops[~ops["warmup"]]
    g = counted.groupby(["policy", "stage", "op"], sort=False)[["predicted", "measured"]].mean()
    g = g.reset_index()
    with np.errstate(divide="ignore", invalid="ignore"):
        g["delta_pct"] = np.where(g["measured"] != 0, (g["predicted"] - g["measured"])
                                  / g["measured"] * 100.0, np.nan)
    return g


def plot_validation(iterations: pd.DataFrame, speedups: pd.DataFrame, path: str | Path,
                    title: str = "") -> Path:
    """Two panels, predicted (y) vs measured (x) with the y = x line and a ±10 % band: iteration
    times (s) per policy (warm-up hollow) and the speedup of each policy over the baseline.
    Writes ``path`` (PNG) and an SVG beside it; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def frame(ax, xs, ys, quantity, unit):
        lo, hi = float(min(np.min(xs), np.min(ys))), float(max(np.max(xs), np.max(ys)))
        pad = 0.1 * (hi - lo) if hi > lo else 0.1 * max(abs(hi), 1e-9)
        line = np.array([lo - pad, hi + pad])
        ax.plot(line, line, color="black", lw=1, label="y = x")
        ax.fill_between(line, line * 0.9, line * 1.1, color="grey", alpha=0.15, label="±10 %")
        ax.set_xlim(*line)
        ax.set_ylim(*line)
        ax.set_aspect("equal")
        ax.grid(alpha=0.3)
        ax.set_xlabel(f"measured {quantity}{unit}")
        ax.set_ylabel(f"predicted {quantity}{unit}")

    ax = axes[0]
    for c, (pol, g) in zip(colors, iterations.groupby("policy", sort=False)):
        w = g["warmup"].to_numpy(bool)
        ax.scatter(g["measured"][~w], g["predicted"][~w], color=c, s=30, zorder=3, label=pol)
        if w.any():
            ax.scatter(g["measured"][w], g["predicted"][w], facecolors="none", edgecolors=c, s=30,
                       zorder=3, label=f"{pol} (warm-up)")
    frame(ax, iterations["measured"], iterations["predicted"], "iteration time", " (s)")
    ax.set_title("iteration times", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")

    ax = axes[1]
    ax.scatter(speedups["measured_speedup"], speedups["predicted_speedup"], color=colors[0], s=40,
               zorder=3)
    for _, r in speedups.iterrows():
        ax.annotate(str(r["policy"]), (r["measured_speedup"], r["predicted_speedup"]),
                    textcoords="offset points", xytext=(5, 4), fontsize=8)
    frame(ax, np.r_[speedups["measured_speedup"], 1.0], np.r_[speedups["predicted_speedup"], 1.0],
          "speedup over baseline", "")
    ax.axhline(1.0, color="grey", lw=0.6, ls=":")
    ax.axvline(1.0, color="grey", lw=0.6, ls=":")
    ax.set_title("speedup (quadrants off the dotted lines: ranking)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title or "predicted vs measured", fontsize=11)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    atomic_savefig(fig, path.with_suffix(".svg"))
    plt.close(fig)
    return path
