"""Accuracy of the Triton kernel judged as attention-kernel test suites judge it.

FlashAttention's tests compare a kernel and a PyTorch implementation of the same math, both in the
low precision, against a high-precision reference, and accept the kernel when its error is at most
twice the PyTorch implementation's. Here: reference = ``naive.py`` in float64 on the inputs rounded
to the test dtype; PyTorch implementation = ``naive.py`` in the test dtype; kernel =
``moba_attention_triton`` in the test dtype. Errors are max |x - ref| over the tensor, for the output
and each gradient. Used by the kernel tests (interpreter on CPU, compiled on CUDA) and by
``sparsebalance gpu-check``.

Every path of the kernel is checked: the automatic dispatch sends some sparse cases to the masked
dense path and others to the sparse one (the cost model decides per sequence), so a plan that
checked only ``"auto"`` could leave kernels uncompiled (``_fwd_past_kernel``, the gathered
``_bwd_kv_kernel``, ``_bwd_dq_past_kernel``, the MASKED variants); :data:`ACCURACY_PLAN` forces
``"sparse"`` and ``"masked"`` on every case beside ``"auto"``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

#: Absolute floor of the bound, relative to max |ref|: keeps a float32 comparison whose PyTorch error
#: happens to be ~0 from demanding bit equality (float32 epsilon is 1.2e-7).
FLOOR = 1e-5


@dataclass(kw_only=True, slots=True, frozen=True)
class Case:
    """One packed variable-length input."""

    lens: tuple[int, ...]
    """Sequence lengths in tokens."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (GQA when fewer than ``heads``)."""
    dim: int
    """Head dimension."""
    block: int
    """MoBA block size."""
    topk: tuple[int, ...]
    """Budget per sequence (own block included)."""
    seed: int = 0
    """Seed of the random q, k, v and output gradient."""


#: The cases of the compiled-kernel tests (tests/kernels/test_triton_gpu.py) and of gpu-check.
GPU_CASES = {
    # qwen2.5-3b per TP-2 rank: 8 query heads on 1 kv head, D = 128, block 128
    "3b-tp2-d128-b128": Case(lens=(1000, 2900, 517, 4096), heads=8, kv_heads=1, dim=128, block=128,
                             topk=(4, 8, 2, 6), seed=1),
    # qwen2.5-0.5b dims: 14 heads on 2 kv heads, D = 64, block 64, one sequence shorter than a block
    "05b-d64-b64": Case(lens=(37, 2000, 1500, 700), heads=14, kv_heads=2, dim=64, block=64,
                        topk=(3, 12, 5, 1), seed=2),
    # full budget: dense causal through the same kernels
    "dense-d128-b64": Case(lens=(640, 1100), heads=4, kv_heads=2, dim=128, block=64, topk=(10, 18), seed=3),
}


def make_inputs(case: Case) -> tuple[Any, ...]:
    """float64 CPU tensors q, k, v, dout and int32 cu_seqlens for ``case``."""
    import torch

    g = torch.Generator().manual_seed(case.seed)
    T = sum(case.lens)
    q, k, v, do = (torch.randn(T, n, case.dim, generator=g, dtype=torch.float64)
                   for n in (case.heads, case.kv_heads, case.kv_heads, case.heads))
    cu = torch.tensor([0, *itertools.accumulate(case.lens)], dtype=torch.int32)
    return q, k, v, do, cu


#: The kernel's paths (``moba_attention_triton``'s ``path``), each checked on every case.
PATHS = ("auto", "sparse", "masked")
#: (case, dtype) of gpu-check's accuracy step, in order, each on every path: bf16 on every case, then
#: fp32 on one (fp32 runs the tiles in fp32 with ``input_precision="ieee"``).
ACCURACY_PLAN = [(name, "bfloat16") for name in GPU_CASES] + [("3b-tp2-d128-b128", "float32")]


def _run(fn, inputs, dtype, device):

    q, k, v, do = (x.to(device=device, dtype=dtype) for x in inputs)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(do)
    return [t.detach().double().cpu() for t in (out, *(x.grad for x in leaves))]


def accuracy(case: Case, dtype: Any, device: str, paths: tuple[str, ...] = ("auto",)) -> list[dict]:
    """One row per (path, tensor in out, dq, dk, dv): kernel and PyTorch errors vs float64, bound, ok.
    ``paths``: the kernel's paths to check (``moba_attention_triton``'s ``path``: auto, sparse,
    masked); the float64 reference (on ``device``) and the PyTorch error are computed once for all."""
    import torch

    from sparsebalance.kernels.moba.naive import moba_attention_naive
    from sparsebalance.kernels.moba.triton_impl import moba_attention_triton

    q, k, v, do, cu = make_inputs(case)
    rounded = [x.to(dtype).double() for x in (q, k, v, do)]
    topk = torch.tensor(case.topk, dtype=torch.long, device=device)
    cu_d = cu.to(device)
    ref = _run(lambda a, b, c: moba_attention_naive(a, b, c, cu_d, case.block, topk), rounded, torch.float64, device)
    pt = _run(lambda a, b, c: moba_attention_naive(a, b, c, cu_d, case.block, topk), rounded, dtype, device)
    rows = []
    for path in paths:
        kern = _run(lambda a, b, c, path=path: moba_attention_triton(a, b, c, cu_d, case.block, topk, path=path),
                    rounded, dtype, device)
        for name, r, p, x in zip(("out", "dq", "dk", "dv"), ref, pt, kern):
            scale = float(r.abs().max())
            err_k, err_p = float((x - r).abs().max()), float((p - r).abs().max())
            bound = 2 * err_p + FLOOR * scale
            rows.append({"dtype": str(dtype).removeprefix("torch."), "path": path, "tensor": name,
                         "kernel_err": err_k, "torch_err": err_p, "bound": bound,
                         "ratio": err_k / err_p if err_p else float("nan"), "ok": err_k <= bound})
    return rows
