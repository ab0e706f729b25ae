"""How busy the host was while our processes ran: the measurement's own load record.

On a shared host the load average says little about a 30-second run. Instead, around each run,
read the host's busy CPU seconds (``/proc/stat``) and the CPU seconds of our finished child
processes (``getrusage(RUSAGE_CHILDREN)``: torchrun and the workers it waited for); the rest is
**foreign** CPU: other jobs competing for the cores (in cores, averaged over the run). Steal time
(the hypervisor running other guests) is recorded too. Linux only; elsewhere the fields are None.
:func:`judged_window` times a block, judges it (``analysis/disturbance.py``) and prints the host
line beside the figures: what the benchmarks use.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


def _stat() -> tuple[float, float] | None:
    """(busy seconds, steal seconds) of all CPUs since boot, or None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    steal = v[7] if len(v) > 7 else 0
    # guest time is already counted in user on Linux: sum the first 8 fields only
    return (sum(v[:8]) - idle - steal) / tick, steal / tick


def _own() -> float:
    r, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


@dataclass(slots=True)
class HostLoad:
    """Start with :meth:`start`, finish with :meth:`stop`; fields in seconds and cores."""

    wall_s: float = 0.0
    own_cpu_s: float = 0.0
    """CPU seconds of this process and its waited-for children (the run) over the window."""
    foreign_cores: float | None = None
    """Other processes' CPU over the window / its wall time (0 = a quiet host)."""
    steal_cores: float | None = None
    verdict: Any = None
    """The :class:`~sparsebalance.analysis.disturbance.Verdict` once :func:`judged_window` ends."""
    _t0: float = 0.0
    _s0: tuple[float, float] | None = None
    _o0: float = 0.0

    def start(self) -> HostLoad:
        self._t0, self._s0, self._o0 = time.perf_counter(), _stat(), _own()
        return self

    def stop(self) -> HostLoad:
        s1 = _stat()
        self.wall_s = time.perf_counter() - self._t0
        self.own_cpu_s = _own() - self._o0
        if s1 is not None and self._s0 is not None and self.wall_s > 0:
            busy = s1[0] - self._s0[0]
            self.foreign_cores = max(0.0, busy - self.own_cpu_s) / self.wall_s
            self.steal_cores = (s1[1] - self._s0[1]) / self.wall_s
        return self

    def record(self) -> dict:
        return {"wall_s": self.wall_s, "own_cpu_s": self.own_cpu_s, "foreign_cores": self.foreign_cores,
                "steal_cores": self.steal_cores}


def host_cores() -> int:
    """The host's CPUs: /proc/stat's busy time sums over all of them, whatever our affinity."""
    return os.cpu_count() or 1


@contextmanager
def judged_window(what: str, *, cores: int = 1, emit: Callable[[str], None] = print) -> Iterator[HostLoad]:
    """Record the host's load over the ``with`` block (``cores``: the cores the timed work uses),
    then judge it and ``emit`` one host line, with DISTURBED and the reason when the judge says so;
    the verdict is left on the yielded record. A block that raises is not judged."""
    from sparsebalance.analysis.disturbance import host_line, judge

    load = HostLoad().start()
    yield load
    load.stop()
    rec = [load.record()]
    load.verdict = judge(rec, cores=cores, host_cores=host_cores())
    emit(host_line(rec, load.verdict, cores=cores, what=what))
