"""``sparsebalance ablation --schedules 1f1b,interleaved,zb-h1,zbv,dualpipev``: SAB + DST and SAB +
dst-cp under each pipeline schedule, each against the same schedule's baseline.

Setting (the paper's main one): Qwen2.5-3B on DP4 x PP4 x TP2 (``h200-4x8``: 4 nodes x 8 H200),
the analytical-h200 profile, chatqa2-like data, micro-batch size 1 (the paper's), so each rank runs
``global_batch / dp`` micro-batches. Default global batch 32, not the paper's 16: DualPipeV needs at
least 2 x pp = 8 micro-batches per rank (torch's rule), and 16 / 4 gives 4; ``--global-batch 16``
runs the paper's batch for the schedules that accept it (asking DualPipeV for it is a one-line
error). Interleaved 1F1B, ZB-V and DualPipeV use 2 virtual stages per device (36 layers over 8
virtual stages: the first four take 5 layers, the rest 4).

Rows per schedule: ``baseline`` (LBB + fixed budget: the paper's end-to-end baseline), ``SAB+DST``
(MEAN anchor, p = 0.1), ``SAB+DST-CP`` (critical-path DST). Every row sees the same global batches
(same data seeds). Per row: mean iteration time, bubble share (idle / (devices x iteration time)),
speedup over the same schedule's baseline with a 95 % t-interval over the data seeds (per seed the
ratio of mean iteration times), speedup over the 1F1B baseline, mean coverage. Outputs in ``--out``:
``schedules.csv``, ``schedules.png``/``.svg`` and ``config.toml`` (the resolved 1F1B baseline).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import pandas as pd

BASE: dict[str, Any] = {
    "name": "ablation-schedules",
    "profile": "analytical-h200",
    "model": {"preset": "qwen2.5-3b"},
    "cluster": {"preset": "h200-4x8"},
    "data": {"distribution": "chatqa2-like", "num_sequences": 1024},
    "policy": {},
}
POLICIES = {"baseline": ("lbb", "fixed"), "SAB+DST": ("sab", "dst"), "SAB+DST-CP": ("sab", "dst-cp")}
"""Row -> (batching, tuning)."""
VIRTUAL = {"interleaved": 2, "zbv": 2, "dualpipev": 2}
"""Virtual stages per device of the schedules that have more than one."""


def parse_schedules(text: str) -> list[str]:
    from sparsebalance.commands._args import comma_list
    from sparsebalance.simulator.config import SCHEDULES

    return comma_list(text, "--schedules", what="schedule names", allowed=SCHEDULES)


def parse_seeds(text: str) -> list[int]:
    from sparsebalance.commands._args import comma_list
    from sparsebalance.errors import ConfigError

    seeds = comma_list(text, "--seeds", int, what="integers")
    if len(seeds) < 2 or min(seeds) < 0:
        raise ConfigError(f"--seeds: give two or more integers >= 0 (the interval is over seeds), got {text!r}")
    return seeds


def configs(args, schedule: str, policy: tuple[str, str], seeds: list[int]):
    """Run configs of one (schedule, row), one per seed; the schedule is validated for the run's
    micro-batch count here, before anything runs (ConfigError: one line)."""
    from sparsebalance.simulator.schedule.schedules import validate_schedule

    v = VIRTUAL.get(schedule, 1)
    over = {"cluster": {"schedule": schedule, "virtual_stages": v, "global_batch": args.global_batch},
            "policy": {"batching": policy[0], "tuning": policy[1]}}
    out = seeded_configs(args, BASE, over, seeds)
    for cfg in out:
        c = cfg.cluster
        validate_schedule(schedule, c.pp, c.microbatches_per_rank, c.virtual_stages)
    return out


def seeded_configs(args, base: dict[str, Any], over: dict[str, dict[str, Any]], seeds: list[int]):
    """One run config per data seed: ``args.config`` (a TOML file) or the study's built-in ``base``,
    with the section overrides ``over``, the seed (run and data) and ``args.iterations``."""
    from sparsebalance.runconfig import load_run_config, run_config_from_mapping

    out = []
    for seed in seeds:
        if args.config:
            flat = {f"{s}.{k}": val for s, t in over.items() for k, val in t.items()}
            cfg = load_run_config(args.config, flat | {"seed": seed, "data.seed": seed,
                                                       "iterations": args.iterations})
        else:
            data = json.loads(json.dumps(base))
            for section, table in over.items():
                data[section].update(table)
            data |= {"seed": seed, "iterations": args.iterations}
            data["data"]["seed"] = seed
            cfg = run_config_from_mapping(data)
        out.append(cfg)
    return out


def measure(cfgs) -> pd.DataFrame:
    """Per seed: mean iteration time, bubble share, coverage over the run's iterations."""
    from sparsebalance.commands._common import run_simulation

    rows = []
    for cfg in cfgs:
        m = run_simulation(cfg, progress=False).metrics
        rows.append({"seed": cfg.seed, "iteration_time_s": float(m["iteration_time_s"].mean()),
                     "bubble_fraction": float(m["bubble_fraction"].mean()),
                     "mean_coverage": float(m["mean_coverage"].mean()),
                     "mean_budget": float(m["mean_budget"].mean())})
    return pd.DataFrame(rows)


def run_schedules(args) -> int:
    from tqdm import tqdm

    from sparsebalance.analysis import schedules as S
    from sparsebalance.commands._args import progress_enabled, resolve_out
    from sparsebalance.runconfig import dump_toml
    from sparsebalance.runner import check_inputs

    names = parse_schedules(args.schedules)
    seeds = parse_seeds(args.seeds)
    jobs = [(s, row) for s in names for row in POLICIES]
    cfgs = {job: configs(args, job[0], POLICIES[job[1]], seeds) for job in jobs}  # validate first
    check_inputs(c for cs in cfgs.values() for c in cs)  # profile and data too, before any output
    out = resolve_out(args.out, "results/ablation-schedules", force=args.force, verb="ablation")
    (out / "config.toml").write_text(dump_toml(cfgs[jobs[0]][0]))
    per_seed = []
    bar = tqdm(jobs, desc="schedules", disable=args.json or not progress_enabled(args), file=sys.stderr)
    for schedule, row in bar:
        per_seed.append(measure(cfgs[(schedule, row)]).assign(schedule=schedule, config=row))
    table = S.summarise(pd.concat(per_seed, ignore_index=True), names)
    table.to_csv(out / "schedules.csv", index=False)
    cfg0 = cfgs[jobs[0]][0]
    S.plot(table, out / "schedules",
           title=f"{cfg0.model.name}, DP{cfg0.cluster.dp} x PP{cfg0.cluster.pp} x TP{cfg0.cluster.tp}, "
                 f"global batch {cfg0.cluster.global_batch}, {cfg0.profile}")
    if args.json:
        print(json.dumps(table.replace({np.nan: None}).to_dict("records")))
        return 0
    print(S.format_table(table))
    print(f"table: {out / 'schedules.csv'}  figure: {out / 'schedules.png'}")
    return 0
