"""Process trees: descendants from /proc, ending them, and children that die with their parent."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparsebalance.procutil import descendants, dying_with_us, end_processes, pid_alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl")

# a child that starts a grandchild (sleep) and prints its pid, then sleeps
PARENT = ("import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', "
          "'import time; time.sleep(300)']); print(g.pid, flush=True); time.sleep(300)")


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not cond():
        time.sleep(0.05)
    return cond()


def test_descendants_and_end_processes():
    p = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    grandchild = int(p.stdout.readline())
    assert grandchild in descendants(p.pid)
    forced = end_processes([p.pid, grandchild], grace_s=5.0)
    assert forced == []  # SIGTERM was enough
    p.wait(timeout=10)
    assert _wait(lambda: not pid_alive(grandchild))


def test_a_wrapped_child_dies_when_its_parent_is_killed():
    # middle process: starts a dying_with_us child and prints its pid; then we SIGKILL the middle
    code = ("import subprocess, sys, time; from sparsebalance.procutil import dying_with_us; "
            "c = subprocess.Popen(dying_with_us([sys.executable, '-c', 'import time; time.sleep(300)'])); "
            "print(c.pid, flush=True); time.sleep(300)")
    mid = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(mid.stdout.readline())
    assert _wait(lambda: b"time.sleep(300)" in Path(f"/proc/{child}/cmdline").read_bytes())
    mid.kill()
    mid.wait(timeout=10)
    assert _wait(lambda: not pid_alive(child)), "the child outlived its SIGKILLed parent"


def test_dying_with_us_execs_the_command_in_place():
    out = subprocess.run(dying_with_us([sys.executable, "-c", "print('hi')"]), capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0 and out.stdout == "hi\n"
