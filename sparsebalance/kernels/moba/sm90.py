"""Compile the MoBA Triton kernels for Hopper (sm_90a) without a GPU and read what ptxas made of them.

Per kernel variant: registers per thread, spill stores/loads (bytes), static shared memory (bytes),
the count of wgmma instructions in the PTX (0 for a tensor-core kernel means ``tl.dot`` fell back to
mma.sync), and the memory-ordering of its atomics: ``ordered`` counts every instruction with an
acquire / release / acq_rel / sc qualifier or a GPU-scope fence (``fence.acq_rel.gpu``,
``fence.sc.gpu``, ``membar.gl``) -- what serialised the previous backward -- and ``relaxed`` the
relaxed atomic reductions. Used to pick ``launch.CHOSEN`` (``benchmarks/inspect_triton_sm90.py``)
and by the test that every production variant compiles clean (tests/kernels/test_sm90_compile.py).
Needs the compiler, so never under ``TRITON_INTERPRET``; the bundled ptxas reads the PTX.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

#: Pointer arguments by name -> Triton type (bf16 inputs; accumulators and statistics in fp32).
POINTERS = {
    **dict.fromkeys(("Q", "K", "V", "O", "DO", "PO", "OQ", "OK", "OV"), "*bf16"),
    **dict.fromkeys(("LSE", "DELTA", "PL", "DQ", "DK", "DV", "MEANS"), "*fp32"),
    **dict.fromkeys(("CODES", "CUM", "CUM_F", "CUM_B", "BSTART", "OWN", "SEL", "BITS", "BLOCKS"), "*i32"),
    "PTR": "*i64", "KEYS": "*i16",
}
#: Tables whose element type differs per kernel.
TABLES = {"gate": "*i64", "fwd_own_merge": "*i32", "bwd_dq_own": "*i32"}
#: The kernels of ``triton_*.py``: (module, kernel, its variants' constexpr sets besides the tiles).
KERNELS = {
    "block_means": "triton_gate", "gate": "triton_gate", "items": "triton_select", "fwd_past": "triton_fwd",
    "fwd_own_merge": "triton_fwd", "bwd_prep": "triton_bwd", "bwd_kv": "triton_bwd", "bwd_dq_own": "triton_bwd",
    "bwd_dq_past": "triton_bwd", "cast": "triton_bwd",
}
#: Kernels whose matrix products run on tensor cores (wgmma expected).
TENSOR_CORE = {"fwd_past", "fwd_own_merge", "bwd_kv", "bwd_dq_own", "bwd_dq_past"}
_ORDER = {"acq_rel", "acquire", "release", "sc"}


def kernel_fn(name: str):
    import importlib

    return getattr(importlib.import_module(f"sparsebalance.kernels.moba.{KERNELS[name]}"), f"_{name}_kernel")


def _signature(name: str, fn, const: dict) -> dict[str, str]:
    sig = {}
    for a in fn.arg_names:
        if a in const:
            sig[a] = "constexpr"
        elif a == "TILES":
            sig[a] = TABLES[name]
        elif a in POINTERS:
            sig[a] = POINTERS[a]
        elif "scale" in a:
            sig[a] = "fp32"
        else:
            sig[a] = "i32"
    return sig


def memory_order(ptx: str) -> dict[str, int]:
    """Ordered memory instructions and GPU-scope fences (``ordered``), relaxed atomics (``relaxed``)."""
    ordered = relaxed = 0
    for ins in re.findall(r"(?<![\w.])((?:atom|red|fence|membar|ld|st)\.[\w.:]+)", ptx):
        parts = set(ins.split("."))
        if parts & _ORDER or ins.startswith("membar.gl"):
            ordered += 1
        elif ins.startswith(("atom.", "red.")):
            relaxed += 1
    return {"ordered": ordered, "relaxed": relaxed}


def loop_instructions(ptx: str) -> list[int]:
    """PTX instructions of each loop body (a block branched to from below), largest first: the
    per-iteration work of a kernel's main loop, what the cost model prices the gate's scoring by."""
    lines = [x.strip() for x in ptx.splitlines()]
    labels = {m.group(1): i for i, x in enumerate(lines) if (m := re.match(r"^(\$L\w+):", x))}
    sizes = []
    for i, x in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L\w+);", x)
        if m and labels.get(m.group(1), i) < i:
            body = lines[labels[m.group(1)]:i + 1]
            sizes.append(sum(1 for y in body if y and y.endswith(";") and not y.startswith(("//", "."))))
    return sorted(sizes, reverse=True)


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


def inspect(name: str, const: dict, warps: int, stages: int) -> dict:
    """Compile kernel ``name`` with constexprs ``const`` for sm_90a; the report row."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel_fn(name)
    const = {a: c for a, c in const.items() if a in fn.arg_names}
    k = triton.compile(ASTSource(fn, _signature(name, fn, const), const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    variant = ",".join(f"{a}={c}" for a, c in const.items() if a in ("MASKED", "GATHERED", "FROM_SEL", "KW") and c is not False)
    return dict(kernel=name, variant=variant, D=const.get("D"), BLOCK_M=const.get("BLOCK_M", const.get("BM")),
                BLOCK_N=const.get("BLOCK_N", const.get("KW")), warps=warps, stages=stages, **_ptxas_usage(ptx),
                smem=k.metadata.shared, wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                mma_sync=len(re.findall(r"\bmma\.sync", ptx)), **memory_order(ptx),
                loop=(loop_instructions(ptx) or [0])[0])


def variants(head_dim: int = 128, block: int = 128, configs: dict | None = None) -> list[tuple[str, dict, int, int]]:
    """Every (kernel, constexprs, warps, stages) a bf16 call compiles at ``head_dim`` and ``block``
    with ``configs`` (per kernel; default: ``launch.chosen``): the gate at every slot width up to
    ``plan.GATE_MAX_KW`` and its PyTorch-top-k variant, own-block kernels without and with MASKED."""
    from sparsebalance.kernels.moba import launch
    from sparsebalance.kernels.moba.plan import GATE_MAX_KW

    cfg = {k: launch.chosen(k, head_dim) for k in launch.KERNELS} | (configs or {})
    D, att = head_dim, {"D": head_dim, "BLOCK": block, "F32_DOT": False, "PREC": "tf32"}
    out = [("block_means", {"D": D, "BLOCK": block, "BR": min(64, block)}, 4, 1),
           ("items", {"BLK": 1024}, 4, 1), ("bwd_prep", {"D": D, "BR": 32}, 4, 1), ("cast", {"BLK": 1024}, 4, 1)]
    g = cfg["gate"]
    kw = 16
    while kw <= GATE_MAX_KW:
        out.append(("gate", {"D": D, "KW": kw, "M": kw.bit_length() - 1, "BM": g.block_m, "FROM_SEL": False},
                    launch.GATE_WARPS.get(kw, g.warps), g.stages))
        kw *= 2
    out.append(("gate", {"D": D, "KW": 64, "M": 6, "BM": g.block_m, "FROM_SEL": True}, g.warps, g.stages))
    for name, flags in (("fwd_past", ({},)), ("fwd_own_merge", ({"MASKED": False}, {"MASKED": True})),
                        ("bwd_kv", ({"MASKED": False, "GATHERED": False}, {"MASKED": True, "GATHERED": False},
                                    {"MASKED": False, "GATHERED": True})),
                        ("bwd_dq_own", ({"MASKED": False}, {"MASKED": True})), ("bwd_dq_past", ({},))):
        c = cfg[name]
        for f in flags:
            out.append((name, att | f | {"BLOCK_M": min(c.block_m, block), "BLOCK_N": min(c.block_n, block)},
                        c.warps, c.stages))
    return out


def production_variants(head_dim: int = 128, block: int = 128) -> list[dict]:
    """Every variant of :func:`variants`, inspected."""
    return [inspect(name, const, w, s) for name, const, w, s in variants(head_dim, block)]
