"""Routing coverage C(k) per sequence and per micro-batch, as the policies see it.

Definition (own block out, routed-query mean): ``docs/coverage.md``; code shared with the kernel's
measurement: :mod:`sparsebalance.data.coverage`. Where a curve comes from, in order of preference:

1. a curve measured by realrun from real gate scores and handed to :meth:`CoverageModel.observe`;
2. the curve a :class:`~sparsebalance.data.sequence.Sequence` carries (``seq.coverage``);
3. the parametric model: a query in block ``i >= 1`` ranks its ``i`` past blocks, and the gate
   probability of rank ``r`` is ``w_r / W(i)`` with ``w_r = r ** -a`` (``coverage_shape = "power"``)
   or ``exp(-a (r - 1))`` (``"geometric"``), ``W(m) = sum_{r <= m} w_r``, ``a = coverage_rate *
   sensitivity``. Budget ``k`` keeps the ``k - 1`` top ranks: share ``W(min(k - 1, i)) / W(i)``.
   Those per-block shares go through the same :func:`~sparsebalance.data.coverage.aggregate` as
   measured ones, evaluated in closed form for all sequences at once (:mod:`.parametric`); curves
   are cached per ``(length, rate)``. :func:`fit_rate` fits ``a`` to measured curves (least
   squares over every k).

When a sequence has no ``sensitivity``, one is drawn from log-normal(0, 0.5) (the data loader's
distribution) with a generator seeded by ``(seed, seq.id)``, so the draw does not depend on the
order sequences are seen in.

**Micro-batch coverage** of packed sequences at budget ``k`` (``coverage_agg``): ``"tokens"`` = the
routed-query-weighted mean of the sequences' C(k) (the share of all the micro-batch's routed gate
mass that is kept), ``"min"`` = the worst sequence's C(k). A per-layer budget's coverage is the
mean over layers. dst-cp reads all micro-batches at once (:meth:`CoverageModel.microbatch_matrix`,
bitwise each micro-batch's :meth:`~CoverageModel.microbatch_curve`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

import numpy as np

from sparsebalance.data import coverage as cov
from sparsebalance.data.sequence import Sequence
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.parametric import (  # noqa: F401 (re-exported: the model's public names)
    fit_rate,
    parametric_curve,
    parametric_curves,
    parametric_flat,
    parametric_shares,
)
from sparsebalance.simulator.config import ModelConfig
from sparsebalance.simulator.plan import Budget, MicroBatch

SENSITIVITY_SIGMA = 0.5
"""Standard deviation of ln(sensitivity) for sequences that carry none (matches data/)."""


class CoverageModel:
    """C(k) per sequence (measured or parametric) and per micro-batch. See the module docstring."""

    def __init__(self, model: ModelConfig, policy: PolicyConfig, seed: int = 0) -> None:
        self.block_size = model.block_size
        self.layers = model.layers
        self.rate = policy.coverage_rate
        self.shape = policy.coverage_shape
        self.agg = policy.coverage_agg
        self.seed = seed
        self._measured: dict[int, np.ndarray] = {}
        self._cache: dict[tuple[int, float], np.ndarray] = {}

    def sensitivity(self, seq: Sequence) -> float:
        """The sequence's sensitivity, or a deterministic draw from ``(seed, seq.id)``."""
        if seq.sensitivity is not None:
            return float(seq.sensitivity)
        rng = np.random.default_rng([self.seed, seq.id, 0xC0])
        return float(math.exp(rng.normal(0.0, SENSITIVITY_SIGMA)))

    def curve(self, seq: Sequence) -> np.ndarray:
        """C(k) for k = 1..n_blocks (read-only float64 array, C(n_blocks) = 1, non-decreasing)."""
        if seq.id in self._measured:
            return self._measured[seq.id]
        if seq.coverage is not None:
            return _as_curve(seq.coverage)
        key = (seq.length, self.rate * self.sensitivity(seq))
        c = self._cache.get(key)
        if c is None:
            c = parametric_curve(seq.length, self.block_size, key[1], self.shape)
            c.setflags(write=False)
            self._cache[key] = c
        return c

    def coverage(self, seq: Sequence, k: int) -> float:
        """C(k); budgets beyond the sequence's block count keep everything (1.0)."""
        c = self.curve(seq)
        return float(c[min(max(int(k), 1), len(c)) - 1])

    def microbatch_curve(self, mb: MicroBatch, k_hi: int) -> np.ndarray:
        """Micro-batch coverage at k = 1..k_hi (shape [k_hi]) under ``coverage_agg``."""
        return self.microbatch_matrix([mb], k_hi)[0]

    def microbatch_coverage(self, mb: MicroBatch, budget: Budget | int) -> float:
        """Coverage of ``mb`` at ``budget``, averaged over layers for a per-layer budget."""
        ks = Budget.of(budget).ks
        k_hi = max(ks)
        c = self.microbatch_curve(mb, k_hi)
        return float(np.mean([c[k - 1] for k in ks]))

    def observe(self, seq_id: int, curve: Seq[float]) -> None:
        """Record a measured curve (realrun, real gate scores); it replaces the model's from now on."""
        self._measured[seq_id] = _as_curve(curve)

    def curves(self, seqs: Seq[Sequence]) -> list[np.ndarray]:
        """:meth:`curve` of many sequences (same values, same cache): the parametric curves not
        cached yet are computed together (:func:`parametric_curves`), once per distinct (length, rate)."""
        out: list = [None] * len(seqs)
        todo: dict[tuple[int, float], int] = {}  # key -> its first sequence (no list per key)
        again: list[int] = []  # later sequences of a key already in todo
        measured, cache, rate = self._measured, self._cache, self.rate
        for i, s in enumerate(seqs):
            if s.coverage is not None or s.id in measured:
                out[i] = self.curve(s)
                continue
            sens = s.sensitivity
            key = (s.length, rate * (float(sens) if sens is not None else self.sensitivity(s)))
            c = cache.get(key)
            if c is not None:
                out[i] = c
            elif key in todo:
                again.append(i)
            else:
                todo[key] = i
        if todo:
            keys = list(todo)
            flat, start = parametric_flat([k[0] for k in keys], self.block_size, [k[1] for k in keys],
                                          self.shape)
            flat.setflags(write=False)  # views taken after this are read-only: no flag set per curve
            bounds = start.tolist()
            for key, a, b in zip(keys, bounds[:-1], bounds[1:]):
                out[todo[key]] = cache[key] = flat[a:b]
            for i in again:  # its key's curve is cached now
                s = seqs[i]
                sens = s.sensitivity
                out[i] = cache[(s.length, rate * (float(sens) if sens is not None else self.sensitivity(s)))]
        return out

    def microbatch_curves(self, mbs: Seq[MicroBatch], k_his: Seq[int]) -> list[np.ndarray]:
        """:meth:`microbatch_curve` of many micro-batches (``mbs[i]`` at k = 1..k_his[i]), bitwise:
        rows of one :meth:`microbatch_matrix` (its columns do not depend on its width)."""
        k_his = [int(k) for k in k_his]
        mat = self.microbatch_matrix(mbs, max(k_his, default=0))
        return [mat[i, :k].copy() for i, k in enumerate(k_his)]

    def microbatch_matrix(self, mbs: Seq[MicroBatch], width: int) -> np.ndarray:
        """[len(mbs), width]: row i = micro-batch i's coverage at k = 1..width under
        ``coverage_agg`` (:func:`~sparsebalance.data.coverage.microbatch_rows` over slots: the
        sequences' curves padded with 1 past their blocks). :meth:`microbatch_curve` is this with
        one micro-batch; values do not depend on the other micro-batches or on ``width``."""
        sizes = np.array([len(mb.sequences) for mb in mbs], dtype=np.int64)
        seqs = [s for mb in mbs for s in mb.sequences]
        if not seqs or width <= 0:
            return np.ones((len(mbs), max(width, 0)))
        curves = self.curves(seqs)
        keep = np.minimum(np.fromiter(map(len, curves), dtype=np.int64, count=len(curves)), width)
        starts = np.cumsum([0] + [len(c) for c in curves[:-1]])
        row = np.repeat(np.arange(len(seqs)), keep)
        col = np.arange(int(keep.sum())) - np.repeat(np.cumsum(keep) - keep, keep)
        padded = np.ones((len(seqs), width))  # curves padded with 1 past their blocks
        padded[row, col] = np.concatenate(curves)[np.repeat(starts, keep) + col]
        group = np.repeat(np.arange(len(mbs)), sizes)  # micro-batch and slot of every sequence
        if self.agg == "min":
            out = np.ones((len(mbs), width))
            np.minimum.at(out, group, padded)
            return out
        slot = np.arange(len(seqs)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        routed = np.maximum(np.array([s.length for s in seqs]) - self.block_size, 0)
        return cov.microbatch_rows(padded, routed, group, slot, len(mbs))


def _as_curve(values: Seq[float]) -> np.ndarray:
    c = np.asarray(values, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ValueError(f"coverage curve: expected a non-empty 1-D sequence, got shape {c.shape}")
    c = np.clip(np.maximum.accumulate(c), 0.0, 1.0)
    c.setflags(write=False)
    return c


def make_coverage_model(model: ModelConfig, policy: PolicyConfig, seed: int = 0) -> CoverageModel:
    """The coverage model a run uses (one per run; it caches curves)."""
    return CoverageModel(model, policy, seed)
