"""Routing coverage C(k): the share of gate-score mass a query keeps with MoBA top-k blocks.

Where a curve comes from, in order of preference:

1. a curve measured by realrun from real gate scores and handed to :meth:`CoverageModel.observe`;
2. the curve a :class:`~sparsebalance.data.sequence.Sequence` carries (``seq.coverage``);
3. the parametric model below.

**Parametric model.** A sequence of ``L`` tokens has ``n = ceil(L / B)`` key blocks (``B`` = the
model's MoBA block size). A query in block ``i`` (0-based) may attend ``i + 1`` blocks (causal; its
own block included). Its gate-score mass over those blocks, ranked, decays with rank ``r = 1..i+1``
as ``w_r = r ** -a`` (``coverage_shape = "power"``) or ``w_r = exp(-a (r - 1))`` (``"geometric"``),
where ``a = coverage_rate * sensitivity``. The own block is taken to be rank 1 (MoBA always selects
it). Top-k keeps ``W(min(k, i + 1)) / W(i + 1)`` with ``W(m) = sum_{r <= m} w_r``: queries with at
most ``k`` past blocks keep everything. C(k) is the mean over all ``L`` query tokens (each block
holds ``B`` queries, the last one ``L - (n - 1) B``), as MoBA gates every query. Hence
C(n) = 1 and C is non-decreasing in k. With ``S(k) = sum_{i >= k} q_i / W(i + 1)`` (a suffix sum)
the curve is ``C(k) = (sum_{i < k} q_i + W(k) S(k)) / L``, O(n) per sequence; curves are cached per
``(length, rate)``.

When a sequence has no ``sensitivity``, one is drawn from log-normal(0, 0.5) (the data loader's
distribution) with a generator seeded by ``(seed, seq.id)``, so the draw does not depend on the
order sequences are seen in.

**Micro-batch coverage** of packed sequences at budget ``k`` (``coverage_agg``): ``"tokens"`` = the
token-weighted mean of the sequences' C(k) (the share of all the micro-batch's gate mass that is
kept), ``"min"`` = the worst sequence's C(k). A per-layer budget's coverage is the mean over layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

import numpy as np

from sparsebalance.data.sequence import Sequence
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.simulator.config import ModelConfig
from sparsebalance.simulator.plan import Budget, MicroBatch

SENSITIVITY_SIGMA = 0.5
"""Standard deviation of ln(sensitivity) for sequences that carry none (matches data/)."""


def parametric_curve(length: int, block_size: int, rate: float, shape: str = "power") -> np.ndarray:
    """C(k) for k = 1..n_blocks of the parametric model (float64, shape [n_blocks])."""
    n = -(-length // block_size)
    r = np.arange(1, n + 1, dtype=np.float64)
    w = r ** -rate if shape == "power" else np.exp(-rate * (r - 1.0))
    W = np.cumsum(w)                                   # W[m-1] = W(m)
    q = np.full(n, float(block_size))
    q[-1] = length - (n - 1) * block_size             # queries per block
    ratio = q / W                                      # q_i / W(i + 1), i = 0..n-1
    S = np.cumsum(ratio[::-1])[::-1]                   # S[k] = sum_{i >= k} q_i / W(i+1)
    Q = np.concatenate(([0.0], np.cumsum(q)))          # Q[k] = sum_{i < k} q_i
    k = np.arange(1, n + 1)
    tail = np.where(k < n, S[np.minimum(k, n - 1)], 0.0)
    curve = (Q[k] + W[k - 1] * tail) / length
    curve = np.minimum(np.maximum.accumulate(curve), 1.0)  # guard against rounding only
    curve[-1] = 1.0
    return curve


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
        out = np.zeros(k_hi) if self.agg == "tokens" else np.ones(k_hi)
        for s in mb.sequences:
            c = self.curve(s)
            padded = np.ones(k_hi)
            m = min(k_hi, len(c))
            padded[:m] = c[:m]
            if self.agg == "tokens":
                out += s.length * padded
            else:
                np.minimum(out, padded, out=out)
        return out / mb.tokens if self.agg == "tokens" else out

    def microbatch_coverage(self, mb: MicroBatch, budget: Budget) -> float:
        ks = budget if isinstance(budget, tuple) else (budget,)
        k_hi = max(ks)
        c = self.microbatch_curve(mb, k_hi)
        return float(np.mean([c[k - 1] for k in ks]))

    def observe(self, seq_id: int, curve: Seq[float]) -> None:
        """Record a measured curve (realrun, real gate scores); it replaces the model's from now on."""
        self._measured[seq_id] = _as_curve(curve)


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
