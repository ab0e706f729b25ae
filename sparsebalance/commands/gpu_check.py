"""``sparsebalance gpu-check [--out DIR] [--budget-s S] [--steps ...]``: what can only be checked on a GPU.

Steps, most valuable first (``gpucheck/steps.py``): ``accuracy`` (compiled kernels vs float64 on
every path), ``speed`` (MoBA vs flash attention, 8K-128K), ``layer`` (eager against compiled decoder
layer and head: time, launches, measured / analytical, agreement with float64; its compilation fills
the caches the next steps reuse), ``stages`` (single-GPU stage validation),
``profile`` (CUDA profiles, 3B first, beside the analytical model), ``gpu-tests`` (the compiled
kernel tests), ``validate`` (NCCL, two or more GPUs). Each runs in a process of its own under its own
deadline: the time left is shared among the steps still to run (:data:`SHARE`), so an early step
that finishes quickly gives its time to the later ones. ``summary.md`` is rewritten after every step;
the results folder holds flat files only (``gpucheck/report.py``). Without CUDA it prints one line
and exits 2, before any results directory exists. Run it on a lent machine through
``scripts/gpu-check.sh`` (offline, system python3, hard deadline).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sparsebalance.errors import ConfigError

#: Relative share of the time left that each step gets when its turn comes (``layer`` compiles cold,
#: a minute or so on a GPU machine, which ``stages`` and ``profile`` then find in Inductor's cache).
SHARE = {"accuracy": 1.0, "speed": 1.2, "layer": 1.2, "stages": 1.0, "profile": 1.0, "gpu-tests": 1.0,
         "validate": 0.6}
#: A step with less than this many seconds is not started.
MIN_STEP_S = 15.0
#: Seconds past its deadline before a step's process group is killed (the step itself stops early).
GRACE_S = 10.0
#: Steps that need CUDA (``--device cpu`` skips them: it exists to test the plumbing).
CUDA_ONLY = {"accuracy", "speed", "layer", "gpu-tests", "validate"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sparsebalance.commands._args import add_config, add_out
    from sparsebalance.gpucheck.steps import ORDER

    add_config(p, required=False, help="run config of the stage validation (default: the packaged preset "
                                       "gpu_check_stages.toml: qwen2.5-3b, PP 4, SAB + DST)")
    add_out(p, "results/gpu-check")
    p.add_argument("--steps", default=",".join(ORDER), help=f"comma-separated subset of {', '.join(ORDER)}")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="seconds the steps may take together (default 450; scripts/gpu-check.sh adds a "
                        "hard deadline around the whole run)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda (default); cpu runs only the steps that can (stages, profile), to test the "
                        "plumbing on a machine without a GPU")
    p.add_argument("--validate-config", default=None, metavar="FILE",
                   help="run config for `validate` on NCCL (two or more GPUs)")


def cuda_device() -> str | None:
    """The CUDA device name, or None when torch is missing or sees no CUDA device."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _steps(text: str) -> list[str]:
    from sparsebalance.commands._args import comma_list
    from sparsebalance.gpucheck.steps import ORDER

    return comma_list(text, "--steps", what="step names", allowed=ORDER)


class Stopped(Exception):
    """SIGTERM or SIGINT arrived (``timeout`` in scripts/gpu-check.sh, or Ctrl-C)."""


