"""Compile the MoBA Triton kernels for Hopper (sm_90a) without a GPU and report what ptxas made of them.

For bf16 inputs, head_dim 128 (``--head-dim``), block 128 (``--block``) and each candidate launch config
(and, for the own-block kernels, without and with the masked dense path's ``MASKED`` variant), prints
registers per thread, spill stores/loads (bytes), static shared memory (bytes), and the number of wgmma
instructions in the PTX (0 means tl.dot fell back to mma.sync). Used to pick ``launch_config``.

    .venv/bin/python benchmarks/inspect_triton_sm90.py [--configs 64x64x4x2 128x64x8x2 ...]

A config is BLOCK_MxBLOCK_Nxnum_warpsxnum_stages. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import os
import sys

from sparsebalance.kernels.moba.sm90 import inspect


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("inspect_triton_sm90: unset TRITON_INTERPRET (it replaces the compiler)", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="*", default=["64x64x4x2", "64x64x8x2", "128x64x8x2", "64x128x8x2"])
    ap.add_argument("--kernels", nargs="*", default=["fwd_past", "fwd_own_merge", "bwd_past", "bwd_own"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--masked", choices=("no", "yes", "both"), default="both",
                    help="MASKED variant of the own-block kernels (the masked dense path)")
    args = ap.parse_args(argv)
    import pandas as pd

    from sparsebalance.kernels.moba import triton_impl as ti

    rows = []
    for name in args.kernels:
        fn = getattr(ti, f"_{name}_kernel")
        variants = {"no": [False], "yes": [True], "both": [False, True]}[args.masked] \
            if "MASKED" in fn.arg_names else [False]
        for c in args.configs:
            bm, bn, w, s = map(int, c.split("x"))
            for m in variants:
                rows.append(inspect(fn, bm, bn, w, s, d=args.head_dim, block=args.block, masked=m))
                print(rows[-1], file=sys.stderr, flush=True)
    df = pd.DataFrame(rows)
    print(df.to_markdown(index=False) if _has_tabulate() else df.to_string(index=False))
    return 0


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
        return True
    except ImportError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
