"""``sparsebalance ablation``: the paper's Table I, simulated, beside the paper's numbers.

Setting (the paper's ablation): Qwen2.5-3B, chatqa2-like data, DP2 x PP4 (TP1, one node of eight
H200), global batch 16, the analytical-h200 profile, 1F1B; micro-batches packed up to 64K tokens
(the data's longest sample), at least PP per rank. Each row is the mean over ``--seeds`` x
``--iterations`` simulated iterations of the same data (the rows see identical global batches).
``overhead_ms`` is our measured policy decision time per iteration (batching + tuning, this CPU).

``--anchors`` runs the anchor x p study instead: SAB + DST with MEAN/MIN/MAX x p in {0.1, 0.2, 0.3},
speedup vs the same baseline against mean coverage, with a Pareto plot.

Beyond the paper: Table I mode adds ``+DST-CP`` and ``+SAB+DST-CP`` (critical-path DST, see
``sparsebalance.policies.critical``) and ``+SAB+DST-slots`` (SAB + DST in fixed slots of the token
cap, ``pp`` per rank: what torch's one-shape pipelining, as in torchtitan, costs) after the paper's rows, with mean coverage in the printed table
(``--json`` stays the paper's six rows); the anchor study adds SAB + dst-cp at each p to
``anchors_cp.csv`` and to the Pareto plot (``anchors.csv`` keeps its ten rows).
Every number is the mean over seeds of per-seed values (speedup paired by seed: the baseline's
iteration time of the same seed over the row's), with the per-seed spread and a 95 % confidence
interval over seeds (``sparsebalance.analysis.stats``).
Outputs go to ``--out`` (default results/ablation): ``ablation.csv`` (with ``*_ci_lo``/``*_ci_hi``,
``*_min``/``*_max`` columns), ``ablation_seeds.csv`` (one row per config x seed),
``ablation.png``/``.svg``, ``anchors.csv``, ``anchors_seeds.csv``, ``anchors_pareto.png``/``.svg``,
and ``config.toml`` (the resolved base config); the wall-clock ``overhead_ms`` (and its interval)
goes to ``timing.csv`` (``timing_cp.csv``), not the deterministic tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd

BASE: dict[str, Any] = {
    "name": "ablation",
    "iterations": 20,
    "profile": "analytical-h200",
    "model": {"preset": "qwen2.5-3b"},
    # full recomputation: the setting needs it to fit (213 GB on stage 0 without it, H200: 141 GB)
    "cluster": {"preset": "h200-4x8", "name": "h200-1x8-dp2pp4", "dp": 2, "pp": 4, "tp": 1,
                "global_batch": 16, "recompute": "full"},
    "data": {"distribution": "chatqa2-like", "num_sequences": 1024},
    "policy": {"batching": "sequential", "tuning": "fixed", "token_cap": 65536},
}
ANCHORS = ("mean", "min", "max")
PS = (0.1, 0.2, 0.3)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sparsebalance.commands._args import add_config, add_out, add_output_flags, positive_int

    add_config(p, required=False, help="base run config (TOML) instead of the built-in Table I setting")
    p.add_argument("--iterations", type=positive_int, default=20, help="iterations per seed (default 20)")
    p.add_argument("--seeds", default="0,1,2,3,4",
                   help="comma-separated data seeds (default 0,1,2,3,4); >= 2 for a confidence interval")
    p.add_argument("--anchors", action="store_true", help="run the anchor x p study instead")
    p.add_argument("--schedules", default=None, metavar="LIST",
                   help="run the schedule study instead: SAB+DST and SAB+DST-CP under each of these "
                        "schedules (e.g. 1f1b,interleaved,zb-h1,zbv,dualpipev) on DP4 x PP4 x TP2")
    p.add_argument("--cp", action="store_true",
                   help="run the context-parallel study instead: dense zigzag ring, MTraining-like, SAB+DST "
                        "and SAB+DST with the best layout per sequence, PP2 x CP16 at 32K-512K tokens")
    p.add_argument("--cp-split", action="store_true",
                   help="run the CP-degree-per-sequence study instead: LBB + fixed and SAB+DST with every "
                        "sequence split over the whole CP group vs a degree per sequence, PP2 x CP16, "
                        "chatqa2-like packed to 256K tokens")
    p.add_argument("--global-batch", type=positive_int, default=32,
                   help="schedule study: sequences per iteration (default 32: DualPipeV needs 8 "
                        "micro-batches per rank)")
    p.add_argument("--json", action="store_true", help="print the table as JSON (stdout) only")
    add_out(p, "results/ablation")
    add_output_flags(p)


def _configs(args, policy: dict[str, Any], seeds: list[int]):
    from sparsebalance.runconfig import load_run_config, run_config_from_mapping

    out = []
    for seed in seeds:
        over = {"policy": policy, "seed": seed, "data": {"seed": seed}}
        if args.config:
            flat = {f"{s}.{k}": v for s, t in over.items() if isinstance(t, dict) for k, v in t.items()}
            flat |= {"seed": seed, "iterations": args.iterations}
            out.append(load_run_config(args.config, flat))
        else:
            data = json.loads(json.dumps(BASE))
            for section, table in over.items():
                if isinstance(table, dict):
                    data[section].update(table)
                else:
                    data[section] = table
            data["iterations"] = args.iterations
            out.append(run_config_from_mapping(data))
    return out


def _measure(cfgs, seeds: list[int]) -> list[dict[str, float]]:
    """One row per seed: means over that seed's iterations."""
    from sparsebalance.commands._common import run_simulation

    rows = []
    for seed, c in zip(seeds, cfgs, strict=True):
        m = run_simulation(c, progress=False).metrics
        floor = m["tuning_floor_share"].mean() if "tuning_floor_share" in m else 0.0
        rows.append({"seed": seed,
                     "imbalance": float(m["imbalance"].mean()),
                     "iteration_time_s": float(m["iteration_time_s"].mean()),
                     "overhead_ms": float(m["decision_ms"].mean()),
                     "mean_budget": float(m["mean_budget"].mean()),
                     "mean_coverage": float(m["mean_coverage"].mean()),
                     "floor_share": float(floor),
                     **_memory(m)})
    return rows


