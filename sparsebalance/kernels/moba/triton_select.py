"""The index of the key-block-major MoBA Triton kernels, built on the device without synchronising.

Selection follows ``gate.py`` (README "Math"): a query at position t of its sequence lies in block
c = t // B and, among past blocks j < c, attends the k - 1 with the highest gate score (all of them
when c <= k - 1); ties go to the lower index. The fused gate kernel (``triton_gate.py``) writes every
gathered (row, head, choice) *entry* at its closed-form position (``plan.py``) with

* its sort key: bucket x chunks + forward chunk, bucket = (global key block, kv head);
* its code: (t H + h) k1p + slot, the entry's row of the forward chunk's partial buffer (less
  row0 H k1p) and, shifted right by log2(k1p), the packed (row, head) the kernels read q, dO from.

Then, all with fixed sizes:

1. a stable sort of the keys (int16 when buckets x chunks fit: two radix passes) -> the codes in
   bucket-major order, by code inside a bucket (the rows that chose a key block, ascending);
2. ``ptr``: where each (bucket, chunk) run starts, by ``searchsorted`` of every possible key;
3. ``_items_kernel``: per chunk, the running count of forward items (``block_m`` entries of a bucket
   each) over the buckets, and the running count of backward pieces (``bwd_entries`` entries of a
   bucket over all chunks). The past kernels find their item by binary search in these, on grids
   sized from host upper bounds (``plan.py``); programs past the last item exit.

A sequence on the masked dense path gets no entries: the gate writes its bit words (one bit per
block a row attends, own block included) instead, and the sequence runs the dense loops masked by
them. A dense sequence (k >= n) gets neither. ``sel`` [T, H, k1p] is written only when asked
(tests) or when the top-k ran in PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from sparsebalance.kernels.moba.plan import MobaPlan
from sparsebalance.kernels.moba.triton_gate import run_gate


@dataclass(kw_only=True, slots=True)
class MobaIndex:
    """What the kernels of one call need besides q, k, v and the plan."""

    codes: Any
    """[E] entry codes sorted by (bucket, chunk), then code (int32, or int64 when T H k1p >= 2^31)."""
    ptr: Any
    """int64 [buckets x chunks + 1]: first sorted entry of every (bucket, chunk) run."""
    cum_fwd: Any
    """int32 [buckets, chunks]: forward items (``block_m`` entries) of buckets 0..b in chunk c."""
    cum_bwd: Any
    """int32 [buckets]: backward pieces (``plan.bwd_entries`` entries over all chunks) of buckets 0..b."""
    bits: Any = None
    """int32 [T, H, W]: per (token, head) of a masked-path sequence, the blocks it attends."""
    sel: Any = None
    """int32 [T, H, k1p]: chosen local blocks ascending, -1 padded (only when asked)."""


@triton.jit(do_not_specialize=["NBK", "NC", "fwd_rows", "bwd_rows"])
def _items_kernel(PTR, CUM_F, CUM_B, NBK, NC, fwd_rows, bwd_rows, BLK: tl.constexpr):
    # program c < NC: forward items of chunk c per bucket; program NC: backward pieces per bucket
    c = tl.program_id(0)
    carry = tl.zeros([1], tl.int32)
    for b0 in range(0, NBK, BLK):
        b = b0 + tl.arange(0, BLK)
        ok = b < NBK
        if c < NC:
            lo = tl.load(PTR + b * NC + c, mask=ok, other=0)
            hi = tl.load(PTR + b * NC + c + 1, mask=ok, other=0)
            n = ((hi - lo + fwd_rows - 1) // fwd_rows).to(tl.int32)
            cum = tl.cumsum(n, 0) + carry
            tl.store(CUM_F + b * NC + c, cum, mask=ok)
        else:
            lo = tl.load(PTR + b * NC, mask=ok, other=0)
            hi = tl.load(PTR + (b + 1) * NC, mask=ok, other=0)
            n = ((hi - lo + bwd_rows - 1) // bwd_rows).to(tl.int32)
            cum = tl.cumsum(n, 0) + carry
            tl.store(CUM_B + b, cum, mask=ok)
        carry += tl.sum(n, 0)


def build_index(plan: MobaPlan, q: torch.Tensor, k: torch.Tensor, *, write_sel: bool = False) -> MobaIndex:
    """Gate, sort and item tables of one call (module docstring); no host synchronisation."""
    sel, keys, codes, bits = run_gate(plan, q, k, write_sel=write_sel)
    dev = q.device
    nbk, nc = plan.n_blocks * plan.HKV, plan.nc
    if not plan.entries:
        none = plan.dev["none"]
        return MobaIndex(codes=codes, ptr=none, cum_fwd=none, cum_bwd=none, bits=bits, sel=sel)
    keys, order = torch.sort(keys, stable=True)
    codes = codes.index_select(0, order)
    ptr = torch.searchsorted(keys, plan.dev["ptr_keys"])
    cum_fwd = torch.empty((nbk, nc), dtype=torch.int32, device=dev)
    cum_bwd = torch.empty(nbk, dtype=torch.int32, device=dev)
    _items_kernel[(nc + 1,)](ptr, cum_fwd, cum_bwd, nbk, nc, plan.cfg["fwd_past"].block_m, plan.bwd_entries,
                             BLK=1024, num_warps=4)
    return MobaIndex(codes=codes, ptr=ptr, cum_fwd=cum_fwd, cum_bwd=cum_bwd, bits=bits, sel=sel)
