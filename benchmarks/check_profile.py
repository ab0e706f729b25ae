"""Does the shipped CPU profile still predict this machine?  Re-measures a subset of its grid the
way the profile was measured (same profiler, same rounds and concurrency as its sidecar says) and
prints the simulator's prediction beside the fresh measurement (Δ %).

    .venv/bin/python benchmarks/check_profile.py [--profile cpu-tiny] [--repeats 10]

A timing, not a test: run it on a quiet machine (other load inflates wall-clock times).
"""

from __future__ import annotations

import argparse

import pandas as pd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu-tiny")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    from sparsebalance.kernels.profiler import ProfileGrid, run_profile
    from sparsebalance.simulator.config import ClusterConfig, tiny
    from sparsebalance.simulator.cost.latency import load_latency_model

    model = tiny()
    lm = load_latency_model(args.profile, model, ClusterConfig(device="cpu", pp=1, dp=1, global_batch=1))
    concurrency = lm.profile.meta.concurrency or 1
    grid = ProfileGrid(seq_lens=(1024, 2048, 4096), budgets=(4, 8, 16), tokens=(1024, 8192),
                       params=(10_000, 100_000), repeats=args.repeats, warmup=5)
    fresh = run_profile(model, grid, progress=True, concurrency=concurrency)
    predict = {
        "attn_fwd": lambda n, k: lm.attention(n, k),
        "attn_bwd": lambda n, k: lm.attention(n, k, backward=True),
        "layer_fwd": lambda n, k: lm.dense(n), "layer_bwd": lambda n, k: lm.dense(n, backward=True),
        "embed_fwd": lambda n, k: lm.embed(n), "embed_bwd": lambda n, k: lm.embed(n, backward=True),
        "head_fwd": lambda n, k: lm.head(n), "head_bwd": lambda n, k: lm.head(n, backward=True),
    }
    rows = [(op, n, k, predict[op](n, k), t) for op, n, k, t in fresh.itertuples(index=False)
            if op in predict]
    df = pd.DataFrame(rows, columns=["op", "seq_len", "budget", "predicted_s", "measured_s"])
    df["delta_pct"] = (df.predicted_s - df.measured_s) / df.measured_s * 100
    print(f"profile {args.profile}: {lm.profile.meta.how}")
    print(df.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    for name, part in (("attention", df[df.op.str.startswith("attn")]), ("all", df)):
        d = part.delta_pct.abs()
        print(f"{name}: mean |Δ| = {d.mean():.1f} %, median |Δ| = {d.median():.1f} %, "
              f"max |Δ| = {d.max():.1f} %")


if __name__ == "__main__":
    main()
