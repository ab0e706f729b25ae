"""The CPU validate errors, call after call: runs ``sparsebalance validate`` N times and prints, per
call, the iteration-time error (round means and single runs), the measured speedup with its 95 %
CI, the predicted speedup with its range, whether the ranking is resolved and consistent, the
calibration scales, the host's load (other processes' cores, the workers' CPU share) and the call's
verdict on itself (``disturbed``, with the reasons, and its rounds repeated or left out).

A benchmark, not a test: its figures depend on the machine. For figures you report, run it under
the project's exclusive CPU lock (a quiet machine) and say so:

    flock -x /work/locks/cpu.lock .venv/bin/python benchmarks/bench_validate_cpu.py --calls 3
    python benchmarks/bench_validate_cpu.py --calls 1 -- --rounds 6 --profile-as-is
    python benchmarks/validate_probe_refit.py results/bench-validate-cpu/call1   # the same runs, calibrated 4 ways

Arguments after ``--`` go to every validate call. Each call writes ``<out>/call<i>/``; the table
is also written to ``<out>/calls.csv``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def _uptime() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def one_call(config: str, out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "sparsebalance", "validate", "--config", config, "--json", "--out", str(out),
           *extra]
    load0, t0 = _uptime(), time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.stderr.write(res.stderr[-3000:])
        raise SystemExit(f"validate failed (exit {res.returncode}); see above")
    s = json.loads(res.stdout.strip().splitlines()[-1])
    ci, pci = s.get("measured_speedup_ci95") or [None, None], s.get("predicted_speedup_ci95") or [None, None]
    cal = s.get("calibration") or {}
    host = s.get("host") or {}
    return {
        "wall_s": round(wall, 1), "load_start": load0, "load_end": _uptime(),
        "mae_round_means_pct": 100 * s["mean_abs_error"], "mae_single_runs_pct": 100 * s["mean_abs_error_per_run"],
        "mae_baseline_pct": 100 * s["mean_abs_error_by_policy"].get("baseline", float("nan")),
        "mae_policy_pct": 100 * s["mean_abs_error_by_policy"].get(s["policy"], float("nan")),
        "predicted_speedup": s["predicted_speedup"], "predicted_lo": pci[0], "predicted_hi": pci[1],
        "measured_speedup": s["measured_speedup"], "measured_lo": ci[0], "measured_hi": ci[1],
        "ranking_agrees": s["ranking_agrees"], "ranking_resolved": s.get("ranking_resolved"),
        "in_predicted_range": s.get("measured_in_predicted_range"),
        "speedup_consistent": s.get("speedup_consistent"), "rounds": s["rounds"],
        "calibration": ", ".join(f"{k} {v:.2f}" for k, v in (cal.get("scales") or {}).items()) or cal.get("status"),
        "foreign_cores_mean": host.get("foreign_cores_mean"), "foreign_cores_max": host.get("foreign_cores_max"),
        "cpu_busy_mean": host.get("cpu_busy_mean"),
        # the call's verdict on itself (analysis/disturbance.py): a disturbed call is no result
        "disturbed": s.get("disturbed"), "disturbed_reasons": "; ".join(s.get("disturbed_reasons") or []),
        "rounds_dropped": len(s.get("rounds_dropped") or []),
        "rounds_repeated": sum(t["attempt"] > 0 for t in s.get("round_tries") or []),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=3, help="validate calls, one after another")
    p.add_argument("--config", default=str(ROOT / "examples" / "cpu_pp2.toml"))
    p.add_argument("--out", default="results/bench-validate-cpu")
    p.add_argument("extra", nargs="*", help="arguments for every validate call (after --)")
    args = p.parse_args()
    out = Path(args.out)
    rows = []
    print(f"{dt.datetime.now().isoformat(timespec='seconds')}: {args.calls} x validate {args.config} "
          f"{' '.join(args.extra)}", flush=True)
    for i in range(args.calls):
        row = {"call": i + 1, **one_call(args.config, out / f"call{i + 1}", args.extra)}
        rows.append(row)
        print(f"call {row['call']}: MAE {row['mae_round_means_pct']:.1f} % (single runs "
              f"{row['mae_single_runs_pct']:.1f} %), speedup measured {row['measured_speedup']:.3f} "
              f"[{_f(row['measured_lo'])}, {_f(row['measured_hi'])}] vs predicted "
              f"{row['predicted_speedup']:.3f} [{_f(row['predicted_lo'])}, {_f(row['predicted_hi'])}], "
              f"resolved {row['ranking_resolved']}, in predicted range {row['in_predicted_range']}, "
              f"consistent {row['speedup_consistent']}; foreign load "
              f"{_f(row['foreign_cores_mean'], 2)} cores; {row['wall_s']:.0f} s"
              + (f" -- DISTURBED ({row['disturbed_reasons']})" if row["disturbed"] else ""), flush=True)
    table = pd.DataFrame(rows)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "calls.csv", index=False)
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(table.round(3).to_string(index=False))


def _f(x, nd: int = 3) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.{nd}f}"


if __name__ == "__main__":
    main()
