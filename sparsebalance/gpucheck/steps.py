"""The steps of ``gpu-check``, most valuable first; each runs in a process of its own (``__main__.py``).

Every step takes a :class:`Step` (where to write, its deadline, the device) and returns
``(status, figures, files)``. Steps with many points write their table after each point and stop
early when their deadline nears ("partial"), so a step killed at its deadline still leaves what it
measured. Tables meant to come back flat go to ``ctx.out``; the rest goes to ``ctx.work``, which the
verb archives (``report.archive``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

ORDER = ("accuracy", "speed", "layer", "stages", "profile", "gpu-tests", "validate")


@dataclass(kw_only=True, slots=True, frozen=True)
class Step:
    """Where and until when one step works."""

    out: Path
    """Flat results folder (absolute): what comes back from a lent machine as files."""
    work: Path
    """Folder of everything else (absolute): logs, profiles, per-step results; archived."""
    deadline: float
    """``time.monotonic()`` at which the step must be done (it is killed a little later)."""
    device: str = "cuda"
    """Torch device of the measurements (``cpu`` only for the plumbing tests)."""
    config: str | None = None
    """Run config of the stage validation (default: the packaged ``gpu_check_stages.toml``)."""
    validate_config: str | None = None
    """Run config of the NCCL validation (two or more GPUs)."""

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _device_name(ctx: Step) -> str:
    import torch

    return torch.cuda.get_device_name() if ctx.device == "cuda" else "cpu"


def label_of(device_name: str) -> str:
    """A file-name label of a device ("NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3")."""
    return "-".join(device_name.lower().replace("_", " ").split())


def accuracy(ctx: Step) -> tuple[str, str, str]:
    """Compiled kernels vs float64 on every path (auto, sparse, masked) of every case: bf16 on all
    cases, fp32 on one (``check.ACCURACY_PLAN``)."""
    import pandas as pd
    import torch

    from sparsebalance.fsutil import atomic_to_csv
    from sparsebalance.kernels.moba.check import ACCURACY_PLAN, GPU_CASES, PATHS
    from sparsebalance.kernels.moba.check import accuracy as check_case

    rows, done = [], 0
    for name, dtype in ACCURACY_PLAN:
        if ctx.left() < 20 and done:
            break
        rows += [r | {"case": name} for r in check_case(GPU_CASES[name], getattr(torch, dtype), ctx.device, PATHS)]
        done += 1
        atomic_to_csv(pd.DataFrame(rows), ctx.out / "accuracy.csv", index=False)
    df = pd.DataFrame(rows)
    bad = df[~df.ok]
    figures = (f"{len(df) - len(bad)}/{len(df)} tensors within 2x PyTorch's error over paths {', '.join(PATHS)} "
               f"({done}/{len(ACCURACY_PLAN)} case-dtypes); worst ratio {df.ratio.max():.2f}")
    if len(bad):
        figures += "; failing: " + ", ".join(sorted({f"{r.case}/{r.dtype}/{r.path}/{r.tensor}" for r in
                                                     bad.itertuples()})[:6])
    status = "FAIL" if len(bad) else ("ok" if done == len(ACCURACY_PLAN) else "partial")
    return status, figures, "accuracy.csv"


#: The speed grid: lengths (tokens) and densities (budget / blocks).
SPEED_LENGTHS = (32768, 8192, 16384, 65536, 131072)
SPEED_DENSITIES = (1 / 8, 1 / 4, 1 / 16, 1 / 32)
#: The grid in the order it is measured: the issue's target points first (32K, 8K, 128K at 1/8).
SPEED_POINTS = [(32768, 1 / 8), (8192, 1 / 8), (131072, 1 / 8)] + [
    (L, d) for L in SPEED_LENGTHS for d in SPEED_DENSITIES if (L, d) not in ((32768, 1 / 8), (8192, 1 / 8), (131072, 1 / 8))]
#: Seconds of the speed step kept for timing the launch candidates (after the grid, if left).
TUNE_S = 60.0


def speed(ctx: Step) -> tuple[str, str, str]:
    """MoBA vs dense (flash) attention, forward and forward + backward, median of do_bench, every MoBA
    call checked under ``torch.cuda.set_sync_debug_mode("error")``; the issue's target table (printed
    and in ``speed_targets.md``); then, with the time left, the launch candidates timed at 32K tokens
    and 1/8 (``tune.csv``, the picks in ``launch_picks.json`` with the device and triton version)."""
    import json

    import pandas as pd

    from sparsebalance.fsutil import atomic_to_csv
    from sparsebalance.kernels.moba.speed import STATISTIC, SpeedShape, speed_table, target_table, tune

    shape = SpeedShape()
    # the table so far after every point: a step killed at its deadline keeps what it measured
    df = speed_table(SPEED_POINTS, shape, budget_s=max(ctx.left() - 25 - TUNE_S, 0.0),
                     progress=lambda rows: atomic_to_csv(pd.DataFrame(rows), ctx.out / "speed.csv", index=False))
    points, total = len(df) // 2, len(SPEED_POINTS)  # two rows (fwd, fwd+bwd) a point
    fig = f"{points}/{total} points, {STATISTIC}"
    head = df[(df["mode"] == "fwd+bwd") & (df.tokens == 32768) & (df.density == 1 / 8)] if len(df) else df
    if len(head):
        r = head.iloc[0]
        fig += f"; 32K at 1/8 fwd+bwd: MoBA {r.moba_ms:.2f} ms, {r.dense} {r.dense_ms:.2f} ms ({r.speedup:.2f}x)"
        if r.predicted_ms == r.predicted_ms and r.predicted_ms:
            fig += f", model {r.predicted_ms:.2f} ms"
    syncs = sorted(set(df.host_syncs)) if len(df) and "host_syncs" in df else []
    fig += "; host syncs: " + ("none" if syncs == ["none"] else ", ".join(map(str, syncs)) or "not checked")
    targets = target_table(df)
    text = targets.to_markdown(index=False) if _has_tabulate() else targets.to_string(index=False)
    print("speed targets (issue 33):\n" + text, flush=True)
    (ctx.work / "speed_targets.md").write_text(text + "\n")
    met = targets.met.dropna()
    fig += f"; targets met {int(met.sum())}/{len(met)}"
    if ctx.left() > 30:
        rows, picks = tune(shape, budget_s=max(ctx.left() - 20, 0.0),
                           progress=lambda rows: atomic_to_csv(pd.DataFrame(rows), ctx.work / "tune.csv", index=False))
        import torch
        import triton

        (ctx.work / "launch_picks.json").write_text(json.dumps(
            {"device": _device_name(ctx), "triton": triton.__version__, "torch": torch.__version__,
             "point": "32768 tokens, density 1/8, qwen2.5-3b TP-2 rank shape", "picks": picks}, indent=1))
        fig += f"; tuned {len(rows)} candidates, picks " + ", ".join(f"{k} {v}" for k, v in sorted(picks.items()))
    return ("ok" if points == total else "partial"), fig, "speed.csv"


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
        return True
    except ImportError:
        return False


def _stage_config(ctx: Step):
    """The stage check's run config (policies driven by the device's analytical profile), its
    analytical profile's name and the folder a profile of its model measured here lands in."""
    from dataclasses import replace
    from importlib import resources

    from sparsebalance.kernels.moba.speed import hardware_for
    from sparsebalance.runconfig import load_run_config
    from sparsebalance.simulator.cost.roofline import HARDWARE

    preset = resources.files("sparsebalance.data") / "presets" / "gpu_check_stages.toml"
    cfg = load_run_config(ctx.config or str(preset))
    name = _device_name(ctx)
    hw = hardware_for(name) or HARDWARE["h100"]
    analytical = f"analytical-{hw.device}"
    measured = (ctx.work / "profiles" / f"{label_of(name)}-{cfg.model.name}").resolve()
    return replace(cfg, profile=analytical), analytical, measured


