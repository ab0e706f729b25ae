"""Does the shipped CPU profile still predict this machine?  Re-measures profiled points and prints
the simulator's prediction beside a fresh measurement (Δ %). Issue 4's acceptance: within 5 %.

    .venv/bin/python benchmarks/check_profile.py [--profile cpu-tiny] [--repeats 9]

A timing, not a test: run it on a quiet machine (other load inflates wall-clock times).
"""

from __future__ import annotations

import argparse

import pandas as pd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu-tiny")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()

    import torch

    from sparsebalance.kernels.profiler import Bench, ProfileGrid
    from sparsebalance.simulator.config import ClusterConfig, tiny
    from sparsebalance.simulator.latency import load_latency_model

    torch.set_num_threads(1)
    model = tiny()
    lm = load_latency_model(args.profile, model, ClusterConfig(pp=1, dp=1, global_batch=1))
    bench = Bench(model, ProfileGrid(repeats=args.repeats, warmup=5))
    rows = []
    for seq_len, budget in [(1024, 4), (2048, 8), (4096, 4), (4096, 16)]:
        f, b = bench.attention(seq_len, budget)
        rows += [("attn_fwd", seq_len, budget, lm.attention(seq_len, budget), f),
                 ("attn_bwd", seq_len, budget, lm.attention(seq_len, budget, backward=True), b)]
    for tokens in (1024, 8192):
        f, b = bench.layer_dense(tokens)
        rows += [("layer_fwd", tokens, 0, lm.dense(tokens), f),
                 ("layer_bwd", tokens, 0, lm.dense(tokens, backward=True), b)]
    df = pd.DataFrame(rows, columns=["op", "seq_len", "budget", "predicted_s", "measured_s"])
    df["delta_pct"] = (df.predicted_s - df.measured_s) / df.measured_s * 100
    print(df.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    print(f"mean |Δ| = {df.delta_pct.abs().mean():.1f} %, max |Δ| = {df.delta_pct.abs().max():.1f} %")


if __name__ == "__main__":
    main()
