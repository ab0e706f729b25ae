"""Count the PyTorch ops and bytes of the MoBA kernel's host-side phases (selection, index, backward
glue) by intercepting every ATen call -- the measurement behind the cost model's per-element
constants (``sparsebalance/simulator/cost/kernelcost.py``) and its launch counts.

Bytes of an op = sum of ``nbytes`` of its tensor inputs and outputs (each read or written once);
ops that only create views (no kernel on a GPU) are not counted. Internal passes of an op are not
seen (e.g. a radix sort reads and writes its keys once per digit pass): the cost model adds them.

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
#: ATen ops that make the host wait for the device (a data-dependent size or a value read back).
SYNC_OPS = {"nonzero", "repeat_interleave", "_local_scalar_dense", "item", "is_nonzero", "masked_select"}


@dataclass(slots=True)
class OpCount:
    """Totals of one phase."""

    ops: int = 0
    """Kernel-launching ATen ops."""
    bytes: int = 0
    """Bytes read and written by them."""
    syncs: int = 0
    """Ops that make the host wait for the device."""
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
            block_m: int = 64, seed: int = 0, masked: bool = False) -> dict[str, OpCount]:
    """Counts of selection, index building (the rest of ``build_index``; on the masked dense path
    when ``masked``: the selection bits instead of the gathered index) and the backward glue (delta,
    zeroed fp32 accumulators, casts) for one bf16 sequence."""
    import torch

    from sparsebalance.kernels.moba import triton_select as ts

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, heads, dim, generator=g).to(torch.bfloat16)
    k = torch.randn(length, kv_heads, dim, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, length], dtype=torch.int32)
    topk = torch.tensor([budget])
    k1p = max(2, ts._next_pow2(budget - 1))
    _, sel = count_ops(ts.select_blocks, q, k, [0, length], block, [budget], k1p)
    _, total = count_ops(ts.build_index, q, k, cu, block, topk, block_m, masked=[masked])
    index = OpCount(ops=total.ops - sel.ops, bytes=total.bytes - sel.bytes, syncs=total.syncs - sel.syncs,
                    by_op={n: total.by_op[n] - sel.by_op.get(n, 0) for n in total.by_op})

    def glue(o, do):  # what moba_backward does around its two kernels
        with torch.no_grad():
            delta = (do.float() * o.float()).sum(-1).transpose(0, 1).contiguous()
            acc = [torch.zeros(length, n, dim) for n in (heads, kv_heads, kv_heads)]
            return delta, [a.to(torch.bfloat16) for a in acc]

    o, do = (torch.randn(length, heads, dim, generator=g).to(torch.bfloat16) for _ in range(2))
    _, bwd = count_ops(glue, o, do)
    return {"select": sel, "index": index, "bwd_glue": bwd}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="ATen ops and bytes of the MoBA host-side phases")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--budgets", type=int, nargs="*", default=[8, 32])
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    for b in args.budgets:
        for phase, c in measure(args.length, b).items():
            print(f"L={args.length} k={b} {phase}: {c.ops} ops, {c.bytes / 1e6:.1f} MB, {c.syncs} syncs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
