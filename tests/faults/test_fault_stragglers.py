"""The last unclean failures (issue 35, item 2), each one line with the right exit code before any
work or process starts, nothing left behind: an empty data file, a ``runs.sqlite`` that is a
directory, a SIGTERM while ``simulate`` writes, lengths-only data for ``train``, sizes a profile
cannot hold, ``gpu-check`` without CUDA, the store API on the wrong directory, an edited analytical
profile under ``ablation``. Inputs are generated per seed."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path

import pytest
from faultkit import SWEEP_BASE, TINY_REALRUN

from sparsebalance.commands._args import MARKER

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "qwen25-3b_h200_dp4pp4.toml"
SEEDS = range(3)


def _one_line(r, code: int, *needles: str) -> str:
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert r.code == code and len(lines) == 1 and "Traceback" not in r.err, (r.code, r.err[-2000:])
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


# -- an empty data file ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_an_empty_or_blank_jsonl_says_so(tmp_path, run_cli, seed):
    """Before: "no sequence ... is left after the filters (min_length = 1, ...)"."""
    rng = random.Random(seed)
    blank = "".join(rng.choice(["\n", " \n", "\t\n", "\r\n", "   \t \n"]) for _ in range(rng.randint(1, 50)))
    for text, needle in (("", "is empty"), (blank, "holds only blank lines")):
        data = tmp_path / "d.jsonl"
        data.write_text(text)
        out = tmp_path / "o"
        r = run_cli("simulate", "--config", EXAMPLE, "--set", "data.source='jsonl'", "--set", f"data.path='{data}'",
                    "--out", out)
        line = _one_line(r, 2, f"path: {data}", needle)
        assert "min_length" not in line and not out.exists()


# -- a runs.sqlite that is a directory ---------------------------------------------------------------
@pytest.mark.parametrize("force", [False, True])
def test_a_store_that_is_a_directory_is_exit_2(tmp_path, run_cli, force):
    """Before: exit 1 ("unable to open database file"), and the sweep's marker flipped to incomplete."""
    base = tmp_path / "base.toml"
    base.write_text(SWEEP_BASE.replace("iterations = 2", "iterations = 1"))
    argv = ("sweep", "--config", base, "--batching", "sab", "--out", tmp_path / "sw")
    assert run_cli(*argv).code == 0
    marker = (tmp_path / "sw" / MARKER).read_text()
    for f in (tmp_path / "sw").glob("runs.sqlite*"):
        f.unlink()
    (tmp_path / "sw" / "runs.sqlite").mkdir()
    if not force:
        _one_line(run_cli(*argv), 2, "runs.sqlite is not a file, so not a sweep store")
        assert (tmp_path / "sw" / MARKER).read_text() == marker  # untouched
    else:  # our directory: --force starts afresh
        r = run_cli(*argv, "--force")
        assert r.code == 0 and (tmp_path / "sw" / "runs.sqlite").is_file(), r.err


# -- SIGTERM while simulate writes -------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_sigterm_while_simulate_writes_marks_it_incomplete(tmp_path, run_cli, monkeypatch, seed):
    """A real SIGTERM to this process as simulate writes its k-th results file (k drawn per seed):
    exit 143, one line naming the directory as unfinished, its marker incomplete, no truncated file;
    the next run replaces it without --force. Before the first file, no directory at all."""
    from sparsebalance import fsutil

    real = fsutil.atomic_write_bytes
    written: list[str] = []
    k = random.Random(seed).randint(0, 6)

    def write(path, data):
        if len(written) == k and Path(path).parent == tmp_path / "o":
            os.kill(os.getpid(), signal.SIGTERM)  # handled (cli's handler) at the next bytecode
        written.append(Path(path).name)
        return real(path, data)

    monkeypatch.setattr(fsutil, "atomic_write_bytes", write)
    argv = ("simulate", "--config", EXAMPLE, "--iterations", "2", "--out", tmp_path / "o")
    r = run_cli(*argv)
    monkeypatch.undo()
    assert r.code == 143 and "Traceback" not in r.err, r.err
    assert len(r.err.strip().splitlines()) == 1 and "terminated (SIGTERM)" in r.err, r.err
    out = tmp_path / "o"
    results = [p for p in out.iterdir() if p.name != MARKER] if out.exists() else []
    if results:
        assert json.loads((out / MARKER).read_text())["complete"] is False
        assert f"terminated (SIGTERM); {out} holds an unfinished run, marked incomplete" in r.err
        assert not list(out.glob(".*.tmp"))  # every file whole or absent
    else:
        assert not out.exists()
    again = run_cli(*argv)
    assert again.code == 0 and json.loads((out / MARKER).read_text())["complete"] is True, again.err


