"""`sparsebalance sweep`: grid expansion, tidy table, speedup pairing, resume, parallel, errors."""

import json

import pandas as pd
import pytest

from sparsebalance import cli
from sparsebalance.commands.sweep import expand

BASE = """
name = "t"
iterations = 2
[model]
preset = "qwen2.5-3b"
[cluster]
dp = 2
pp = 2
global_batch = 8
[data]
distribution = "chatqa2-like"
num_sequences = 64
[policy]
token_cap = 65536
"""


@pytest.fixture
def main():
    return cli.main


@pytest.fixture
def base(tmp_path):
    p = tmp_path / "base.toml"
    p.write_text(BASE)
    return p


def test_expand_drops_dst_keys_for_fixed_and_adds_baseline():
    runs = expand({"policy.tuning": ["fixed", "dst"], "policy.p": [0.1, 0.2], "seed": [0, 1]},
                  {"policy.batching": "sequential", "policy.tuning": "fixed"})
    fixed = [r for r in runs if r.get("policy.tuning") == "fixed" and "policy.batching" not in r]
    assert len(fixed) == 2 and all("policy.p" not in r for r in fixed)
    assert sum(r.get("policy.batching") == "sequential" for r in runs) == 2
    assert len(runs) == 2 + 4 + 2
    assert len({json.dumps(r, sort_keys=True) for r in runs}) == len(runs)


def test_sweep_table_speedup_and_resume(main, base, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["sweep", "--config", str(base), "--batching", "lbb,sab", "--tuning", "fixed,dst",
            "--p", "0.1", "--seeds", "0", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    df = pd.read_csv(out / "results.csv")
    assert set(df.columns) >= {"run_id", "batching", "tuning", "seed", "metric", "value"}
    assert df.run_id.nunique() == 5                      # 2 x 2 + the sequential+fixed baseline
    assert set(df.metric) == {"iteration_time_s", "imbalance", "mean_budget", "mean_coverage",
                              "floor_share", "speedup"}  # wall clock (decision_ms) is in timing.csv
    timing = pd.read_csv(out / "timing.csv")
    assert set(timing.run_id) == set(df.run_id) and (timing.decision_ms >= 0).all()
    w = df.pivot_table(index=["run_id", "batching", "tuning"], columns="metric", values="value").reset_index()
    base_t = w[(w.batching == "sequential") & (w.tuning == "fixed")].iteration_time_s.iloc[0]
    assert w.speedup.to_numpy() == pytest.approx(base_t / w.iteration_time_s.to_numpy())
    assert len(list((out / "configs").glob("*.toml"))) == 5
    capsys.readouterr()
    assert main(argv) == 0
    assert "5 already" in capsys.readouterr().out
    pd.testing.assert_frame_equal(pd.read_csv(out / "results.csv"), df)
    assert main(argv[:-3] + ["--batching", "lbb,sab,quadratic", "--out", str(out), "--no-progress"]) == 0
    assert "5 already" in capsys.readouterr().out and pd.read_csv(out / "results.csv").run_id.nunique() == 7


def test_parallel_matches_serial(main, base, tmp_path):
    args = ["sweep", "--config", str(base), "--batching", "sab", "--tuning", "dst",
            "--anchor", "mean,max", "--clusters", "2x2,4x2", "--no-progress"]
    assert main(args + ["--out", str(tmp_path / "a"), "--jobs", "1"]) == 0
    assert main(args + ["--out", str(tmp_path / "b"), "--jobs", "2"]) == 0
    a, b = (pd.read_csv(tmp_path / d / "results.csv") for d in "ab")
    key = ["run_id", "metric"]
    a, b = (x.sort_values(key).reset_index(drop=True) for x in (a, b))
    pd.testing.assert_frame_equal(a, b)
    assert set(a.dp) == {2, 4}


@pytest.mark.parametrize("flags,needle", [
    (["--batching", "nope"], "policy.batching"), (["--p", "1.5"], "p: must lie in (0, 1)"),
    (["--anchor", "median"], "anchor"), (["--clusters", "2by4"], "--clusters"), ([], "empty grid"),
])
def test_bad_input_exits_2(main, base, tmp_path, capsys, flags, needle):
    assert main(["sweep", "--config", str(base), "--out", str(tmp_path / "o"), *flags]) == 2
    assert needle in capsys.readouterr().err


def test_grid_file(main, base, tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text('base = "base.toml"\n[grid]\n"policy.tuning" = ["dst"]\n"policy.anchor" = ["mean"]\n'
                    '[baseline]\n"policy.batching" = "lbb"\n"policy.tuning" = "fixed"\n')
    assert main(["sweep", "--grid", str(grid), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    df = pd.read_csv(tmp_path / "o" / "results.csv")
    sp = df[(df.metric == "speedup") & (df.batching == "lbb")].value
    assert list(sp) == [1.0]
    grid.write_text("[grid]\nfoo = 1\n")
    assert main(["sweep", "--grid", str(grid), "--out", str(tmp_path / "o")]) == 2
