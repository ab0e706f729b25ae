"""Named sequence-length distributions that approximate the paper's two datasets (seeded).

The paper's data are only described in words (../shared/PAPER.md): ChatQA2-Long-SFT is *bimodal,
many samples under 4K and many over 16K tokens*; LongAlign-10k is *long-tailed, about 8K-72K
tokens*. The raw length histograms were not available here, so each distribution below is a
mixture of shifted log-normals whose parameters were chosen to match that description; they are
approximations, not fits. Every parameter is listed in :func:`describe` and in the docstrings.

A length is drawn as ``shift + exp(N(ln(median - shift), sigma))`` from one mixture component, then
rounded and clipped to ``[low, high]`` of the distribution (clipping puts the tail mass on the
bounds, so the closed-form CDF of the mixture holds exactly strictly inside ``(low, high)``).

Sparsity sensitivity (the paper's second source of heterogeneity) is drawn independently of length
from a log-normal with median 1.0 and sigma 0.5: a dimensionless multiplier of the rate at which
gate-score mass decays over ranked key blocks (1.0 = the coverage model's typical sequence; the
10th-90th percentile range is about 0.53-1.90). Independence is our choice; the paper gives none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sparsebalance.errors import ConfigError, check, check_choice, check_positive


@dataclass(kw_only=True, slots=True, frozen=True)
class LogNormalComponent:
    """One mixture component: ``shift + LogNormal`` whose median is ``median`` (tokens)."""

    weight: float
    """Mixture weight (the weights of a distribution sum to 1)."""
    median: float
    """Median length of the component, tokens (> shift)."""
    sigma: float
    """Standard deviation of ln(length - shift)."""
    shift: float = 0.0
    """Lengths of this component are ``shift`` plus a log-normal variable, tokens (>= 0)."""

    def __post_init__(self) -> None:
        check(0.0 < self.weight <= 1.0, "weight", f"must lie in (0, 1], got {self.weight}")
        check_positive(self.sigma, "sigma")
        check_positive(self.shift, "shift", allow_zero=True)
        check(self.median > self.shift, "median", f"must be > shift ({self.shift}), got {self.median}")

    @property
    def mu(self) -> float:
        """Mean of ln(length - shift)."""
        return math.log(self.median - self.shift)


@dataclass(kw_only=True, slots=True, frozen=True)
class LengthDistribution:
    """A clipped mixture of shifted log-normal length distributions."""

    name: str
    """Registry name (``DataConfig.distribution``)."""
    components: tuple[LogNormalComponent, ...]
    """Mixture components; weights sum to 1."""
    low: int
    """Smallest length drawn, tokens (lower tail mass is clipped onto it)."""
    high: int
    """Largest length drawn, tokens (upper tail mass is clipped onto it)."""
    approximates: str
    """What published description this stands for."""

    def __post_init__(self) -> None:
        check(bool(self.components), "components", "need at least one component")
        total = sum(c.weight for c in self.components)
        check(abs(total - 1.0) < 1e-9, "components", f"weights must sum to 1, got {total}")
        check(1 <= self.low < self.high, "low", f"need 1 <= low < high, got {self.low}, {self.high}")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` lengths (int64 tokens, shape [n]) drawn with ``rng``."""
        weights = np.array([c.weight for c in self.components])
        which = rng.choice(len(self.components), size=n, p=weights)
        z = rng.standard_normal(n)
        mu = np.array([c.mu for c in self.components])[which]
        sigma = np.array([c.sigma for c in self.components])[which]
        shift = np.array([c.shift for c in self.components])[which]
        raw = shift + np.exp(mu + sigma * z)
        return np.clip(np.rint(raw), self.low, self.high).astype(np.int64)


# Medians/spreads: the short mode covers chat-style SFT turns (~90 % of it under 4K), the long mode
# long-document QA centred at 24K (~88 % of it over 16K); 55/45 gives "many" on both sides.
CHATQA2_LIKE = LengthDistribution(
    name="chatqa2-like",
    components=(
        LogNormalComponent(weight=0.55, median=1500.0, sigma=0.8),
        LogNormalComponent(weight=0.45, median=24000.0, sigma=0.35),
    ),
    low=128,
    high=65536,
    approximates="ChatQA2-Long-SFT: bimodal, many samples under 4K and many over 16K tokens",
)

# Every sample is at least 8K (8192 + a log-normal excess), median about 14K, and a tail that
# reaches the 72K clip for under 1 % of samples.
LONGALIGN_LIKE = LengthDistribution(
    name="longalign-like",
    components=(LogNormalComponent(weight=1.0, median=14192.0, sigma=1.0, shift=8192.0),),
    low=8192,
    high=73728,
    approximates="LongAlign-10k: long-tailed, about 8K-72K tokens",
)

