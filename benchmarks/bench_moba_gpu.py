"""GPU benchmark of the MoBA Triton kernel against dense causal attention (bf16).

    .venv/bin/python benchmarks/bench_moba_gpu.py [--lengths 8192 32768 131072] [--densities 0.25 0.125]
        [--heads 8 --kv-heads 1 --head-dim 128 --block 256] [--csv out.csv]

Prints milliseconds, TFLOP/s on attended pairs and the speedup over dense (flash_attn varlen, or SDPA
on the flash backend) for forward and forward + backward, beside the analytical cost model's
prediction; the measurement itself is ``sparsebalance/kernels/moba/speed.py`` (also run by
``sparsebalance gpu-check``). Exits with code 2 and a message when CUDA is absent.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="MoBA Triton vs dense causal attention on one GPU")
    ap.add_argument("--lengths", type=int, nargs="*", default=[8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--densities", type=float, nargs="*", default=[1 / 4, 1 / 8, 1 / 16, 1 / 32])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--csv", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_moba_gpu: CUDA is not available; this benchmark needs an NVIDIA GPU", file=sys.stderr)
        return 2
    from sparsebalance.kernels.moba.speed import SpeedShape, speed_table, target_table

    shape = SpeedShape(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, block=args.block)
    points = [(L, d) for L in args.lengths for d in args.densities]
    df = speed_table(points, shape, progress=lambda rows: print(rows[-1], file=sys.stderr, flush=True))
    print(f"device: {torch.cuda.get_device_name()}  {shape}  bf16")
    print(df.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    print(target_table(df).to_string(index=False))
    if args.csv:
        df.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