#: The layer step's token counts (the target "measured / analytical <= 1.25" is stated from 8K on),
#: and those of ``--device cpu`` (the tiny model: the plumbing).
LAYER_TOKENS = (8192, 16384, 32768, 4096)
CPU_LAYER_TOKENS = (64, 128)


def layer(ctx: Step) -> tuple[str, str, str]:
    """Eager against compiled decoder layer and head of the stage check's model (``kernels/layerbench.py``):
    time, launches per forward + backward, measured / analytical; then both against float64. It runs
    before ``stages`` and ``profile``: its compilation fills the on-disk caches they reuse."""
    import pandas as pd

    from sparsebalance.fsutil import atomic_to_csv
    from sparsebalance.kernels.layerbench import agreement, layer_table
    from sparsebalance.simulator.config import tiny

    cuda = ctx.device == "cuda"
    model = _stage_config(ctx)[0].model if cuda else tiny()
    dtype = "bfloat16" if cuda else "float32"
    tokens = LAYER_TOKENS if cuda else CPU_LAYER_TOKENS
    path = ctx.work / "layer.csv"

    def keep(rows: list) -> None:  # the table so far: a step stopped at its deadline keeps it
        atomic_to_csv(pd.DataFrame(rows), path, index=False)

    df = layer_table(model, tokens, device=ctx.device, dtype=dtype, repeats=5 if cuda else 2, warmup=1,
                     progress=keep, stop=lambda: ctx.left() < 40)
    fig = f"{model.name} {dtype}: " + _layer_figure(df, tokens[0])
    acc = agreement(model, 4096 if cuda else 64, device=ctx.device, dtype=dtype)
    atomic_to_csv(acc, ctx.work / "layer_agreement.csv", index=False)
    worst = acc.loc[(acc.err_compiled / acc.err_eager.clip(lower=1e-12)).idxmax()]
    fig += (f"; vs float64 ({len(acc)} tensors): compiled within 2x eager's error + 1e-3 on {int(acc.ok.sum())}"
            f"/{len(acc)}, worst {worst.tensor} {worst.err_compiled:.1e} (eager {worst.err_eager:.1e})")
    status = "FAIL" if not acc.ok.all() else ("ok" if df.tokens.nunique() == len(tokens) else "partial")
    return status, fig, "rest.tar.gz: layer.csv"


