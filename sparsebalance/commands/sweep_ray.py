"""The Ray backend of ``sparsebalance sweep --backend ray [--address ADDR]``.

Another executor of :func:`~sparsebalance.commands.sweep_exec.run_point`: each grid point is one Ray
task; records come back to the coordinating process, which stores them exactly as with the local
backend (one SQLite transaction per finished run), so results are the same rows and values, a
killed sweep resumes with the same command, and the progress bar counts finished runs.

* no ``--address``: an embedded Ray on this machine with ``--jobs`` worker CPUs (started here,
  shut down at the end);
* ``--address host:port`` (or ``ray://host:port``, or ``auto`` inside a Ray job): join a running
  cluster (``ray start --head`` + ``ray start --address``; ``examples/slurm/sbatch_sweep_ray.sh``
  starts one over a SLURM allocation). The workers import this package: install it on every node
  (a shared file system with the same virtual environment does it).

At most twice as many tasks as the cluster has CPUs are in flight (the rest wait here), so a stop
(Ctrl-C, SIGTERM) cancels only those. Ray is the optional extra ``[cluster]``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

from sparsebalance.commands.sweep_exec import RunFailure, RunSpec, _one_line, run_point
from sparsebalance.errors import ConfigError

EXTRA_HINT = "pip install 'sparsebalance[cluster]'"


def _task(spec: RunSpec):
    """One grid point on a Ray worker: its record, or its failure in one line."""
    try:
        return run_point(spec)
    except Exception as e:  # noqa: BLE001  (one failed run does not stop the others)
        return RunFailure(run_id=spec.run_id, error=_one_line(e))


def check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """ConfigError (exit 2) unless ``host:port`` of ``address`` accepts a TCP connection: Ray's own
    connection attempts retry for minutes before giving up."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"--address: expected HOST:PORT (or ray://HOST:PORT, or auto), got {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConfigError(f"--address: cannot reach a Ray cluster at {address} ({e.strerror or e})") from None


class RayBackend:
    """Runs specs as Ray tasks (see the module docstring)."""

    name = "ray"

    def __init__(self, address: str | None = None, jobs: int = 1) -> None:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ConfigError(f"--backend ray: Ray is not installed; it is the optional extra "
                              f"[cluster]: {EXTRA_HINT}") from None
        if address is not None:
            check_reachable(address)
        self.address, self.jobs = address, jobs

    def _start(self) -> bool:
        """Connect or start Ray; True when this process started it (and must shut it down)."""
        import ray

        if ray.is_initialized():
            return False
        kw = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
        if self.address is None:
            ray.init(num_cpus=self.jobs, object_store_memory=256 * 1024 * 1024, **kw)
        else:
            try:
                ray.init(address=self.address, **kw)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ConfigError(f"--address: cannot join the Ray cluster at {self.address}: "
                                  f"{_one_line(e)}") from None
        return True

    def execute(self, specs: list[RunSpec]) -> Iterator[tuple[RunSpec, object]]:
        import ray

        if not specs:
            return
        started = self._start()
        remote = ray.remote(num_cpus=1, max_retries=1)(_task)
        cpus = int(ray.cluster_resources().get("CPU", 1)) or 1
        window = max(2 * cpus, 1)
        todo = list(reversed(specs))  # pop() from the end = spec order
        flight: dict = {}
        try:
            while todo or flight:
                while todo and len(flight) < window:
                    spec = todo.pop()
                    flight[remote.remote(spec)] = spec
                done, _ = ray.wait(list(flight), num_returns=1)
                for ref in done:
                    spec = flight.pop(ref)
                    try:
                        out = ray.get(ref)
                    except Exception as e:  # noqa: BLE001  (a worker that died: the run failed)
                        out = RunFailure(run_id=spec.run_id, error=_one_line(e))
                    yield spec, out
        finally:
            for ref in flight:
                ray.cancel(ref, force=True)
            if started:
                ray.shutdown()


def make_backend(kind: str, address: str | None, jobs: int):
    """The sweep's backend: ``local`` (processes here) or ``ray``."""
    from sparsebalance.commands.sweep_exec import LocalBackend

    if kind == "local":
        if address is not None:
            raise ConfigError("--address: only with --backend ray")
        return LocalBackend(jobs)
    return RayBackend(address, jobs if jobs > 1 or address else (os.cpu_count() or 1))
