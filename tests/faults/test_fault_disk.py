"""A full disk, a full stdout and a damaged store are one line each (issue 23, item 2): exit 1 for the
machine (ENOSPC, SQLite's "database or disk is full"), 2 for a damaged input, the file named, and no
directory marked complete with a truncated file in it.

A real full file system needs root to mount; stdout uses /dev/full, file writes run the verb in
process with ``open`` patched to fail once a byte budget drawn per seed is spent (so the disk fills
at a different file each run), and the store with a connection that fails its k-th insert."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import random
import sqlite3
from pathlib import Path

import pytest
from faultkit import SWEEP_BASE, TINY_RUN, sparsebalance

TINY = TINY_RUN.replace("{profile}", "cpu-tiny").format(name="tiny")
MARKER = ".sparsebalance.json"


def _one_line(r, code: int, *needles: str) -> str:
    lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
    assert r.code == code and len(lines) == 1 and "Traceback" not in r.err, (r.code, r.err[-2000:])
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [("--help",), ("simulate", "--help"), ("pipeline", "--config", "{d}"),
                                  ("pipeline", "--config", "{d}", "--json")])
def test_stdout_on_a_full_device_is_exit_1(tmp_path, argv):
    d = tmp_path / "d.json"
    d.write_text(json.dumps({"forward": [[1, 2], [1, 2]], "backward": [[2, 3], [2, 3]]}))
    with open("/dev/full", "w") as full:
        p = sparsebalance(*(a.format(d=d) for a in argv), stdout=full)
        _, err = p.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, (p.returncode, err)
    assert "standard output: No space left on device" in lines[0]


class _SmallDisk:
    """``open`` for files under ``root`` whose writes fail with ENOSPC once ``budget`` bytes are
    written in all (what a disk filling up does), everything else untouched."""

    def __init__(self, root: Path, budget: int):
        self.root, self.left, self.real = str(root), budget, io.open

    def open(self, file, mode="r", *a, **kw):
        f = self.real(file, mode, *a, **kw)
        name = os.path.realpath(file) if isinstance(file, (str, Path)) else f"/proc/self/fd/{file}"
        if isinstance(file, int):
            name = os.path.realpath(name)
        if any(m in mode for m in "wax+") and name.startswith(self.root):
            return _Limited(f, self)
        return f


class _Limited:
    def __init__(self, f, disk: _SmallDisk):
        self._f, self._disk = f, disk

    def write(self, data):
        n = len(data)
        if n > self._disk.left:
            self._disk.left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._disk.left -= n
        return self._f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


@pytest.mark.parametrize("seed", range(4))
def test_a_disk_filling_during_simulate_leaves_no_result(tmp_path, run_cli, monkeypatch, seed):
    (tmp_path / "run.toml").write_text(TINY)
    out = (tmp_path / "o").resolve()
    disk = _SmallDisk(out, random.Random(seed).randrange(0, 60_000))  # a full run writes ~75 KB
    monkeypatch.setattr(io, "open", disk.open)
    monkeypatch.setattr(builtins, "open", disk.open)
    r = run_cli("simulate", "--config", tmp_path / "run.toml", "--out", out, "--profile-as-is")
    monkeypatch.undo()
    line = _one_line(r, 1, "No space left on device")
    assert str(out) in line or "o/" in line, line  # the file (or the results directory) is named
    if out.exists():  # what it wrote stays marked incomplete; nothing half-written is a result
        assert json.loads((out / MARKER).read_text())["complete"] is False
        assert not list(out.glob(".*.tmp"))
        for f in out.glob("*.json"):
            json.loads(f.read_text())
        for f in out.glob("*.csv"):
            assert f.read_text().endswith("\n")
    r = run_cli("simulate", "--config", tmp_path / "run.toml", "--out", out, "--profile-as-is", "--no-trace")
    assert r.code == 0, r.err  # the same command, with room, replaces it without --force


class _FullAfter:
    """An ``sqlite3`` module whose connections fail their ``k``-th insert (and every later one)
    with "database or disk is full", as SQLite does when the disk fills."""

    def __init__(self, k: int):
        self.k = k
        self.__dict__.update({n: getattr(sqlite3, n) for n in ("DatabaseError", "OperationalError")})

    def connect(self, *a, **kw):
        return _Conn(sqlite3.connect(*a, **kw), self)


class _Conn:
    def __init__(self, db, full: _FullAfter):
        self._db, self._full = db, full

    def execute(self, sql, *a):
        if sql.startswith("INSERT"):
            self._full.k -= 1
            if self._full.k < 0:
                raise sqlite3.OperationalError("database or disk is full")
        return self._db.execute(sql, *a)

    def __getattr__(self, name):
        return getattr(self._db, name)


@pytest.mark.parametrize("seed", range(2))
def test_a_full_disk_during_sweep_keeps_the_stored_runs(tmp_path, run_cli, monkeypatch, seed):
    from sparsebalance.analysis import store

    base = tmp_path / "base.toml"
    base.write_text(SWEEP_BASE.replace("iterations = 2", "iterations = 1"))
    out = tmp_path / "sw"
    k = random.Random(seed).randrange(0, 3)  # the grid has 3 runs: sab, lbb and the baseline
    monkeypatch.setattr(store, "sqlite3", _FullAfter(k))
    argv = ("sweep", "--config", base, "--batching", "sab,lbb", "--out", out, "--jobs", "1")
    r = run_cli(*argv)
    monkeypatch.undo()
    _one_line(r, 1, f"store: {out / 'runs.sqlite'}", "database or disk is full")
    if k == 0:  # nothing stored: a fresh sweep leaves no directory
        assert not out.exists()
    else:
        assert json.loads((out / MARKER).read_text())["complete"] is False
        with store.ResultStore(out) as st:
            assert len(st) == k  # every run stored before the disk filled is there, intact
    r = run_cli(*argv)
    assert r.code == 0 and f"{k} already in" in r.out, r.err


def _damage(out: Path, how: str, rng: random.Random) -> None:
    db = out / "runs.sqlite"
    if how == "garbage":
        db.write_bytes(rng.randbytes(rng.randint(1, 50_000)))
        return
    con = sqlite3.connect(db)
    if how == "bad-json":
        col = rng.choice(["coords", "metrics", "timing"])
        junk = "".join(rng.choice("{[\"':,x0") for _ in range(rng.randint(0, 40))) + "{"  # never JSON
        n = con.execute("SELECT count(*) FROM runs").fetchone()[0]
        con.execute(f"UPDATE runs SET {col} = ? WHERE rowid = ?", (junk, rng.randint(1, n)))
    else:  # another tool's `runs` table
        con.execute("DROP TABLE runs")
        cols = rng.sample(["a", "b", "run_id", "metrics", "stamp", "value"], rng.randint(1, 4))
        con.execute(f"CREATE TABLE runs ({', '.join(cols)})")
    con.commit()
    con.close()


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("how", ["garbage", "bad-json", "other-schema"])
def test_a_damaged_store_is_one_line_naming_it(tmp_path, run_cli, how, seed):
    out = tmp_path / "sw"
    base = tmp_path / "base.toml"
    base.write_text(SWEEP_BASE.replace("iterations = 2", "iterations = 1"))
    argv = ("sweep", "--config", base, "--batching", "sab", "--out", out, "--jobs", "1")
    assert run_cli(*argv).code == 0
    _damage(out, how, random.Random(f"{how}-{seed}"))  # then the same sweep resumes from it
    _one_line(run_cli(*argv), 2, f"store: {out / 'runs.sqlite'}")


@pytest.mark.parametrize("exc,code,needle", [
    (MemoryError(), 1, "out of memory"),
    (OSError(errno.EIO, "Input/output error", "/data/x.jsonl"), 1, "/data/x.jsonl: Input/output error"),
    (sqlite3.OperationalError("disk I/O error"), 1, "SQLite: disk I/O error"),
    (RecursionError("maximum recursion depth exceeded"), 2, "RecursionError"),
    (OverflowError("int too large to convert to float"), 2, "OverflowError"),
])
def test_what_escapes_a_verb_is_one_line(tmp_path, run_cli, monkeypatch, exc, code, needle):
    """The net in cli.main: what no check named still ends as one line with the right exit code."""
    from sparsebalance.commands import pipeline

    def fail(*a, **k):
        raise exc

    monkeypatch.setattr(pipeline, "load_durations", fail)
    _one_line(run_cli("pipeline", "--config", tmp_path / "d.json"), code, needle)
