"""``sparsebalance ablation --cp``: long-context training with context parallelism at 32K-512K tokens.

Setting: Qwen2.5-3B on 4 nodes x 8 H200 (``h200-4x8``) as PP 2 x CP 16 x DP 1 x TP 1 -- a CP group
spans two nodes, 8 of its ranks in each -- full activation recomputation, ``longctx-512k`` lengths
(MTraining's 32K-512K range, shape assumed: ``data/distributions.py``), the analytical-h200 profile,
global batch 8 sequences, micro-batches of one sequence.

Rows (every row the same global batches, per data seed):

* ``dense zigzag ring``: dense attention (budget 2,048 blocks: every length up to 512K at block 256),
  zigzag layout, P2P ring over the 16 ranks: the dense CP baseline;
* ``MTraining-like``: a fixed MoBA budget (32 blocks), stripe layout, hierarchical ring (an inner
  ring in each node, one inter-node transfer hidden behind it);
* ``SAB+DST (CP)``: SAB batching and DST budgets (MEAN, p = 0.1) on the hierarchical ring with the
  zigzag layout (balanced for dense attention, not for sparse);
* ``SAB+DST (CP, best layout)``: the same with ``cp_layout = "best"``: per sequence and budget the
  fastest of zigzag and stripe on the hierarchical ring and all-gather, by the model's layer times;
* ``SAB+DST-CP (CP, best layout)``: critical-path DST instead of DST.

Per row: mean iteration time and speedup over the dense ring and over the MTraining-like row, each
with a 95 % t-interval over the data seeds (per seed the ratio of mean iteration times), the CP figures (worker and step imbalance,
exposed communication per layer, ring efficiency), mean coverage and budget, peak memory. Outputs in
``--out``: ``cp.csv``, ``cp_seeds.csv``, ``cp.png``/``.svg`` and ``config.toml`` (the resolved
baseline). A CP degree per sequence has its own study (``ablation --cp-split``,
:mod:`.ablation_cp_split`): here every micro-batch holds one sequence, which rings over the whole
group either way.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import pandas as pd

BASE: dict[str, Any] = {
    "name": "ablation-cp",
    "profile": "analytical-h200",
    "model": {"preset": "qwen2.5-3b"},
    "cluster": {"preset": "h200-4x8", "name": "h200-4x8-pp2cp16", "pp": 2, "dp": 1, "tp": 1, "cp": 16,
                "global_batch": 8, "recompute": "full"},
    "data": {"distribution": "longctx-512k", "num_sequences": 256},
    "policy": {"k_max": 64},
}
ROWS: dict[str, dict[str, dict[str, Any]]] = {
    "dense zigzag ring": {"cluster": {"cp_layout": "zigzag", "cp_comm": "ring"},
                          "policy": {"batching": "sequential", "tuning": "fixed", "k0": 2048, "k_max": 2048}},
    "MTraining-like": {"cluster": {"cp_layout": "stripe", "cp_comm": "hierarchical"},
                       "policy": {"batching": "sequential", "tuning": "fixed", "k0": 32}},
    "SAB+DST (CP)": {"cluster": {"cp_layout": "zigzag", "cp_comm": "hierarchical"},
                     "policy": {"batching": "sab", "tuning": "dst", "k0": 32}},
    "SAB+DST (CP, best layout)": {"cluster": {"cp_layout": "best", "cp_comm": "hierarchical"},
                                  "policy": {"batching": "sab", "tuning": "dst", "k0": 32}},
    "SAB+DST-CP (CP, best layout)": {"cluster": {"cp_layout": "best", "cp_comm": "hierarchical"},
                                     "policy": {"batching": "sab", "tuning": "dst-cp", "k0": 32}},
}
"""Row -> overrides of :data:`BASE`."""
BASELINE = "dense zigzag ring"
MTRAINING = "MTraining-like"


def configs(args, row: str, seeds: list[int]):
    """Run configs of one row, one per seed (validated here, before anything runs)."""
    from sparsebalance.commands.ablation_schedules import seeded_configs

    return seeded_configs(args, BASE, ROWS[row], seeds)


def measure(cfgs) -> pd.DataFrame:
    """Per seed: means over the run's iterations. The latency model of a row is built once (its
    CP fold is the costly part) and shared by the row's seeds, which differ only in data."""
    from dataclasses import replace

    from sparsebalance.commands._common import run_simulation
    from sparsebalance.runner import prepare
    from sparsebalance.simulator.cost.cp.trace import FIGURES as CP_FIGURES

    rows, latency = [], None
    for cfg in cfgs:
        p = prepare(cfg) if latency is None else prepare(cfg, profile=latency.profile)
        if latency is None:
            latency = p.latency
        p = replace(p, latency=latency)
        p.ctx.latency = latency
        m = run_simulation(cfg, progress=False, prepared=p).metrics
        rows.append({"seed": cfg.seed, "iteration_time_s": float(m["iteration_time_s"].mean()),
                     "mean_coverage": float(m["mean_coverage"].mean()),
                     "mean_budget": float(m["mean_budget"].mean()),
                     "peak_memory_gb": float(m["peak_memory_gb"].max()),
                     **{f: float(m[f].mean()) for f in CP_FIGURES}})
    return pd.DataFrame(rows)


def measure_rows(cfgs: dict[str, list], args, desc: str) -> pd.DataFrame:
    """Per seed figures (:func:`measure`) of every row of ``cfgs`` (row -> its seeds' configs), one
    row after another behind a progress bar, with a ``config`` column naming the row."""
    from tqdm import tqdm

    from sparsebalance.commands._args import progress_enabled

    rows = tqdm(cfgs, desc=desc, disable=args.json or not progress_enabled(args), file=sys.stderr)
    return pd.concat([measure(cfgs[row]).assign(config=row) for row in rows], ignore_index=True)


def run_cp(args) -> int:
    from sparsebalance.analysis.cp import format_table, plot, summarise
    from sparsebalance.commands._args import resolve_out
    from sparsebalance.commands.ablation_schedules import parse_seeds
    from sparsebalance.runconfig import dump_toml
    from sparsebalance.runner import check_inputs

    seeds = parse_seeds(args.seeds)
    cfgs = {row: configs(args, row, seeds) for row in ROWS}  # every config validated first
    check_inputs(c for cs in cfgs.values() for c in cs)  # profile and data too, before any output
    out = resolve_out(args.out, "results/ablation-cp", force=args.force, verb="ablation")
    (out / "config.toml").write_text(dump_toml(cfgs[BASELINE][0]))
    seeds_df = measure_rows(cfgs, args, "cp rows")
    seeds_df.to_csv(out / "cp_seeds.csv", index=False)
    table = summarise(seeds_df, ROWS, BASELINE, MTRAINING)
    table.to_csv(out / "cp.csv", index=False)
    c = cfgs[BASELINE][0]
    plot(table, out / "cp", f"{c.model.name}, PP{c.cluster.pp} x CP{c.cluster.cp} x DP{c.cluster.dp}, "
                            f"{c.data.distribution}, {c.profile}, {len(seeds)} seeds x {c.iterations} iterations")
    if args.json:
        print(json.dumps(table.replace({np.nan: None}).to_dict("records")))
        return 0
    print(format_table(table))
    print(f"mean over {len(seeds)} seeds; [95 % CI over seeds, Student t]; per seed: {out / 'cp_seeds.csv'}")
    print(f"table: {out / 'cp.csv'}  figure: {out / 'cp.png'}")
    return 0
