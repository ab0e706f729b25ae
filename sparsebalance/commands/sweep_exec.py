"""How a sweep runs its grid points: one pure function per point, and interchangeable backends.

* :func:`run_point` ``(RunSpec) -> RunRecord``: builds the run config, simulates it and summarises
  it; no side effects (the coordinating process stores the record). Raises on failure.
* A backend executes many specs: ``backend.execute(specs)`` is an iterator that yields
  ``(spec, RunRecord | RunFailure)`` as each run finishes. Closing the iterator, or an exception in
  the consumer (Ctrl-C, SIGTERM), stops every worker at once; finished records were yielded already.
  :class:`LocalBackend` runs in this process (``jobs = 1``) or in spawned worker processes that the
  kernel kills if this process dies (``procutil.die_with_parent``). A Ray backend plugs in as another
  class with the same ``execute`` (``sweep --backend``), calling the same :func:`run_point`.
* :func:`run_id` names a run by a hash of everything that determines its numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sparsebalance.analysis.store import RESULT_SCHEMA_VERSION, RunRecord
from sparsebalance.errors import NoteWarning


@dataclass(kw_only=True, slots=True, frozen=True)
class RunSpec:
    """One grid point, ready to run anywhere (picklable, no open files)."""

    run_id: str
    config: dict[str, Any]
    """The resolved run config as a mapping (``RunConfig.to_dict()`` without ``base_dir``)."""
    base_dir: str
    """Directory the config's relative paths (profile, data) resolve against."""
    coords: dict[str, Any]
    """Grid coordinates, the tidy table's columns."""


@dataclass(kw_only=True, slots=True, frozen=True)
class RunFailure:
    """A run that did not finish: its error in one line."""

    run_id: str
    error: str


def run_id(cfg) -> str:
    """16 hex digits of SHA-256 over the full resolved config (base, overrides, iterations, seed, ...;
    ``output_dir`` left out), the profile's bytes, the result schema and the package version."""
    from sparsebalance import __version__
    from sparsebalance.simulator.cost.catalog import profile_fingerprint

    d = cfg.to_dict()
    d.pop("base_dir", None)
    d.pop("output_dir", None)
    data_path = cfg.resolve(cfg.data.path)
    payload = {"schema": RESULT_SCHEMA_VERSION, "version": __version__, "config": d,
               "profile": profile_fingerprint(cfg.profile, cfg.base_dir),
               "data_path": str(data_path.resolve()) if data_path else None}
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_spec(cfg, coords: dict[str, Any]) -> RunSpec:
    d = cfg.to_dict()
    d.pop("base_dir", None)
    return RunSpec(run_id=run_id(cfg), config=d, base_dir=cfg.base_dir, coords=coords)


def run_point(spec: RunSpec) -> RunRecord:
    """Simulate one grid point and return its record (deterministic metrics apart from timing; the
    run's meaning warnings in ``warnings``, not shown here: the coordinator shows and judges them)."""
    from sparsebalance.analysis.sweep import METRICS, TIMING, summarize
    from sparsebalance.commands._warnings import captured
    from sparsebalance.runconfig import dump_toml, run_config_from_mapping
    from sparsebalance.runner import run_simulation

    t0 = time.perf_counter()
    with captured() as warned:  # the run's own: carried in its record, shown and judged by the sweep
        cfg = run_config_from_mapping(spec.config, base_dir=spec.base_dir)
        m = run_simulation(cfg, progress=False).metrics
    return RunRecord(run_id=spec.run_id, coords=dict(spec.coords), metrics=summarize(m, METRICS),
                     timing={**summarize(m, TIMING), "wall_s": time.perf_counter() - t0},
                     config=dump_toml(cfg), warnings=warned)


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class LocalBackend:
    """Runs specs on this machine: in this process for ``jobs = 1``, else ``jobs`` spawned workers."""

    name = "local"

    def __init__(self, jobs: int = 1, *, grace_s: float = 2.0):
        self.jobs, self.grace_s = jobs, grace_s

    def execute(self, specs: list[RunSpec]) -> Iterator[tuple[RunSpec, RunRecord | RunFailure]]:
        if self.jobs <= 1 or len(specs) <= 1:
            for spec in specs:
                try:
                    yield spec, run_point(spec)
                except Exception as e:  # noqa: BLE001  (one failed run does not stop the others)
                    yield spec, RunFailure(run_id=spec.run_id, error=_one_line(e))
            return
        yield from _Pool(min(self.jobs, len(specs)), self.grace_s).run(specs)


