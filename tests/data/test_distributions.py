"""Length distributions against the closed-form CDF of their documented mixtures (scipy oracle)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from sparsebalance.data import DataConfig, load_sequences
from sparsebalance.data.distributions import describe, sample_lengths
from sparsebalance.errors import ConfigError

N = 20_000
# 5 standard errors of a proportion near 0.5 with N samples: a wrong parameter shows, noise does not.
TOL = 5 * np.sqrt(0.25 / N)


def mixture_cdf(x: float, comps: list[tuple[float, float, float, float]]) -> float:
    """P(L <= x) of a mixture of (weight, median, sigma, shift) shifted log-normals."""
    total = 0.0
    for w, median, sigma, shift in comps:
        if x > shift:
            total += w * stats.lognorm(s=sigma, scale=median - shift).cdf(x - shift)
    return total


# The parameters as the module documents them (written out here, not read from the code).
CHATQA2 = [(0.55, 1500.0, 0.8, 0.0), (0.45, 24000.0, 0.35, 0.0)]
LONGALIGN = [(1.0, 14192.0, 1.0, 8192.0)]


def test_chatqa2_bimodal_mass_split_matches_closed_form():
    x = sample_lengths("chatqa2-like", N, seed=1)
    assert len(x) == N and x.min() >= 128 and x.max() <= 65536
    # Lengths are rounded, so "< 4096" is raw < 4095.5 and "> 16384" is raw >= 16384.5.
    under_4k = mixture_cdf(4095.5, CHATQA2)
    over_16k = 1 - mixture_cdf(16384.5, CHATQA2)
    assert under_4k > 0.4 and over_16k > 0.3  # "many under 4K, many over 16K"
    assert abs(np.mean(x < 4096) - under_4k) < TOL
    assert abs(np.mean(x > 16384) - over_16k) < TOL
    # the valley between the modes is thin: 8K-12K holds far less than either mode
    valley = mixture_cdf(12288.5, CHATQA2) - mixture_cdf(8191.5, CHATQA2)
    assert abs(np.mean((x >= 8192) & (x <= 12288)) - valley) < TOL and valley < 0.1
    # clipping puts the lower tail on the bound
    assert abs(np.mean(x == 128) - mixture_cdf(128.5, CHATQA2)) < TOL


def test_longalign_long_tail_in_8k_72k():
    x = sample_lengths("longalign-like", N, seed=2)
    assert x.min() >= 8192 and x.max() <= 73728
    for t in (12288, 16384, 32768):
        assert abs(np.mean(x > t) - (1 - mixture_cdf(t + 0.5, LONGALIGN))) < TOL
    assert np.mean(x == 73728) == pytest.approx(1 - mixture_cdf(73727.5, LONGALIGN), abs=TOL)
    assert np.percentile(x, 99) / np.median(x) > 3  # long tail


def test_seeded_and_deterministic():
    a = load_sequences(DataConfig(num_sequences=300, seed=7))
    b = load_sequences(DataConfig(num_sequences=300, seed=7))
    c = load_sequences(DataConfig(num_sequences=300, seed=8))
    assert [(s.id, s.length, s.sensitivity) for s in a] == [(s.id, s.length, s.sensitivity) for s in b]
    assert [s.length for s in a] != [s.length for s in c]
    assert [s.id for s in a] == list(range(300))
    assert all(s.tokens is None for s in a)


def test_sensitivity_is_documented_lognormal():
    seqs = load_sequences(DataConfig(num_sequences=N, distribution="longalign-like", seed=3))
    logs = np.log([s.sensitivity for s in seqs])
    se = 0.5 / np.sqrt(N)
    assert abs(np.median(logs) - np.log(1.0)) < 5 * 1.25 * se
    assert abs(logs.std() - 0.5) < 0.02
    # independent of length (our documented choice): rank correlation near 0
    rho = stats.spearmanr(logs, [s.length for s in seqs]).statistic
    assert abs(rho) < 0.04


def test_min_max_length_and_exact_count():
    seqs = load_sequences(DataConfig(num_sequences=500, min_length=2048, max_length=20000, seed=4))
    lengths = np.array([s.length for s in seqs])
    assert len(seqs) == 500 and lengths.min() >= 2048 and lengths.max() <= 20000
    # truncation keeps the long mode's mass, now on the cap
    assert abs(np.mean(lengths == 20000) - (1 - mixture_cdf(19999.5, CHATQA2)) /
               (1 - mixture_cdf(2047.5, CHATQA2))) < 0.07


def test_describe_lists_documented_parameters():
    df = describe()
    chat = df[df.distribution == "chatqa2-like"]
    assert sorted(zip(chat.weight, chat.median_tokens, chat.sigma)) == sorted(
        (w, m, s) for w, m, s, _ in CHATQA2)
    la = df[df.distribution == "longalign-like"].iloc[0]
    assert (la.low_tokens, la.high_tokens, la.shift_tokens) == (8192, 73728, 8192.0)
    for name in ("chatqa2-like", "longalign-like"):
        assert df[df.distribution == name].weight.sum() == pytest.approx(1.0)


def test_bad_distribution_inputs():
    with pytest.raises(ConfigError, match="distribution: 'nope' is not allowed.*chatqa2-like"):
        load_sequences(DataConfig(distribution="nope"))
    with pytest.raises(ConfigError, match="min_length"):
        load_sequences(DataConfig(distribution="chatqa2-like", min_length=70000))
