"""Stage seconds of many micro-batches at a range of budgets each: the table ``dst-cp`` moves on.

A stage's forward (backward) time is affine in its attention: ``n_layers(vs) x sum over sequences
of attention(L, k)`` + a budget-free part (dense layers, embedding on the first virtual stage, LM
head on the last). The budget-free part is the stage's time at the lowest budget minus its
attention (``StageCost.budget_free``: the one sum, as ``stage_time`` adds it, sums over a
micro-batch's sequences left to right), so every entry equals ``stage_time``'s bit for bit. The
attention of every (sequence, k) pair comes from one vectorised call per sequence position, the
dense parts from one per op.

Rows are computed for k = k_lo..k_top up front and beyond on demand (:meth:`StageTable.extend`):
``dst-cp`` lowers budgets from k0 and raises few above it, so most rows above k0 are never read.
"""

from __future__ import annotations

import numpy as np

from sparsebalance.data.sequence import blocks


def budget_monotone_range(lm) -> tuple[float, float] | None:
    """The range of sequence lengths over which ``lm``'s attention surely does not fall as the
    budget grows (its profile's attention grid non-decreasing along the budget at every length,
    hence so is the bilinear interpolation; lengths outside the grid are extrapolated, which may
    not keep it unless clamped), or None when that cannot be established."""
    lo, hi = -np.inf, np.inf
    for op in ("attn_fwd", "attn_bwd"):
        rows = lm.profile.rows(op)
        if not len(rows):
            return None
        g = rows.sort_values(["seq_len", "budget"], kind="stable")
        x, z = g["seq_len"].to_numpy(), g["latency_s"].to_numpy()
        if (np.diff(z)[x[1:] == x[:-1]] < 0).any():
            return None
        if lm.extrapolate != "clamp":
            lo, hi = max(lo, float(x.min())), min(hi, float(x.max()))
    return lo, hi


