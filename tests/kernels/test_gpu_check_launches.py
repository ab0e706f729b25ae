"""gpu-check's accuracy plan launches every Triton kernel of the MoBA op, on the CPU.

The automatic dispatch sends the accuracy cases to the masked or dense path, so a plan that checked
only ``path="auto"`` would never run the sparse key-block-major kernels compiled. Here each kernel
object of ``triton_impl`` is replaced by a recorder (nothing is computed: the outputs are garbage,
only the launches count) and the plan is run forward and backward at its real sizes.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from sparsebalance.kernels.moba import triton_impl
from sparsebalance.kernels.moba.check import ACCURACY_PLAN, GPU_CASES, PATHS, make_inputs

KERNELS = ("_fwd_past_kernel", "_fwd_own_merge_kernel", "_bwd_past_kernel", "_bwd_own_kernel")


class _Recorder:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append((self.name.strip("_").removesuffix("_kernel"), bool(kw.get("MASKED", False))))
        return launch


def _launches(monkeypatch, case_name: str, dtype: str, path: str) -> set:
    log: list = []
    for k in KERNELS:
        monkeypatch.setattr(triton_impl, k, _Recorder(k, log))
    case = GPU_CASES[case_name]
    q, k, v, do, cu = make_inputs(case)
    q, k, v = (x.to(getattr(torch, dtype)).requires_grad_() for x in (q, k, v))
    out = triton_impl.moba_attention_triton(q, k, v, cu, case.block, torch.tensor(case.topk), path=path)
    out.backward(do.to(out.dtype))
    return set(log)


def test_the_plan_launches_all_four_kernels_and_both_own_block_variants(monkeypatch):
    seen = {}
    for name, dtype in ACCURACY_PLAN:
        for path in PATHS:
            seen[(name, dtype, path)] = _launches(monkeypatch, name, dtype, path)
    every = set().union(*seen.values())
    assert every == {("fwd_past", False), ("bwd_past", False), ("fwd_own_merge", False), ("fwd_own_merge", True),
                     ("bwd_own", False), ("bwd_own", True)}
    # forced paths do what they say on each sparse case; the full-budget case is dense on every path
    for (name, dtype, path), got in seen.items():
        sparse_case = any(k < -(-n // GPU_CASES[name].block) for n, k in zip(GPU_CASES[name].lens, GPU_CASES[name].topk))
        if path == "sparse" and sparse_case:
            assert {("fwd_past", False), ("bwd_past", False)} <= got, (name, dtype, path, got)
            assert not any(masked for _, masked in got), (name, dtype, path, got)
        if path == "masked" and sparse_case:
            assert {("fwd_own_merge", True), ("bwd_own", True)} <= got, (name, dtype, path, got)
            assert ("fwd_past", False) not in got, (name, dtype, path, got)
        if not sparse_case:
            assert got == {("fwd_own_merge", False), ("bwd_own", False)}, (name, dtype, path, got)
