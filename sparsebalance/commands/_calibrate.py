"""``validate`` and ``simulate``: a calibrated profile saved beside the run's results.

The probe and the rescale are the library's (``sparsebalance/calibrate.py``); a verb saves what it
returned into its results directory, ``profile-calibrated/`` and ``calibration.csv`` (the probed
points), and runs or replays with the config pointing there.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sparsebalance.calibrate import Calibrated
from sparsebalance.runconfig import RunConfig

CALIBRATED_DIR = "profile-calibrated"


def save_calibrated(cfg: RunConfig, out: Path, calibrated: Calibrated) -> RunConfig:
    """``cfg`` with its profile replaced by the saved calibrated one; ``cfg`` itself where no probe
    ran (nothing is written then)."""
    if calibrated.profile is None or calibrated.points is None:
        return cfg
    target = calibrated.profile.save(out / CALIBRATED_DIR)
    calibrated.points.to_csv(out / "calibration.csv", index=False)
    return dataclasses.replace(cfg, profile=str(target.resolve()))