def _stop(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def run_step(step: str, seconds: float, args: argparse.Namespace, out: Path, work: Path) -> dict:
    """Run one step in its own process group under ``seconds`` (+ grace); its result row."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "sparsebalance.gpucheck", step, "--out", str(out), "--work", str(work),
           "--seconds", f"{seconds:.1f}", "--device", args.device]
    if args.config:
        cmd += ["--config", str(Path(args.config).resolve())]
    if args.validate_config:
        cmd += ["--validate-config", str(Path(args.validate_config).resolve())]
    log = work / "logs" / f"{step}.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=seconds + GRACE_S)
        except BaseException as e:  # the deadline, or Stopped: the step's group goes with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            return {"step": step, "status": "timeout", "seconds": time.monotonic() - t0,
                    "figures": f"killed at its deadline ({seconds:.0f} s); what it wrote so far is kept",
                    "file": f"rest.tar.gz: logs/{step}.log"}
    result = work / "results" / f"{step}.json"
    if result.is_file():
        row = json.loads(result.read_text())
    else:  # died without a word (a segfault, an abort in the CUDA driver, the OOM killer)
        tail = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1][:200]
        row = {"step": step, "status": "FAIL", "figures": f"exit {proc.returncode}: {tail}",
               "file": f"rest.tar.gz: logs/{step}.log"}
    return row | {"seconds": time.monotonic() - t0}


def run(args: argparse.Namespace) -> int:
    from sparsebalance.commands._args import resolve_out
    from sparsebalance.gpucheck.report import archive, environment, limit_problems, write_summary

    steps = _steps(args.steps)
    if not args.budget_s > 0 or args.budget_s == float("inf"):
        raise ConfigError(f"--budget-s: must be a positive number of seconds, got {args.budget_s}")
    t_start = time.monotonic()
    device = cuda_device()
    env = {"device": device or "no CUDA device"} | environment()
    env["command"] = "sparsebalance gpu-check " + " ".join(sys.argv[2:])
    if args.device == "cuda" and device is None:  # before the results directory: nothing is left
        why = ("this python has no torch" if env.get("torch") == "not installed"
               else f"torch {env.get('torch')} sees no CUDA device")
        raise ConfigError(f"device: gpu-check needs a CUDA GPU and {why}; nothing was run "
                          "(--device cpu runs the steps that need none)")
    out = resolve_out(args.out, "results/gpu-check", force=args.force, verb="gpu-check").resolve()
    summary = out / "summary.md"
    work = Path(tempfile.mkdtemp(prefix="sparsebalance-gpu-check-"))
    for sub in ("logs", "results"):
        (work / sub).mkdir()
    (work / "options.json").write_text(json.dumps(vars(args) | {"env": env}, indent=2, default=str))
    notes = [(f"each step ran in its own process under its own deadline; the {args.budget_s:.0f} s were "
              "shared among the steps still to run as each began"),
             ("stages: every stage timed alone (seeded upstream gradient, its graph freed before the next), "
              "so one device holds one stage's activations at a time; policies planned with the analytical "
              "profile"),
             "everything not listed as a file is in rest.tar.gz (logs, profiles, per-step results)"]
    rows: list[dict] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    try:
        _run_steps(steps, args, out, work, rows, env, notes, t_start)
    except Stopped as e:
        rows.append({"step": "(stopped)", "status": "stopped", "seconds": 0.0,
                     "figures": f"{e} arrived; the step running then was killed, the rows above stand"})
        write_summary(rows, env, summary, notes)
        archive(work, out)
        print(f"gpu-check: stopped by {e}; wrote {summary}", file=sys.stderr)
        return 124
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
    bad = limit_problems(out)
    if bad:
        notes.append("results folder over the device limits: " + "; ".join(bad))
        write_summary(rows, env, summary, notes)
    import shutil

    shutil.rmtree(work, ignore_errors=True)  # all of it is in rest.tar.gz
    print(f"wrote {summary} ({time.monotonic() - t_start:.0f} s)")
    return 0 if all(r["status"] in ("ok", "skipped", "partial") for r in rows) else 1


def _run_steps(steps: list[str], args: argparse.Namespace, out: Path, work: Path, rows: list[dict], env: dict,
               notes: list[str], t_start: float) -> None:
    from sparsebalance.gpucheck.report import archive, write_summary

    for i, step in enumerate(steps):
        left = args.budget_s - (time.monotonic() - t_start)
        share = SHARE[step] / sum(SHARE[s] for s in steps[i:])
        seconds = min(left, left * share)
        if args.device == "cpu" and step in CUDA_ONLY:
            row = {"step": step, "status": "skipped", "figures": "needs CUDA (--device cpu)", "seconds": 0.0}
        elif seconds < MIN_STEP_S:
            row = {"step": step, "status": "skipped", "figures": f"{max(left, 0):.0f} s left of the budget",
                   "seconds": 0.0}
        else:
            print(f"gpu-check: {step} (up to {seconds:.0f} s) ...", flush=True)
            row = run_step(step, seconds, args, out, work)
        rows.append(row)
        print(f"gpu-check {step}: {row['status']} ({row.get('figures', '')})", flush=True)
        write_summary(rows, env, out / "summary.md", notes)
        archive(work, out)
