"""Nothing of the user's is lost through a results path: ``--out`` and ``name`` that resolve to a
directory the user works in are refused in one line; ``--force`` clears only a directory whose marker
was written for it, and never one another sparsebalance process holds. Every case runs from a working
directory of the user's files generated per run (random names and contents), which must survive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from faultkit import TINY_RUN, sparsebalance, wait_for

ROOT = Path(__file__).resolve().parents[2]
TINY = TINY_RUN.replace("{profile}", "cpu-tiny")


@pytest.fixture
def user_dir(tmp_path):
    """A working directory holding the user's files (and a sub-directory of them): name -> content."""
    work = tmp_path / "work"
    (work / "notes").mkdir(parents=True)
    files = {}
    for rel in ("thesis.tex", "data.csv", "notes/todo.txt"):
        files[rel] = uuid.uuid4().hex
        (work / rel).write_text(files[rel])
    return work, files


def _intact(work: Path, files: dict) -> None:
    for rel, text in files.items():
        assert (work / rel).read_text() == text, f"{rel} lost"


def _run(work: Path, *argv, timeout: float = 240):
    p = sparsebalance(*argv, cwd=work)
    _, err = p.communicate(timeout=timeout)
    return p.returncode, err


def _kill_mid_run(work: Path) -> None:
    """A long simulate into ``res``, kill -9 as soon as its results directory is marked."""
    p = sparsebalance("simulate", "--config", "run.toml", "--out", "res", "--iterations", "400", cwd=work)
    try:
        assert wait_for(lambda: (work / "res" / ".sparsebalance.json").exists(), timeout=60)
    finally:
        os.kill(p.pid, 9)
        p.communicate(timeout=60)


def _one_line(code: int, err: str, needle: str) -> None:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, (code, err)


@pytest.mark.parametrize("out", ["", ".", "..", "./", "{work}", "{parent}", "/", "~"])
def test_out_naming_a_shared_directory_is_refused(user_dir, out):
    work, files = user_dir
    (work / "run.toml").write_text(TINY.format(name="tiny"))
    files["run.toml"] = (work / "run.toml").read_text()
    target = out.format(work=work, parent=work.parent)
    if target == "~":
        target = str(Path.home())
    for force in ((), ("--force",)):
        code, err = _run(work, "simulate", "--config", "run.toml", "--no-trace", "--out", target, *force)
        _one_line(code, err, "--out")
        _intact(work, files)
        assert not (work / ".sparsebalance.json").exists()


@pytest.mark.parametrize("name", ["..", ".", " ", "a/b", "..\\x"])
def test_run_name_that_is_not_a_directory_of_its_own_is_refused(user_dir, name):
    work, files = user_dir
    (work / "run.toml").write_text(TINY.format(name=name.replace("\\", "\\\\")))
    code, err = _run(work, "simulate", "--config", "run.toml", "--no-trace")
    _one_line(code, err, "name")
    _intact(work, files)


def test_force_refuses_a_marker_written_for_another_directory(user_dir, tmp_path):
    """A results marker copied (or a results folder's marker moved) into the user's folder does not
    make that folder ours."""
    work, files = user_dir
    (work / "run.toml").write_text(TINY.format(name="tiny"))
    code, err = _run(work, "simulate", "--config", "run.toml", "--no-trace", "--out", "res")
    assert code == 0, err
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    keep = {"a.txt": uuid.uuid4().hex, "sub/b.txt": uuid.uuid4().hex}
    for rel, text in keep.items():
        (mine / rel).write_text(text)
    (mine / ".sparsebalance.json").write_bytes((work / "res" / ".sparsebalance.json").read_bytes())
    code, err = _run(work, "simulate", "--config", "run.toml", "--no-trace", "--out", str(mine), "--force")
    _one_line(code, err, "written for another directory")
    _intact(mine, keep)
    # its own results folder is still replaced by --force
    code, err = _run(work, "simulate", "--config", "run.toml", "--no-trace", "--out", "res", "--force")
    assert code == 0, err
    _intact(work, files)


