"""The production Triton kernels compile for Hopper (sm_90a) under the pinned triton, on this CPU.

Before any GPU time is spent: every variant a bf16, head-dim-128 call launches (the four kernels,
the own-block ones without and with ``MASKED``) at ``launch_config`` is compiled to PTX and
assembled by the ptxas bundled with triton (``kernels/moba/sm90.py``). Each must use wgmma for its
matrix products (never fall back to mma.sync), fit the register file and shared memory of one SM,
and spill little more than the launch configuration was chosen with (kernels/moba/README.md, "Hopper compile check": the
worst, bwd_own with MASKED, 500 bytes stored and 544 loaded per thread). Runs in a subprocess: the kernel tests here load the kernels interpreted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

#: Spill bytes (stores + loads) per thread the chosen configuration compiled with, with a margin.
SPILL_BUDGET = 1200
#: Hopper: 255 registers per thread, 227 KiB of shared memory per block.
MAX_REGS, MAX_SMEM = 255, 227 * 1024

PROG = """
import json
from sparsebalance.kernels.moba.sm90 import production_variants
print(json.dumps(production_variants(head_dim=128, block=128)))
"""


def test_production_variants_compile_for_sm90_with_wgmma():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", PROG], capture_output=True, text=True, env=env, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert {(x["kernel"], x["masked"]) for x in rows} == {
        ("fwd_past", False), ("fwd_own_merge", False), ("fwd_own_merge", True), ("bwd_past", False),
        ("bwd_own", False), ("bwd_own", True)}
    for x in rows:
        assert x["wgmma"] > 0 and x["mma_sync"] == 0, x
        assert x["regs"] <= MAX_REGS and x["smem"] <= MAX_SMEM, x
        assert x["spill_st"] + x["spill_ld"] <= SPILL_BUDGET, x
