"""Starting torchrun for ``sparsebalance train`` / ``validate``, ending it, and naming what failed.

Launcher side (:func:`launch`):

* port: ``--master-port N`` is checked free before starting (one line otherwise); with none given,
  torchrun's ``--standalone`` rendezvous binds a free port itself (no race between two runs);
* process groups: torchrun starts in a session of its own (a terminal Ctrl-C reaches only us, and we
  decide) and is SIGKILLed by the kernel if we die (PDEATHSIG). torchrun gives every worker a session
  of its own too, so on SIGINT/SIGTERM/SIGHUP, on an error and on every exit we end torchrun's group,
  each worker's group and every descendant we can see (SIGTERM, 5 s grace, SIGKILL);
* output: workers' stdout (rank 0's progress and summary) is copied to the console and to
  ``launch.log``; torchrun's own stderr (its tracebacks, its failure summary) and the workers' stderr
  go to ``launch.log`` only;
* failure: each worker keeps a status file ``ranks/rank<r>.json`` (running, done, failed with its
  error, stopped by SIGTERM); a rank that vanished while running died without a Python error (a
  signal, a crash). The rank that failed FIRST is named in one line: hard deaths and errors of its
  own come before errors that only report a lost peer (closed connections, timeouts) or a stop.

Worker side (called by ``realrun/__main__.py``): :func:`worker_started` writes the status file, dies
with its parent (PDEATHSIG), turns SIGTERM into a recorded stop even while blocked in a collective,
and exits if the launcher is gone; :func:`worker_failed` / :func:`worker_done` record the outcome.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sparsebalance.errors import ConfigError

RANK_DIR_ENV = "SPARSEBALANCE_RANK_DIR"
LAUNCHER_ENV = "SPARSEBALANCE_LAUNCHER_PID"
GRACE_S = 5.0
#: Errors that only say a peer went away or a stop came from outside (not a cause of their own).
SECONDARY = re.compile(r"connection (closed|reset|refused)|closed by peer|broken pipe|timed? ?out|"
                       r"socket|ECONNRESET|EPIPE|peer|DistBackendError|SIGTERM|terminated|"
                       r"Terminated|NCCL communicator was aborted|process group.*(aborted|destroyed)",
                       re.IGNORECASE)


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """ConfigError naming --master-port when something listens on ``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"--master-port: {port} is in use on {host} ({e.strerror}); another run "
                              "may hold it: leave --master-port out to use a free port") from None


def torchrun_command(config: str, nproc: int, *, master_port: int | None = None,
                     extra: list[str] | None = None, module: str = "sparsebalance.realrun") -> list[str]:
    """The torchrun command line for ``nproc`` workers of ``module`` (realrun's, or another program
    of the same workers such as ``sparsebalance.accuracy.pipeline``) on this node: ``--standalone`` (a
    free port) when ``master_port`` is None, else a static rendezvous on 127.0.0.1:master_port."""
    rdzv = (["--standalone"] if master_port is None
            else ["--master-addr", "127.0.0.1", "--master-port", str(master_port)])
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *rdzv,
            "-m", module, "--config", config, *(extra or [])]


@dataclass(slots=True)
class Outcome:
    """What a launch ended with."""

    returncode: int
    message: str = ""
    """One line naming the rank that failed first ('' on success)."""
    log: Path | None = None


