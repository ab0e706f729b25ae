"""Faults injected into real ``sparsebalance sweep`` processes: kill -9 at random points, Ctrl-C and
SIGTERM with workers busy, SIGKILL of the coordinator, a worker killed mid-run.

Oracles: an uninterrupted sweep of the same grid (its records, byte for byte), SQLite's own
integrity check, and /proc (which processes are still alive). Every wait is a bounded hang guard.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import time
from pathlib import Path

import pandas as pd
import pytest
from faultkit import sparsebalance, tree, wait_for, wait_gone

from sparsebalance.analysis.store import ResultStore
from sparsebalance.analysis.sweep import METRICS

GRID = ["--batching", "lbb,sab", "--tuning", "fixed,dst", "--p", "0.1,0.2", "--seeds", "0,1"]
N_RUNS = 14  # (lbb, sab) x (fixed, dst p0.1, dst p0.2) x 2 seeds + 2 baselines


def _records(out) -> dict[str, dict]:
    if not ResultStore.exists(out):
        return {}
    with ResultStore(out) as st:
        return {r.run_id: r.metrics for r in st.records()}


def _integrity(out) -> str:
    db = sqlite3.connect(out / "runs.sqlite")
    try:
        return db.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        db.close()


def _stored(out) -> int:
    """Runs stored so far, read as a second process would (read-only; 0 before the store exists)."""
    try:
        db = sqlite3.connect(f"file:{out / 'runs.sqlite'}?mode=ro", uri=True, timeout=5)
        try:
            return db.execute("SELECT count(*) FROM runs").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:
        return 0


def _check_tables(out, stored: set[str]) -> None:
    """results.csv, when present, is whole: every run in it is stored and has every metric."""
    path = out / "results.csv"
    if not path.exists():
        return
    df = pd.read_csv(path)  # never empty or truncated: written by rename
    assert set(df.run_id) <= stored
    det = df[df.metric != "speedup"]
    assert det["value"].notna().all()
    assert (det.groupby("run_id").metric.nunique() == len(METRICS)).all()


@pytest.mark.slow
def test_kill9_at_random_points_loses_no_finished_run(tmp_path, sweep_base):
    ref, out = tmp_path / "ref", tmp_path / "out"
    t0 = time.monotonic()
    p = sparsebalance("sweep", "--config", sweep_base, *GRID, "--out", ref, "--no-progress")
    assert p.wait(timeout=300) == 0, p.stderr.read()
    duration = time.monotonic() - t0
    want = _records(ref)
    assert len(want) == N_RUNS

    rng = random.Random(20240611)
    seen: set[str] = set()
    kills = 0
    for attempt in range(8):
        jobs = 1 + attempt % 2
        p = sparsebalance("sweep", "--config", sweep_base, *GRID, "--out", out, "--jobs", jobs,
                          "--no-progress")
        # the kill point is drawn relative to the sweep's progress, not to a wall time measured
        # under another load: after 0-2 more stored runs, then a random part of one run's time
        target = len(seen) + rng.randint(0, 2)
        wait_for(lambda p=p, target=target: p.poll() is not None or _stored(out) >= target,
                 timeout=300, step=0.02)
        time.sleep(rng.uniform(0.0, duration / N_RUNS))
        pids = tree(p.pid)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait(timeout=60)
        assert wait_gone(pids) == [], "a sweep worker outlived its killed coordinator"
        got = _records(out)
        if (out / "runs.sqlite").exists():
            assert _integrity(out) == "ok"
        assert seen <= set(got), "a finished run was lost"
        for rid, metrics in got.items():
            assert metrics == want[rid]  # the stored record is the uninterrupted run's, exactly
        _check_tables(out, set(got))
        seen = set(got)
        if len(seen) == N_RUNS:
            break
    assert kills >= 3
    p = sparsebalance("sweep", "--config", sweep_base, *GRID, "--out", out, "--no-progress")
    stdout, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert f"{N_RUNS} runs, {len(seen)} already" in stdout
    key = ["run_id", "metric"]
    a, b = (pd.read_csv(d / "results.csv").sort_values(key).reset_index(drop=True) for d in (ref, out))
    pd.testing.assert_frame_equal(a, b)
    assert not list(out.glob(".*.tmp"))


def _slow_grid(tmp_path):
    """2 quick runs (2 iterations) then 2 slow ones (minutes): a stop must not wait for the latter."""
    g = tmp_path / "grid.toml"
    g.write_text('base = "base.toml"\n[grid]\niterations = [2, 20000]\n"policy.batching" = ["lbb"]\n'
                 '"policy.tuning" = ["fixed"]\n')
    return g


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_stop_keeps_finished_runs_and_ends_busy_workers_at_once(tmp_path, sweep_base, sig, code):
    out = tmp_path / "out"
    p = sparsebalance("sweep", "--grid", _slow_grid(tmp_path), "--out", out, "--jobs", "2", "--no-progress")
    assert wait_for(lambda: len(_records(out)) >= 2, timeout=120), "the quick runs never finished"
    workers = tree(p.pid)[1:]
    assert workers, "no worker processes seen"
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)  # the slow runs take minutes: exiting now means they were ended
    assert p.returncode == code
    assert "2 of 4 runs are in" in err and "Traceback" not in err
    assert wait_gone(workers) == []
    assert len(_records(out)) == 2
    assert pd.read_csv(out / "results.csv").run_id.nunique() == 2


@pytest.mark.slow
def test_sigkill_of_the_coordinator_leaves_no_worker(tmp_path, sweep_base):
    out = tmp_path / "out"
    p = sparsebalance("sweep", "--grid", _slow_grid(tmp_path), "--out", out, "--jobs", "2", "--no-progress")
    assert wait_for(lambda: len(_records(out)) >= 2, timeout=120)
    workers = tree(p.pid)[1:]
    p.kill()
    p.wait(timeout=30)
    assert wait_gone(workers) == []
    assert _integrity(out) == "ok" and len(_records(out)) == 2


@pytest.mark.slow
def test_a_killed_worker_fails_its_run_only(tmp_path, sweep_base):
    out = tmp_path / "out"
    g = tmp_path / "grid.toml"
    g.write_text('base = "base.toml"\n[grid]\niterations = [2, 20000]\n"policy.batching" = ["lbb"]\n'
                 '"policy.tuning" = ["fixed"]\n[baseline]\n"policy.batching" = "lbb"\n'
                 '"policy.tuning" = "fixed"\n')
    p = sparsebalance("sweep", "--grid", g, "--out", out, "--jobs", "2", "--no-progress")
    assert wait_for(lambda: len(_records(out)) >= 1, timeout=120)
    workers = [w for w in tree(p.pid)[1:] if b"spawn_main" in Path(f"/proc/{w}/cmdline").read_bytes()]
    assert len(workers) >= 1
    for w in workers:  # the quick run's worker has exited or idles; the busy one runs the slow run
        try:
            os.kill(w, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    assert "worker died" in err and "1 run(s) failed" in err
    assert len(_records(out)) == 1


def test_force_into_a_running_sweep_clears_nothing(tmp_path, sweep_base):
    """``sweep --force`` while another sweep writes the same --out: refused before anything is
    cleared (the directory's lock comes first), the running sweep's store untouched."""
    out = tmp_path / "out"
    p = sparsebalance("sweep", "--grid", _slow_grid(tmp_path), "--out", out, "--no-progress")
    try:
        assert wait_for(lambda: (out / "runs.sqlite").exists(), timeout=120)
        # SQLite's -wal/-shm files come and go with the running sweep's transactions: not the store
        transient = ("-wal", "-shm", "-journal")
        before = sorted(x.name for x in out.iterdir() if not x.name.endswith(transient))
        q = sparsebalance("sweep", "--grid", _slow_grid(tmp_path), "--out", out, "--force", "--no-progress")
        _, err = q.communicate(timeout=120)
        assert q.returncode == 2 and "another sweep is writing" in err, err
        assert len(err.strip().splitlines()) == 1
        assert (out / "runs.sqlite").exists() and set(before) <= {x.name for x in out.iterdir()}
    finally:
        p.kill()
        p.wait()


def test_second_sweep_into_the_same_out_is_refused(tmp_path, sweep_base):
    out = tmp_path / "out"
    p = sparsebalance("sweep", "--grid", _slow_grid(tmp_path), "--out", out, "--no-progress")
    try:
        assert wait_for(lambda: (out / "runs.sqlite").exists(), timeout=120)
        q = sparsebalance("sweep", "--grid", _slow_grid(tmp_path), "--out", out, "--no-progress")
        _, err = q.communicate(timeout=120)
        assert q.returncode == 2 and "another sweep is writing" in err
        assert len(err.strip().splitlines()) == 1
    finally:
        p.kill()
        p.wait()

