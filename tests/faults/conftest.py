"""Fixtures of the fault-injection suite (helpers: faultkit.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import faultkit
import pytest
from faultkit import SWEEP_BASE


@pytest.fixture
def sweep_base(tmp_path) -> Path:
    p = tmp_path / "base.toml"
    p.write_text(SWEEP_BASE)
    return p


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if the verb reaches torchrun or starts any process (``train``/``validate`` must
    refuse before either)."""
    import sparsebalance.realrun.launch as L

    def refuse(*a, **k):
        raise AssertionError(f"a process was started: {a[:1]}")

    monkeypatch.setattr(L, "launch", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.fixture(autouse=True)
def _nothing_left_running():
    """A test that fails half-way (a timeout) must not leave its launcher and workers training."""
    yield
    while faultkit.STARTED:
        p = faultkit.STARTED.pop()
        if p.poll() is None:
            faultkit.kill_all(faultkit.tree(p.pid))
            p.wait()