def launch(config: str, nproc: int, *, out_dir: Path, sets: list[str] | None = None,
           master_port: int | None = None, quiet: bool = False, progress: bool = True, console=None,
           what: str = "realrun", module: str = "sparsebalance.realrun") -> Outcome:
    """Run ``nproc`` realrun workers under torchrun writing into ``out_dir``; wait; clean up.

    ``console``: where workers' stdout is copied (default sys.stdout). A KeyboardInterrupt (SIGINT, or
    SIGTERM/SIGHUP as raised by the CLI) ends the whole process tree before it propagates."""
    if master_port is not None:
        check_port_free(master_port)
    out_dir = Path(out_dir)
    rank_dir = out_dir / "ranks"
    rank_dir.mkdir(parents=True, exist_ok=True)
    for f in rank_dir.glob("rank*"):
        f.unlink()
    log_path = out_dir / "launch.log"
    extra = [x for s in (sets or []) for x in ("--set", s)] + ["--output-dir", str(out_dir)]
    if quiet:
        extra.append("--quiet")
    elif not progress:
        extra.append("--no-progress")
    cmd = torchrun_command(config, nproc, master_port=master_port, extra=extra, module=module)
    env = dict(os.environ, **{RANK_DIR_ENV: str(rank_dir), LAUNCHER_ENV: str(os.getpid())})
    env.setdefault("OMP_NUM_THREADS", "1")
    console = console or sys.stdout
    from sparsebalance.procutil import dying_with_us

    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(dying_with_us(cmd), stdout=subprocess.PIPE, stderr=log, env=env,
                                start_new_session=True)
        tee = threading.Thread(target=_tee, args=(proc.stdout, console, log), daemon=True)
        tee.start()
        deaths: dict[int, float] = {}
        try:
            while proc.poll() is None:
                _watch(rank_dir, deaths)
                time.sleep(0.1)
            _watch(rank_dir, deaths)
        finally:
            stop_tree(proc, rank_dir)
            tee.join(timeout=2.0)
    if proc.returncode == 0:
        return Outcome(returncode=0, log=log_path)
    # torchrun says 1 whatever its workers said: a bad input found by a worker (a diverged loss) is
    # the run's 2, as every bad input is
    code = 2 if proc.returncode > 0 and first_failure_code(rank_dir, deaths) == 2 else proc.returncode or 1
    return Outcome(returncode=code, log=log_path,
                   message=first_failure(rank_dir, deaths, nproc, proc.returncode, what, log_path))


def _tee(stream, console, log) -> None:
    """Copy the workers' stdout to the console and the log, chunk by chunk (progress bars too)."""
    out = getattr(console, "buffer", None)
    while True:
        try:
            chunk = os.read(stream.fileno(), 65536)
        except OSError:
            break
        if not chunk:
            break
        log.write(chunk)
        log.flush()
        try:
            if out is not None:
                out.write(chunk)
                out.flush()
            else:
                console.write(chunk.decode(errors="replace"))
                console.flush()
        except (OSError, ValueError):
            pass  # the console went away (closed pipe): the log still has everything


def _statuses(rank_dir: Path) -> dict[int, dict]:
    import json

    out = {}
    for f in rank_dir.glob("rank*.json"):
        try:
            d = json.loads(f.read_text())
            out[int(d["rank"])] = d
        except (OSError, ValueError, KeyError):
            continue
    return out


def _watch(rank_dir: Path, deaths: dict[int, float]) -> None:
    """Note when a rank's process vanished while its status still said running."""
    from sparsebalance.procutil import pid_alive

    for r, d in _statuses(rank_dir).items():
        if d.get("state") == "running" and r not in deaths and not pid_alive(int(d["pid"])):
            deaths[r] = time.time()


def stop_tree(proc: subprocess.Popen, rank_dir: Path | None = None) -> None:
    """End torchrun, its process group, every worker's group and every descendant; reap torchrun."""
    from sparsebalance.procutil import descendants, end_processes, pid_alive

    workers = [int(d["pid"]) for d in _statuses(rank_dir).values()] if rank_dir else []
    pids = [p for p in {proc.pid, *descendants(proc.pid), *workers} if pid_alive(p)]
    if pids:
        end_processes(pids, groups=[proc.pid, *workers], grace_s=GRACE_S)
    try:
        proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _failures(st: dict[int, dict], deaths: dict[int, float]) -> list[tuple[bool, float, int, str, int]]:
    """(secondary?, time, rank, text, exit code) of each failed or vanished rank, first failure first."""
    cands = []
    for r, d in st.items():
        where = f"rank {r}" + (f" (dp_rank {d['dp_rank']}, stage {d['stage']})" if "stage" in d else "")
        if d.get("state") == "failed":
            err, code = d.get("error", ""), int(d.get("code", 1))
            text = f"{where} failed: {err}"
            if code == 2:  # a bad input (ConfigError and kin): the line says what, as the CLI's own do
                text = "error: " + err.partition(": ")[2]
            cands.append((bool(SECONDARY.search(err)), d.get("time", 0.0), r, text, code))
        elif d.get("state") == "running" and r in deaths:
            text = f"{where} (pid {d['pid']}) died without a Python error (killed by a signal or crashed)"
            cands.append((False, deaths[r], r, text, 1))
    return sorted(cands)


