"""``sparsebalance ablation --cp-split``: a CP degree per sequence against splitting every sequence
over the whole CP group, on the paper's bimodal mix packed to long micro-batches.

Setting (built in; ``--config`` swaps in a TOML file): Qwen2.5-3B on 4 x 8 H200 as PP 2 x CP 16 (a
CP group spans two nodes: the hierarchical ring), full recomputation, chatqa2-like lengths (the
paper's SFT mix: many 1-4K sequences beside 16-64K ones), micro-batches packed to 256K tokens,
MoBA budget k0 = 8, the analytical-h200 profile. Rows: the paper's baseline (LBB + fixed budget) and
SAB + DST, each with ``cluster.cp_split = "whole"`` and ``"per-sequence"``. Per row: mean iteration
time, speedup over the baseline with a 95 % Student-t interval of the per-seed ratios (paired by
seed), and for the per-sequence rows the same against their whole-split row. The placement itself:
``simulator/cost/cp/placement.py``, docs/costmodel.md section 11; tables: ``analysis/cp.py``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

BASE: dict[str, Any] = {
    "name": "ablation-cp-split",
    "profile": "analytical-h200",
    "model": {"preset": "qwen2.5-3b"},
    "cluster": {"preset": "h200-4x8", "name": "h200-4x8-pp2cp16", "pp": 2, "dp": 1, "tp": 1, "cp": 16,
                "global_batch": 32, "recompute": "full", "cp_layout": "best", "cp_comm": "hierarchical"},
    "data": {"distribution": "chatqa2-like", "num_sequences": 1024},
    "policy": {"k0": 8, "k_max": 32, "token_cap": 262144},
}
ROWS: dict[str, dict[str, dict[str, Any]]] = {
    "LBB + fixed, whole split": {"cluster": {"cp_split": "whole"}, "policy": {"batching": "lbb", "tuning": "fixed"}},
    "LBB + fixed, per-sequence": {"cluster": {"cp_split": "per-sequence"},
                                  "policy": {"batching": "lbb", "tuning": "fixed"}},
    "SAB+DST, whole split": {"cluster": {"cp_split": "whole"}, "policy": {"batching": "sab", "tuning": "dst"}},
    "SAB+DST, per-sequence": {"cluster": {"cp_split": "per-sequence"}, "policy": {"batching": "sab", "tuning": "dst"}},
}
"""Row -> overrides of :data:`BASE`."""
BASELINE = "LBB + fixed, whole split"
PAIRS = {"LBB + fixed, per-sequence": "LBB + fixed, whole split", "SAB+DST, per-sequence": "SAB+DST, whole split"}
"""A per-sequence row -> its whole-split row (the paired comparison)."""


def run_cp_split(args) -> int:
    from sparsebalance.analysis.cp import format_split_table, summarise_split
    from sparsebalance.commands._args import resolve_out
    from sparsebalance.commands.ablation_cp import measure_rows
    from sparsebalance.commands.ablation_schedules import parse_seeds, seeded_configs
    from sparsebalance.runconfig import dump_toml
    from sparsebalance.runner import check_inputs

    seeds = parse_seeds(args.seeds)
    cfgs = {row: seeded_configs(args, BASE, over, seeds) for row, over in ROWS.items()}  # all validated first
    check_inputs(c for cs in cfgs.values() for c in cs)  # profile and data too, before any output
    out = resolve_out(args.out, "results/ablation-cp-split", force=args.force, verb="ablation")
    for row, c in cfgs.items():
        (out / f"config_{row.replace(' ', '_').replace(',', '').replace('+', 'plus')}.toml").write_text(dump_toml(c[0]))
    seeds_df = measure_rows(cfgs, args, "cp-split rows")
    seeds_df.to_csv(out / "cp_split_seeds.csv", index=False)
    table = summarise_split(seeds_df, ROWS, BASELINE, PAIRS)
    table.to_csv(out / "cp_split.csv", index=False)
    if args.json:
        print(json.dumps(table.replace({np.nan: None}).to_dict("records")))
        return 0
    print(format_split_table(table))
    c = cfgs[BASELINE][0]
    print(f"{c.model.name}, PP{c.cluster.pp} x CP{c.cluster.cp} x DP{c.cluster.dp}, {c.data.distribution}, "
          f"{c.profile}; mean over {len(seeds)} seeds x {c.iterations} iterations; [95 % CI over seeds, "
          f"Student t]; per seed: {out / 'cp_split_seeds.csv'}")
    return 0
