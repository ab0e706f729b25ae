"""The measured accuracy experiment's join of speed and accuracy, paired by seed (oracles: means and
Student t intervals computed by hand)."""

import math

import numpy as np
import pandas as pd
import pytest

from sparsebalance.analysis import accuracy_speed as A

T_975_2 = 4.302652729911275  # Student t, 0.975 quantile, 2 degrees of freedom (tables)


def _iterations(times: dict, *, drop=()) -> pd.DataFrame:
    """Rows for arms x seeds x iterations 0..3: ``times[arm][seed]`` = the four iteration times;
    predicted = 2 x measured, budget 8, coverage 0.9, loss = time / 10, answer accuracy = 1 - time / 10."""
    rows = []
    for arm, per_seed in times.items():
        for seed, ts in enumerate(per_seed):
            for it, t in enumerate(ts):
                if (arm, seed, it) in drop:
                    continue
                rows.append({"arm": arm, "seed": seed, "iteration": it, "iteration_time_s": t, "predicted_s": 2 * t,
                             "mean_budget": 8.0, "mean_coverage": 0.9, "loss": t / 10, "answer_accuracy": 1 - t / 10})
    return pd.DataFrame(rows)


def test_speedup_is_paired_by_seed_and_iteration_without_the_first():
    # iteration 0 (one-off costs) is huge and must not count; the arm is 1.25x, 1.5x, 2x on the seeds
    fixed = [[9.0, 2.0, 2.0, 2.0], [9.0, 3.0, 3.0, 3.0], [9.0, 4.0, 4.0, 4.0]]
    dst = [[1.0, 1.6, 1.6, 1.6], [1.0, 2.0, 2.0, 2.0], [1.0, 2.0, 2.0, 2.0]]
    ps = A.per_seed(_iterations({"fixed": fixed, "MEAN0.1": dst})).set_index(["arm", "seed"])
    assert ps.loc[("MEAN0.1", 0), "measured_speedup"] == pytest.approx(1.25)
    assert ps.loc[("MEAN0.1", 1), "measured_speedup"] == pytest.approx(1.5)
    assert ps.loc[("MEAN0.1", 2), "measured_speedup"] == pytest.approx(2.0)
    assert ps.loc[("MEAN0.1", 0), "sim_speedup"] == pytest.approx(1.25)  # predicted = 2 x measured
    assert ps.loc[("MEAN0.1", 0), "loss_vs_fixed"] == pytest.approx(0.16 - 0.2)
    assert ps.loc[("MEAN0.1", 0), "train_accuracy_vs_fixed"] == pytest.approx(0.04)
    assert ps.loc[("fixed", 1), "measured_speedup"] == 1.0 and ps.loc[("fixed", 1), "iterations"] == 3
    # the interval over seeds is Student t of the per-seed speedups
    held = pd.DataFrame([{"arm": a, "seed": s, "bucket": 64, "right": 5, "total": 8}
                         for a in ("fixed", "MEAN0.1") for s in range(3)])
    s = A.summary(_iterations({"fixed": fixed, "MEAN0.1": dst}), held).set_index("arm")
    x = np.array([1.25, 1.5, 2.0])
    half = T_975_2 * x.std(ddof=1) / math.sqrt(3)
    r = s.loc["MEAN0.1"]
    assert r["measured_speedup"] == pytest.approx(x.mean())
    assert (r["measured_speedup_ci_lo"], r["measured_speedup_ci_hi"]) == pytest.approx((x.mean() - half, x.mean() + half))
    assert r["accuracy_vs_fixed"] == 0.0 and r["n_seeds"] == 3


def test_an_iteration_missing_on_one_side_drops_from_both():
    fixed = [[9.0, 2.0, 4.0, 2.0]]
    dst = [[1.0, 1.0, 1.0, 1.0]]
    ps = A.per_seed(_iterations({"fixed": fixed, "MEAN0.1": dst}, drop={("fixed", 0, 2)}))
    r = ps.set_index("arm").loc["MEAN0.1"]
    assert r["iterations"] == 2 and r["measured_speedup"] == pytest.approx(2.0)  # iterations 1 and 3 only
    assert r["iteration_time_s"] == pytest.approx(1.0)


def test_without_the_reference_speedups_are_nan():
    ps = A.per_seed(_iterations({"MEAN0.1": [[1.0, 1.0, 1.0]]}))
    assert np.isnan(ps.measured_speedup).all() and np.isnan(ps.loss_vs_fixed).all()