class _Pool:
    """Spawned workers, one duplex pipe each: the parent hands a worker its next spec when it is
    idle, so nothing is queued inside a worker and stopping loses only the runs in flight. Workers
    ignore SIGINT (a terminal Ctrl-C reaches the whole foreground group; only this process decides)
    and die with this process (PDEATHSIG). A worker that dies fails its run and is replaced."""

    def __init__(self, n: int, grace_s: float):
        import multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.n, self.grace_s = n, grace_s

    def run(self, specs: list[RunSpec]):
        from multiprocessing.connection import wait

        from sparsebalance.procutil import end_processes

        todo = list(range(len(specs)))[::-1]  # pop() from the end = spec order
        workers: dict[Any, tuple[Any, int | None]] = {}  # conn -> (process, index it runs)
        pending = len(specs)

        def start() -> None:
            parent, child = self.ctx.Pipe()
            with _sigint_ignored():  # the child inherits SIG_IGN for SIGINT
                p = self.ctx.Process(target=_worker, args=(child, os.getpid()), daemon=True)
                p.start()
            child.close()
            workers[parent] = (p, None)
            feed(parent)

        def feed(conn) -> None:
            p, _ = workers[conn]
            i = todo.pop() if todo else None
            try:
                conn.send(None if i is None else (i, specs[i]))
            except OSError:  # the worker died between runs: its next run goes back, a new one starts
                if i is not None:
                    todo.append(i)
                del workers[conn]
                conn.close()
                p.join(timeout=self.grace_s)
                if todo:
                    start()
                return
            workers[conn] = (p, i)

        try:
            for _ in range(min(self.n, len(specs))):
                start()
            while pending:
                busy = {c: p for c, (p, i) in workers.items() if i is not None}
                ready = wait(list(busy) + [p.sentinel for p in busy.values()], timeout=1.0)
                for conn, p in busy.items():
                    if conn in ready:
                        try:
                            msg = conn.recv()
                        except (EOFError, OSError):
                            msg = None
                        if msg is not None and msg[0] == "warn":  # a worker's note (run_point keeps
                            warnings.warn(msg[1], NoteWarning, stacklevel=1)  # the others in the record)
                            continue
                        if msg is not None:
                            pending -= 1
                            workers[conn] = (p, None)
                            yield specs[msg[1]], msg[2]
                            feed(conn)
                            continue
                    if p.sentinel in ready or not p.is_alive():  # died (OOM, kill) mid-run
                        p.join(timeout=self.grace_s)
                        _, i = workers.pop(conn)
                        conn.close()
                        pending -= 1
                        yield specs[i], RunFailure(run_id=specs[i].run_id,
                                                   error=f"worker died (exit code {p.exitcode})")
                        if todo:
                            start()
        finally:
            procs = [p for p, _ in workers.values()]
            end_processes([p.pid for p in procs if p.pid and p.is_alive()], grace_s=self.grace_s)
            for p in procs:
                p.join(timeout=self.grace_s)
            for conn in workers:
                conn.close()


class _sigint_ignored:
    def __enter__(self):
        import threading

        self.old = None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGINT, signal.SIG_IGN)

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)


def _worker(conn, parent: int) -> None:
    from sparsebalance.procutil import die_with_parent

    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import threading

    from tqdm import tqdm

    # tqdm's default lock is a named multiprocessing semaphore here (spawn); a worker ended by
    # SIGTERM/SIGKILL would leave it for the resource tracker to report. A thread lock is enough.
    tqdm.set_lock(threading.RLock())

    def forward(message, category, filename, lineno, file=None, line=None):
        conn.send(("warn", str(message)))

    warnings.showwarning = forward
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):
            return
        if item is None:
            return
        i, spec = item
        try:
            out: RunRecord | RunFailure = run_point(spec)
        except Exception as e:  # noqa: BLE001  (reported as the run's failure)
            out = RunFailure(run_id=spec.run_id, error=_one_line(e))
        conn.send(("done", i, out))