def first_failure_code(rank_dir: Path, deaths: dict[int, float]) -> int:
    """The exit code the rank that failed first recorded (2: bad input; 1 otherwise or unknown)."""
    cands = _failures(_statuses(rank_dir), deaths)
    return cands[0][4] if cands else 1


def first_failure(rank_dir: Path, deaths: dict[int, float], nproc: int, returncode: int,
                  what: str, log: Path) -> str:
    """One line naming the rank that failed first (see the module docstring for the order)."""
    st = _statuses(rank_dir)
    cands = _failures(st, deaths)
    if not cands:
        if returncode < 0:
            return (f"{what}: torchrun was stopped by {signal.Signals(-returncode).name}; all workers "
                    f"ended. Log: {log}")
        missing = sorted(set(range(nproc)) - set(st))
        hint = f" (ranks {missing} never started)" if missing else ""
        return f"{what}: torchrun failed with exit code {returncode}{hint}. Log: {log}"
    text = cands[0][3]
    others = sorted(c[2] for c in cands[1:])
    after = f"; rank(s) {', '.join(map(str, others))} failed after it" if others else ""
    return f"{what}: {text}{after}. Log: {log}"


# -- worker side ----------------------------------------------------------------------------------
_STATUS: dict = {}


def _write_status(**kw) -> None:
    import json

    from sparsebalance.fsutil import atomic_write_text

    d = os.environ.get(RANK_DIR_ENV)
    if not d or "rank" not in _STATUS:
        return
    _STATUS.update(kw)
    try:
        atomic_write_text(Path(d) / f"rank{_STATUS['rank']}.json", json.dumps(_STATUS))
    except OSError:
        pass


def worker_started(rank: int, **info) -> None:
    """Record 'running' (pid, layout); die with torchrun; SIGTERM = a recorded stop, handled by a
    thread (so it works while the main thread is blocked in a collective); exit if the launcher is
    gone. A no-op outside :func:`launch` (plain torchrun) apart from PDEATHSIG."""
    from sparsebalance.procutil import die_with_parent, pid_alive

    die_with_parent()
    if not os.environ.get(RANK_DIR_ENV):
        return
    _STATUS.update(rank=rank, pid=os.getpid())
    _write_status(state="running", time=time.time(), **info)
    launcher = int(os.environ.get(LAUNCHER_ENV, "0") or 0)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads made later inherit it

    def guard() -> None:
        while True:
            sig = signal.sigtimedwait({signal.SIGTERM}, 0.5)
            if sig is not None:
                if _STATUS.get("state") != "done":  # a rank that said done ended its work: keep it so
                    _write_status(state="stopped", error="stopped by SIGTERM", time=time.time())
                os._exit(143)
            if launcher and not pid_alive(launcher):
                os._exit(1)

    threading.Thread(target=guard, name="sparsebalance-guard", daemon=True).start()


def worker_info(**info) -> None:
    """Add fields (dp_rank, stage) to this rank's status once they are known."""
    _write_status(**info)


def worker_failed(error: str, traceback_text: str = "", code: int = 1) -> None:
    """Record the failure; ``code`` 2 = a bad input (the launcher's exit code), 1 = anything else."""
    _write_status(state="failed", error=error, time=time.time(), code=code)
    d = os.environ.get(RANK_DIR_ENV)
    if d and traceback_text and "rank" in _STATUS:
        try:
            (Path(d) / f"rank{_STATUS['rank']}.traceback").write_text(traceback_text)
        except OSError:
            pass


def worker_done() -> None:
    _write_status(state="done", time=time.time())


def worker_exit(e: BaseException, where: str, what: str = "realrun"):
    """End a worker on an exception (never returns): record the failure; a bad input (ConfigError:
    before any collective, or a diverged loss) is one line and exit 2, anything else names the rank
    (``where``) and exits 1 (a traceback with ``SPARSEBALANCE_TRACEBACK``). ``os._exit``: a process
    group with pending sends/receives can block a normal interpreter exit."""
    import traceback

    from sparsebalance.errors import ConfigError

    first = (str(e).strip().splitlines() or [""])[0]
    bad_input = isinstance(e, ConfigError)
    worker_failed(f"{type(e).__name__}: {first}", traceback.format_exc(), code=2 if bad_input else 1)
    if bad_input:
        print(f"{what}: error: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    print(f"{what}: {where} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    if os.environ.get("SPARSEBALANCE_TRACEBACK"):
        traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
