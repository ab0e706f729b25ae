"""gpu-check's accuracy plan launches every Triton kernel of the MoBA op, on the CPU.

The automatic dispatch sends the accuracy cases to the masked or dense path, so a plan that checked
only ``path="auto"`` would never run the sparse key-block-major kernels compiled. Here every kernel
is replaced by a recorder (``hostcheck.stubbed``: nothing is computed, the outputs are garbage,
only the launches count) and the plan is run forward and backward at its real sizes.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from sparsebalance.kernels.moba import hostcheck, triton_impl
from sparsebalance.kernels.moba.check import ACCURACY_PLAN, GPU_CASES, PATHS, make_inputs

SPARSE = {("block_means", False), ("gate", False), ("items", False), ("fwd_past", False), ("bwd_kv", False),
          ("bwd_dq_past", False)}
MASKED = {("block_means", False), ("gate", False), ("fwd_own_merge", True), ("bwd_kv", True), ("bwd_dq_own", True)}
DENSE = {("fwd_own_merge", False), ("bwd_kv", False), ("bwd_dq_own", False)}
ALWAYS = {("bwd_prep", False)}


def _launches(case_name: str, dtype: str, path: str) -> set:
    case = GPU_CASES[case_name]
    q, k, v, do, cu = make_inputs(case)
    q, k, v = (x.to(getattr(torch, dtype)).requires_grad_() for x in (q, k, v))
    with hostcheck.stubbed() as log:
        out = triton_impl.moba_attention_triton(q, k, v, cu, case.block, torch.tensor(case.topk), path=path)
        out.backward(do.to(out.dtype))
    return set(log)


def test_the_plan_launches_every_kernel_and_both_own_block_variants():
    seen = {(name, dtype, path): _launches(name, dtype, path) for name, dtype in ACCURACY_PLAN for path in PATHS}
    every = set().union(*seen.values())
    assert every == SPARSE | MASKED | DENSE | ALWAYS | {("cast", False)}
    # forced paths do what they say on each sparse case; the full-budget case is dense on every path
    for (name, dtype, path), got in seen.items():
        case = GPU_CASES[name]
        sparse_case = any(k < -(-n // case.block) for n, k in zip(case.lens, case.topk))
        assert ALWAYS <= got and (("cast", False) in got) == (dtype != "float32")
        if path == "sparse" and sparse_case:
            assert SPARSE <= got and not any(masked for _, masked in got), (name, dtype, path, got)
        if path == "masked" and sparse_case:
            assert MASKED <= got and ("fwd_past", False) not in got, (name, dtype, path, got)
        if not sparse_case:
            assert got - {("cast", False)} == DENSE | ALWAYS, got
