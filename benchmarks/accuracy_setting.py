"""Where can DST buy speed on this CPU? The simulated speedups that chose the measured accuracy setting.

    .venv/bin/python benchmarks/accuracy_setting.py [--profile cpu-tiny-long] [--checkpoint DIR]

Simulation only (seconds): the real run's PP 2 x DP 1 (1F1B) on the CPU profile of the tiny model,
global batches of the recall task's length mix, the policies of the accuracy grid. For each setting
(length range, micro-batch size 1 or a token cap, k0) and each watched layer's coverage rate (the
checkpoint's per-layer fits: DST's floors come from the layer it watches), the mean iteration time of
``fixed`` (LBB + k0) and the speedup of the grid's main arms over the same batches. Prints a table;
docs/accuracy.md quotes it.
"""

from __future__ import annotations

import argparse
import itertools
import warnings

import numpy as np
import pandas as pd

ARMS = {"SAB-fixed": {"batching": "sab", "tuning": "fixed"},
        "MEAN0.1": {"batching": "sab", "tuning": "dst", "anchor": "mean", "p": 0.1},
        "MEAN0.3": {"batching": "sab", "tuning": "dst", "anchor": "mean", "p": 0.3},
        "MIN0.1": {"batching": "sab", "tuning": "dst", "anchor": "min", "p": 0.1},
        "MAX": {"batching": "sab", "tuning": "dst", "anchor": "max", "p": 0.1},
        "FREE": {"batching": "lbb", "tuning": "dst-cp", "cp_rounds": 0}}


def simulate(profile: str, lo: int, hi: int, tail: float, gb: int, cap, k0: int, rate: float, arm: dict,
             iterations: int = 8, seed: int = 0) -> pd.DataFrame:
    from sparsebalance.data.recall import RecallConfig, RecallTask
    from sparsebalance.data.sequence import Sequence
    from sparsebalance.loop import global_batches, run_loop
    from sparsebalance.policies.base import PolicyContext
    from sparsebalance.policies.config import PolicyConfig
    from sparsebalance.policies.coverage import make_coverage_model
    from sparsebalance.policies.registry import make_batching, make_tuning
    from sparsebalance.simulator.config import ClusterConfig, tiny
    from sparsebalance.simulator.cost.latency import load_latency_model
    from sparsebalance.simulator.engine.executor import SimulatorExecutor

    m = tiny()
    cl = ClusterConfig(name="cpu-pp2", device="cpu", pp=2, dp=1, schedule="1f1b", global_batch=gb,
                       p2p_bandwidth=2e9, p2p_latency=50e-6, allreduce_bandwidth=2e9, allreduce_latency=50e-6)
    pol = PolicyConfig(**({"batching": "lbb", "tuning": "fixed"} | arm), k0=k0, k_max=max(64, k0), token_cap=cap,
                       coverage_rate=rate)
    lat = load_latency_model(profile, m, cl, allow_nonmonotone=True)
    ctx = PolicyContext(model=m, cluster=cl, policy=pol, latency=lat, coverage=make_coverage_model(m, pol, seed=seed),
                        rng=np.random.default_rng(seed))
    task = RecallTask(RecallConfig(min_length=lo, max_length=hi, tail=tail, seed=seed))
    seqs = [Sequence(id=i, length=task.train_length(i), sensitivity=1.0) for i in range(256)]
    batches = global_batches(seqs, gb, shuffle=True, rng=np.random.default_rng(seed))
    return run_loop(batches=batches, batching=make_batching(pol), tuning=make_tuning(pol),
                    executor=SimulatorExecutor(lat, m, cl), ctx=ctx, iterations=iterations, progress=False).metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu-tiny-long")
    ap.add_argument("--checkpoint", default=None, help="default: the shipped recall-long")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*latency falls as work grows.*")
    from sparsebalance.accuracy.model import load

    ck = load(args.checkpoint, default="recall-long")
    rates = {f"layer {f['layer']}": f["rate"] for f in ck.meta["coverage_fits"]}
    rows = []
    settings = [(1024, 8192, 1.0, 8, None, 32), (1024, 8192, 1.0, 8, None, 16), (1024, 8192, 1.0, 8, 16384, 32),
                (2048, 8192, 1.0, 8, None, 32), (1024, 8192, 0.5, 16, None, 32)]
    for (lo, hi, tail, gb, cap, k0), (layer, rate) in itertools.product(settings, rates.items()):
        base = simulate(args.profile, lo, hi, tail, gb, cap, k0, rate, {})
        row = {"lengths": f"{lo}-{hi}", "tail": tail, "global_batch": gb, "token_cap": cap or "-", "k0": k0,
               "watched": f"{layer} (rate {rate:.2f})", "fixed_s": round(base.iteration_time_s.mean(), 2)}
        for name, arm in ARMS.items():
            m = simulate(args.profile, lo, hi, tail, gb, cap, k0, rate, arm)
            row[name] = f"{base.iteration_time_s.mean() / m.iteration_time_s.mean():.2f}x (k {m.mean_budget.mean():.0f})"
        rows.append(row)
        print(" | ".join(str(v) for v in row.values()), flush=True)
    df = pd.DataFrame(rows)
    print("| " + " | ".join(df.columns) + " |\n|" + "---|" * len(df.columns))
    for r in df.itertuples(index=False):
        print("| " + " | ".join(str(v) for v in r) + " |")


if __name__ == "__main__":
    main()
