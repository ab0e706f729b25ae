"""Launch candidates of the MoBA Triton kernels timed side by side on one CUDA GPU, per kernel.

    python benchmarks/tune_launch_gpu.py --out results/tune-launch     # a few minutes on an H100

Why: ``launch.CHOSEN`` comes from the sm_90a compile report (and, for the forward past kernel, the
H100 sweep of 2026-11-26); the backward kernels have never been timed. For each (length, density)
point, each kernel's candidates (``launch.CANDIDATES``; the other kernels at their chosen
configuration) are timed by ``speed.tune`` -- forward for the forward kernels and the gate, forward +
backward for the backward ones, medians of do_bench -- on the speed grid's shape (qwen2.5-3b on a
TP-2 rank: 8 query heads, 1 kv head, D = 128, block 256, bf16). Writes ``tune_launch.csv`` and
``launch_picks.json`` (the fastest candidate per kernel and point, with the device and triton
version); ``gpu-check``'s speed step runs the 32K point of this with the time it has left.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POINTS = [(32768, 0.125), (16384, 0.125), (8192, 0.125), (4096, 0.25)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/tune-launch"))
    ap.add_argument("--budget-s", type=float, default=120.0, help="seconds per point")
    args = ap.parse_args()
    import pandas as pd
    import torch
    import triton

    from sparsebalance.kernels.moba import speed

    if not torch.cuda.is_available():
        print("tune_launch_gpu: no CUDA GPU here; nothing measured", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    tables, picks = [], {}
    for L, d in POINTS:
        df, p = speed.tune(speed.SpeedShape(), L, d, budget_s=args.budget_s)
        tables.append(df)
        picks[f"{L}@{d}"] = p
        print(df.to_string(index=False, float_format="%.3f"), flush=True)
        pd.concat(tables).to_csv(args.out / "tune_launch.csv", index=False)
    (args.out / "launch_picks.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
         "picks": picks}, indent=1))
    print(json.dumps(picks, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
