"""Helpers of the fault-injection suite (imported by its tests): start ``sparsebalance`` as a real process, find its process
tree in /proc, and wait (bounded) until processes are gone. Bounds are hang guards, not timings."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sparsebalance.procutil import descendants, pid_alive

ROOT = Path(__file__).resolve().parents[2]
STARTED: list[subprocess.Popen] = []
"""Every process :func:`sparsebalance` started; conftest kills what a failed test left running."""

SWEEP_BASE = """
name = "f"
iterations = 2
profile = "analytical-h200"
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


def sparsebalance(*argv, **kw) -> subprocess.Popen:
    """``python -m sparsebalance ARGV`` as a child with SIGINT at its default (a background job of
    a non-interactive shell would inherit SIG_IGN) and OMP_NUM_THREADS=1."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # A Ctrl-C'd user's process has SIGINT at its default; under `make test &` pytest inherits
    # SIG_IGN and so would the child. exec resets a handled signal to its default, an ignored one not.
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        p = subprocess.Popen([sys.executable, "-m", "sparsebalance", *map(str, argv)], cwd=kw.pop("cwd", None),
                             env=env, **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True,
                                         **kw})  # a test may hand its own stdout (/dev/full)
    finally:
        signal.signal(signal.SIGINT, old)
    STARTED.append(p)
    return p


def kill_all(pids) -> None:
    """SIGKILL whatever of ``pids`` still lives (clean-up after a failed test, so nothing lingers)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants."""
    return [pid, *descendants(pid)]


def wait_gone(pids, timeout: float = 20.0) -> list[int]:
    """Poll until none of ``pids`` is alive or ``timeout`` passes; returns those still alive."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if pid_alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if pid_alive(p)]
    return left


def wait_for(cond, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()



#: A real-run config of the tiny model on stdlib text (PP 2, 4 sequences a batch) that torchrun runs
#: in seconds on this CPU; format ``iterations`` and ``extra`` (more TOML, appended).
TINY_REALRUN = """
name = "f"
iterations = {iterations}
profile = "analytical-h200"
[model]
preset = "tiny"
[cluster]
pp = 2
global_batch = 4
[data]
source = "text_dir"
path = "stdlib"
num_sequences = 16
max_length = 128
[realrun]
timeout_s = 30
{extra}
"""

#: A run config of the tiny model on the CPU that simulates in about a second; format ``name`` and
#: ``profile`` (a shipped name or a path).
TINY_RUN = """
name = "{name}"
iterations = 1
profile = "{profile}"
[model]
preset = "tiny"
[cluster]
device = "cpu"
pp = 2
global_batch = 4
[data]
distribution = "chatqa2-like"
num_sequences = 16
max_length = 2048
"""
