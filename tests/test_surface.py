"""One surface for every verb: --config/--out, deprecated spellings, results directories never
silently overwritten, deterministic tables apart from wall-clock ones, one meaning of ``seed``,
--no-trace / --trace-limit, warnings and progress off non-terminal output, a closed stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from sparsebalance.cli import VERBS, build_parser

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "qwen25-3b_h200_dp4pp4.toml"
SMALL = ("--iterations", "2", "--set", "data.num_sequences=64")


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_verb_takes_config_and_out_and_points_to_the_formats(verb):
    parser = build_parser(verb)
    sub = next(a for a in parser._actions if a.dest == "verb").choices[verb]
    flags = {s for a in sub._actions for s in a.option_strings}
    assert {"--config", "--out"} <= flags
    assert "docs/formats.md" in sub.format_help()


def test_deprecated_output_still_works_with_one_line(tmp_path, run_cli):
    r = run_cli("simulate", "--config", EXAMPLE, *SMALL, "--output", tmp_path, "--no-trace")
    assert r.code == 0
    assert r.err.count("deprecated") == 1 and "--out" in r.err
    assert (tmp_path / "qwen25-3b_h200_dp4pp4" / "metrics.csv").is_file()


def test_positional_config_is_a_deprecated_alias(tmp_path, run_cli):
    d = tmp_path / "d.json"
    d.write_text(json.dumps({"forward": [[1.0, 2.0]], "backward": [[2.0, 4.0]]}))
    new = run_cli("pipeline", "--config", d, "--json")
    old = run_cli("pipeline", d, "--json")
    assert new.code == old.code == 0 and new.out == old.out
    assert "deprecated" in old.err and "deprecated" not in new.err


def test_default_directory_gets_a_timestamped_sibling_and_force_replaces(tmp_path, run_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ("simulate", "--config", EXAMPLE, *SMALL, "--no-trace", "--set", "output_dir=res")
    assert run_cli(*args).code == 0
    first = tmp_path / "res" / "qwen25-3b_h200_dp4pp4"
    stamp = (first / "metrics.csv").stat().st_mtime_ns
    r = run_cli(*args)
    assert r.code == 0 and "exists; writing to" in r.err
    dirs = sorted(p.name for p in (tmp_path / "res").iterdir())
    assert len(dirs) == 2 and dirs[1].startswith("qwen25-3b_h200_dp4pp4-")
    assert (first / "metrics.csv").stat().st_mtime_ns == stamp  # untouched
    (first / "stale.txt").write_text("x")
    assert run_cli(*args, "--out", first, "--force").code == 0
    assert not (first / "stale.txt").exists() and (first / "metrics.csv").is_file()


def test_identical_runs_give_identical_metrics_and_apart_timing(tmp_path, run_cli):
    outs = [tmp_path / "a", tmp_path / "b"]
    for o in outs:
        assert run_cli("simulate", "--config", EXAMPLE, *SMALL, "--out", o, "--no-trace").code == 0
    a, b = ((o / "metrics.csv").read_bytes() for o in outs)
    assert a == b
    assert "decision_ms" not in a.decode().splitlines()[0]
    timing = pd.read_csv(outs[0] / "timing.csv")
    assert list(timing.columns) == ["iteration", "decision_ms"] and len(timing) == 2


def test_seed_means_the_same_in_simulate_and_sweep(tmp_path, run_cli):
    assert run_cli("simulate", "--config", EXAMPLE, *SMALL, "--set", "seed=3", "--out", tmp_path / "s",
                   "--no-trace").code == 0
    sim = pd.read_csv(tmp_path / "s" / "metrics.csv")["iteration_time_s"].mean()
    base = tmp_path / "base.toml"
    base.write_text(EXAMPLE.read_text().replace("num_sequences = 1024", "num_sequences = 64"))
    assert run_cli("sweep", "--config", base, "--seeds", "3", "--batching", "sequential", "--tuning",
                   "fixed", "--iterations", "2", "--out", tmp_path / "w").code == 0
    df = pd.read_csv(tmp_path / "w" / "results.csv")
    sw = df[(df.metric == "iteration_time_s") & (df.seed == 3)].value.item()
    assert sw == pytest.approx(sim, rel=1e-12)
    other = run_cli("simulate", "--config", EXAMPLE, *SMALL, "--set", "seed=4", "--out", tmp_path / "t",
                    "--no-trace")
    assert other.code == 0
    assert pd.read_csv(tmp_path / "t" / "metrics.csv")["iteration_time_s"].mean() != sim


def test_no_trace_and_trace_limit(tmp_path, run_cli):
    assert run_cli("simulate", "--config", EXAMPLE, *SMALL, "--out", tmp_path / "n", "--no-trace").code == 0
    assert not list((tmp_path / "n").glob("trace*")) and not list((tmp_path / "n").glob("timeline*"))
    r = run_cli("simulate", "--config", EXAMPLE, *SMALL, "--out", tmp_path / "l", "--trace-limit", "300")
    assert r.code == 0 and "--trace-limit" in r.err
    tr = pd.read_csv(tmp_path / "l" / "trace.csv")
    assert len(tr) <= 300 and set(tr.iteration) == {0}


def test_sweep_rerun_with_other_settings_never_shows_old_numbers(tmp_path, run_cli):
    base = tmp_path / "base.toml"
    base.write_text(EXAMPLE.read_text().replace("num_sequences = 1024", "num_sequences = 64"))
    args = ("sweep", "--config", base, "--batching", "sab", "--tuning", "fixed", "--out", tmp_path / "w")
    assert run_cli(*args, "--iterations", "2").code == 0
    first = pd.read_csv(tmp_path / "w" / "results.csv")
    r = run_cli(*args, "--iterations", "3")
    assert r.code == 0 and "0 already" in r.out
    second = pd.read_csv(tmp_path / "w" / "results.csv")
    assert set(first.run_id).isdisjoint(second.run_id) and second.run_id.nunique() == 2
    r = run_cli(*args, "--iterations", "2")
    assert "2 already" in r.out and "0 to run" in r.out  # the store keeps both settings


def test_warnings_are_counted_not_printed_off_a_terminal(tmp_path, run_cli):
    cfg = tmp_path / "run.toml"
    # an H200 profile on a cluster labelled h20: a warning (predictions follow the profile)
    cfg.write_text(EXAMPLE.read_text().replace('preset = "h200-4x8"', 'preset = "h200-4x8"\ndevice = "h20"'))
    quiet = run_cli("simulate", "--config", cfg, *SMALL, "--out", tmp_path / "q", "--no-trace")
    # the accepted non-monotone points are counted; the device mismatch changes what the result
    # means, so it is shown even here
    assert quiet.code == 0 and "1 note(s) not shown" in quiet.err and "falls as work grows" not in quiet.err
    assert "sparsebalance: warning: profile" in quiet.err and "is for device 'h200'" in quiet.err
    loud = run_cli("simulate", "--config", cfg, *SMALL, "--out", tmp_path / "v", "--no-trace", "-v")
    assert loud.code == 0 and "sparsebalance: warning: profile" in loud.err


def test_closed_stdout_is_not_a_traceback(tmp_path):
    d = tmp_path / "d.json"
    d.write_text(json.dumps({"forward": [[0.001] * 400] * 4, "backward": [[0.002] * 400] * 4}))
    p = subprocess.Popen([sys.executable, "-m", "sparsebalance", "pipeline", "--config", str(d), "--json", "--ops"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
    p.stdout.read(10)
    p.stdout.close()  # the reader goes away (`| head -c 10`)
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141
    assert err == ""
