"""Compile the MoBA Triton kernels for Hopper (sm_90a) without a GPU and read what ptxas made of them.

Registers per thread, spill stores/loads (bytes), static shared memory (bytes) and the count of
wgmma instructions in the PTX (0 means ``tl.dot`` fell back to mma.sync). Used to pick
``triton_impl.launch_config`` (``benchmarks/inspect_triton_sm90.py``) and by the test that the
production variants compile for sm_90 before any GPU time is spent (tests/kernels/test_sm90_compile.py).
Needs the compiler, so never under ``TRITON_INTERPRET``; the bundled ptxas reads the PTX.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

CONSTEXPRS = ("D", "BLOCK", "BLOCK_M", "BLOCK_N", "MASKED", "F32_DOT", "PREC")
BF16_PTRS = {"Q", "K", "V", "O", "DO", "PO"}
FP32_PTRS = {"LSE", "DELTA", "PL", "DQ", "DK", "DV"}  # gradients accumulate in fp32 buffers (atomics)
INT_SCALARS = {"T", "H", "G", "HKV", "W"}


def _signature(fn) -> dict[str, str]:
    sig = {}
    for a in fn.arg_names:
        if a in CONSTEXPRS:
            sig[a] = "constexpr"
        elif a in BF16_PTRS:
            sig[a] = "*bf16"
        elif a in FP32_PTRS:
            sig[a] = "*fp32"
        elif a.isupper() and a not in INT_SCALARS:  # CODES, ITEMS, TILES, SEL, BITS
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
            masked: bool = False) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = {"D": d, "BLOCK": block, "BLOCK_M": bm, "BLOCK_N": bn, "MASKED": masked,
             "F32_DOT": False, "PREC": "tf32"}
    const = {a: c for a, c in const.items() if a in fn.arg_names}
    src = ASTSource(fn, _signature(fn), const)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    usage = _ptxas_usage(ptx)
    return dict(kernel=fn.__name__.strip("_").removesuffix("_kernel"), masked="MASKED" in const and masked,
                D=d, BLOCK_M=bm, BLOCK_N=bn, warps=warps, stages=stages, **usage,
                smem=k.metadata.shared, wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                mma_sync=len(re.findall(r"\bmma\.sync", ptx)))


#: The Triton kernels of ``triton_impl`` and whether each has a ``MASKED`` variant.
KERNELS = {"fwd_past": False, "fwd_own_merge": True, "bwd_past": False, "bwd_own": True}


def production_variants(head_dim: int = 128, block: int = 128) -> list[dict]:
    """Every kernel variant a bf16 call compiles at ``launch_config`` (own-block kernels without and
    with ``MASKED``), inspected."""
    import torch

    from sparsebalance.kernels.moba import triton_impl as ti

    cfg = ti.launch_config(block, head_dim, torch.bfloat16)
    rows = []
    for name, has_masked in KERNELS.items():
        for masked in ((False, True) if has_masked else (False,)):
            rows.append(inspect(getattr(ti, f"_{name}_kernel"), cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"],
                                cfg["num_stages"], d=head_dim, block=block, masked=masked))
    return rows
