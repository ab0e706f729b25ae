"""`sparsebalance ablation --schedules`: rows per schedule, speedups from the rows' own times, the
interval around them, and the one-line errors."""

import json

import numpy as np
import pandas as pd
import pytest

from sparsebalance import cli
from sparsebalance.analysis.schedules import summarise
from sparsebalance.analysis.stats import t_interval


def test_study_rows_and_files(tmp_path, capsys):
    assert cli.main(["ablation", "--schedules", "1f1b,zb-h1", "--json", "--iterations", "1",
                     "--seeds", "0,1", "--out", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["schedule"], r["config"]) for r in rows] == [
        (s, c) for s in ("1f1b", "zb-h1") for c in ("baseline", "SAB+DST", "SAB+DST-CP")]
    t = pd.read_csv(tmp_path / "schedules.csv")
    base = t[t.config == "baseline"].set_index("schedule").iteration_time_s
    for r in t.itertuples():
        assert r.speedup == pytest.approx(base[r.schedule] / r.iteration_time_s)
        assert r.speedup_vs_1f1b_baseline == pytest.approx(base["1f1b"] / r.iteration_time_s)
        assert 0 < r.bubble_fraction < 1 and r.seeds == 2
    # with the same plans and budgets, zero bubble only removes idle time: its baseline is faster
    assert base["zb-h1"] < base["1f1b"]
    assert (tmp_path / "schedules.png").is_file() and (tmp_path / "schedules.svg").is_file()
    assert 'schedule = "1f1b"' in (tmp_path / "config.toml").read_text()


def test_summary_by_hand():
    per_seed = pd.DataFrame([
        {"schedule": "1f1b", "config": c, "seed": s, "iteration_time_s": t, "bubble_fraction": 0.5,
         "mean_coverage": 1.0, "mean_budget": 8.0}
        for c, ts in (("baseline", (2.0, 4.0)), ("SAB+DST", (1.0, 4.0)), ("SAB+DST-CP", (2.0, 2.0)))
        for s, t in zip((0, 1), ts)])
    t = summarise(per_seed, ["1f1b"]).set_index("config")
    assert t.loc["SAB+DST", "speedup"] == pytest.approx(6.0 / 5.0)  # ratio of the means
    lo, hi = t_interval(np.array([2.0, 1.0]))  # per-seed ratios 2/1 and 4/4
    assert (t.loc["SAB+DST", "speedup_ci_low"], t.loc["SAB+DST", "speedup_ci_high"]) == pytest.approx((lo, hi))
    assert lo == pytest.approx(1.5 - 12.706204736 * 0.5, rel=1e-6)  # t(0.975, 1) x s / sqrt(2)
    assert (t.gain_vs_1f1b == 1.0).all()  # 1F1B against itself


@pytest.mark.parametrize("argv,needle", [
    (["--schedules", "1f1b,dualpipev", "--global-batch", "16"], "dualpipev needs at least 2 x pp = 8"),
    (["--schedules", "zb"], "--schedules: zb: choose from"),
    (["--schedules", "zb-h1", "--global-batch", "36"], "zb-h1 needs a multiple of rounds"),
    (["--schedules", "1f1b", "--seeds", "0"], "--seeds: give two or more"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, needle):
    assert cli.main(["ablation", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()
