"""``sparsebalance gpu-check [--out DIR] [--config FILE]``: everything this project can only check on a GPU, in one go.

Steps (each timed and recorded; a failing step does not stop the others; the whole run aims at
``--budget-s`` seconds, 570 by default, so it fits in 10 minutes):

1. ``accuracy``: compiled Triton forward and every gradient vs the float64 reference at bf16 and
   fp32 on packed variable-length input with GQA and per-sequence budgets, judged by the rule of
   attention-kernel suites (kernels/moba/check.py) -> ``accuracy.csv``;
2. ``gpu-tests``: the pytest tests marked ``gpu`` and the Triton kernel tests, compiled -> ``tests.log``;
3. ``speed``: kernel vs dense causal attention at 8K-128K tokens and densities 1/4-1/32, forward and
   forward + backward, beside the analytical model's prediction -> ``speed.csv``;
4. ``profile``: ``sparsebalance profile --device cuda`` for qwen2.5-0.5b and qwen2.5-3b layer dims ->
   ``profiles/<device>-<model>/``;
5. ``stages``: single-GPU stage validation (sparsebalance/stagecheck.py) of a PP-4 plan with SAB +
   DST budgets, predicted with the measured 3b profile and the analytical one -> ``stages_ops.csv``,
   ``stages_iteration.csv``;
6. ``validate``: with two or more GPUs, ``sparsebalance validate`` on NCCL for ``--validate-config``.

``summary.md`` holds one line per step. Without CUDA the command exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

from sparsebalance.errors import ConfigError

STEPS = ("accuracy", "gpu-tests", "speed", "profile", "stages", "validate")
PROFILE_GRID = ["--seq-lens", "512,1024,2048,4096,8192,16384", "--budgets", "1,2,4,8,16,32,64",
                "--tokens", "512,1024,2048,4096,8192,16384,32768", "--repeats", "5", "--warmup", "2",
                "--no-progress"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sparsebalance.commands._args import add_config, add_out

    add_config(p, required=False, help="run config of the stage validation (default: the packaged preset "
                                       "gpu_check_stages.toml: qwen2.5-3b, PP 4, SAB + DST)")
    add_out(p, "results/gpu-check")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {', '.join(STEPS)}")
    p.add_argument("--budget-s", type=float, default=570.0, help="time to aim at for the whole run (s)")
    p.add_argument("--validate-config", default=None, metavar="FILE",
                   help="run config for `validate` on NCCL (two or more GPUs)")


def require_cuda() -> str:
    """The CUDA device name, or ConfigError (one line) when there is none."""
    try:
        import torch
    except ImportError:
        raise ConfigError("device: gpu-check needs torch (pip install -e '.[train]'); nothing was run") from None
    if not torch.cuda.is_available():
        raise ConfigError("device: gpu-check needs a CUDA GPU and torch sees none; nothing was run")
    return torch.cuda.get_device_name()


def write_summary(rows: list[dict], env: dict, path: Path) -> Path:
    """``summary.md``: the environment, then one table row per step (status, figures, file, seconds)."""
    lines = ["# sparsebalance gpu-check", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", "| step | status | figures | file | seconds |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['step']} | {r['status']} | {r.get('figures', '')} | {r.get('file', '')} | "
                     f"{r.get('seconds', 0):.0f} |")
    path.write_text("\n".join(lines) + "\n")
    return path


def _accuracy(out: Path) -> tuple[str, str, str]:
    import pandas as pd
    import torch

    from sparsebalance.kernels.moba.check import GPU_CASES, accuracy

    rows = [r | {"case": name} for name, case in GPU_CASES.items() for dt in (torch.bfloat16, torch.float32)
            for r in accuracy(case, dt, "cuda")]
    df = pd.DataFrame(rows)
    df.to_csv(out / "accuracy.csv", index=False)
    bad = int((~df.ok).sum())
    worst = float(df.ratio.max())
    figures = f"{len(df) - bad}/{len(df)} within 2x PyTorch error; worst ratio {worst:.2f}"
    return ("ok" if bad == 0 else "FAIL", figures, "accuracy.csv")


def _gpu_tests(out: Path, timeout: float) -> tuple[str, str, str]:
    root = Path(__file__).resolve().parents[2]
    tests = [str(root / "tests" / "kernels" / f) for f in
             ("test_triton_gpu.py", "test_triton.py", "test_kernelcost_counts.py")]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=root, check=False)
    (out / "tests.log").write_text(r.stdout + r.stderr)
    last = (r.stdout.strip().splitlines() or ["no output"])[-1]
    return ("ok" if r.returncode == 0 else "FAIL", last, "tests.log")


def _speed(out: Path, budget: float) -> tuple[str, str, str]:
    from sparsebalance.kernels.moba.speed import SpeedShape, speed_table

    df = speed_table([8192, 16384, 32768, 65536, 131072], [1 / 4, 1 / 8, 1 / 16, 1 / 32], SpeedShape(),
                     budget_s=budget)
    df.to_csv(out / "speed.csv", index=False)
    fb = df[(df["mode"] == "fwd+bwd") & (df.tokens == 32768) & (df.density == 1 / 8)]
    fig = f"{len(df)} rows"
    if len(fb):
        r = fb.iloc[0]
        fig += f"; 32K at 1/8 fwd+bwd: {r.moba_ms:.2f} ms, {r.speedup:.2f}x dense"
        if r.predicted_ms == r.predicted_ms and r.predicted_ms:
            fig += f", model {r.predicted_ms:.2f} ms"
    return ("ok" if len(df) else "FAIL", fig, "speed.csv")


def _profiles(out: Path, device: str) -> tuple[str, str, str]:
    from sparsebalance import cli

    label = device.lower().replace(" ", "-")
    done = []
    for model in ("qwen2.5-0.5b", "qwen2.5-3b"):
        path = out / "profiles" / f"{label}-{model}"
        code = cli.main(["profile", "--device", "cuda", "--model", model, "--out", str(path), *PROFILE_GRID])
        if code != 0:
            return "FAIL", f"profile {model} exited {code}", str(path.relative_to(out))
        done.append(str(path.relative_to(out)))
    return "ok", "measured with CUDA events", ", ".join(done)


def _stages(out: Path, device: str, config: str | None) -> tuple[str, str, str]:
    from importlib import resources

    from sparsebalance.kernels.moba.speed import hardware_for
    from sparsebalance.runconfig import load_run_config
    from sparsebalance.simulator.roofline import HARDWARE
    from sparsebalance.stagecheck import run_stage_check

    preset = resources.files("sparsebalance.data") / "presets" / "gpu_check_stages.toml"
    cfg = load_run_config(config or str(preset))
    hw = hardware_for(device) or HARDWARE["h100"]
    profiles = {f"analytical-{hw.device}": f"analytical-{hw.device}"}
    measured = out / "profiles" / f"{device.lower().replace(' ', '-')}-qwen2.5-3b"
    if (measured / "profile.csv").exists():
        profiles = {"measured": str(measured)} | profiles
    from dataclasses import replace

    cfg = replace(cfg, profile=next(iter(profiles.values())))
    res = run_stage_check(cfg, profiles, device="cuda", dtype="bfloat16", backend="triton", rounds=3)
    res.ops.to_csv(out / "stages_ops.csv", index=False)
    res.iteration.to_csv(out / "stages_iteration.csv", index=False)
    errs = "; ".join(f"{r.source} {r.error_vs_measured:+.1%}" for r in res.iteration.itertuples() if r.source != "measured")
    return "ok", f"iteration {res.iteration.iteration_time_s.iloc[0]:.3f} s measured; predicted {errs}", \
        "stages_ops.csv, stages_iteration.csv"


def _validate(out: Path, config: str | None, timeout: float) -> tuple[str, str, str]:
    import torch

    if torch.cuda.device_count() < 2:
        return "skipped", "one GPU: NCCL validation needs two or more", ""
    if not config:
        return "skipped", "no --validate-config given", ""
    cmd = [sys.executable, "-m", "sparsebalance", "validate", "--config", config, "--out", str(out / "validate"),
           "--rounds", "2", "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    (out / "validate.log").write_text(r.stdout + r.stderr)
    return ("ok" if r.returncode == 0 else "FAIL", f"exit {r.returncode}", "validate/, validate.log")


def run(args: argparse.Namespace) -> int:
    device = require_cuda()
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad:
        raise ConfigError(f"--steps: unknown {', '.join(bad)}; choose from {', '.join(STEPS)}")
    import torch
    import triton

    from sparsebalance.commands._args import resolve_out

    out = resolve_out(args.out, "results/gpu-check", force=args.force, verb="gpu-check")
    env = {"device": device, "gpus": torch.cuda.device_count(), "torch": torch.__version__,
           "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "command": "sparsebalance gpu-check " + " ".join(sys.argv[2:])}
    (out / "options.json").write_text(json.dumps(vars(args) | {"env": env}, indent=2, default=str))
    t_start = time.monotonic()
    share = {"accuracy": 0.08, "gpu-tests": 0.15, "speed": 0.3, "profile": 0.25, "stages": 0.15, "validate": 0.07}
    rows = []
    for step in steps:
        t0 = time.monotonic()
        left = max(30.0, args.budget_s - (t0 - t_start))
        try:
            if step == "accuracy":
                status, fig, f = _accuracy(out)
            elif step == "gpu-tests":
                status, fig, f = _gpu_tests(out, left)
            elif step == "speed":
                status, fig, f = _speed(out, share["speed"] * args.budget_s)
            elif step == "profile":
                status, fig, f = _profiles(out, device)
            elif step == "stages":
                status, fig, f = _stages(out, device, args.config)
            else:
                status, fig, f = _validate(out, args.validate_config, left)
        except Exception as e:  # noqa: BLE001 -- record and go on: one broken step must not hide the others
            (out / f"{step}.error.txt").write_text(traceback.format_exc())
            status, fig, f = "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200], \
                f"{step}.error.txt"
        rows.append({"step": step, "status": status, "figures": fig, "file": f, "seconds": time.monotonic() - t0})
        print(f"gpu-check {step}: {status} ({fig})", flush=True)
        write_summary(rows, env, out / "summary.md")
    print(f"wrote {out / 'summary.md'}")
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1
