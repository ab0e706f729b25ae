"""Confidence intervals over seeds (analysis/stats.py) and where ablation/sweep report them."""

import math

import numpy as np
import pandas as pd
import pytest

from sparsebalance.analysis.stats import fmt_ci, mean_ci, over_seeds, summarize

T975 = {1: 12.706204736, 2: 4.302652730, 4: 2.776445105}  # Student t quantiles (tables)


@pytest.mark.parametrize("x", [[1.0, 2.0], [1.2, 1.25, 1.31], [3.0, 3.5, 2.5, 4.0, 3.3]])
def test_mean_ci_is_the_t_interval(x):
    m, lo, hi = mean_ci(x)
    n = len(x)
    half = T975[n - 1] * np.std(x, ddof=1) / math.sqrt(n)
    assert m == pytest.approx(np.mean(x))
    assert (lo, hi) == pytest.approx((m - half, m + half))


def test_one_value_has_no_interval():
    m, lo, hi = mean_ci([1.5])
    assert m == 1.5 and math.isnan(lo) and math.isnan(hi)
    assert fmt_ci(m, lo, hi) == "1.50"
    assert fmt_ci(1.0, 0.9, 1.1) == "1.00 [0.90, 1.10]"


def test_summarize_keeps_group_order_and_spread():
    df = pd.DataFrame({"config": ["b", "b", "a", "a"], "speedup": [1.0, 1.2, 2.0, 2.4]})
    s = summarize(df, "config", ["speedup"])
    assert list(s.config) == ["b", "a"]
    row = s.iloc[1]
    assert row.speedup == pytest.approx(2.2) and row.speedup_min == 2.0 and row.speedup_max == 2.4
    assert row.n_seeds == 2


def test_over_seeds_groups_grid_points_including_nan_coordinates():
    summary = pd.DataFrame({
        "run_id": list("abcdef"), "tuning": ["fixed", "fixed", "dst", "dst", "dst", "dst"],
        "p": [np.nan, np.nan, 0.1, 0.1, 0.2, 0.2], "seed": [0, 1, 0, 1, 0, 1],
        "speedup": [1.0, 1.0, 1.2, 1.3, 1.4, 1.6], "imbalance": [1.8, 1.9, 1.7, 1.6, 1.5, 1.6],
        "iteration_time_s": [3.0, 3.1, 2.5, 2.4, 2.2, 2.0]})
    ci = over_seeds(summary, {"speedup", "imbalance", "iteration_time_s"})
    assert len(ci) == 3 and (ci.n_seeds == 2).all()
    assert ci.p.isna().sum() == 1
    dst2 = ci[ci.p == 0.2].iloc[0]
    assert dst2.speedup == pytest.approx(1.5)
    assert dst2.speedup_ci_hi - dst2.speedup == pytest.approx(T975[1] * np.std([1.4, 1.6], ddof=1) / math.sqrt(2))
    assert over_seeds(summary.drop(columns="seed"), {"speedup"}) is None


def test_sweep_writes_the_interval_per_grid_point(tmp_path, capsys):
    from sparsebalance import cli

    base = tmp_path / "base.toml"
    base.write_text('name = "t"\niterations = 2\n[model]\npreset = "qwen2.5-3b"\n[cluster]\ndp = 2\n'
                    'pp = 2\nglobal_batch = 8\n[data]\nnum_sequences = 64\n[policy]\ntoken_cap = 65536\n')
    out = tmp_path / "out"
    assert cli.main(["sweep", "--config", str(base), "--batching", "sab", "--tuning", "dst",
                     "--seeds", "0,1", "--out", str(out), "--no-progress"]) == 0
    ci = pd.read_csv(out / "summary_ci.csv")
    assert set(ci.batching) == {"sab", "sequential"} and (ci.n_seeds == 2).all()
    assert (ci.speedup_ci_lo <= ci.speedup).all() and (ci.speedup <= ci.speedup_ci_hi).all()
    assert "95 % CI" in capsys.readouterr().out
