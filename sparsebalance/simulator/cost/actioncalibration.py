"""Action calibration: what a trainer adds to each forward and backward action beyond the profile.

A latency profile times each op alone (``profile``); inside a trainer the same action also runs the
trainer's own per-action work: a pipeline stage's input and output handling, FSDP's per-unit hooks
and buffer copies, the collectives' waits on a host whose cores the communication thread shares.
A **trainer probe** runs the real job once on plans of its own (another seed than the runs it is
judged on), and :func:`fit` relates its measured F and B actions to the simulator's prediction of the
same plans, per (device stage, op), as ``measured = scale x predicted + offset`` (least squares),
plus the part of the iteration no action explains (``step_s``: the mean over the probe's iterations
of measured minus predicted once the actions are corrected; the trainer's work between steps'
actions: its data loading, loss reduction, hooks outside the timed actions).

:class:`ActionCalibration` applies the fit to the simulator's action durations (``SimulatorExecutor``,
``calibration=``) and ``step_s`` to every device's optimizer step, so an iteration's time is the
schedule over corrected actions + that per-step constant. Where the probe's predictions barely vary
(coefficient of variation under :data:`MIN_SPREAD`) or the line would make an action of the probe's
range non-positive, the fit falls back to the ratio of means (offset 0) and says so (``method``).
Imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparsebalance.errors import ConfigError

MIN_SPREAD = 0.05
"""Coefficient of variation of the probe's predicted durations below which a line is not fitted:
an offset and a slope cannot be told apart on (nearly) one duration."""
MIN_POINTS = 4
"""Fewest actions of a (stage, op) a line is fitted to; fewer: the ratio of means."""


@dataclass(frozen=True, slots=True)
class Line:
    """``measured = scale x predicted + offset_s`` for one (device stage, op)."""

    scale: float
    """Seconds measured per second predicted (dimensionless)."""
    offset_s: float
    """Seconds added to every action."""
    points: int
    """Probe actions the line was fitted to."""
    r: float
    """Correlation of predicted and measured durations over those actions (nan: no spread)."""
    method: str
    """``least-squares`` or ``ratio`` (the fall-back, see module docstring)."""

    def __call__(self, seconds: np.ndarray) -> np.ndarray:
        return self.scale * seconds + self.offset_s


@dataclass(frozen=True, slots=True)
class ActionCalibration:
    """Per (device stage, op) lines and the per-step constant of one trainer probe."""

    lines: dict[tuple[int, str], Line] = field(default_factory=dict)
    """(device stage, ``F`` or ``B``) -> its line; actions of a pair not here are left as predicted."""
    step_s: float = 0.0
    """Seconds per iteration the corrected actions leave unexplained, added to every device's
    optimizer step (may be negative: a device's step is then shortened, never below 0 s)."""

    def apply(self, times: dict[str, np.ndarray], devices: Sequence[int]) -> dict[str, np.ndarray]:
        """``times`` ([dp, V, m] seconds per mode) with each line applied to its virtual stages'
        actions; ``devices[v]`` is virtual stage v's device. Modes without a line (``I``, ``W``) stay."""
        out = {}
        for mode, t in times.items():
            t = np.array(t, dtype=float, copy=True)
            for v, d in enumerate(devices):
                line = self.lines.get((d, mode))
                if line is not None:
                    t[:, v, :] = line(t[:, v, :])
            out[mode] = t
        return out

    def record(self) -> dict[str, Any]:
        """JSON-ready: every line and ``step_s`` (summary.json)."""
        return {"step_s": self.step_s,
                "lines": [{"stage": s, "op": op, "scale": ln.scale, "offset_s": ln.offset_s,
                           "points": ln.points, "r": ln.r, "method": ln.method}
                          for (s, op), ln in sorted(self.lines.items())]}


def fit_line(predicted: np.ndarray, measured: np.ndarray) -> Line:
    """The line of one (stage, op) from its probe actions (seconds, same order)."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    if p.shape != m.shape or p.size == 0:
        raise ConfigError(f"action calibration: needs predicted and measured actions of one shape, got "
                          f"{p.shape} and {m.shape}")
    if not (np.all(p > 0) and np.all(m > 0)):
        raise ConfigError("action calibration: every predicted and measured action must last > 0 s")
    spread = float(p.std() / p.mean())
    r = float(np.corrcoef(p, m)[0, 1]) if spread > 0 and m.std() > 0 else float("nan")
    if p.size >= MIN_POINTS and spread >= MIN_SPREAD:
        scale, offset = np.polyfit(p, m, 1)
        if scale > 0 and scale * p.min() + offset > 0:
            return Line(float(scale), float(offset), int(p.size), r, "least-squares")
    return Line(float(m.mean() / p.mean()), 0.0, int(p.size), r, "ratio")


def fit(actions: Any) -> dict[tuple[int, str], Line]:
    """Lines from a table of probe actions with columns ``stage, op, predicted, measured`` (seconds;
    ``analysis.validate.action_table`` after warm-up), one per (stage, op) of ``F`` and ``B``."""
    lines = {}
    for (stage, op), g in actions[actions["op"].isin(("F", "B"))].groupby(["stage", "op"]):
        lines[(int(stage), str(op))] = fit_line(g["predicted"].to_numpy(), g["measured"].to_numpy())
    if not lines:
        raise ConfigError("action calibration: the probe measured no F or B action after warm-up")
    return lines