def test_force_never_clears_a_directory_another_process_holds(user_dir):
    """What a running sweep, simulate or train holds (the directory's lock): --force is refused
    before anything is cleared, whatever the verb."""
    work, files = user_dir
    (work / "run.toml").write_text(TINY.format(name="tiny"))
    code, err = _run(work, "simulate", "--config", "run.toml", "--no-trace", "--out", "res")
    assert code == 0, err
    before = sorted(p.name for p in (work / "res").iterdir())
    holder = subprocess.Popen(
        [sys.executable, "-c", ("import fcntl, os, sys, time\n"
                                "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
                                "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(120)\n"),
         str(work / "res")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, err = _run(work, "simulate", "--config", "run.toml", "--no-trace", "--out", "res", "--force")
        _one_line(code, err, "another simulate is writing to")
        assert sorted(p.name for p in (work / "res").iterdir()) == before
    finally:
        holder.kill()
        holder.wait()
    _intact(work, files)


def test_lock_is_released_with_the_process(user_dir):
    """A verb that ended (even by kill -9) leaves no lock behind: the next --force goes through."""
    work, _ = user_dir
    (work / "run.toml").write_text(TINY.format(name="tiny"))
    _kill_mid_run(work)
    code, err = _run(work, "simulate", "--config", "run.toml", "--no-trace", "--out", "res", "--force")
    assert code == 0, err


def test_a_run_that_fails_after_its_directory_exists_leaves_none(user_dir):
    """A check that needs the run (here: P2P seconds overflow at a 1e-307 B/s link) fails after the
    results directory was made: the directory goes with it, and the corrected run needs no --force."""
    work, files = user_dir
    (work / "run.toml").write_text(TINY.format(name="tiny"))
    code, err = _run(work, "simulate", "--config", "run.toml", "--no-trace", "--out", "res", "--profile-as-is",
                     "--set", "cluster.p2p_bandwidth=1e-307")
    _one_line(code, err, "finite")
    assert not (work / "res").exists()
    # with calibration (a measured profile on another CPU) the directory holds the calibrated
    # profile when the run fails: it stays, marked incomplete, and is replaced without --force
    code, err = _run(work, "simulate", "--config", "run.toml", "--no-trace", "--out", "res",
                     "--set", "cluster.p2p_bandwidth=1e-307")
    assert code == 2 and "finite" in err, err
    if (work / "res").exists():
        assert json.loads((work / "res" / ".sparsebalance.json").read_text())["complete"] is False
    code, err = _run(work, "simulate", "--config", "run.toml", "--no-trace", "--out", "res")
    assert code == 0, err
    assert json.loads((work / "res" / ".sparsebalance.json").read_text())["complete"] is True
    _intact(work, files)


def test_a_killed_run_is_marked_incomplete_and_replaced_without_force(user_dir):
    """kill -9 mid-run: the marker still says ``complete: false`` (never a result); the same command
    replaces those files without --force, saying so."""
    work, _ = user_dir
    (work / "run.toml").write_text(TINY.format(name="tiny"))
    _kill_mid_run(work)
    mark = json.loads((work / "res" / ".sparsebalance.json").read_text())
    if mark["complete"]:
        pytest.skip("the run finished before the kill landed")
    code, err = _run(work, "simulate", "--config", "run.toml", "--no-trace", "--out", "res")
    assert code == 0 and "did not finish; replacing them" in err, err
    assert json.loads((work / "res" / ".sparsebalance.json").read_text())["complete"] is True


def test_a_verb_frees_its_directory_when_it_ends(tmp_path, run_cli):
    """In one process (the Python API, a notebook) a verb's lock ends with the verb: a directory a
    failed run removed and made again is locked afresh, and once the verb returns another process
    can take the directory."""
    (tmp_path / "run.toml").write_text(TINY.format(name="tiny"))
    args = ("simulate", "--config", tmp_path / "run.toml", "--no-trace", "--profile-as-is", "--out", tmp_path / "res")
    assert run_cli(*args, "--set", "cluster.p2p_bandwidth=1e-307").code == 2
    assert not (tmp_path / "res").exists()
    r = run_cli(*args)
    assert r.code == 0, r.err
    take = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n")
    probe = subprocess.run([sys.executable, "-c", take, str(tmp_path / "res")],
                           capture_output=True, text=True, timeout=60, check=False)
    assert probe.returncode == 0, probe.stderr
