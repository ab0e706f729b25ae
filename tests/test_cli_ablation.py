"""`sparsebalance ablation`: Table I rows, JSON keys, files, the anchor x p study, errors."""

import json

import pandas as pd
import pytest

from sparsebalance import cli


@pytest.fixture
def main():
    return cli.main


def test_json_rows(main, tmp_path, capsys):
    assert main(["ablation", "--json", "--iterations", "3", "--seeds", "0", "--out", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["config"] for r in rows] == ["baseline", "+DST", "+SAB", "+SAB+DST", "+LBB", "+LBB+DST"]
    keys = {"config", "imbalance", "imbalance_ci_lo", "imbalance_ci_hi", "iteration_time_s", "speedup",
            "speedup_ci_lo", "speedup_ci_hi", "overhead_ms"}
    assert all(set(r) == keys for r in rows)
    assert all(r["speedup_ci_lo"] is None for r in rows)  # one seed: no interval
    base = rows[0]["iteration_time_s"]
    for r in rows:
        assert r["speedup"] == pytest.approx(base / r["iteration_time_s"])
        assert r["imbalance"] >= 1.0 and r["overhead_ms"] >= 0
    t = pd.read_csv(tmp_path / "ablation.csv")
    assert t.loc[t.config == "+SAB+DST", "paper_speedup"].item() == 1.35
    # beyond the paper, last: SAB + DST in fixed slots of the token cap, slower than variable
    # micro-batches (each slot pays the dense layers on its padding)
    assert t.config.iloc[-1] == "+SAB+DST-slots" and pd.isna(t.paper_speedup.iloc[-1])
    slots, free = (t.loc[t.config == c, "iteration_time_s"].item() for c in ("+SAB+DST-slots", "+SAB+DST"))
    assert slots > free
    assert (tmp_path / "ablation.png").is_file() and (tmp_path / "ablation.svg").is_file()


def test_anchor_study(main, tmp_path, capsys):
    assert main(["ablation", "--anchors", "--iterations", "2", "--seeds", "0", "--out", str(tmp_path),
                 "--no-progress"]) == 0
    df = pd.read_csv(tmp_path / "anchors.csv")
    assert len(df) == 10 and set(df.anchor.dropna()) == {"mean", "min", "max"}
    mx = df[df.anchor == "max"]
    # MAX never lowers a budget: coverage at least the baseline's, and no speedup from tuning itself
    assert (mx.mean_coverage >= df.loc[df.config == "baseline", "mean_coverage"].item() - 1e-9).all()
    assert (tmp_path / "anchors_pareto.png").is_file()


def test_two_seeds_give_paired_speedups_and_intervals(main, tmp_path, capsys):
    """Speedup is paired by seed (baseline of the same seed / the row's), then averaged; the interval
    is the Student-t one over the per-seed values (closed form with n = 2: t = 12.706)."""
    assert main(["ablation", "--json", "--iterations", "2", "--seeds", "0,1", "--out", str(tmp_path)]) == 0
    rows = {r["config"]: r for r in json.loads(capsys.readouterr().out)}
    seeds = pd.read_csv(tmp_path / "ablation_seeds.csv")
    base = seeds[seeds.config == "baseline"].set_index("seed").iteration_time_s
    for name in ("+DST", "+SAB+DST"):
        s = seeds[seeds.config == name].set_index("seed")
        per = base / s.iteration_time_s
        assert rows[name]["speedup"] == pytest.approx(per.mean())
        half = 12.706204736 * per.std(ddof=1) / 2 ** 0.5
        assert rows[name]["speedup_ci_lo"] == pytest.approx(per.mean() - half)
        assert rows[name]["imbalance_ci_hi"] >= rows[name]["imbalance"] >= rows[name]["imbalance_ci_lo"]


@pytest.mark.slow
def test_default_run_prints_every_row(main, tmp_path, capsys):
    """The full default setting (5 seeds x 20 iterations); its run time is reported in docs/results.md,
    not asserted here."""
    assert main(["ablation", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    for row in ("baseline", "+DST", "+SAB", "+SAB+DST", "+LBB", "+LBB+DST"):
        assert f"\n{row} " in out


def test_bad_input(main, tmp_path, capsys):
    assert main(["ablation", "--seeds", "x", "--out", str(tmp_path)]) == 2
    bad = tmp_path / "bad.toml"
    bad.write_text('[policy]\nanchor = "median"\n')
    assert main(["ablation", "--config", str(bad), "--out", str(tmp_path)]) == 2
    assert "anchor" in capsys.readouterr().err