def _layer_figure(df, first: int) -> str:
    """The headline of the layer table: fwd + bwd at the first token count per implementation, with
    launches, and the median measured / analytical from 8K tokens on."""
    parts = []
    for (impl, op), g in df.groupby(["impl", "op"], sort=False):
        at = g[g.tokens == first].iloc[0]
        part = f"{op} {impl} {1e3 * (at.fwd_s + at.bwd_s):.2f} ms fwd+bwd at {first} ({int(at.launches)} launches)"
        big = g[g.tokens >= 8192]
        if len(big) and big.ratio_fwd.notna().all():
            part += f", measured/analytical >= 8K fwd {big.ratio_fwd.median():.2f} bwd {big.ratio_bwd.median():.2f}"
        parts.append(part)
    return "; ".join(parts)


def stages(ctx: Step) -> tuple[str, str, str]:
    """Single-device stage validation of a PP plan (``stagecheck.py``), every stage in isolation."""
    from sparsebalance.stagecheck import run_stage_check

    # the policies are driven by the analytical profile (a plan that does not depend on this run's
    # noise); a profile measured here before predicts beside it (else step "profile" adds it later)
    cfg, analytical, measured = _stage_config(ctx)
    profiles = {analytical: analytical}
    if (measured / "profile.csv").exists():
        profiles["measured-profile"] = str(measured)
    dtype = "bfloat16" if ctx.device == "cuda" else "float32"
    backend = "triton" if ctx.device == "cuda" else "auto"
    peak = _reset_peak(ctx.device)
    res = run_stage_check(cfg, profiles, device=ctx.device, dtype=dtype, backend=backend,
                          rounds=3 if ctx.device == "cuda" else 1)
    _write_stages(ctx, res)
    fig = (f"{cfg.model.name} PP {cfg.cluster.pp}, layers {res.layer_impl}, {len(res.ops) // (2 * cfg.cluster.pp)} "
           f"micro-batches, each stage alone (seeded upstream gradient, graph freed): iteration "
           f"{_iteration_figure(res)}")
    if peak is not None:
        fig += f"; peak {peak():.1f} GiB"
    return "ok", fig, "stages.csv"