def test_a_signal_while_the_directory_is_made_leaves_none(tmp_path, run_cli, monkeypatch):
    """The directory is created, marked and registered as one step: a SIGTERM between mkdir and the
    marker waits, then the directory (holding only its marker) is removed."""
    from sparsebalance.commands import _args

    real = _args._lock

    def lock(path):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(path)

    monkeypatch.setattr(_args, "_lock", lock)
    r = run_cli("simulate", "--config", EXAMPLE, "--iterations", "1", "--out", tmp_path / "o")
    assert r.code == 143 and "Traceback" not in r.err and not (tmp_path / "o").exists(), r.err


# -- train with lengths only ------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_train_on_lengths_only_is_refused_before_launch(tmp_path, run_cli, no_launch, seed):
    """Before: rank 0 failed after torchrun started ("sequence 2 has no tokens")."""
    rng = random.Random(seed)
    data = tmp_path / "lengths.jsonl"
    data.write_text("".join(json.dumps({"length": rng.randint(16, 128)}) + "\n" for _ in range(rng.randint(16, 40))))
    cfg = tmp_path / "run.toml"
    cfg.write_text(TINY_REALRUN.format(iterations=2, extra="").replace('source = "text_dir"', 'source = "jsonl"')
                   .replace('path = "stdlib"', f'path = "{data}"'))
    for verb in ("train", "validate"):
        _one_line(run_cli(verb, "--config", cfg, "--out", tmp_path / verb), 2, "lengths without text", str(data))
        assert not (tmp_path / verb).exists()


# -- sizes a profile cannot hold --------------------------------------------------------------------
@pytest.fixture
def no_measure(monkeypatch):
    """Fail the test if the profiler builds its inputs (the first tensors)."""
    from sparsebalance.kernels import profiler

    def refuse(*a, **k):
        raise AssertionError("the profiler started allocating")

    monkeypatch.setattr(profiler.Bench, "__init__", refuse)


@pytest.mark.parametrize("seed", SEEDS)
def test_profile_sizes_past_the_machine_are_refused_before_allocating(tmp_path, run_cli, no_measure, seed):
    """Before: 2^40 tokens died with the allocator's traceback, a block of 10^9 tokens grew to 23 GB."""
    pytest.importorskip("torch")
    rng = random.Random(seed)
    big = 2 ** rng.randint(36, 60)
    out = tmp_path / "p"
    _one_line(run_cli("profile", "--seq-lens", f"64,{big}", "--out", out), 2, "--seq-lens:", "GB", f"{big:,} tokens")
    _one_line(run_cli("profile", "--tokens", f"64,{big}", "--out", out), 2, "--tokens:", f"{big:,} tokens")
    block = rng.randint(2**24 + 1, 10**12)
    _one_line(run_cli("profile", "--block-size", str(block), "--out", out), 2, "--block-size:", f"{block:,}")
    assert not out.exists()


@pytest.mark.parametrize("seed", SEEDS)
def test_the_profile_memory_check_against_a_machine(seed):
    """The check refuses exactly when the estimate passes the memory given, naming the largest part's
    flag; the estimate grows with every axis and with the padded length of a bigger block."""
    from dataclasses import replace

    from sparsebalance.commands._profile_memory import check_memory, grid_memory
    from sparsebalance.errors import ConfigError
    from sparsebalance.kernels.profiler import ProfileGrid
    from sparsebalance.simulator.config import tiny

    rng = random.Random(seed)
    lens = tuple(sorted(rng.sample(range(64, 65536), 3)))
    grid = ProfileGrid(seq_lens=lens, budgets=(1, 4), tokens=(64, 1024), params=(10_000, 100_000))
    need, flag, _ = grid_memory(tiny(), grid)
    check_memory(tiny(), grid, available=need * 1.01)
    with pytest.raises(ConfigError, match=f"^{flag}: measuring this grid needs about"):
        check_memory(tiny(), grid, available=need * 0.99)
    bigger = ProfileGrid(seq_lens=(*lens, lens[-1] * 4), budgets=(1, 4), tokens=(64, 1024), params=(10_000, 100_000))
    assert grid_memory(tiny(), bigger)[0] > need
    short = ProfileGrid(seq_lens=(64, 128), budgets=(1, 4), tokens=(64, 1024), params=(10_000, 100_000))
    need_b, flag_b, _ = grid_memory(replace(tiny(), block_size=rng.randint(2**20, 2**24)), short)
    assert need_b > grid_memory(tiny(), short)[0] and flag_b == "--block-size"  # the padded length
    assert grid_memory(tiny(), grid, concurrency=2)[0] == pytest.approx(2 * need)


