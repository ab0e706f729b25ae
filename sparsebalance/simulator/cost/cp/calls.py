"""A ring step is a kernel call: the seconds of each rank's attention at each step of a CP ring.

Rank r at step s runs one attention call on its ``q_len`` queries against the ``k_len`` keys it holds
at that step, with the step's mask (causal diagonal, full, shifted causal, MoBA's selected blocks:
the pairs :mod:`.shards` counts for the step). docs/design/per-call-costs.md section 1 and
docs/costmodel.md ("A ring step is a kernel call") state the model:

    forward step  = call(pairs) + merge(q_len)            (merge: every step after the first)
    backward step = call(pairs) + accumulate(q_len, k_len)
    call(pairs)   = fixed + pairs x rate(pairs)            (0 for a step with no pairs: no call)

**The call** (:class:`CallPrice`). ``rate(P)`` is the seconds per attended pair of the profile's
one-GPU call that attends P pairs at the same budget -- read off the one-GPU attention rows at the
profile's lengths, interpolated in log pairs and held at the ends -- so a step pays the per-pair cost
of a call of its own size, not of the whole sequence's call (what the old ``seconds x pairs / total``
charged: a 64K sequence's rate for eight 8K steps, fixed and per-length parts paid once, a dense
zigzag ring above its ideal). ``fixed`` is the profile's per-call fixed part (``OpTables.call``: the
analytical kernel's launches, which its rows leave out), now paid at every step; a measured table's
rows time each length as a call of its own, fixed costs included, so its ``fixed`` is 0 and its rate
at a small call carries them. A step is at least ``floor`` (the profile's cheapest attention point).

Left out (stated in docs/costmodel.md): a full tile and a causal tile cost the same per pair (the
causal / non-causal efficiency curves of FA3's Fig. 5 are not applied), and a step is priced as the
one-GPU call of equal pairs rather than from its own tile count.

**Merge** (forward): the step's bf16 partial output and its LSE folded into the fp32 accumulator,
``MERGE_BYTES[cp_merge]`` bytes per q_len x H_q x D element (unfused: cast 2 + 4, ``out - block_out``
12, times sigmoid of the LSE difference 8, subtracted from ``out`` 12 = 38, the eager ops of
ring-flash-attention's ``_update_out_and_lse`` and of our ``kernels/moba/cp_ring.py``; fused: read
4 + 2, write 4 = 10), at the memory bandwidth, + its launches. **Accumulation** (backward, every
step): dQ += the step's dQ in fp32 (read 4 + 2, write 4: 10 bytes per q element of H_q x D) and dK, dV
likewise (20 bytes per k element of H_kv x D), 3 kernels. An all-gather group runs one call per rank:
no merge, no accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MERGE_BYTES = {"unfused": 38, "fused": 10}
"""Bytes per q_len x H_q x D element of one step's merge (module docstring)."""
MERGE_KERNELS = {"unfused": 4, "fused": 1}
"""Kernels of one step's merge (the two LSE-sized ops left out: negligible bytes)."""
ACCUM_Q_BYTES, ACCUM_K_BYTES, ACCUM_KERNELS = 10, 20, 3
"""Backward accumulation per step: bytes per q element (dQ), per k element (dK + dV), kernels."""


def merge_bytes(q_len, heads: int, head_dim: int, merge: str):
    """Bytes one forward step's merge moves for ``q_len`` queries of ``heads`` heads of ``head_dim``."""
    return MERGE_BYTES[merge] * np.asarray(q_len, dtype=float) * heads * head_dim


def accumulate_bytes(q_len, k_len, heads: int, kv_heads: int, head_dim: int):
    """Bytes one backward step's fp32 dQ, dK and dV accumulation moves."""
    return (ACCUM_Q_BYTES * np.asarray(q_len, dtype=float) * heads * head_dim
            + ACCUM_K_BYTES * np.asarray(k_len, dtype=float) * kv_heads * head_dim)


@dataclass(frozen=True, slots=True)
class CallPrice:
    """Seconds of one attention call by the pairs it attends (module docstring)."""

    log_pairs: np.ndarray
    """Ascending log pairs of the profile's one-GPU calls at this budget."""
    rate: np.ndarray
    """Seconds per pair of those calls (their rows' variable part)."""
    fixed: float
    """Seconds every call pays on top (``OpTables.call``)."""
    floor: float
    """Least variable seconds of a call (the profile's cheapest attention point)."""

    @classmethod
    def of(cls, pairs, seconds, *, fixed: float, floor: float) -> CallPrice:
        """From one-GPU calls attending ``pairs`` in ``seconds`` (rows of one budget, any order)."""
        p, s = np.asarray(pairs, dtype=float), np.asarray(seconds, dtype=float)
        keep = p > 0
        lp, idx = np.unique(np.log(p[keep]), return_index=True)
        return cls(log_pairs=lp, rate=(s[keep] / p[keep])[idx], fixed=float(fixed), floor=float(floor))

    def __call__(self, pairs) -> np.ndarray:
        p = np.asarray(pairs, dtype=float)
        rate = np.interp(np.log(np.maximum(p, 1.0)), self.log_pairs, self.rate)
        return np.where(p > 0, np.maximum(p * rate, self.floor) + self.fixed, 0.0)


def step_work(pairs: np.ndarray, call: CallPrice, scale: float = 1.0) -> np.ndarray:
    """[W, S] variable seconds of one sequence's calls at each rank's step: the call of its
    ``pairs`` less the fixed part, times ``scale`` (the profile's measured CP work ratio where it
    has one); 0 where it attends nothing."""
    return np.where(pairs > 0, (call(pairs) - call.fixed) * scale, 0.0)


def step_times(pairs: np.ndarray, q_len: np.ndarray, k_len: np.ndarray, call: CallPrice, *, backward: bool,
               allgather: bool, merge: str, heads: int, kv_heads: int, head_dim: int, bandwidth: float,
               launch: float, scale: float = 1.0, work: np.ndarray | None = None) -> np.ndarray:
    """[W, S] seconds of each rank's step: the call of its ``pairs`` (:func:`step_work` + the fixed
    part; ``work``: the variable seconds given, a packed micro-batch's sequences' summed), + the
    merge (forward, steps s >= 1 that run a call) or the accumulation (backward, every step that
    runs a call) at ``bandwidth`` bytes/s with ``launch`` seconds per kernel. ``q_len`` [W]: each
    rank's queries; ``k_len`` [W, S]: the keys it holds at each step."""
    called = pairs > 0
    if work is None:
        work = step_work(pairs, call, scale)
    t = np.where(called, work + call.fixed, 0.0)
    if allgather:
        return t
    q = np.broadcast_to(np.asarray(q_len, dtype=float)[:, None], pairs.shape)
    if backward:
        extra = accumulate_bytes(q, k_len, heads, kv_heads, head_dim) / bandwidth + ACCUM_KERNELS * launch
        return t + np.where(called, extra, 0.0)
    extra = merge_bytes(q, heads, head_dim, merge) / bandwidth + MERGE_KERNELS[merge] * launch
    later = np.arange(pairs.shape[1])[None, :] >= 1
    return t + np.where(called & later, extra, 0.0)