def _write_stages(ctx: Step, res) -> None:
    from sparsebalance.fsutil import atomic_to_csv

    atomic_to_csv(res.ops, ctx.out / "stages.csv", index=False)
    atomic_to_csv(res.iteration, ctx.work / "stages_iteration.csv", index=False)


def _iteration_figure(res) -> str:
    it = res.iteration.set_index("source")
    errs = "; ".join(f"{src} {r.error_vs_measured:+.1%}" for src, r in it.iterrows() if src != "measured")
    return f"{it.loc['measured', 'iteration_time_s']:.3f} s measured; predicted {errs}"


def restage(ctx: Step) -> str | None:
    """After step "profile": the stage check measured earlier in this run, predicted again with the
    profile just measured for its model (the figure), or None when either is missing."""
    import pandas as pd

    from sparsebalance.stagecheck import predict_stages

    cfg, analytical, measured = _stage_config(ctx)
    if not (ctx.out / "stages.csv").exists() or not (measured / "profile.csv").exists():
        return None
    res = predict_stages(cfg, pd.read_csv(ctx.out / "stages.csv"),
                         {analytical: analytical, "measured-profile": str(measured)})
    _write_stages(ctx, res)
    return f"stages predicted again: {_iteration_figure(res)}"


def _reset_peak(device: str):
    """A function giving the peak device memory (GiB) since now, or None off CUDA."""
    if device != "cuda":
        return None
    import torch

    torch.cuda.reset_peak_memory_stats()
    return lambda: torch.cuda.max_memory_allocated() / 2**30


#: The profile grid of gpu-check: small enough for ~40 s per model on an H100 (cold Triton cache).
PROFILE_GRID = {"seq_lens": (1024, 2048, 4096, 8192, 16384), "budgets": (1, 2, 4, 8, 16, 32, 64),
                "tokens": (1024, 2048, 4096, 8192, 16384, 32768), "params": (1_000_000, 100_000_000)}
PROFILE_MODELS = ("qwen2.5-3b", "qwen2.5-0.5b")
#: ``--device cpu`` (the plumbing tests): the tiny model on a grid of seconds.
CPU_PROFILE_GRID = {"seq_lens": (64, 128), "budgets": (1, 2), "tokens": (64, 128), "params": (1000, 10000)}


def profile(ctx: Step) -> tuple[str, str, str]:
    """CUDA profiles (3B first), each beside the analytical model on the same points."""
    from sparsebalance.kernels.measure import measure_profile
    from sparsebalance.kernels.profiler import ProfileGrid
    from sparsebalance.simulator.config import MODEL_PRESETS

    name = _device_name(ctx)
    cuda = ctx.device == "cuda"
    grid = ProfileGrid(device=ctx.device, dtype="bfloat16" if cuda else "float32", repeats=3, warmup=1,
                       **(PROFILE_GRID if cuda else CPU_PROFILE_GRID))
    models = PROFILE_MODELS if cuda else ("tiny",)
    done, figs, t_first = [], [], None
    for preset in models:
        if done and t_first is not None and ctx.left() < 1.3 * t_first:
            break
        t0 = time.monotonic()
        model = MODEL_PRESETS[preset]()
        prof = measure_profile(model, grid, command=f"sparsebalance gpu-check (step profile, {preset})")
        path = prof.save(ctx.work / "profiles" / f"{label_of(name)}-{preset}")
        t_first = t_first or time.monotonic() - t0
        done.append(preset)
        cmp = versus_analytical(prof.table, model, name)
        if cmp is not None:
            cmp.to_csv(path / "vs_analytical.csv", index=False)
            off = cmp.groupby("op").ratio.median()
            big = cmp[cmp.op.isin(("layer_fwd", "layer_bwd")) & (cmp.seq_len >= 8192)]
            figs.append(f"{preset}: measured/analytical median per op "
                        + ", ".join(f"{op} {r:.2f}" for op, r in off.items())
                        + (f"; layer ops >= 8K tokens {big.ratio.median():.2f}" if len(big) else ""))
    status = "ok" if len(done) == len(models) else "partial"
    again = restage(ctx)
    return status, "; ".join([f"{', '.join(done)} measured (layer_impl {grid.resolved_layer_impl()})", *figs,
                              *([again] if again else [])]), \
        "rest.tar.gz: profiles/"


