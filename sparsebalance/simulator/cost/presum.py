"""The whole model's forward + backward of a micro-batch, fast: ``StageCost``'s sum over pre-summed tables.

What the policies balance (SAB, LBB and DST ask it thousands of times per decision) is

    model.layers x (sum over the micro-batch's sequences of attention F + B + the calls' F + B)
    + the per-token terms' F + B over the whole model (``StageCost.whole_terms``)

A stage-by-stage sum would cost V interpolations per term; instead two private tables are summed
once from ``StageCost``'s own terms when the model is built: attention F + B on the attention grid,
and the per-token terms (:data:`.stagecost.TERMS`, each counted as often as the model holds it) on
the union of their token grids. Interpolation is linear, so interpolating a sum equals summing the
interpolations (up to rounding); queries outside either table's range take the term-by-term path
(which warns, errors or clamps as configured). What the profile's tables do not hold (the dense
term's TP all-reduces) is added after them (``StageCost.whole_untabled``). Nothing here names a term:
the tables and the untabled share are ``StageCost``'s, and ``tests/simulator/cost/test_stagecost.py``
holds these totals to the stage-by-stage sum, so a term priced into a stage but not into the
totals fails there.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any, Protocol

import numpy as np

from sparsebalance.data.sequence import blocks
from sparsebalance.errors import ConfigError
from sparsebalance.simulator.budget import Budget
from sparsebalance.simulator.cost.modes import plain, uniform_budgets
from sparsebalance.simulator.cost.tables import Curve, OpTables, Surface
from sparsebalance.simulator.plan import split_pad


class Sums(Protocol):
    """What the totals read of their ``StageCost`` (which builds them: no import back)."""

    lm: Any
    tables: OpTables
    terms: tuple[tuple[str, str], ...]
    model_layers: int
    per_sequence: Any
    joint: Any

    def whole_terms(self, tokens: int) -> float: ...

    def whole_untabled(self, tokens) -> Any: ...

    def budget_counts(self, budget, layers: range | None = None) -> tuple[tuple[int, int], ...]: ...


class Presummed:
    """The whole-model totals of one :class:`StageCost` (module docstring)."""

    def __init__(self, cost: Sums) -> None:
        self.cost = cost
        self._attn_fb: dict[tuple[int, int], float] = {}
        self._dense_fb: dict[int, float] = {}
        self._mb: dict[tuple, float] = {}
        self.attn, self.dense = self._tables()

    def _tables(self) -> tuple[Surface | None, Curve | None]:
        """Attention F + B on the shared grid (None where the passes' grids differ), and the
        per-token terms' F + B over the whole model on the union of their token grids (None
        without two points in common)."""
        t = self.cost.tables
        f, b = t.surfaces["attn_fwd"], t.surfaces["attn_bwd"]
        fast_attn = None
        if f.xs == b.xs and f.ks == b.ks:
            fast_attn = Surface(f.xs, f.ks, [[u + v for u, v in zip(ru, rv)] for ru, rv in zip(f.zs, b.zs)])
        weights: dict[str, int] = {}
        for name, where in self.cost.terms:
            count = self.cost.model_layers if where == "layers" else 1
            weights |= {f"{name}_fwd": count, f"{name}_bwd": count}
        curves = [(w, t.curves[op]) for op, w in weights.items() if op in t.curves]
        lo = max(c.xs[0] for _, c in curves)
        hi = min(c.xs[-1] for _, c in curves)
        xs = sorted({x for _, c in curves for x in c.xs if lo <= x <= hi})
        fast_dense = Curve(xs, [sum(w * c(x) for w, c in curves) for x in xs]) if len(xs) > 1 else None
        return fast_attn, fast_dense

    # -- one sequence, one micro-batch's tokens --------------------------------------------------
    def attention_fb(self, L: int, k: int) -> float:
        """One layer's attention forward + backward of one sequence."""
        hit = self._attn_fb.get((L, k))
        if hit is None:
            fast = self.attn
            t = self.cost.tables
            ke = min(k, blocks(L, t.block_size))
            if fast is not None and fast.xs[0] <= L <= fast.xs[-1] and fast.ks[0] <= ke <= fast.ks[-1] \
                    and L > t.whole_max:
                hit = fast(L, ke)
            else:
                lm = self.cost.lm
                hit = lm.attention(L, k) + lm.attention(L, k, backward=True)
            self._attn_fb[(L, k)] = hit
        return hit

    def dense_fb(self, tokens: int) -> float:
        """The per-token terms' forward + backward over the whole model."""
        hit = self._dense_fb.get(tokens)
        if hit is None:
            fast = self.dense
            if fast is not None and fast.xs[0] <= tokens <= fast.xs[-1]:
                hit = fast(tokens)
                rest = self.cost.whole_untabled(tokens)  # the table holds the profile's ops alone
                if rest is not None:
                    hit += rest
            else:
                hit = self.cost.whole_terms(tokens)
            self._dense_fb[tokens] = hit
        return hit

    def microbatch_latency(self, lengths, budget) -> float:
        cost = self.cost
        budget = plain(budget)
        key = (tuple(lengths), budget)
        hit = self._mb.get(key)
        if hit is not None:
            return hit
        if cost.per_sequence is not None:  # every stage's slowest CP rank, forward + backward
            got = cost.per_sequence.times([key[0]], uniform_budgets([budget]))
            hit = self._mb[key] = float(got["F"].sum() + got["B"].sum())
            return hit
        lengths, tokens = split_pad(key[0])  # a slot's padding: tokens, no attention
        call = cost.tables.call[False] + cost.tables.call[True] if lengths else 0.0
        if type(budget) is int:
            if budget < 1:
                raise ConfigError(f"budget: must be >= 1 (MoBA top-k), got {budget}")
            total = cost.model_layers * (sum(self.attention_fb(L, budget) for L in lengths)
                                         + self._joint_fb(lengths, budget) + call)
        else:
            total = 0.0
            for k, n in cost.budget_counts(budget):
                total += n * (sum(self.attention_fb(L, k) for L in lengths) + self._joint_fb(lengths, k) + call)
        total += self.dense_fb(tokens)
        if len(self._mb) > 1_000_000:  # bound memory in very long runs
            self._mb.clear()
        self._mb[key] = total
        return total

    # -- many micro-batches at once ----------------------------------------------------------------
    def microbatch_latencies(self, microbatches, budgets) -> np.ndarray:
        cost = self.cost
        if cost.per_sequence is not None:  # a placement per micro-batch: no shared vectorised pass
            ks = [budgets] * len(microbatches) if isinstance(budgets, Integral) else budgets
            return np.array([self.microbatch_latency(mb, k) for mb, k in zip(microbatches, ks)], dtype=float)
        counts = np.fromiter((len(mb) for mb in microbatches), dtype=np.int64, count=len(microbatches))
        if isinstance(budgets, Integral) and not isinstance(budgets, bool):
            budgets = np.full(len(counts), int(budgets), dtype=np.int64)
        elif any(isinstance(b, Budget) for b in budgets):
            budgets = [plain(b) for b in budgets]
            if any(isinstance(b, Budget) for b in budgets):
                return np.array([self.microbatch_latency(mb, b) for mb, b in zip(microbatches, budgets)])
        k_mb = np.asarray(budgets, dtype=np.int64)
        if k_mb.shape != counts.shape:
            raise ConfigError(f"budget: expected one budget per micro-batch ({len(counts)}), got {k_mb.shape}")
        if (k_mb < 1).any():
            raise ConfigError(f"budget: must be >= 1 (MoBA top-k), got {int(k_mb.min())}")
        lengths = np.fromiter((L for mb in microbatches for L in mb), dtype=np.int64, count=int(counts.sum()))
        k = np.repeat(k_mb, counts)
        doc = lengths > 0  # a negative entry is a slot's padding: tokens, no attention (plan.split_pad)
        per_seq = np.zeros(lengths.shape)
        per_seq[doc] = cost.model_layers * self._attention_fb_array(lengths[doc], k[doc])
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        nonempty = counts > 0
        attn = np.zeros(len(counts))
        attn[nonempty] = np.add.reduceat(per_seq, starts[nonempty]) if per_seq.size else 0.0
        tokens = np.zeros(len(counts), dtype=np.int64)
        tokens[nonempty] = np.add.reduceat(np.abs(lengths), starts[nonempty]) if lengths.size else 0
        if not doc.all():  # the fixed call costs come with documents only
            nonempty = np.zeros(len(counts), dtype=bool)
            nonempty[np.unique(np.repeat(np.arange(len(counts)), counts)[doc])] = True
        call = cost.tables.call[False] + cost.tables.call[True]
        if call:
            attn = attn + np.where(nonempty, cost.model_layers * call, 0.0)
        if cost.joint is not None:  # one CP ring per packed micro-batch (StageCost.joint)
            for i in np.flatnonzero(counts > 1).tolist():
                mb = lengths[starts[i]:starts[i] + counts[i]]
                attn[i] += cost.model_layers * self._joint_fb(mb[mb > 0].tolist(), int(k_mb[i]))
        return attn + self._dense_fb_array(tokens)

    def _joint_fb(self, lengths, k: int) -> float:
        """One layer's :attr:`StageCost.joint`, forward + backward (0.0 without it)."""
        cost = self.cost
        if cost.joint is None or len(lengths) < 2:
            return 0.0
        return cost.joint(lengths, k, backward=False) + cost.joint(lengths, k, backward=True)

    def _attention_fb_array(self, L: np.ndarray, k: np.ndarray) -> np.ndarray:
        fast, t = self.attn, self.cost.tables
        out = np.empty(L.shape)
        ke = np.minimum(k, blocks(L, t.block_size))
        if fast is None:
            inside = np.zeros(L.shape, dtype=bool)
        else:
            xs, ks, zs = np.asarray(fast.xs), np.asarray(fast.ks), np.asarray(fast.zs)
            inside = (L >= xs[0]) & (L <= xs[-1]) & (ke >= ks[0]) & (ke <= ks[-1]) & (L > t.whole_max)
            x, kk = L[inside].astype(float), ke[inside].astype(float)
            i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
            j = np.clip(np.searchsorted(ks, kk, side="right") - 1, 0, len(ks) - 2)
            tt = (x - xs[i]) / (xs[i + 1] - xs[i])
            u = (kk - ks[j]) / (ks[j + 1] - ks[j])
            a = zs[i, j] + u * (zs[i, j + 1] - zs[i, j])
            b = zs[i + 1, j] + u * (zs[i + 1, j + 1] - zs[i + 1, j])
            out[inside] = np.maximum(0.0, a + tt * (b - a))
        for idx in np.flatnonzero(~inside):
            out[idx] = self.attention_fb(int(L[idx]), int(k[idx]))
        return out

    def _dense_fb_array(self, tokens: np.ndarray) -> np.ndarray:
        fast = self.dense
        out = np.empty(tokens.shape)
        if fast is None:
            inside = np.zeros(tokens.shape, dtype=bool)
        else:
            xs, ys = np.asarray(fast.xs), np.asarray(fast.ys)
            inside = (tokens >= xs[0]) & (tokens <= xs[-1])
            out[inside] = np.interp(tokens[inside].astype(float), xs, ys)
            rest = self.cost.whole_untabled(tokens[inside].astype(float))
            if rest is not None:
                out[inside] += rest
        for idx in np.flatnonzero(~inside):
            out[idx] = self.dense_fb(int(tokens[idx]))
        return out
