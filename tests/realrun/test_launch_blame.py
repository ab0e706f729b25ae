"""Which rank failed first, from the per-rank status files (realrun/launch.py): hard deaths and
errors of a rank's own come before errors that only report a lost peer or a stop."""

from __future__ import annotations

import json

import pytest

from sparsebalance.realrun.launch import SECONDARY, first_failure


def _write(d, rank, **kw):
    d.mkdir(exist_ok=True)
    (d / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "pid": 1000 + rank, "dp_rank": 0,
                                                    "stage": rank, **kw}))


def test_own_error_beats_an_earlier_lost_peer_error(tmp_path):
    d = tmp_path / "ranks"
    _write(d, 0, state="failed", time=1.0,
           error="RuntimeError: [gloo/pair.cc:534] Connection closed by peer [127.0.0.1]:1")
    _write(d, 1, state="failed", time=2.0, error="RuntimeError: injected fault")
    line = first_failure(d, {}, 2, 1, "train", tmp_path / "launch.log")
    assert line.startswith("train: rank 1 (dp_rank 0, stage 1) failed: RuntimeError: injected fault")
    assert "rank(s) 0 failed after it" in line


def test_hard_death_beats_the_stopped_and_the_lost_peer(tmp_path):
    d = tmp_path / "ranks"
    _write(d, 0, state="stopped", time=1.0, error="stopped by SIGTERM")
    _write(d, 1, state="running", time=0.0)
    _write(d, 2, state="failed", time=0.5, error="DistBackendError: timed out")
    line = first_failure(d, {1: 3.0}, 3, 1, "train", tmp_path / "l")
    assert "rank 1 (dp_rank 0, stage 1) (pid 1001) died without a Python error" in line


def test_among_own_errors_the_earliest_wins(tmp_path):
    d = tmp_path / "ranks"
    _write(d, 0, state="failed", time=5.0, error="ValueError: b")
    _write(d, 1, state="failed", time=4.0, error="ValueError: a")
    assert "rank 1 " in first_failure(d, {}, 2, 1, "x", tmp_path / "l")


def test_nothing_recorded(tmp_path):
    d = tmp_path / "ranks"
    d.mkdir()
    assert "ranks [0, 1] never started" in first_failure(d, {}, 2, 1, "x", tmp_path / "l")
    assert "stopped by SIGKILL" in first_failure(d, {}, 2, -9, "x", tmp_path / "l")


@pytest.mark.parametrize("text,secondary", [
    ("RuntimeError: Connection closed by peer", True), ("RuntimeError: Connection reset by peer", True),
    ("DistBackendError: wait timeout after 30000ms", True), ("stopped by SIGTERM", True),
    ("RuntimeError: injected fault (realrun.fail_rank = 1)", False), ("ValueError: bad shape", False),
])
def test_secondary_errors(text, secondary):
    assert bool(SECONDARY.search(text)) is secondary


@pytest.mark.parametrize("done", [False, True])
def test_sigterm_records_a_stop_unless_the_rank_said_done(tmp_path, done):
    """torchrun tears the other workers down when one exits with an error; a rank that had already
    said done (rank 0 released it) keeps 'done', a rank mid-work records 'stopped'."""
    import os
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "from sparsebalance.realrun.launch import worker_started, worker_done\n"
            "worker_started(1, dp_rank=0, stage=1)\n"
            + ("worker_done()\n" if done else "")
            + "os.kill(os.getpid(), signal.SIGTERM)\n"
              "time.sleep(10)\n")
    env = dict(os.environ, SPARSEBALANCE_RANK_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], env=env, timeout=60, check=False)
    assert p.returncode == 143
    state = json.loads((tmp_path / "rank1.json").read_text())["state"]
    assert state == ("done" if done else "stopped")
