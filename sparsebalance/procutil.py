"""Processes that never outlive the process that started them (Linux), and ending process trees.

* :func:`die_with_parent` asks the kernel to SIGKILL the calling process when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``), which holds even when the parent itself is SIGKILLed and cannot
  clean up. Sweep workers, torchrun (:func:`dying_with_us`) and realrun workers use it, so a
  ``kill -9`` of ``sparsebalance`` leaves no orphan.
* :func:`descendants` walks ``/proc`` for a process's children, grandchildren, ...; torchrun starts
  every worker in a session of its own, so ending torchrun's process group alone does not reach them.
* :func:`end_processes` sends SIGTERM, waits a grace period, then SIGKILLs what is left.

On systems without ``/proc`` or ``prctl`` these degrade to no-ops (documented in docs/reliability.md).
Imports no part of the package.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterable

PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits. If the parent is already
    gone (``expected_parent`` given and no longer our parent), exit at once. Returns whether the
    request was made (False off Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)  # the parent died before the request took effect
    return True


def dying_with_us(argv: list[str]) -> list[str]:
    """``argv`` wrapped so that the started program is SIGKILLed when this process dies: a tiny
    Python trampoline sets PDEATHSIG (which survives exec) and execs ``argv`` in place (same pid).
    Used instead of ``Popen(preexec_fn=...)``, which is unsafe in a process with threads."""
    code = ("import os, sys; from sparsebalance.procutil import die_with_parent; "
            "die_with_parent(int(sys.argv[1])); os.execv(sys.argv[2], sys.argv[2:])")
    return [sys.executable, "-c", code, str(os.getpid()), *argv]


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _parents() -> dict[int, int]:
    out: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out[int(name)] = ppid
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), from ``/proc``; [] where unavailable."""
    parents = _parents()
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def end_processes(pids: Iterable[int], *, grace_s: float = 5.0, groups: Iterable[int] = ()) -> list[int]:
    """SIGTERM ``pids`` (and the process ``groups``), wait up to ``grace_s`` for them to exit, then
    SIGKILL the rest. Returns the pids that needed SIGKILL."""
    pids = [p for p in set(pids) if p != os.getpid()]
    groups = [g for g in set(groups) if g not in (0, os.getpgrp())]
    _signal_all(pids, groups, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if pid_alive(p)]
    _signal_all(left, groups, signal.SIGKILL)
    return left


def _signal_all(pids: Iterable[int], groups: Iterable[int], sig: int) -> None:
    for g in groups:
        try:
            os.killpg(g, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass
