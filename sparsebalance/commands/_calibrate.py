"""``validate`` and ``simulate``: check a measured profile on this machine before trusting it.

One entry point, :func:`calibrate_run`: for a measured (non-analytical) profile whose device this
machine has, probe a few of its points here (seconds), rescale it per op by the measured ratios,
write the rescaled profile and the probe beside the results, and return the run config pointing
at it; one line says what happened. ``as_is`` (``--profile-as-is``) keeps the profile untouched and
only reports a fingerprint mismatch. Analytical profiles are models, not measurements: left alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

CALIBRATED_DIR = "profile-calibrated"


def calibrate_run(cfg: Any, out: Path, *, as_is: bool, measure: Callable | None = None,
                  emit: Callable[[str], None] = print) -> tuple[Any, dict]:
    """Returns (config to run with, a JSON-able record for the results whose ``status`` is one of
    analytical, no-torch, as-is, device-not-here, rescaled)."""
    from sparsebalance.simulator.calibration import (
        fingerprint_mismatch,
        fit,
        needs_probe,
        probe_grid,
        rescale,
        same_device_kind,
    )
    from sparsebalance.simulator.profile import load_profile, write_profile

    prof = load_profile(cfg.profile, cfg.base_dir)
    if not needs_probe(prof):
        return cfg, {"applied": False, "status": "analytical"}
    try:
        from sparsebalance.kernels.calibrate import machine_fingerprint, profile_threads, timed_probe
    except ImportError as e:  # base install: no torch to run the probe with
        emit(f"calibration: skipped, the probe needs the [train] extra ({e}); profile used as is")
        return cfg, {"applied": False, "status": "no-torch"}
    # threads as the run uses them (realrun.threads), else as the probe measures (the profile's)
    threads = (cfg.realrun or {}).get("threads", 1) if cfg.realrun else profile_threads(prof)
    here = machine_fingerprint("cuda" if _is_cuda(prof) else "cpu", threads=threads)
    mismatch = fingerprint_mismatch(prof.meta.get("machine"), here)
    fp_note = (f"fingerprint differs: {'; '.join(mismatch)}" if mismatch else
               "the profile records no machine fingerprint" if not prof.meta.get("machine") else
               "fingerprint matches")
    record = {"fingerprint_here": here, "fingerprint_profile": prof.meta.get("machine"),
              "fingerprint_mismatch": mismatch}
    if as_is:
        emit(f"calibration: off (--profile-as-is), profile {cfg.profile} used as measured; {fp_note}")
        return cfg, {"applied": False, "status": "as-is", **record}
    if not same_device_kind(prof, here):
        emit(f"calibration: profile {cfg.profile} was measured on {prof.meta.get('device')!r}, which "
             f"this machine cannot run; used as is ({fp_note})")
        return cfg, {"applied": False, "status": "device-not-here", **record}
    grid = probe_grid(prof, max_len=getattr(cfg.data, "max_length", None), budget=cfg.policy.k0)
    table, secs = timed_probe(prof, grid, measure)
    cal = fit(prof, table, fingerprint_here=here, seconds=secs)
    scaled = rescale(prof, cal)
    target = out / CALIBRATED_DIR
    write_profile(scaled.table, scaled.meta, target)
    out.mkdir(parents=True, exist_ok=True)
    cal.points.to_csv(out / "calibration.csv", index=False)
    emit(cal.line(applied=True))
    return (dataclasses.replace(cfg, profile=str(target.resolve())),
            {"status": "rescaled", **cal.to_dict(applied=True)})


def _is_cuda(prof: Any) -> bool:
    kind = (prof.meta.get("machine") or {}).get("device_kind")
    return kind == "cuda" if kind else not str(prof.meta.get("device", "")).lower().startswith("cpu")
