"""The accuracy experiment's summary: differences to ``fixed`` paired by seed and bucket, and the
Markdown table docs/results.md is written from (oracles: hand-computed means and t intervals)."""

import math

import numpy as np
import pandas as pd
import pytest

from sparsebalance.analysis import accuracy as A

T_975_2 = 4.302652729911275  # Student t, 0.975 quantile, 2 degrees of freedom (tables)


def _rows(fixed, other):
    """Rows of configs ``fixed`` and ``MEAN0.1`` over seeds 0..2, buckets 64 and 256."""
    out = []
    for seed in range(3):
        for b in (64, 256):
            for cfg, acc in (("fixed", fixed), ("MEAN0.1", other)):
                out.append({"config": cfg, "anchor": None if cfg == "fixed" else "mean",
                            "p": None if cfg == "fixed" else 0.1, "seed": seed, "bucket": b,
                            "accuracy": acc[seed][b], "mean_budget": 8.0, "coverage": 0.95,
                            "cpu_time_s": 10.0, "sim_speedup": 1.0})
    return pd.DataFrame(out)


def test_difference_to_fixed_is_paired_by_seed_and_bucket():
    # fixed varies a lot across seeds; the other config is fixed + (0.1, 0.2, 0.3) at bucket 64 and
    # fixed - 0.05 at bucket 256: the paired interval sees only the differences' spread
    fixed = [{64: 0.2, 256: 0.9}, {64: 0.6, 256: 0.5}, {64: 0.4, 256: 0.7}]
    other = [{64: f[64] + d, 256: f[256] - 0.05} for f, d in zip(fixed, (0.1, 0.2, 0.3), strict=True)]
    s = A.summarize_rows(_rows(fixed, other)).set_index(["config", "bucket"])
    r = s.loc[("MEAN0.1", 64)]
    half = T_975_2 * 0.1 / math.sqrt(3)
    assert r["accuracy_vs_fixed"] == pytest.approx(0.2)
    assert (r["accuracy_vs_fixed_ci_lo"], r["accuracy_vs_fixed_ci_hi"]) == pytest.approx((0.2 - half, 0.2 + half))
    r = s.loc[("MEAN0.1", 256)]
    assert r["accuracy_vs_fixed"] == pytest.approx(-0.05)
    assert r["accuracy_vs_fixed_ci_hi"] - r["accuracy_vs_fixed_ci_lo"] == pytest.approx(0.0, abs=1e-12)
    assert s.loc[("fixed", 64), "accuracy_vs_fixed"] == 0.0
    # the unpaired accuracy interval of the same config is far wider (fixed's spread over seeds)
    assert s.loc[("MEAN0.1", 64), "accuracy_ci_hi"] - s.loc[("MEAN0.1", 64), "accuracy_ci_lo"] > 4 * half


def test_without_fixed_the_difference_is_nan():
    rows = _rows([{64: 0.5, 256: 0.5}] * 3, [{64: 0.6, 256: 0.6}] * 3)
    s = A.summarize_rows(rows[rows.config != "fixed"])
    assert np.isnan(s["accuracy_vs_fixed"]).all()


def test_markdown_table_has_one_line_per_config_with_intervals():
    fixed = [{64: 0.2, 256: 0.9}, {64: 0.6, 256: 0.5}, {64: 0.4, 256: 0.7}]
    other = [{64: f[64] + 0.1, 256: f[256]} for f in fixed]
    md = A.markdown_table(A.summarize_rows(_rows(fixed, other))).splitlines()
    assert len(md) == 4 and md[0].count("|") == md[2].count("|") == md[3].count("|")
    assert md[2].startswith("| fixed | 0.400 [") and "| – | – |" in md[2]
    assert md[3].startswith("| MEAN0.1 | 0.500 [") and "| 0.100 [0.100, 0.100] |" in md[3]