def _memory(m: pd.DataFrame) -> dict[str, float]:
    """Peak memory of the largest device (GB, max over iterations) and per stage, and how many
    iterations put a device over the cluster's device memory (simulator/cost/memory.py)."""
    if "peak_memory_gb" not in m:
        return {}
    out = {"peak_memory_gb": float(m["peak_memory_gb"].max()),
           "memory_exceeded_iterations": float((m["memory_exceeded"] > 0).sum())}
    out |= {c: float(m[c].max()) for c in m.columns if c.startswith("peak_memory_gb_s")}
    return out


def _print_memory(df: pd.DataFrame) -> None:
    if "peak_memory_gb" not in df:
        return
    stages = sorted(c for c in df.columns if c.startswith("peak_memory_gb_s"))
    print("peak memory per device, GB (largest device; per stage " + ", ".join(s[-2:] for s in stages)
          + "); * = over the device memory in some iteration")
    for _, r in df.iterrows():
        flag = " *" if r.get("memory_exceeded_iterations", 0) > 0 else ""
        print(f"  {r['config']:<20} {r['peak_memory_gb']:8.1f}  ("
              + ", ".join(f"{r[s]:.1f}" for s in stages) + ")" + flag)


WALL_CLOCK = ("overhead_ms", "paper_overhead_ms")
"""Columns measured by a wall clock (and their intervals, ``overhead_ms_ci_lo``...): written to
timing.csv, not to the deterministic tables."""


def _split_timing(df: pd.DataFrame, table: Path, timing: Path) -> None:
    wall = [c for c in df.columns if c.startswith(WALL_CLOCK)]
    df.drop(columns=wall).to_csv(table, index=False)
    df[["config", *wall]].to_csv(timing, index=False)


