"""`sparsebalance sweep --backend ray`: same rows as local, resumable after a kill, one-line errors.

The Ray test starts a 2-CPU embedded Ray twice (about 15-30 s on the project's VM)."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time

import pandas as pd
import pytest

from sparsebalance import cli

BASE = """
name = "t"
iterations = 3
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
GRID = ["--batching", "sab,lbb", "--tuning", "dst", "--anchor", "mean,max", "--seeds", "0,1", "--no-progress"]


@pytest.fixture
def base(tmp_path):
    p = tmp_path / "base.toml"
    p.write_text(BASE)
    return p


def stored(out) -> int:
    try:
        with sqlite3.connect(out / "runs.sqlite") as db:
            return db.execute("select count(*) from runs").fetchone()[0]
    except sqlite3.Error:
        return 0


def test_ray_matches_local_and_resumes_after_a_kill(base, tmp_path):
    pytest.importorskip("ray")
    ray_out, local_out = tmp_path / "ray", tmp_path / "local"
    argv = ["sweep", "--config", str(base), *GRID, "--backend", "ray", "--jobs", "2", "--out", str(ray_out)]
    proc = subprocess.Popen([sys.executable, "-m", "sparsebalance.cli", *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while stored(ray_out) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # stop mid-sweep: Ray shut down, finished runs kept
    proc.wait(timeout=120)
    done_before = stored(ray_out)
    total = 2 + 2 * 2 * 2  # the baseline per seed + batching x anchor x seeds
    assert 2 <= done_before <= total
    assert cli.main(argv) == 0  # the same command finishes the sweep
    assert cli.main(["sweep", "--config", str(base), *GRID, "--jobs", "2", "--out", str(local_out)]) == 0
    key = ["run_id", "metric"]
    a, b = (pd.read_csv(d / "results.csv").sort_values(key).reset_index(drop=True) for d in (ray_out, local_out))
    pd.testing.assert_frame_equal(a, b)  # same rows, same values
    assert a.run_id.nunique() == total
    with sqlite3.connect(ray_out / "runs.sqlite") as db:  # nothing lost, nothing twice
        assert db.execute("select count(*), count(distinct run_id) from runs").fetchone() == (total, total)


def test_ray_missing_is_a_one_line_error(base, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    code = cli.main(["sweep", "--config", str(base), *GRID, "--backend", "ray", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "[cluster]" in err[0]


@pytest.mark.parametrize("flags,needle", [
    (["--backend", "ray", "--address", "127.0.0.1:1"], "cannot reach a Ray cluster"),
    (["--backend", "ray", "--address", "nohost"], "HOST:PORT"),
    (["--address", "127.0.0.1:6379"], "only with --backend ray"),
])
def test_bad_address_exits_2(base, tmp_path, capsys, flags, needle):
    if "ray" in flags:
        pytest.importorskip("ray")
    code = cli.main(["sweep", "--config", str(base), *GRID, *flags, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0]
    assert not (tmp_path / "o" / "runs.sqlite").exists()  # refused before any work
