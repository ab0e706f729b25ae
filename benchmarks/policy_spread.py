"""Seed-to-seed spread of the headline policy gains (the margins of tests/test_policy_regression.py).

    .venv/bin/python benchmarks/policy_spread.py [--iterations 20] [--seeds 30]

On the ablation setting (sparsebalance.commands.ablation.BASE), per seed: SAB+DST's speedup over the
baseline (sequential + fixed) and DST's drop of the mean micro-batch imbalance (baseline - DST);
then mean, standard deviation, min and max over seeds. Simulation only: deterministic, any machine.
"""

from __future__ import annotations

import argparse
import json

import pandas as pd

from sparsebalance.commands.ablation import BASE
from sparsebalance.runconfig import run_config_from_mapping
from sparsebalance.runner import run_simulation

POLICIES = {"base": ("sequential", "fixed"), "dst": ("sequential", "dst"), "sabdst": ("sab", "dst")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=30)
    args = ap.parse_args()
    rows = []
    for seed in range(args.seeds):
        r = {"seed": seed}
        for name, (b, t) in POLICIES.items():
            d = json.loads(json.dumps(BASE))
            d["iterations"], d["seed"], d["data"]["seed"] = args.iterations, seed, seed
            d["policy"].update({"batching": b, "tuning": t})
            m = run_simulation(run_config_from_mapping(d), progress=False).metrics
            r[f"{name}_time_s"], r[f"{name}_imbalance"] = m.iteration_time_s.mean(), m.imbalance.mean()
        rows.append(r)
    df = pd.DataFrame(rows)
    df["speedup"] = df.base_time_s / df.sabdst_time_s
    df["imbalance_drop"] = df.base_imbalance - df.dst_imbalance
    print(df.round(4).to_string(index=False))
    for c in ("speedup", "imbalance_drop"):
        x = df[c]
        print(f"{c}: mean {x.mean():.4f}  sd {x.std(ddof=1):.4f}  min {x.min():.4f}  max {x.max():.4f}")


if __name__ == "__main__":
    main()
