"""The machine side of profile calibration: a fingerprint of this machine and the probe that
re-measures a few profile points here (see ``simulator/cost/calibration.py`` for the comparison).

The probe is the profiler itself (``kernels/profiler.run_profile``) on a small grid of the profile's
own points, with the profile's statistic, threads and concurrency, so a probe point and a profile
point are measured the same way and their ratio is the machine, not the method.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pandas as pd

from sparsebalance.simulator.config import ARCH_FIELDS, ModelConfig
from sparsebalance.simulator.cost.calibration import ProbeGrid
from sparsebalance.simulator.cost.profile import Profile
from sparsebalance.simulator.cost.profilemeta import MODEL_DIMS


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_clocks() -> dict[str, Any]:
    """Max SM / memory clocks (MHz) and power limit of GPU 0 from nvidia-smi, where it exists."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    q = "clocks.max.sm,clocks.max.mem,power.limit,driver_version"
    try:
        out = subprocess.run([exe, f"--query-gpu={q}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    vals = [v.strip() for v in out.strip().split(",")]
    if len(vals) != 4:
        return {}

    def num(v: str) -> float | None:
        try:
            return float(v)
        except ValueError:
            return None

    return {"gpu_sm_clock_max_mhz": num(vals[0]), "gpu_memory_clock_max_mhz": num(vals[1]),
            "gpu_power_limit_w": num(vals[2]), "gpu_driver": vals[3]}


def machine_fingerprint(device: str = "cpu", threads: int | None = None) -> dict[str, Any]:
    """What a latency profile depends on: CPU model and usable cores, torch threads; on CUDA the GPU
    name, count, memory, SM count and clocks. Keys are compared by
    ``simulator.cost.calibration.fingerprint_mismatch``."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    fp: dict[str, Any] = {"device_kind": device, "cpu_model": _cpu_model(), "cores": cores,
                          "torch_threads": int(threads if threads is not None else torch.get_num_threads()),
                          "torch": torch.__version__, "host": platform.node()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        fp.update({"gpu_name": p.name, "gpu_count": torch.cuda.device_count(),
                   "gpu_memory_gib": round(p.total_memory / 2**30, 1),
                   "gpu_sms": p.multi_processor_count, "gpu_capability": f"{p.major}.{p.minor}",
                   **_gpu_clocks()})
    return fp


def profile_model(profile: Profile) -> ModelConfig:
    """The model dims a measured profile was taken with (its sidecar), as a ModelConfig."""
    dims = {k: int(profile.meta.model[k]) for k in MODEL_DIMS}
    arch = {k: v for k, v in profile.meta.model.items() if k in ARCH_FIELDS}  # where not Qwen2's
    return ModelConfig(name="profiled", block_size=profile.meta.block_size, **dims, **arch)


def profile_threads(profile: Profile) -> int:
    """torch threads the profile was measured with (fingerprint, else its device label, else 1)."""
    fp = profile.meta.machine or {}
    if "torch_threads" in fp:
        return int(fp["torch_threads"])
    m = re.search(r"(\d+) thread", profile.meta.device)
    return int(m.group(1)) if m else 1


Measure = Callable[[Profile, ProbeGrid], pd.DataFrame]


def probe(profile: Profile, grid: ProbeGrid, *, repeats: int = 3, warmup: int = 2) -> pd.DataFrame:
    """Measure ``grid`` (points of ``profile``) on this machine the way the profile was measured:
    the profiler's closures, interleaved rounds, the profile's statistic, threads, device and
    concurrency. Returns ``op, seq_len, budget, latency_s``."""
    from sparsebalance.kernels.profiler import ProfileGrid, run_profile

    meta = profile.meta
    # cuda where either the fingerprint or the device label says so (as the profile verb records them)
    device = "cuda" if (meta.machine or {}).get("device_kind") == "cuda" or \
        not meta.device.lower().startswith("cpu") else "cpu"
    optim = sorted(int(x) for x in profile.rows("optim")["seq_len"]) if "optim" in profile.ops else [10_000]
    stat = "median" if "median of" in meta.how else "mean"
    pg = ProfileGrid(seq_lens=grid.seq_lens, budgets=grid.budgets, tokens=grid.tokens,
                     params=(optim[0],), repeats=repeats, warmup=warmup, threads=profile_threads(profile),
                     device=device, dtype=meta.dtype, statistic=stat,
                     tp_plan="(tp_plan)" in meta.how, cp=meta.cp or 1, cp_layout=meta.cp_layout or "zigzag", cp_steps=False,
                     bench=meta.bench or "",
                     # as the profile ran its layers (its how says so), not as auto would pick here
                     layer_impl="compiled" if "layer_impl compiled" in meta.how else "eager")
    conc = (meta.concurrency or 1) if device == "cpu" else 1
    return run_profile(profile_model(profile), pg, progress=False, concurrency=conc)


def timed_probe(profile: Profile, grid: ProbeGrid, measure: Measure | None = None) -> tuple[pd.DataFrame, float]:
    """(probe table, wall seconds) with ``measure`` (default :func:`probe`; tests pass a fake)."""
    t0 = time.perf_counter()
    table = (measure or probe)(profile, grid)
    return table, time.perf_counter() - t0
