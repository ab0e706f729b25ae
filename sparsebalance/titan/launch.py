"""Start a torchtitan job of ours (``torchrun --standalone ... -m sparsebalance.titan.train``) and read
what it wrote: the per-step losses, the measured trace and the budgets each MoBA layer ran at.

The job is checked first in this process (:func:`check_job`: the torchtitan config parsed as
torchrun's workers will parse it, then :func:`setup.resolve` with the documents), so a bad input is
one line and exit code 2 before any process starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparsebalance.errors import ConfigError, HostError
from sparsebalance.procutil import descendants, end_processes


def read_trace(dump: Path):
    """The measured trace of every rank of a job's dump folder (``trace_rank<R>.csv``, written with
    ``--sparsebalance.measure``), concatenated; HostError where there is none."""
    import pandas as pd

    files = sorted(Path(dump).glob("trace_rank*.csv"))
    if not files:
        raise HostError(f"titan: no measured trace in {dump} (run with --sparsebalance.measure)")
    return pd.concat([pd.read_csv(f) for f in files], ignore_index=True)


@dataclass(slots=True)
class JobResult:
    dump: Path
    """The job's dump folder."""
    losses: list[float]
    """Global token-mean loss of each step run (rank 0's ``losses.json``)."""
    first_step: int
    """The step of ``losses[0]`` (after a resume: the restored step + 1)."""

    def trace(self):
        """The measured trace of every rank (:func:`read_trace` of the dump folder)."""
        return read_trace(self.dump)

    def budgets(self) -> list[dict]:
        """What every MoBA layer ran at, all ranks (``budgets_rank<R>.json``), tagged rows only."""
        rows = []
        for f in sorted(self.dump.glob("budgets_rank*.json")):
            rows += [r for r in json.loads(f.read_text()) if "step" in r]
        return rows


MODULE = "sparsebalance.titan"
"""torchtitan ``--module`` of the shipped presets (``sparsebalance.titan.config_registry``)."""


def module_and_preset(config: str) -> tuple[str, str]:
    """(torchtitan ``--module``, ``--config``) of ``config``: a preset of this package
    (``sparsebalance_tiny_pp2``) or ``MODULE:PRESET`` for a config registry of one's own (a module
    importable in the job's processes too, whose ``config_registry`` holds the preset function)."""
    module, sep, preset = config.rpartition(":")
    if not sep:
        return MODULE, config
    if not module.strip() or not preset.strip():
        raise ConfigError(f"--config: expected PRESET or MODULE:PRESET (a torchtitan config registry), got {config!r}")
    return module.strip(), preset.strip()


def parse_job(config: str, overrides: list[str]) -> Any:
    """The torchtitan job config as its workers will see it (``--module``/``--config`` of
    :func:`module_and_preset` + overrides)."""
    import logging

    from sparsebalance.titan.compat import import_torchtitan

    import_torchtitan()
    from torchtitan.config import ConfigManager

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # torchtitan's config warnings belong to the job's log, not here
    module, preset = module_and_preset(config)
    try:
        return ConfigManager().parse_args(["--module", module, "--config", preset, *overrides])
    except ConfigError:  # a config function's own check (use_moba, ...): its line as it is
        raise
    except SystemExit as e:  # tyro's own usage error, already printed
        raise ConfigError(f"titan: the torchtitan config {config!r} with {overrides} does not parse") from e
    except (ValueError, ImportError, AttributeError) as e:
        raise ConfigError(f"titan: {e}") from None
    finally:
        root.setLevel(level)


def check_job(config: str, nproc: int, overrides: list[str]):
    """Every check the job's workers would make, here: returns the resolved :class:`TitanSetup`."""
    from sparsebalance.titan.setup import resolve

    job = parse_job(config, overrides)
    return resolve(job, world_size=nproc)


def run_job(config: str, nproc: int, dump: Path, overrides: list[str] = (), *, timeout_s: float = 900,
            check: bool = True, log: Path | None = None) -> JobResult:
    """Run the job on ``nproc`` processes (gloo on a CPU, one thread each), writing to ``dump``."""
    dump = Path(dump).resolve()
    overrides = [*overrides, "--dump_folder", str(dump)]
    if check:
        check_job(config, nproc, overrides)
    module, preset = module_and_preset(config)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "sparsebalance.titan.train", "--module", module, "--config", preset, *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    dump.mkdir(parents=True, exist_ok=True)
    log = log or dump / "job.log"
    with open(log, "w") as f:
        # its own process group: torchrun and its workers end together, whatever ends this call
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise HostError(f"titan: the job did not finish in {timeout_s:.0f} s (log: {log})") from None
        finally:
            if proc.poll() is None:
                end_processes([proc.pid, *descendants(proc.pid)], groups=[proc.pid])
                proc.wait()
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()
        last = next((ln for ln in reversed(tail) if "Error" in ln), tail[-1] if tail else "")
        raise HostError(f"titan: the job exited {proc.returncode}: {last.strip()} (log: {log})")
    path = dump / "losses.json"  # none where no step ran (a seed checkpoint)
    got = json.loads(path.read_text()) if path.is_file() else {"losses": [], "first_step": 0}
    return JobResult(dump=dump, losses=list(got["losses"]), first_step=int(got["first_step"]))
