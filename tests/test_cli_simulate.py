"""`sparsebalance simulate`: end to end on the shipped example, overrides, and bad input."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from sparsebalance.commands.simulate import parse_override
from sparsebalance.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "qwen25-3b_h200_dp4pp4.toml"


@pytest.mark.parametrize("item,want", [
    ("cluster.pp=8", ("cluster.pp", 8)),
    ("policy.p=0.25", ("policy.p", 0.25)),
    ("data.shuffle=false", ("data.shuffle", False)),
    ('name="x y"', ("name", "x y")),
    ("policy.batching=sab", ("policy.batching", "sab")),
])
def test_parse_override(item, want):
    assert parse_override(item) == want


@pytest.mark.parametrize("item", ["novalue", "=3", "a..b=1", "a="])
def test_bad_override(item):
    with pytest.raises(ConfigError, match="--set"):
        parse_override(item)


def test_simulate_example_end_to_end(tmp_path, run_cli):
    out = tmp_path / "qwen25-3b_h200_dp4pp4"
    r = run_cli("simulate", "--config", EXAMPLE, "--iterations", 2, "--out", out,
                "--set", "data.num_sequences=64", "--no-progress")
    assert r.code == 0, r.err
    for name in ("config.toml", "metrics.csv", "trace.csv", "trace.json", "timeline.png", "timeline.svg"):
        assert (out / name).is_file(), name
    metrics = pd.read_csv(out / "metrics.csv")
    assert len(metrics) == 2 and (metrics["iteration_time_s"] > 0).all()
    assert ((metrics["bubble_fraction"] > 0) & (metrics["bubble_fraction"] < 1)).all()
    trace = pd.read_csv(out / "trace.csv")
    assert set(trace["iteration"]) == {0, 1}
    assert set(trace["dp_rank"]) == set(range(4)) and set(trace["stage"]) == set(range(4))
    assert "iterations = 2" in (out / "config.toml").read_text()
    assert "iteration time" in r.out and str(out) in r.out


@pytest.mark.parametrize("override,needle", [
    ("cluster.pp=0", "cluster.pp"),
    ("cluster.schedule=zb", "cluster.schedule"),
])
def test_bad_config_is_one_line_exit_2(tmp_path, run_cli, override, needle):
    r = run_cli("simulate", "--config", EXAMPLE, "--out", tmp_path, "--set", override, "--no-progress")
    assert r.code == 2
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.err


def test_missing_config(tmp_path, run_cli):
    r = run_cli("simulate", "--config", tmp_path / "none.toml")
    assert r.code == 2 and "no such file" in r.err


@pytest.mark.parametrize("overrides,needle", [
    (("cluster.schedule=zbv", "cluster.virtual_stages=3"), "virtual_stages: zbv places exactly 2 stages"),
    (("cluster.schedule=dualpipev",), "virtual_stages: dualpipev places exactly 2 stages"),
    (("cluster.schedule=dualpipev", "cluster.virtual_stages=2", "cluster.global_batch=16"),
     "dualpipev needs at least 2 x pp = 8 micro-batches"),
    (("cluster.schedule=zb-h1", "cluster.global_batch=36"), "zb-h1 needs a multiple of rounds"),
    (("cluster.tp=3", "cluster.dp=2"), "must divide model.heads"),
])
def test_schedules_and_meshes_the_model_cannot_run(tmp_path, run_cli, overrides, needle):
    sets = [a for o in overrides for a in ("--set", o)]
    r = run_cli("simulate", "--config", EXAMPLE, "--out", tmp_path / "o", *sets, "--no-progress")
    assert r.code == 2, r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.err
    assert not (tmp_path / "o").exists()
