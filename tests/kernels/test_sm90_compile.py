"""Every production Triton kernel variant compiles for Hopper (sm_90a) under the pinned triton, on this
CPU, with no ordered atomic and no GPU-scope fence.

Before any GPU time is spent: every variant a bf16, head-dim-128 call can launch at the chosen
launch configurations (``launch.CHOSEN``; ``sm90.variants``: the gate at each slot width and its
PyTorch-top-k variant, the own-block kernels with and without ``MASKED``, the backward's gathered
variant, the small kernels) is compiled to PTX and assembled by the ptxas bundled with triton
(``kernels/moba/sm90.py``). Each must

* carry no instruction with an acquire / release / acq_rel / sc ordering and no GPU-scope fence
  (``fence.acq_rel.gpu``, ``fence.sc.gpu``, ``membar.gl``): Triton's default ``acq_rel`` atomics
  wrapped each gradient add in fences and made the previous backward two thirds of the time;
* run its matrix products on wgmma where it has tensor-core products (never mma.sync);
* fit the register file and shared memory of one SM, and spill at most what the configuration was
  chosen with (kernels/moba/README.md, "Hopper compile check").

Runs in a subprocess: the kernel tests here load the kernels interpreted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

#: Spill bytes (stores + loads) per thread of the worst chosen variant (README table), with a margin.
SPILL_BUDGET = 200
#: Hopper: 255 registers per thread, 227 KiB of shared memory per block.
MAX_REGS, MAX_SMEM = 255, 227 * 1024

PROG = """
import json
from sparsebalance.kernels.moba.sm90 import production_variants
print(json.dumps(production_variants(head_dim=128, block=128)))
"""


def test_production_variants_compile_for_sm90_unordered_and_on_wgmma():
    from sparsebalance.kernels.moba.plan import GATE_MAX_KW
    from sparsebalance.kernels.moba.sm90 import TENSOR_CORE

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", PROG], capture_output=True, text=True, env=env, timeout=900,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    widths = [16 << i for i in range(GATE_MAX_KW.bit_length() - 4)]
    assert {(x["kernel"], x["variant"]) for x in rows} == {
        ("block_means", ""), ("items", ""), ("bwd_prep", ""), ("cast", ""), ("fwd_past", ""),
        *(("gate", f"KW={w}") for w in widths), ("gate", "KW=64,FROM_SEL=True"),
        ("fwd_own_merge", ""), ("fwd_own_merge", "MASKED=True"), ("bwd_kv", ""), ("bwd_kv", "MASKED=True"),
        ("bwd_kv", "GATHERED=True"), ("bwd_dq_own", ""), ("bwd_dq_own", "MASKED=True"), ("bwd_dq_past", "")}
    for x in rows:
        assert x["ordered"] == 0, x                       # no acq_rel / acquire / release / sc, no GPU fence
        assert x["mma_sync"] == 0, x
        assert (x["wgmma"] > 0) == (x["kernel"] in TENSOR_CORE), x
        assert x["regs"] <= MAX_REGS and x["smem"] <= MAX_SMEM, x
        assert x["spill_st"] + x["spill_ld"] <= SPILL_BUDGET, x
    relaxed = {x["kernel"] for x in rows if x["relaxed"]}
    assert relaxed == {"bwd_kv", "bwd_dq_past"}  # the gradient adds, all relaxed


def test_memory_order_reader_sees_ordered_atomics_and_fences():
    """Not vacuous: the PTX of the previous backward (acq_rel adds) and GPU-scope fences count."""
    from sparsebalance.kernels.moba.sm90 import memory_order

    ptx = """
        atom.global.gpu.acq_rel.add.f32 %f1, [%rd1], %f2;
        red.global.gpu.relaxed.add.f32 [%rd2], %f3;
        fence.acq_rel.gpu;
        membar.gl;
        fence.proxy.async.shared::cta;
        wgmma.fence.sync.aligned;
        ld.acquire.gpu.b32 %r1, [%rd3];
    """
    assert memory_order(ptx) == {"ordered": 4, "relaxed": 1}
