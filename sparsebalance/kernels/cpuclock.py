"""CPU time beside wall time, and pinning CPU workers to cores: what makes a CPU measurement
trustworthy on a small shared host.

* :func:`thread_usage`: this thread's (user + system CPU seconds, system seconds, minor page faults)
  from ``getrusage(RUSAGE_THREAD)`` (Linux); elsewhere ``time.thread_time()`` with 0 system/faults.
  realrun's compute (F/B) runs on the calling thread on the CPU (autograd executes CPU work on the
  thread that calls backward; one intra-op thread), so wall - CPU of an action is time the thread
  was not running: descheduled by another process, or blocked.
* :func:`manual_gc`: Python's cyclic collector off during timed work, run explicitly between
  iterations or profiling rounds (realrun and the profiler alike);
* :func:`pin_to_core`: ``os.sched_setaffinity`` of this process to one core of the cores it may
  use, chosen by local rank; with one worker per core no two workers of a run share a core and the
  scheduler does not migrate them (cache refills).
"""

from __future__ import annotations

import os
import time

try:
    import resource

    _THREAD = getattr(resource, "RUSAGE_THREAD", None)
except ImportError:  # not on POSIX
    resource, _THREAD = None, None

#: Extra measured-trace columns (per row; NaN where not measured): thread CPU seconds, of which
#: system (kernel: page faults, syscalls) seconds, minor page faults, and involuntary context
#: switches (the thread preempted: by another process, or by its own process's other threads).
CPU_COLUMNS = ("cpu_s", "sys_s", "minflt", "nivcsw")


def thread_usage() -> tuple[float, float, int, int]:
    """(CPU seconds, system seconds, minor faults, involuntary switches) of the calling thread."""
    if _THREAD is not None:
        r = resource.getrusage(_THREAD)
        return r.ru_utime + r.ru_stime, r.ru_stime, r.ru_minflt, r.ru_nivcsw
    return time.thread_time(), 0.0, 0, 0


def usage_delta(a: tuple, b: tuple) -> tuple:
    return tuple(y - x for x, y in zip(a, b))


def pin_to_core(local_rank: int) -> int | None:
    """Pin this process to core ``allowed[local_rank % len(allowed)]``; returns the core, or None
    where affinity cannot be set (not Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[local_rank % len(allowed)]
    os.sched_setaffinity(0, {core})
    return core


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_KEEP_SET = False


def _glibc():
    """The C library when it is glibc (the mallopt numbers above are glibc's), else None."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def steady_allocator() -> bool:
    """Keep freed memory in the process (glibc): no ``mmap`` for large blocks and no trimming of the
    heap top, so a tensor allocated after a free of the same size reuses pages already faulted in.

    Why: with glibc's defaults, blocks above the (dynamic, <= 32 MiB) mmap threshold are mapped on
    every allocation and unmapped on free, and the heap top is returned to the OS; each new tensor
    then page-faults all its pages in (the kernel zeroes them: system time). The profiler times an
    op in a steady state where its memory is reused, while a pipeline stage holding several
    micro-batches' activations keeps churning. Measured in docs/validation.md. Returns False where
    mallopt is unavailable (not glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_MAX, 0) == 1
    return bool(ok and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1)


def keep_freed_memory() -> None:
    """The CPU MoBA path's milder form of :func:`steady_allocator`, once per process: blocks up to
    1 GiB come from the heap (mmap threshold) and its free top is not given back (trim threshold).

    Why: each attention call allocates tens of MB of temporaries (gathered tile rows, kernel
    outputs); with glibc's defaults the large ones are unmapped or trimmed when freed and faulted in
    again page by page on the next call. On the project's VM a fault costs ~3 us, which was a third
    of forward + backward at 8,192 tokens (top-64: 0.30 s system time of 1.08 s). The process keeps
    its peak memory, as a training process does anyway. Skipped off glibc, when the user set
    ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``, or with
    ``SPARSEBALANCE_KEEP_FREED_MEMORY=0``."""
    global _KEEP_SET
    if _KEEP_SET:
        return
    _KEEP_SET = True
    env = os.environ
    if env.get("SPARSEBALANCE_KEEP_FREED_MEMORY") == "0" or any(
            v in env for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)


def manual_gc() -> None:
    """Collect, freeze what exists (the model, libraries: later collections skip it) and turn
    automatic collection off; the caller runs ``gc.collect()`` between timed units of work.

    Why: automatic collections start whenever enough Python objects were allocated, so they land
    inside whichever F/B action (or profiled op) happens to run, a cost no profile row holds (a
    realrun rank of the tiny model collected ~900 times over a 6-iteration run, a full collection
    taking up to ~0.3 s on this VM). Autograd graphs are freed by reference counting, not by the
    collector, so turning it off during an iteration keeps no tensor alive."""
    import gc

    gc.collect()
    gc.freeze()
    gc.disable()