def run(args) -> int:
    from tqdm import tqdm

    from sparsebalance.analysis import ablation as A
    from sparsebalance.commands._args import progress_enabled, resolve_out
    from sparsebalance.errors import ConfigError
    from sparsebalance.runconfig import dump_toml
    from sparsebalance.runner import check_inputs

    if sum([args.cp, args.cp_split, args.schedules is not None, args.anchors]) > 1:
        raise ConfigError("ablation: give one of --cp, --cp-split, --schedules, --anchors")
    if args.cp_split:  # the CP-degree-per-sequence study lives in its own module
        from sparsebalance.commands.ablation_cp_split import run_cp_split

        if args.iterations == 20:  # as --cp: long-context iterations take longer to simulate
            args.iterations = 10
        return run_cp_split(args)
    if args.cp:  # the context-parallel study lives in its own module
        from sparsebalance.commands.ablation_cp import run_cp

        if args.iterations == 20:  # the default of Table I; 512K-token iterations take longer to simulate
            args.iterations = 10
        return run_cp(args)
    if args.schedules is not None:  # the schedule study lives in its own module
        from sparsebalance.commands.ablation_schedules import run_schedules

        return run_schedules(args)
    from sparsebalance.commands._args import comma_list

    seeds = comma_list(args.seeds, "--seeds", int, what="integers")
    if min(seeds) < 0:
        raise ConfigError(f"--seeds: give one or more integers >= 0, got {args.seeds!r}")
    if args.anchors:
        jobs = [("baseline", {"batching": "sequential", "tuning": "fixed"})]
        jobs += [(f"{a.upper()}{p}", {"batching": "sab", "tuning": "dst", "anchor": a, "p": p})
                 for a in ANCHORS for p in PS]
        jobs += [(f"CP{p}", {"batching": "sab", "tuning": "dst-cp", "p": p}) for p in PS]
    else:
        jobs = [(name, {"batching": b, "tuning": t}) for name, (b, t) in A.ROW_POLICIES.items()]
        jobs += [(name, {"batching": b, "tuning": t}) for name, (b, t) in A.BEYOND_POLICIES.items()]
    if not args.anchors:  # fixed slots of the setting's token cap (none without one)
        cap = _configs(args, {"batching": "sequential", "tuning": "fixed"}, seeds[:1])[0].policy.token_cap
        if cap is not None:
            jobs.append((A.SLOTS_ROW, {"batching": "sab", "tuning": "dst", "token_cap": None, "slot_tokens": cap}))
    cfgs = {name: _configs(args, pol, seeds) for name, pol in jobs}  # validates before running
    check_inputs(c for cs in cfgs.values() for c in cs)  # profile and data too, before any output
    out = resolve_out(args.out, "results/ablation", force=args.force, verb="ablation")
    (out / "config.toml").write_text(dump_toml(cfgs["baseline"][0]))
    rows = []
    for name, _ in tqdm(jobs, desc="ablation", disable=args.json or not progress_enabled(args), file=sys.stderr):
        rows += [{"config": name, **r} for r in _measure(cfgs[name], seeds)]
    per_seed = A.paired_speedup(pd.DataFrame(rows))
    _split_timing(per_seed, out / ("anchors_seeds.csv" if args.anchors else "ablation_seeds.csv"),
                  out / ("timing_anchors_seeds.csv" if args.anchors else "timing_seeds.csv"))
    df = A.summarize_seeds(per_seed)
    if args.anchors:
        df["anchor"] = [""] + [a for a in ANCHORS for _ in PS] + ["dst-cp"] * len(PS)
        df["p"] = [float("nan")] + [p for _ in ANCHORS for p in PS] + list(PS)
        cp = df.config.str.startswith("CP")
        df, df_cp = df[~cp], df[cp]
        _split_timing(df, out / "anchors.csv", out / "timing.csv")
        _split_timing(df_cp, out / "anchors_cp.csv", out / "timing_cp.csv")
        from sparsebalance.analysis.sweep import plot_pareto

        plot_pareto(pd.concat([df[df.config != "baseline"], df_cp]), out / "anchors_pareto",
                    title="SAB + DST anchor x p and SAB + DST-CP\n(speedup vs sequential + fixed)")
        if args.json:
            print(json.dumps(A.json_safe(df.to_dict("records"))))
            return 0
        cols = ["config", "speedup", "speedup_ci_lo", "speedup_ci_hi", "mean_coverage", "mean_budget",
                "floor_share", "imbalance", "imbalance_ci_lo", "imbalance_ci_hi", "iteration_time_s",
                "overhead_ms"]
        print(pd.concat([df, df_cp])[cols].round(4).to_string(index=False))
        _print_memory(pd.concat([df, df_cp]))
        print(f"table: {out / 'anchors.csv'} (+ {out / 'anchors_cp.csv'})  "
              f"figure: {out / 'anchors_pareto.png'}")
        return 0
    table = A.side_by_side(df)
    _split_timing(table, out / "ablation.csv", out / "timing.csv")
    A.plot_ablation(table, out / "ablation")
    if args.json:
        print(json.dumps(A.json_safe([{k: r[k] for k in A.JSON_KEYS} for r in table.to_dict("records")
                                      if r["config"] in A.CONFIGS])))
        return 0
    print(A.format_table(table))
    print(f"mean over {len(seeds)} seeds; [95 % CI over seeds, Student t]; per-seed values: "
          f"{out / 'ablation_seeds.csv'}")
    _print_memory(df)
    print(f"table: {out / 'ablation.csv'}  figure: {out / 'ablation.png'}")
    return 0
