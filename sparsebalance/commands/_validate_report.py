"""``validate``'s printed report: per iteration, stage and op, the headline error with the call's
verdict on itself (undisturbed, rounds left out, or DISTURBED with the reasons), the speedups, and
the host's load during the runs. The same figures are in ``summary.json`` and the CSV tables.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def print_report(out: Path, tables: dict, summary: dict) -> None:
    from sparsebalance.analysis.validate import round_means

    its, stages, ops = tables["iterations"], tables["stages"], tables["op_summary"]
    cols = ["policy", "iteration", "predicted", "measured", "delta_pct", "rounds"]
    print(f"per iteration: iteration time (s), mean over {summary['rounds']} round(s); "
          "delta = (predicted - measured) / measured")
    print(round_means(its)[cols].round(4).to_string(index=False))
    st = stages[~stages["warmup"]].groupby(["policy", "dp_rank", "stage"], sort=False)[
        ["predicted", "measured"]].mean().reset_index()
    st["delta_pct"] = (st["predicted"] - st["measured"]) / st["measured"] * 100
    print("\nper stage: F + B busy seconds per iteration (mean over counted iterations)")
    print(st.round(4).to_string(index=False))
    # P2P and untraced mean different things on the two sides (a real receive wait vs a simulated
    # transfer; framework time vs pipeline idle), so they are listed measured-only.
    same = ops["op"].isin(["F", "B", "I", "W", "ALLREDUCE", "OPTIM", "CP_COMM", "idle"])
    # a schedule without split backward has no I/W rows on either side, a run without CP no CP_COMM: not listed
    same &= ~(ops["op"].isin(["I", "W", "B", "CP_COMM"]) & (ops["predicted"] == 0) & (ops["measured"] == 0))
    print("\nper op: seconds per iteration (idle = iteration time - F - B, or F - I - W)")
    print(ops[same].round(4).to_string(index=False))
    if (ops[same]["op"] == "CP_COMM").any():
        print("CP_COMM (inside F/B): predicted = the CP transfers' seconds, measured = the CP collectives' "
              "calls, waits for the group's slowest rank included")
    extra = ops[~same][["policy", "stage", "op", "measured"]]
    print("measured only: P2P = receive wait, untraced = time outside any traced action")
    print(extra.round(4).to_string(index=False))
    w = "excluded (first-iteration one-off costs)" if summary["warmup_excluded"] else "included"
    print(f"\nmean absolute iteration-time error: {summary['mean_abs_error'] * 100:.1f} % "
          f"(round means; warm-up iteration 0 {w}; with it: "
          f"{summary['mean_abs_error_with_warmup'] * 100:.1f} %; over single runs' iterations: "
          f"{summary['mean_abs_error_per_run'] * 100:.1f} %){verdict_text(summary)}")
    print(f"speedup of {summary['policy']} over {summary['baseline']}: predicted "
          f"{summary['predicted_speedup']:.3f}x{_range(summary.get('predicted_speedup_ci95'), 'range')}, "
          f"measured {summary['measured_speedup']:.3f}x{_range(summary.get('measured_speedup_ci95'), 'CI')} "
          f"(delta {summary['speedup_delta_pct']:+.1f} %; per round: "
          f"{', '.join(f'{v:.3f}' for v in summary['measured_speedup_by_round'].values())}); ranking "
          f"{'agrees' if summary['ranking_agrees'] else 'DISAGREES'}, "
          f"{_word(summary.get('ranking_resolved'), 'resolved', 'NOT resolved (CI contains 1)', 'unresolved: 1 round')}"
          f"{resolve_advice(summary)}"
          f"; measured inside the predicted range: "
          f"{_word(summary.get('measured_in_predicted_range'), 'yes', 'NO', 'unknown')}, within the "
          f"combined uncertainty: {_word(summary.get('speedup_consistent'), 'yes', 'NO', 'unknown')}")
    h = summary.get("host") or {}
    if h.get("foreign_cores_mean") is not None:
        print(f"host during the runs: other processes used {h['foreign_cores_mean']:.2f} cores on average "
              f"(max {h['foreign_cores_max']:.2f}; the runs use {h['run_cores']} of {h['host_cores']}); "
              f"the workers ran {100 * (h.get('cpu_busy_mean') or float('nan')):.0f} % of their F/B wall "
              "time (runs.csv; quiet machine: ~0 cores and ~100 %)")
    print(f"tables and figure: {out} (validate.png)")


def resolve_advice(summary: dict) -> str:
    """Where the ranking is not resolved: the rounds that would resolve the predicted effect at this
    call's round-to-round spread (``rounds_to_resolve``), or '' ."""
    n = summary.get("rounds_to_resolve")
    if summary.get("ranking_resolved") is not False or n is None:
        return ""
    effect = (summary["predicted_speedup"] - 1.0) * 100
    return f" (at this call's spread a {effect:+.1f} % effect needs about {n} rounds: --rounds {n})"


def verdict_text(summary: dict) -> str:
    """The summary line's verdict: DISTURBED with its reasons, or which rounds were left out."""
    tries = summary["round_tries"]
    again = sum(t["attempt"] > 0 for t in tries)
    note = f"; {again} disturbed round(s) run again" if again else ""
    if summary["disturbed"]:
        return (f" -- DISTURBED ({'; '.join(summary['disturbed_reasons'])}){note}: not a result of this "
                "machine; re-run when it is quiet")
    if summary["rounds_dropped"]:
        return (f" -- rounds {', '.join(map(str, summary['rounds_dropped']))} disturbed and left out "
                f"(summary.json round_tries){note}")
    return f" -- undisturbed{note}"


def _range(iv, what: str) -> str:
    return f" (95 % {what} {iv[0]:.3f}-{iv[1]:.3f})" if iv else ""


def _word(flag, yes: str, no: str, none: str) -> str:
    return none if flag is None else (yes if flag else no)

def finish(args, out: Path, tables: dict, summary: dict, *, chosen, tries, prober, cores: int,
           host_cores: int, title: str) -> int:
    """The end every validate call shares (realrun's and torchtitan's): the rounds' verdict and host
    in the summary, the tables, ``summary.json``, the figure, the report (or one JSON object)."""
    from sparsebalance.analysis import validate as V
    from sparsebalance.commands._rounds import tries_record

    summary["host"] = {**V.host_summary(tables["runs"]), "run_cores": cores, "host_cores": host_cores}
    summary.update(chosen.verdict.to_dict())
    summary["rounds_dropped"] = chosen.dropped
    summary["retries"] = args.retries
    summary["round_tries"] = tries_record(tries, chosen, prober.scales())
    summary["load_average"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    summary["out"] = str(out)
    for name, t in tables.items():
        t.to_csv(out / f"{name}.csv", index=False)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    V.plot_validation(tables["iterations"], tables["speedup"], out / "validate.png", title=title)
    if args.json:
        print(json.dumps(summary, default=str))
    else:
        print_report(out, tables, summary)
    return 0