def test_heldout_difference_is_paired_by_seed_and_bucket():
    rows = []
    for seed, (f, m) in enumerate([(2, 3), (6, 8), (4, 6)]):  # differences 1/8, 2/8, 2/8
        rows += [{"arm": "fixed", "seed": seed, "bucket": 4096, "right": f, "total": 8},
                 {"arm": "MEAN0.1", "seed": seed, "bucket": 4096, "right": m, "total": 8}]
    h = A.heldout_accuracy(pd.DataFrame(rows))
    d = h[h.arm == "MEAN0.1"].accuracy_vs_fixed.to_numpy()
    np.testing.assert_allclose(d, [1 / 8, 2 / 8, 2 / 8])
    assert (h[h.arm == "fixed"].accuracy_vs_fixed == 0).all()


def test_table_and_figure(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparsebalance.analysis.figures import overlapping_texts

    kept = []
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))

    fixed = [[9.0, 2.0, 2.0], [9.0, 3.0, 3.0]]
    dst = [[1.0, 1.6, 1.6], [1.0, 2.0, 2.0]]
    held = pd.DataFrame([{"arm": a, "seed": s, "bucket": b, "right": 5 + (a != "fixed"), "total": 8}
                         for a in ("fixed", "MEAN0.1") for s in range(2) for b in (1024, 8192)])
    s = A.summary(_iterations({"fixed": fixed, "MEAN0.1": dst}), held)
    md = A.markdown_table(s).splitlines()
    assert len(md) == 4 and md[2].startswith("| fixed |") and "1 (reference)" in md[2]
    assert md[3].startswith("| MEAN0.1 |") and "| 0.125 [0.125, 0.125] |" in md[3]
    A.plot(s, tmp_path / "fig")
    assert (tmp_path / "fig.png").stat().st_size > 0 and (tmp_path / "fig.svg").is_file()
    assert len(kept) == 1 and overlapping_texts(kept[0]) == []


def test_speed_table_against_both_references_and_the_target_line():
    # fixed-dense is 1.25x fixed on every seed; MEAN0.1 is 1.25x, 1.5x, 2x fixed
    fixed = [[9.0, 2.0, 2.0, 2.0], [9.0, 3.0, 3.0, 3.0], [9.0, 4.0, 4.0, 4.0]]
    dense = [[9.0, 1.6, 1.6, 1.6], [9.0, 2.4, 2.4, 2.4], [9.0, 3.2, 3.2, 3.2]]
    dst = [[1.0, 1.6, 1.6, 1.6], [1.0, 2.0, 2.0, 2.0], [1.0, 2.0, 2.0, 2.0]]
    sp = A.speed_table(_iterations({"fixed": fixed, "fixed-dense": dense, "MEAN0.1": dst})).set_index(["reference", "arm"])
    x = np.array([1.25, 1.5, 2.0]) / 1.25  # against fixed-dense, seed by seed
    half = T_975_2 * x.std(ddof=1) / math.sqrt(3)
    r = sp.loc[("fixed-dense", "MEAN0.1")]
    assert r["measured_speedup"] == pytest.approx(x.mean())
    assert (r["measured_speedup_ci_lo"], r["measured_speedup_ci_hi"]) == pytest.approx((x.mean() - half, x.mean() + half))
    assert sp.loc[("fixed", "fixed-dense"), "measured_speedup"] == pytest.approx(1.25)
    assert sp.loc[("fixed", "fixed-dense"), "measured_speedup_ci_lo"] == pytest.approx(1.25)  # no spread
    line = A.target_check(sp.reset_index())
    y = np.array([1.25, 1.5, 2.0])
    lo = y.mean() - T_975_2 * y.std(ddof=1) / math.sqrt(3)
    assert line.startswith("target: MEAN0.1 vs fixed") and lo < 1.15 and line.endswith("does not hold")
    assert A.target_check(sp.reset_index(), arm="fixed-dense", goal=1.2, bound=1.15).endswith(": holds")
    md = A.speed_markdown(sp.reset_index()).splitlines()
    assert md[0] == ("| arm | measured vs fixed | simulated vs fixed | measured vs fixed-dense | "
                     "simulated vs fixed-dense |") and len(md) == 5


def test_speed_table_without_the_dense_reference():
    sp = A.speed_table(_iterations({"fixed": [[9.0, 2.0, 2.0]], "MEAN0.1": [[1.0, 1.0, 1.0]]}))
    assert set(sp.reference) == {"fixed"}
    assert A.target_check(sp, arm="MIN0.1") == "target: MIN0.1 vs fixed not run"
