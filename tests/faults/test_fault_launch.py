"""Faults injected into ``sparsebalance train`` (torchrun, 2 CPU workers): a rank killed, a rank
raising, the launcher killed or stopped. Oracles: /proc (no process of the tree survives), the
exit code, and the one line on stderr naming the rank that failed first."""

from __future__ import annotations

import json
import os
import signal
import socket

import pytest
from faultkit import TINY_REALRUN, sparsebalance, tree, wait_for, wait_gone

pytest.importorskip("torch")
pytest.importorskip("transformers")

POLICY = '[policy]\ntuning = "dst"\nk0 = 2\nk_max = 8\n'


def _config(tmp_path, iterations=2000, extra=""):
    p = tmp_path / "run.toml"
    p.write_text(TINY_REALRUN.format(iterations=iterations, extra=extra + "\n" + POLICY))  # extra: [realrun] keys
    return p


def _status(out) -> dict[int, dict]:
    st = {}
    for f in (out / "ranks").glob("rank*.json"):
        try:
            d = json.loads(f.read_text())
        except ValueError:
            continue
        st[d["rank"]] = d
    return st


def _start_training(tmp_path):
    """A long run, returned once both workers are inside the training loop."""
    out = tmp_path / "out"
    p = sparsebalance("train", "--config", _config(tmp_path), "--out", out, "--no-progress")
    ok = wait_for(lambda: len(_status(out)) == 2 and all("stage" in d for d in _status(out).values()),
                  timeout=240, step=0.2)
    if not ok:
        p.kill()
        pytest.fail("workers never started: " + p.communicate()[1][-2000:])
    wait_for(lambda: False, timeout=1.0)  # into the first iterations
    return p, out, tree(p.pid)


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.slow
def test_killed_rank_is_named_and_nothing_survives(tmp_path):
    p, out, pids = _start_training(tmp_path)
    os.kill(_status(out)[1]["pid"], signal.SIGKILL)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1
    line = _one_line(err)
    assert "rank 1 (dp_rank 0, stage 1)" in line and "died without a Python error" in line
    assert "launch.log" in line and (out / "launch.log").stat().st_size > 0
    assert wait_gone(pids) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGKILL, -9), (signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_stopping_the_launcher_ends_torchrun_and_every_worker(tmp_path, sig, code):
    p, _, pids = _start_training(tmp_path)
    assert len(pids) >= 4  # launcher, torchrun, two workers
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == code
    if sig != signal.SIGKILL:
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert wait_gone(pids) == [], "a torchrun process or worker outlived the launcher"


@pytest.mark.slow
def test_raising_rank_is_blamed_not_its_peer(tmp_path):
    cfg = _config(tmp_path, iterations=3, extra="fail_rank = 1\nfail_iteration = 1")
    p = sparsebalance("train", "--config", cfg, "--out", tmp_path / "out", "--no-progress")
    _, err = p.communicate(timeout=300)
    assert p.returncode == 1
    line = _one_line(err)
    assert "rank 1 (dp_rank 0, stage 1) failed: RuntimeError: injected fault" in line
    assert wait_gone(tree(p.pid)) == []
    # what the failed run wrote stays, never taken for a result
    assert json.loads((tmp_path / "out" / ".sparsebalance.json").read_text())["complete"] is False


def test_busy_master_port_is_refused_before_anything_starts(tmp_path, run_cli):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("train", "--config", _config(tmp_path, iterations=1), "--out", tmp_path / "o",
                    "--master-port", port)
    assert r.code == 2 and "--master-port" in _one_line(r.err) and "in use" in r.err
    assert not (tmp_path / "o").exists()