class StageTable:
    """Micro-batch ``i`` (sequence lengths ``lengths[i]``) at k = k_lo[i]..k_hi[i]; rows up to
    ``k_top[i]`` are computed at once. :meth:`rows` gives [C, 2 V] seconds (forward of vstages
    0..V-1, then backward) of micro-batches ``i`` at budgets ``k``. For a schedule that splits
    the backward, ``fused`` [N, V] says where the graph runs micro-batch i's backward of a vstage
    whole: there the backward column is B, elsewhere its input-gradient part I (the W part does
    not depend on k: :meth:`weight_times`)."""

    def __init__(self, lm, lengths: list, k_lo, k_top, k_hi, nv: int, pp: int,
                 fused: np.ndarray | None = None) -> None:
        self.lm, self.nv, self.pp = lm, nv, pp
        self.n_layers = lm.layout.layer_counts
        self.lo = np.asarray(k_lo, dtype=np.int64)
        self.hi = np.asarray(k_hi, dtype=np.int64)
        self.top = np.minimum(np.asarray(k_top, dtype=np.int64), self.hi)
        counts = np.array([len(x) for x in lengths], dtype=np.int64)
        self.counts = counts
        width = int(counts.max()) if len(counts) else 0
        self.lens = np.zeros((len(lengths), width), dtype=np.int64)
        for i, x in enumerate(lengths):
            self.lens[i, :len(x)] = x
        tokens = self.lens.sum(axis=1)
        sizes = self.top - self.lo + 1
        self.offset = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        acc = self._attention(np.arange(len(lengths)), self.lo, sizes)  # [2, rows]
        self.base = np.empty((len(lengths), 2 * nv))  # budget-free part per micro-batch
        a0 = acc[:, self.offset]  # attention at k_lo: stage_time(lens, k_lo) - its attention = the rest
        self.tokens = tokens
        modes: list[tuple[int, bool, str | None]] = [(0, False, None), (1, True, None)]
        if fused is not None:  # the backward's input part I: attention is all input gradient
            modes.append((1, True, "input"))
        for half, bw, part in modes:
            base = self._base(tokens, a0[half], bw, part)
            if part is None:
                self.base[:, half * nv:(half + 1) * nv] = base
            else:  # I where the backward is split, B (kept) where the graph runs it whole
                assert fused is not None
                self.base[:, nv:] = np.where(fused, self.base[:, nv:], base)
        # rows live in a cube [N, k, 2V] from the lowest k_lo (one gather per look-up); those of
        # micro-batch i above top[i] are computed by extend(), which then raises top[i] to k_hi[i]
        self.k_base = int(self.lo.min()) if len(self.lo) else 0
        span = int(self.hi.max()) - self.k_base + 1 if len(self.hi) else 0
        self.cube = np.zeros((len(lengths), span, 2 * nv))
        which = np.repeat(np.arange(len(lengths)), sizes)
        block = self._assemble(which, acc)
        self.cube[which, self._ks(self.lo, sizes) - self.k_base] = block
        self.monotone = np.ones(len(lengths), dtype=bool)
        """Per micro-batch: rows computed so far non-decreasing in k (the attention grows with k
        for profiles monotone in the budget; what bisection over k relies on)."""
        self._check_monotone(np.arange(len(lengths)), self.lo, self.top)

    @staticmethod
    def _ks(k_lo: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """k = k_lo[x] .. k_lo[x] + sizes[x] - 1 of every x, concatenated."""
        return np.repeat(k_lo, sizes) + (np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes))

    def _base(self, tokens: np.ndarray, a0: np.ndarray, bw: bool, part: str | None) -> np.ndarray:
        """[N, V] the budget-free seconds of each stage: the stage cost at k_lo (attention ``a0``
        per layer) minus its attention (``StageCost.budget_free``)."""
        return self.lm.cost.budget_free(a0, tokens, backward=bw, part=part).T

    def weight_times(self) -> np.ndarray:
        """[N, V] seconds of the weight-gradient part W of each stage's backward (no attention,
        so the same at every k): ``StageCost.compose`` with no attention, bitwise ``stage_time``'s."""
        return self.lm.cost.compose(np.zeros(len(self.tokens)), self.tokens, backward=True, part="weight").T

    def _attention(self, mbs: np.ndarray, k_lo: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """[2, sum sizes]: per (micro-batch, k) the sum of its sequences' attention (forward,
        backward), left to right, for k = k_lo[x] .. k_lo[x] + sizes[x] - 1."""
        total = int(sizes.sum())
        which = np.repeat(mbs, sizes)
        start = np.repeat(np.cumsum(sizes) - sizes, sizes)
        k = np.repeat(k_lo, sizes) + (np.arange(total) - start)
        return self._attention_distinct(mbs, k_lo, sizes, which, k, np.zeros((2, total)))

    def _attention_distinct(self, mbs, k_lo, sizes, which, k, out) -> np.ndarray:
        """:meth:`_attention` with each sequence's attention computed once per *distinct* budget:
        it depends on k only through min(k, the sequence's block count) (``attention_many``
        clips first), so a short sequence's values past its block count repeat. One vectorised
        call per mode over all sequences, then the same left-to-right sums."""
        lm = self.lm
        counts = self.counts[mbs]
        x_of = np.repeat(np.arange(len(mbs)), counts)  # every (micro-batch, position): position p
        p_of = np.arange(len(x_of)) - np.repeat(np.cumsum(counts) - counts, counts)
        L = self.lens[mbs[x_of], p_of]
        nb = blocks(L, lm.block_size)
        lo = np.minimum(k_lo[x_of], nb)
        hi = np.minimum(k_lo[x_of] + sizes[x_of] - 1, nb)
        n_k = hi - lo + 1
        off = np.cumsum(n_k) - n_k
        pair_L = np.repeat(L, n_k)
        pair_k = np.repeat(lo, n_k) + (np.arange(int(n_k.sum())) - np.repeat(off, n_k))
        first = np.cumsum(counts) - counts  # flat index of each micro-batch's position 0
        local = np.repeat(np.arange(len(mbs)), sizes)  # row -> index into mbs
        # rows by falling sequence count: those with a position p are a prefix, so the sums run
        # on contiguous slices; the pair read at each (row, p) is found once for both modes
        per_row = counts[local]
        by = np.argsort(-per_row, kind="stable")
        top = int(counts.max()) if len(counts) else 0
        n_at = np.searchsorted(-per_row[by], -np.arange(top), side="left")  # rows with > p sequences
        f0, k0 = first[local[by]], k[by]
        reads = []
        for p, n in enumerate(n_at.tolist()):
            f = f0[:n] + p
            reads.append(off[f] + np.minimum(k0[:n], nb[f]) - lo[f])
        for half, bw in enumerate((False, True)):
            vals = lm.attention_many(pair_L, pair_k, backward=bw)
            acc = np.zeros(len(by))
            for at in reads:  # left to right over positions, as stage_time sums them
                acc[:len(at)] = acc[:len(at)] + vals[at]
            out[half][by] = lm.cost.with_call(acc, per_row[by], backward=bw)  # the call, once per micro-batch
        return out

    def _assemble(self, which: np.ndarray, acc: np.ndarray) -> np.ndarray:
        nv = self.nv
        table = np.empty((len(which), 2 * nv))
        base = self.base[which]  # one gather of the rows, then column by column
        for half in range(2):
            for vs in range(nv):
                c = half * nv + vs
                table[:, c] = base[:, c] + acc[half] * self.n_layers[vs]
        return table

    def extend(self, mbs: np.ndarray) -> None:
        """Compute the rows above ``k_top`` of micro-batches ``mbs`` (once each)."""
        mbs = np.unique(np.asarray(mbs, dtype=np.int64))
        mbs = mbs[self.hi[mbs] > self.top[mbs]]
        if not mbs.size:
            return
        top = self.top[mbs]
        sizes = self.hi[mbs] - top
        acc = self._attention(mbs, top + 1, sizes)
        which = np.repeat(mbs, sizes)
        self.cube[which, self._ks(top + 1, sizes) - self.k_base] = self._assemble(which, acc)
        self.top[mbs] = self.hi[mbs]
        self._check_monotone(mbs, top, self.hi[mbs])  # the new rows and the step into them

    def rows(self, i, k) -> np.ndarray:
        """[C, 2V] seconds of micro-batches ``i`` at budgets ``k`` (computing missing rows)."""
        i, k = np.asarray(i), np.asarray(k)
        above = k > self.top[i]
        if above.any():
            self.extend(i[above])
        return self.cube[i, k - self.k_base]

    def row(self, i: int, k: int) -> np.ndarray:
        """[2V] :meth:`rows` of one micro-batch at one budget (a view when computed already)."""
        if k > self.top[i]:
            return self.rows([i], [k])[0]
        return self.cube[i, k - self.k_base]

    def _check_monotone(self, mbs: np.ndarray, k_from: np.ndarray, k_to: np.ndarray) -> None:
        """Clear ``monotone[i]`` of micro-batches ``mbs`` whose rows k_from..k_to (computed) are
        not non-decreasing in k."""
        if not len(mbs):
            return
        a, b = int(k_from.min()) - self.k_base, int(k_to.max()) - self.k_base
        whole = len(mbs) == len(self.cube) and mbs[0] == 0 and mbs[-1] == len(mbs) - 1  # sorted, distinct
        rows = self.cube[:, a:b + 1] if whole else self.cube[mbs, a:b + 1]  # a view when all of them
        # row k+1 below row k ([len(mbs), rows - 1, 2V]): for finite floats, what row k+1 - row k < 0 says
        falls = (rows[:, 1:] < rows[:, :-1]).any(axis=2)
        at = np.arange(a, b)[None, :] + self.k_base  # the k each step starts from
        inside = (at >= k_from[:, None]) & (at < k_to[:, None])
        bad = (falls & inside).any(axis=1)
        self.monotone[mbs[bad]] = False
