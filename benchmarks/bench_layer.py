"""Eager against compiled decoder layer and head, side by side (``sparsebalance/kernels/layerbench.py``).

    .venv/bin/python benchmarks/bench_layer.py [--model tiny] [--tokens 256 1024 4096] [--repeats 10]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--threads 1] [--out results/bench_layer.csv]

Per token count: forward and backward of one decoder layer (the profiler's zero-cost attention core,
so the time is the dense parts: norms, projections, RoPE, MLP) and of final norm + LM head + loss,
eager (the Hugging Face modules) and compiled (``layer_impl = "compiled"``), medians of --repeats
interleaved calls with their min and max; the kernels one forward + backward launches (torch.profiler;
on the CPU Inductor's C++ kernels are recorded because this script compiles them with
``cpp.enable_kernel_profile``); on an H100/H200 the analytical roofline and measured / analytical.
Compilation (cold: about a minute on this VM) happens before anything is timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="model preset (tiny, qwen2.5-0.5b, qwen2.5-3b, ...)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (realrun uses 1)")
    ap.add_argument("--out", default=None, help="write the table here (CSV)")
    args = ap.parse_args()

    import torch
    import torch._inductor.config as inductor

    from sparsebalance.kernels.layerbench import layer_table
    from sparsebalance.simulator.config import MODEL_PRESETS

    inductor.cpp.enable_kernel_profile = True  # the C++ kernels show in torch.profiler: launches count them
    torch.set_num_threads(args.threads)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    model = MODEL_PRESETS[args.model]()
    df = layer_table(model, tuple(args.tokens), device=args.device, dtype=dtype, repeats=args.repeats, warmup=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        df.to_csv(args.out, index=False)
    wide = df.pivot_table(index=["op", "tokens"], columns="impl",
                          values=["fwd_s", "bwd_s", "launches"], sort=False)
    table = {}
    for impl in ("eager", "compiled"):
        table[f"{impl} fwd ms"] = 1e3 * wide["fwd_s", impl]
        table[f"{impl} bwd ms"] = 1e3 * wide["bwd_s", impl]
        table[f"{impl} launches"] = wide["launches", impl].astype(int)
    import pandas as pd

    out = pd.DataFrame(table)
    out["speedup fwd+bwd"] = ((wide["fwd_s", "eager"] + wide["bwd_s", "eager"])
                              / (wide["fwd_s", "compiled"] + wide["bwd_s", "compiled"]))
    print(f"{model.name}, {dtype}, {args.device}, {args.threads} thread(s), median of {args.repeats}")
    print(out.to_string(float_format=lambda v: f"{v:.3f}"))
    if df.ratio_fwd.notna().any():
        print(df[["impl", "op", "tokens", "ratio_fwd", "ratio_bwd"]].to_string(index=False))


if __name__ == "__main__":
    main()
