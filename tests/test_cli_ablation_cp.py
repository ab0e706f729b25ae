"""`sparsebalance ablation --cp`: the context-parallel study's rows, files, and its headline: the
best layout per sequence beats the dense ring and MTraining's fixed stripe on a seeded setting."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from sparsebalance import cli


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    assert cli.main(["ablation", "--cp", "--iterations", "3", "--seeds", "0,1", "--out", str(out), "--force",
                     "--no-progress"]) == 0
    return out, pd.read_csv(out / "cp.csv").set_index("config")


def test_rows_files_and_intervals(study):
    out, t = study
    assert list(t.index) == ["dense zigzag ring", "MTraining-like", "SAB+DST (CP)", "SAB+DST (CP, best layout)",
                             "SAB+DST-CP (CP, best layout)"]
    assert (t.speedup_ci_low <= t.speedup).all() and (t.speedup <= t.speedup_ci_high).all()
    assert ((t.cp_efficiency > 0) & (t.cp_efficiency <= 1)).all() and (t.cp_worker_imbalance >= 1).all()
    assert (out / "cp.png").is_file() and (out / "cp_seeds.csv").is_file() and (out / "config.toml").is_file()
    assert len(pd.read_csv(out / "cp_seeds.csv")) == 5 * 2


def test_headline_sparse_cp_and_the_layout_choice(study):
    _, t = study
    assert t.loc["MTraining-like", "speedup"] > 2  # a 32-block budget at 32K-512K tokens vs dense
    # zigzag balances dense attention, not a sparse pattern: its steps are less even than stripe's
    assert t.loc["SAB+DST (CP)", "cp_step_imbalance"] > t.loc["SAB+DST (CP, best layout)", "cp_step_imbalance"]
    assert t.loc["SAB+DST (CP, best layout)", "vs_mtraining"] > 1.03
    assert t.loc["SAB+DST (CP, best layout)", "iteration_time_s"] < t.loc["SAB+DST (CP)", "iteration_time_s"]


def test_json_and_bad_combinations(tmp_path, capsys):
    assert cli.main(["ablation", "--cp", "--schedules", "1f1b", "--out", str(tmp_path / "x")]) == 2
    assert "give one of --cp, --cp-split, --schedules, --anchors" in capsys.readouterr().err
    assert cli.main(["ablation", "--cp", "--json", "--iterations", "2", "--seeds", "0,1", "--out",
                     str(tmp_path / "j"), "--no-progress"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["config"] == "dense zigzag ring" and rows[0]["speedup"] == pytest.approx(1.0)