# -- gpu-check without CUDA -------------------------------------------------------------------------
def test_gpu_check_without_cuda_leaves_no_directory(tmp_path, run_cli, monkeypatch):
    from sparsebalance.commands import gpu_check

    monkeypatch.setattr(gpu_check, "cuda_device", lambda: None)  # whatever this machine has
    out = tmp_path / "gc"
    _one_line(run_cli("gpu-check", "--out", out), 2, "needs a CUDA GPU", "nothing was run")
    assert not out.exists()  # before: a directory holding summary.md


# -- the result-store API on the wrong directory ------------------------------------------------------
def test_the_store_api_opens_only_a_store(tmp_path):
    """Before: a directory without a store got an empty one (and no records), a missing directory
    raised sqlite's "unable to open database file"."""
    from sparsebalance.analysis.store import ResultStore, RunRecord
    from sparsebalance.errors import ConfigError

    empty = tmp_path / "results"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no sweep store"):
        ResultStore(empty)
    assert list(empty.iterdir()) == []  # nothing created
    with pytest.raises(ConfigError, match="no such directory"):
        ResultStore(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        ResultStore(tmp_path / "file")
    (empty / "runs.sqlite").mkdir()
    with pytest.raises(ConfigError, match="is not a file"):
        ResultStore(empty, create=True)
    (empty / "runs.sqlite").rmdir()
    (empty / "runs.sqlite").write_bytes(b"")  # an empty file: no runs table, never written
    with pytest.raises(ConfigError, match="has no runs table"):
        ResultStore(empty)
    with ResultStore(tmp_path, create=True) as st:  # the sweep's way
        st.append(RunRecord(run_id="r", coords={}, metrics={"x": 1.0}, warnings=["w"]))
    with ResultStore(tmp_path) as st:
        assert [r.warnings for r in st.records()] == [["w"]]


def test_a_store_of_the_previous_schema_gains_the_warnings_column(tmp_path):
    """A version-1 store (7 columns) opened by a sweep gets ``warnings``; its records say None (not
    recorded), never an empty list."""
    import sqlite3

    from sparsebalance.analysis.store import ResultStore

    con = sqlite3.connect(tmp_path / "runs.sqlite")
    con.execute("CREATE TABLE runs (run_id TEXT PRIMARY KEY, schema INTEGER NOT NULL, coords TEXT NOT NULL, "
                "metrics TEXT NOT NULL, timing TEXT NOT NULL, config TEXT NOT NULL, created REAL NOT NULL)")
    con.execute("INSERT INTO runs VALUES ('old', 1, '{}', '{\"x\": 1.0}', '{}', '', 0.0)")
    con.commit()
    con.close()
    with ResultStore(tmp_path, create=True) as st:
        assert [(r.run_id, r.warnings) for r in st.records()] == [("old", None)]


# -- an edited analytical profile under ablation -----------------------------------------------------
@pytest.mark.parametrize("study", ["", "--anchors", "--cp", "--schedules=1f1b,gpipe"])
def test_an_edited_analytical_profile_leaves_no_ablation_directory(tmp_path, run_cli, study):
    """Before: ablation created its directory and wrote config.toml, then refused the profile."""
    import numpy as np
    import pandas as pd

    shipped = ROOT / "sparsebalance" / "data" / "profiles" / "analytical-h200"
    d = tmp_path / "edited"
    shutil.copytree(shipped, d)
    t = pd.read_csv(d / "profile.csv")
    rng = np.random.default_rng(len(study))
    t.loc[rng.integers(len(t)), "latency_s"] *= rng.uniform(1.5, 20)
    t.to_csv(d / "profile.csv", index=False, float_format="%.17g")
    cfg = tmp_path / "run.toml"
    # another model than the sidecar's: the table is re-derived, so an edit would silently vanish
    cfg.write_text(EXAMPLE.read_text().replace('profile = "analytical-h200"', f'profile = "{d}"')
                   .replace('preset = "qwen2.5-3b"', 'preset = "qwen2.5-0.5b"'))
    out = tmp_path / "ab"
    _one_line(run_cli("ablation", "--config", cfg, "--seeds", "0,1", "--iterations", "1", "--out", out,
                      *([study] if study else [])), 2, "not what that sidecar derives")
    assert not out.exists()
