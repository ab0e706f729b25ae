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
   measured ones; curves are cached per ``(length, rate)``. :func:`fit_rate` fits ``a`` to
   measured curves (least squares over every k).

When a sequence has no ``sensitivity``, one is drawn from log-normal(0, 0.5) (the data loader's
distribution) with a generator seeded by ``(seed, seq.id)``, so the draw does not depend on the
order sequences are seen in.

**Micro-batch coverage** of packed sequences at budget ``k`` (``coverage_agg``): ``"tokens"`` = the
routed-query-weighted mean of the sequences' C(k) (the share of all the micro-batch's routed gate
mass that is kept), ``"min"`` = the worst sequence's C(k). A per-layer budget's coverage is the
mean over layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

import numpy as np

from sparsebalance.data import coverage as cov
from sparsebalance.data.sequence import Sequence
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.simulator.config import ModelConfig
from sparsebalance.simulator.plan import Budget, MicroBatch

SENSITIVITY_SIGMA = 0.5
"""Standard deviation of ln(sensitivity) for sequences that carry none (matches data/)."""


def parametric_shares(n: int, rate: float, shape: str = "power") -> np.ndarray:
    """Kept share ``[n - 1, n]``: row = query block ``i = 1..n-1``, column = budget ``k = 1..n``."""
    r = np.arange(1, n, dtype=np.float64)
    w = r ** -rate if shape == "power" else np.exp(-rate * (r - 1.0))
    W = np.concatenate(([0.0], np.cumsum(w)))          # W[m] = W(m), m = 0..n-1
    i = np.arange(1, n)[:, None]
    m = np.arange(n)[None, :]                          # routed blocks k - 1
    return W[np.minimum(m, i)] / W[i]


def parametric_curve(length: int, block_size: int, rate: float, shape: str = "power") -> np.ndarray:
    """C(k) for k = 1..n_blocks of the parametric model (float64, shape [n_blocks])."""
    n = cov.n_blocks(length, block_size)
    c = cov.aggregate(parametric_shares(n, rate, shape), length, block_size) if n > 1 else np.ones(1)
    c = np.maximum.accumulate(c)                       # guards against rounding only
    c[-1] = 1.0
    return c


def fit_rate(curves: Seq[tuple[int, Seq[float]]], block_size: int, shape: str = "power",
             bounds: tuple[float, float] = (1e-3, 20.0)) -> tuple[float, float]:
    """Rate ``a`` whose parametric curves best match measured ones (least squares over every
    ``(sequence, k)``, sequences weighted by routed queries); returns ``(a, max abs error)``.
    ``curves``: ``(length, C(1..n_blocks))`` pairs. Sequences of one block carry no information."""
    from scipy.optimize import minimize_scalar

    data = [(int(n), np.asarray(c, dtype=np.float64)) for n, c in curves
            if cov.n_blocks(n, block_size) > 1]
    if not data:
        raise ValueError("fit_rate: no curve of a sequence with more than one block")
    w = np.array([cov.routed_queries(n, block_size) for n, _ in data], dtype=np.float64)

    def loss(log_a: float) -> float:
        a = math.exp(log_a)
        return sum(wi * float(np.sum((parametric_curve(n, block_size, a, shape) - c) ** 2))
                   for wi, (n, c) in zip(w, data, strict=True))

    lo, hi = (math.log(b) for b in bounds)
    res = minimize_scalar(loss, bounds=(lo, hi), method="bounded", options={"xatol": 1e-4})
    a = math.exp(res.x)
    err = max(float(np.max(np.abs(parametric_curve(n, block_size, a, shape) - c))) for n, c in data)
    return a, err


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
        curves = []
        for s in mb.sequences:
            c = self.curve(s)
            padded = np.ones(k_hi)
            m = min(k_hi, len(c))
            padded[:m] = c[:m]
            curves.append(padded)
        if self.agg == "min":
            return np.min(curves, axis=0)
        return cov.microbatch(curves, [s.length for s in mb.sequences], self.block_size)

    def microbatch_coverage(self, mb: MicroBatch, budget: Budget) -> float:
        ks = budget if isinstance(budget, tuple) else (budget,)
        k_hi = max(ks)
        c = self.microbatch_curve(mb, k_hi)
        return float(np.mean([c[k - 1] for k in ks]))

    def observe(self, seq_id: int, curve: Seq[float]) -> None:
        """Record a measured curve (realrun, real gate scores); it replaces the model's from now on."""
        self._measured[seq_id] = _as_curve(curve)

    def curves(self, seqs: Seq[Sequence]) -> list[np.ndarray]:
        """:meth:`curve` of many sequences (same arrays, same cache): the parametric curves not
        cached yet are computed once per distinct (length, rate) (:func:`parametric_curves`)."""
        out: list = [None] * len(seqs)
        todo: dict[tuple[int, float], list[int]] = {}
        measured, cache, rate = self._measured, self._cache, self.rate
        for i, s in enumerate(seqs):
            if s.coverage is not None or s.id in measured:
                out[i] = self.curve(s)
                continue
            sens = s.sensitivity
            key = (s.length, rate * (float(sens) if sens is not None else self.sensitivity(s)))
            c = cache.get(key)
            if c is None:
                todo.setdefault(key, []).append(i)
            else:
                out[i] = c
        if todo:
            keys = list(todo)
            got = parametric_curves([k[0] for k in keys], self.block_size, [k[1] for k in keys], self.shape)
            for key, c in zip(keys, got):
                c.setflags(write=False)
                self._cache[key] = c
                for i in todo[key]:
                    out[i] = c
        return out

    def microbatch_curves(self, mbs: Seq[MicroBatch], k_his: Seq[int]) -> list[np.ndarray]:
        """:meth:`microbatch_curve` of many micro-batches (``mbs[i]`` at k = 1..k_his[i]), bitwise
        the same (the sequences' curves computed together first, then each micro-batch at its own
        width: a weighted sum over a wider matrix may round differently)."""
        self.curves([s for mb in mbs for s in mb.sequences])
        return [self.microbatch_curve(mb, k) for mb, k in zip(mbs, k_his, strict=True)]

    def microbatch_matrix(self, mbs: Seq[MicroBatch], width: int) -> np.ndarray:
        """[len(mbs), width]: row i = :meth:`microbatch_curve` of ``mbs[i]`` at k = 1..width (the
        same computation, so bitwise equal; the sequences' curves come through :meth:`curves`,
        computed once each and cached)."""
        if not mbs:
            return np.zeros((0, width))
        self.curves([s for mb in mbs for s in mb.sequences])
        return np.array([self.microbatch_curve(mb, width) for mb in mbs]).reshape(len(mbs), width)


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


def parametric_curves(lengths: Seq[int], block_size: int, rates: Seq[float],
                      shape: str = "power") -> list[np.ndarray]:
    """:func:`parametric_curve` of many sequences (each distinct (length, rate) computed once)."""
    done: dict[tuple[int, float], np.ndarray] = {}
    out = []
    for L, a in zip((int(x) for x in lengths), (float(x) for x in rates), strict=True):
        c = done.get((L, a))
        if c is None:
            c = done[(L, a)] = parametric_curve(L, block_size, a, shape)
        out.append(c)
    return out