# Context-parallel training data: MTraining (Microsoft, arXiv 2510.18830) trains Qwen2.5-3B on
# sequences from 32K to 512K tokens. No histogram of its data is published, so the shape is ours: one
# log-normal with median 128K (the range's geometric middle) and sigma 0.7, clipped to [32K, 512K]
# (about 3 % of samples on each clip).
LONGCTX_512K = LengthDistribution(
    name="longctx-512k",
    components=(LogNormalComponent(weight=1.0, median=131072.0, sigma=0.7),),
    low=32768,
    high=524288,
    approximates="MTraining's training range, 32K-512K tokens (shape assumed: no histogram published)",
)

DISTRIBUTIONS: dict[str, LengthDistribution] = {d.name: d for d in (CHATQA2_LIKE, LONGALIGN_LIKE, LONGCTX_512K)}

SENSITIVITY_MEDIAN = 1.0
"""Median of the per-sequence sparsity sensitivity (dimensionless decay-rate multiplier)."""
SENSITIVITY_SIGMA = 0.5
"""Standard deviation of ln(sensitivity)."""


def get_distribution(name: str) -> LengthDistribution:
    """The registered distribution ``name`` (ConfigError naming the allowed names otherwise)."""
    check_choice(name, "distribution", DISTRIBUTIONS)
    return DISTRIBUTIONS[name]


def sample_sensitivity(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` sparsity sensitivities (float64, shape [n]), log-normal(median 1.0, sigma 0.5)."""
    return SENSITIVITY_MEDIAN * np.exp(SENSITIVITY_SIGMA * rng.standard_normal(n))


def sample_lengths(name: str, n: int, seed: int, *, min_length: int = 1,
                   max_length: int | None = None) -> np.ndarray:
    """``n`` lengths of distribution ``name``, truncated to ``max_length`` and all ``>= min_length``.

    Lengths under ``min_length`` are redrawn (rejection sampling), so the result always has ``n``
    entries; it is a pure function of the arguments.
    """
    dist = get_distribution(name)
    check_positive(n, "num_sequences")
    if min_length > dist.high:
        raise ConfigError(f"min_length: {min_length} exceeds the largest length of {name!r} "
                          f"({dist.high}); allowed 1..{dist.high}")
    rng = np.random.default_rng([seed, 0x5B])
    out: list[np.ndarray] = []
    got = 0
    while got < n:
        draw = dist.sample(max(n - got, 64), rng)
        if max_length is not None:
            draw = np.minimum(draw, max_length)
        draw = draw[draw >= min_length][: n - got]
        out.append(draw)
        got += len(draw)
    return np.concatenate(out)


def simulated_sequences(name: str, n: int, seed: int, *, min_length: int = 1,
                        max_length: int | None = None) -> list:
    """``n`` token-free :class:`Sequence` objects with lengths and sensitivities (ids 0..n-1)."""
    from sparsebalance.data.sequence import Sequence

    lengths = sample_lengths(name, n, seed, min_length=min_length, max_length=max_length)
    sens = sample_sensitivity(n, np.random.default_rng([seed, 0x5E]))
    return [Sequence(id=i, length=int(l), sensitivity=float(s))
            for i, (l, s) in enumerate(zip(lengths, sens))]


def fixed_sequences(length: int, n: int, seed: int) -> list:
    """``n`` sequences of ``length`` tokens each (dense pretraining data cut to the context length),
    with sensitivities drawn as :func:`simulated_sequences` draws them."""
    from sparsebalance.data.sequence import Sequence

    check_positive(n, "num_sequences")
    sens = sample_sensitivity(n, np.random.default_rng([seed, 0x5E]))
    return [Sequence(id=i, length=int(length), sensitivity=float(s)) for i, s in enumerate(sens)]


def describe():
    """One row per mixture component of every distribution, plus the sensitivity model (DataFrame).

    Columns: distribution, component, weight, median_tokens, sigma, shift_tokens, low_tokens,
    high_tokens, approximates.
    """
    import pandas as pd

    rows = []
    for d in DISTRIBUTIONS.values():
        for i, c in enumerate(d.components):
            rows.append({"distribution": d.name, "component": i, "weight": c.weight,
                         "median_tokens": c.median, "sigma": c.sigma, "shift_tokens": c.shift,
                         "low_tokens": d.low, "high_tokens": d.high, "approximates": d.approximates})
    rows.append({"distribution": "sensitivity (all)", "component": 0, "weight": 1.0,
                 "median_tokens": float("nan"), "sigma": SENSITIVITY_SIGMA, "shift_tokens": 0.0,
                 "low_tokens": float("nan"), "high_tokens": float("nan"),
                 "approximates": f"log-normal, median {SENSITIVITY_MEDIAN} (dimensionless), "
                                 "independent of length"})
    return pd.DataFrame(rows)
