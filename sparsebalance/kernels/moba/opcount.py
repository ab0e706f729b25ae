"""Count the PyTorch ops and bytes, and the Triton launches, of the MoBA kernel's phases (gate, index,
backward) by intercepting every ATen call with the Triton kernels stubbed out (``hostcheck.stubbed``)
-- the measurement behind the cost model's launch counts and index bytes
(``sparsebalance/simulator/cost/kernelcost.py``).

Bytes of an op = sum of ``nbytes`` of its tensor inputs and outputs (each read or written once);
ops that only create views or allocate (no kernel on a GPU) are not counted. Internal passes of an
op are not seen (a radix sort reads and writes its keys once per digit pass): the cost model adds
them.

    .venv/bin/python -m sparsebalance.kernels.moba.opcount [--length 16384] [--budgets 8 32]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

#: ATen ops that only make views or change metadata: no kernel launch, no traffic.
VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "expand", "t", "transpose", "as_strided", "detach",
            "alias", "unsqueeze", "squeeze", "permute", "reshape", "_reshape_alias", "lift_fresh",
            "split", "unbind", "unfold", "diagonal", "narrow", "view_as", "numpy_T", "empty", "empty_like",
            "empty_strided", "resize_", "set_", "_to_copy_noop", "_local_scalar_dense"}


@dataclass(slots=True)
class OpCount:
    """Totals of one phase."""

    ops: int = 0
    """Kernel-launching ATen ops."""
    bytes: int = 0
    """Bytes read and written by them."""
    syncs: int = 0
    """Ops that make the host wait for the device whenever they run on one (``hostcheck.SYNC_OPS``)."""
    by_op: dict[str, int] = field(default_factory=dict)
    """Launches per ATen op name."""


def _tensors(x: Any):
    import torch

    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def count_ops(fn, *args, **kwargs) -> tuple[Any, OpCount]:
    """Run ``fn(*args, **kwargs)`` and count its ATen ops (see the module docstring)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sparsebalance.kernels.moba.hostcheck import SYNC_OPS

    c = OpCount()

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            out = func(*a, **(kw or {}))
            name = func.overloadpacket.__name__
            if name in SYNC_OPS:
                c.syncs += 1
            if name not in VIEW_OPS:
                c.ops += 1
                c.by_op[name] = c.by_op.get(name, 0) + 1
                c.bytes += sum(t.numel() * t.element_size() for t in _tensors((a, kw, out)))
            return out

    with _Mode():
        result = fn(*args, **kwargs)
    return result, c


def measure(length: int, budget: int, *, heads: int = 8, kv_heads: int = 1, dim: int = 128, block: int = 256,
            seed: int = 0, masked: bool = False) -> dict[str, OpCount]:
    """ATen counts of the gate (``run_gate``), the rest of the index (``build_index``) and the backward
    (``moba_backward``) of one bf16 sequence, the Triton kernels stubbed (their launches in
    ``OpCount.by_op`` under ``triton:<kernel>``)."""
    import torch

    from sparsebalance.kernels.moba import hostcheck, triton_bwd, triton_gate, triton_select
    from sparsebalance.kernels.moba.triton_impl import plan_for

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, heads, dim, generator=g).to(torch.bfloat16)
    k = torch.randn(length, kv_heads, dim, generator=g).to(torch.bfloat16)
    plan = plan_for(q, k, [0, length], [budget], block, path="masked" if masked else "sparse")
    out = {}
    with hostcheck.stubbed() as log:
        _, gate = count_ops(triton_gate.run_gate, plan, q, k)
        gate.by_op.update({f"triton:{n}": 1 for n, _ in log})
        log.clear()
        idx, total = count_ops(triton_select.build_index, plan, q, k)
        out["gate"] = gate
        out["index"] = OpCount(ops=total.ops - gate.ops, bytes=total.bytes - gate.bytes, syncs=total.syncs - gate.syncs,
                               by_op={n: total.by_op[n] - gate.by_op.get(n, 0) for n in total.by_op
                                      if total.by_op[n] - gate.by_op.get(n, 0)})
        out["index"].by_op.update({f"triton:{n}": 1 for n, _ in log[2:]})
        log.clear()
        o, do = (torch.randn(length, heads, dim, generator=g).to(torch.bfloat16) for _ in range(2))
        lse = torch.zeros(heads, length)
        _, bwd = count_ops(triton_bwd.moba_backward, plan, idx, q, k, k, o, lse, do, interpreting=False)
        bwd.by_op.update({f"triton:{n}": sum(1 for x, _ in log if x == n) for n, _ in log})
        out["backward"] = bwd
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="ATen ops and bytes of the MoBA host-side phases")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--budgets", type=int, nargs="*", default=[8, 32])
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    for b in args.budgets:
        for phase, c in measure(args.length, b).items():
            print(f"L={args.length} k={b} {phase}: {c.ops} ATen ops, {c.bytes / 1e6:.1f} MB, {c.syncs} syncs; "
                  f"{c.by_op}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
