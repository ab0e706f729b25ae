"""Compile the MoBA Triton kernels for Hopper (sm_90a) without a GPU and report what ptxas made of them.

For bf16 inputs, head_dim 128 (``--head-dim``), block 128 (``--block``): every production variant at
the chosen launch configurations (``launch.CHOSEN``; ``sm90.variants``), or with ``--candidates``
every candidate of ``launch.CANDIDATES`` for the tiled kernels (each flag variant: MASKED,
GATHERED, the gate's slot widths). Prints registers per thread, spill stores/loads (bytes), static
shared memory (bytes), wgmma and mma.sync counts, ordered memory instructions (acquire / release /
acq_rel / sc, GPU-scope fences: must be 0), relaxed atomics, and the instructions of the main loop.

    .venv/bin/python benchmarks/inspect_triton_sm90.py [--head-dim 64] [--candidates] [--kernels bwd_kv]

A config is BLOCK_MxBLOCK_Nxnum_warpsxnum_stages. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("inspect_triton_sm90: unset TRITON_INTERPRET (it replaces the compiler)", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--candidates", action="store_true", help="every launch candidate of the tiled kernels")
    ap.add_argument("--kernels", nargs="*", default=None, help="only these kernels")
    args = ap.parse_args(argv)
    import pandas as pd

    from sparsebalance.kernels.moba import launch
    from sparsebalance.kernels.moba.sm90 import inspect, variants

    todo = variants(args.head_dim, args.block)
    if args.candidates:
        todo = [v for name in launch.KERNELS for c in launch.CANDIDATES[name]
                for v in variants(args.head_dim, args.block, {name: launch.Config.parse(c)}) if v[0] == name]
    rows = []
    for name, const, warps, stages in todo:
        if args.kernels and name not in args.kernels:
            continue
        rows.append(inspect(name, const, warps, stages))
        print(rows[-1], file=sys.stderr, flush=True)
    df = pd.DataFrame(rows).drop_duplicates()
    try:
        print(df.to_markdown(index=False))
    except ImportError:
        print(df.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
