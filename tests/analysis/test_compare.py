"""Predicted-vs-measured helpers against numbers worked out by hand."""

from __future__ import annotations

import pandas as pd
import pytest

from sparsebalance.analysis.compare import compare, mean_abs_error, speedup_table, stage_busy
from sparsebalance.errors import ConfigError


def test_compare_joins_and_signs_delta():
    pred = pd.DataFrame({"iteration": [2, 0, 1, 3], "t": [3.3, 1.1, 1.8, 9.0]})
    meas = pd.DataFrame({"iteration": [0, 1, 2, 4], "t": [1.0, 2.0, 3.0, 5.0]})
    table = compare(pred, meas, on=["iteration"], value="t")
    assert list(table.columns) == ["iteration", "predicted", "measured", "delta_pct"]
    assert table["iteration"].tolist() == [0, 1, 2]  # only keys on both sides, sorted
    # (1.1-1)/1 = +10 %, (1.8-2)/2 = -10 %, (3.3-3)/3 = +10 %
    assert table["delta_pct"].tolist() == pytest.approx([10.0, -10.0, 10.0])
    assert mean_abs_error(table) == pytest.approx(0.10)


def test_compare_on_two_keys_and_zero_measured():
    pred = pd.DataFrame({"iteration": [0, 0, 1], "stage": [0, 1, 0], "busy_s": [2.0, 4.0, 1.0]})
    meas = pd.DataFrame({"iteration": [0, 0, 1], "stage": [1, 0, 0], "busy_s": [5.0, 2.5, 0.0]})
    table = compare(pred, meas, on=["iteration", "stage"], value="busy_s")
    # (2-2.5)/2.5 = -20 %, (4-5)/5 = -20 %, measured 0 -> undefined
    assert table["delta_pct"].iloc[:2].tolist() == pytest.approx([-20.0, -20.0])
    assert pd.isna(table["delta_pct"].iloc[2])
    assert mean_abs_error(table) == pytest.approx(0.20)


def test_compare_errors_name_the_problem():
    a = pd.DataFrame({"iteration": [0, 0], "t": [1.0, 2.0]})
    b = pd.DataFrame({"iteration": [5], "t": [1.0]})
    with pytest.raises(ConfigError, match="predicted: key columns .* not unique"):
        compare(a, b, on=["iteration"], value="t")
    with pytest.raises(ConfigError, match=r"measured: missing column\(s\) t"):
        compare(b, b.rename(columns={"t": "u"}), on=["iteration"], value="t")
    with pytest.raises(ConfigError, match="on: predicted and measured share no key"):
        compare(a.iloc[:1], b, on=["iteration"], value="t")
    with pytest.raises(ConfigError, match="on: give at least one key"):
        compare(b, b, on=[], value="t")
    with pytest.raises(ConfigError, match="no row with a defined delta_pct"):
        mean_abs_error(pd.DataFrame({"delta_pct": [float("nan")]}))


def test_speedup_table_hand_computed():
    times = pd.DataFrame({
        "policy": ["lbb+fixed"] * 2 + ["sab+dst"] * 2 + ["slow"] * 2,
        "iteration": [0, 1] * 3,
        "predicted": [4.0, 4.4, 3.0, 3.4, 5.0, 5.0],   # means 4.2, 3.2, 5.0
        "measured": [4.0, 4.8, 3.0, 3.6, 4.0, 4.0],    # means 4.4, 3.3, 4.0
    })
    s = speedup_table(times, baseline="lbb+fixed")
    assert s["policy"].tolist() == ["lbb+fixed", "sab+dst", "slow"]
    assert s["predicted_time_s"].tolist() == pytest.approx([4.2, 3.2, 5.0])
    assert s["predicted_speedup"].tolist() == pytest.approx([1.0, 4.2 / 3.2, 4.2 / 5.0])
    assert s["measured_speedup"].tolist() == pytest.approx([1.0, 4.4 / 3.3, 4.4 / 4.0])
    # 1.3125 vs 1.3333: -1.5625 %
    assert s["delta_pct"].iloc[1] == pytest.approx(-1.5625)
    # "slow": predicted slower (0.84) but measured faster (1.1): the ranking disagrees
    assert s["same_direction"].tolist()[1:] == [True, False]
    with pytest.raises(ConfigError, match="baseline: 'nope' is not among the policies"):
        speedup_table(times, baseline="nope")


def trace_rows():
    cols = ["iteration", "dp_rank", "stage", "microbatch", "op", "start_s", "end_s", "tokens", "budget"]
    rows = [
        (0, 0, 0, 0, "F", 0.0, 1.0, 10, 4), (0, 0, 1, 0, "F", 1.5, 2.5, 10, 4),
        (0, 0, 1, 0, "B", 2.5, 4.5, 10, 4), (0, 0, 0, 0, "B", 5.0, 7.0, 10, 4),
        (0, 0, 0, -1, "P2P", 1.0, 1.5, 10, 0), (0, 0, 0, -1, "OPTIM", 7.0, 7.25, 0, 0),
        (1, 0, 0, 0, "F", 10.0, 11.0, 10, 4), (1, 0, 0, 0, "B", 11.0, 13.0, 10, 4),
    ]
    return pd.DataFrame(rows, columns=cols)


def test_trace_summaries():
    t = trace_rows()
    busy = stage_busy(t)
    # iteration 0: stage 0 F 1 + B 2 = 3, stage 1 F 1 + B 2 = 3; iteration 1: stage 0 = 3
    assert busy.to_dict("list") == {"iteration": [0, 0, 1], "dp_rank": [0, 0, 0], "stage": [0, 1, 0],
                                    "busy_s": [3.0, 3.0, 3.0]}
