"""`sparsebalance ablation --cp-split`: a CP degree per sequence vs the whole split -- rows, files,
intervals, and the headline on the seeded built-in setting."""

from __future__ import annotations

import pandas as pd
import pytest

from sparsebalance import cli


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("cpsplit")
    assert cli.main(["ablation", "--cp-split", "--iterations", "2", "--seeds", "0,1", "--out", str(out),
                     "--force", "--no-progress"]) == 0
    return out, pd.read_csv(out / "cp_split.csv").set_index("config")


def test_rows_files_and_the_headline(study):
    out, t = study
    assert list(t.index) == ["LBB + fixed, whole split", "LBB + fixed, per-sequence", "SAB+DST, whole split",
                             "SAB+DST, per-sequence"]
    assert len(pd.read_csv(out / "cp_split_seeds.csv")) == 4 * 2
    per = t.loc[["LBB + fixed, per-sequence", "SAB+DST, per-sequence"]]
    assert (per.vs_whole_ci_low <= per.vs_whole).all() and (per.vs_whole <= per.vs_whole_ci_high).all()
    assert (per.vs_whole > 1.1).all()  # short sequences stop paying a 16-way ring over two nodes
    assert t.loc["LBB + fixed, whole split", "speedup"] == pytest.approx(1.0)


def test_one_study_at_a_time(tmp_path, capsys):
    assert cli.main(["ablation", "--cp-split", "--cp", "--out", str(tmp_path / "x")]) == 2
    assert "give one of --cp, --cp-split, --schedules, --anchors" in capsys.readouterr().err
