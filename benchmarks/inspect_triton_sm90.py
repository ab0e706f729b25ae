"""Compile the MoBA Triton kernels for Hopper (sm_90a) without a GPU and report what ptxas made of them.

For bf16 inputs, head_dim 128 (``--head-dim``), block 128 (``--block``) and each candidate launch config, prints registers per
thread, spill stores/loads (bytes), static shared memory (bytes), and the number of wgmma
instructions in the PTX (0 means tl.dot fell back to mma.sync). Used to pick ``launch_config``.

    .venv/bin/python benchmarks/inspect_triton_sm90.py [--configs 64x64x4x2 128x64x8x2 ...]

A config is BLOCK_MxBLOCK_Nxnum_warpsxnum_stages. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

CONSTEXPRS = ("D", "BLOCK", "BLOCK_M", "BLOCK_N", "K1P", "F32_DOT", "PREC")
BF16_PTRS = {"Q", "K", "V", "O", "DO", "PO"}
FP32_PTRS = {"LSE", "DELTA", "PL", "DQ", "DK", "DV"}  # gradients accumulate in fp32 buffers (atomics)
INT_SCALARS = {"T", "H", "G", "HKV"}


def _signature(fn) -> dict[str, str]:
    sig = {}
    for a in fn.arg_names:
        if a in CONSTEXPRS:
            sig[a] = "constexpr"
        elif a in BF16_PTRS:
            sig[a] = "*bf16"
        elif a in FP32_PTRS:
            sig[a] = "*fp32"
        elif a.isupper() and a not in INT_SCALARS:  # CODES, ITEMS, TILES, SEL
            sig[a] = "*i32"  # index tables
        elif "scale" in a:
            sig[a] = "fp32"
        else:
            sig[a] = "i32"
    return sig


def _ptxas_usage(ptx: str) -> dict[str, int]:
    """Registers and spills from ``ptxas -v`` on the PTX (the bundled ptxas that accepts triton's PTX)."""
    import triton

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        for exe in ("ptxas-blackwell", "ptxas"):
            r = subprocess.run([os.path.join(bindir, exe), "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull],
                               capture_output=True, text=True, check=False)
            if r.returncode == 0:
                text = r.stdout + r.stderr
                regs = int(re.search(r"Used (\d+) registers", text).group(1))
                st, ld = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text).groups())
                return {"regs": regs, "spill_st": st, "spill_ld": ld}
    raise RuntimeError("no bundled ptxas accepted the PTX")


def inspect(fn, bm: int, bn: int, warps: int, stages: int, *, d: int = 128, block: int = 128,
            k1p: int = 16) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = {"D": d, "BLOCK": block, "BLOCK_M": bm, "BLOCK_N": bn, "K1P": k1p, "F32_DOT": False, "PREC": "tf32"}
    const = {a: c for a, c in const.items() if a in fn.arg_names}
    src = ASTSource(fn, _signature(fn), const)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    usage = _ptxas_usage(ptx)
    return dict(kernel=fn.__name__.strip("_").removesuffix("_kernel"), D=d, BLOCK_M=bm, BLOCK_N=bn, warps=warps, stages=stages, **usage,
                smem=k.metadata.shared, wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                mma_sync=len(re.findall(r"\bmma\.sync", ptx)))


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("inspect_triton_sm90: unset TRITON_INTERPRET (it replaces the compiler)", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="*", default=["64x64x4x2", "64x64x8x2", "128x64x8x2", "64x128x8x2"])
    ap.add_argument("--kernels", nargs="*", default=["fwd_past", "fwd_own_merge", "bwd_past", "bwd_own"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=128)
    args = ap.parse_args(argv)
    import pandas as pd

    from sparsebalance.kernels.moba import triton_impl as ti

    rows = []
    for name in args.kernels:
        fn = getattr(ti, f"_{name}_kernel")
        for c in args.configs:
            bm, bn, w, s = map(int, c.split("x"))
            rows.append(inspect(fn, bm, bn, w, s, d=args.head_dim, block=args.block))
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