def versus_analytical(table, model, device_name: str):
    """Measured vs analytical latency at the measured points (op, seq_len, budget, both, ratio), or
    None when the device has no analytical hardware."""
    import numpy as np

    from sparsebalance.kernels.moba.speed import hardware_for
    from sparsebalance.simulator.cost.roofline import build_table

    hw = hardware_for(device_name)
    if hw is None:
        return None
    att = table[table.op.str.startswith("attn")]
    dense = table[~table.op.str.startswith("attn") & (table.op != "optim")]
    ana = build_table(hw, model, 1, model.block_size, seq_lens=np.unique(att.seq_len),
                      budgets=np.unique(att.budget), tokens=np.unique(dense.seq_len))
    m = table.merge(ana, on=["op", "seq_len", "budget"], suffixes=("_measured", "_analytical"))
    m["ratio"] = m.latency_s_measured / m.latency_s_analytical
    return m


#: The pytest modules of the compiled kernels (all of them run compiled where CUDA is present).
GPU_TESTS = ("test_triton_gpu.py", "test_triton_masked.py", "test_triton.py", "test_kernelcost_counts.py")


def gpu_tests(ctx: Step) -> tuple[str, str, str]:
    """The ``gpu``-marked tests and the Triton kernel tests, compiled; pytest's own timeout is the
    step's deadline."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    tests = [str(root / "tests" / "kernels" / f) for f in GPU_TESTS]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu or not slow", *tests]
    log = ctx.work / "tests.log"
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(ctx.left() - 5, 10), cwd=root,
                           check=False)
    except subprocess.TimeoutExpired as e:
        log.write_text((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))
        return "timeout", "pytest did not finish before the step's deadline", "rest.tar.gz: tests.log"
    log.write_text(r.stdout + r.stderr)
    last = (r.stdout.strip().splitlines() or ["no output"])[-1]
    return ("ok" if r.returncode == 0 else "FAIL"), last, "rest.tar.gz: tests.log"


def validate(ctx: Step) -> tuple[str, str, str]:
    """``sparsebalance validate`` on NCCL with two or more GPUs and ``--validate-config``."""
    import subprocess

    import torch

    if torch.cuda.device_count() < 2:
        return "skipped", "one GPU: NCCL validation needs two or more", ""
    if not ctx.validate_config:
        return "skipped", "no --validate-config given", ""
    cmd = [sys.executable, "-m", "sparsebalance", "validate", "--config", ctx.validate_config, "--out",
           str(ctx.work / "validate"), "--rounds", "2", "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(ctx.left() - 5, 10), check=False)
    (ctx.work / "validate.log").write_text(r.stdout + r.stderr)
    return ("ok" if r.returncode == 0 else "FAIL"), f"exit {r.returncode}", "rest.tar.gz: validate/"


STEPS = {"accuracy": accuracy, "speed": speed, "stages": stages, "profile": profile, "gpu-tests": gpu_tests,
         "validate": validate}
