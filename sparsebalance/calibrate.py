"""A run's measured profile calibrated on this machine: the library producer of a rescaled Profile.

:class:`Prober` probes a measured (non-analytical) profile whose device this machine has at a few
of its points here (seconds), once or several times, then rescales it per op by the ratios of all
probes together (``simulator/cost/calibration.py``) and returns the whole rescaled :class:`Profile`;
one line says what happened. ``validate`` probes once per round, between the real runs: this
machine's speed drifts over minutes (on the project's VM by more than the effect a prediction is
judged on), and a probe taken at one moment rescales the whole call by that moment's speed, while
probes spread over the rounds see the speed the runs saw. ``simulate`` probes once, before the run
is prepared, so the run is prepared once, with the calibrated profile. ``as_is``
(``--profile-as-is``) keeps the profile untouched and only reports a fingerprint mismatch.
Analytical profiles are models, not measurements: left alone.

Saving the result beside a run's results is the verbs' part (``commands/_calibrate.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from sparsebalance.runconfig import RunConfig
from sparsebalance.simulator.cost.profile import Profile


@dataclass(kw_only=True, slots=True)
class Calibrated:
    """What :meth:`Prober.finish` returns."""

    profile: Profile | None
    """The profile rescaled on this machine; None where no probe ran (see ``record['status']``)."""
    points: pd.DataFrame | None
    """Every probed point (op, seq_len, budget, profile_s, probe_s, ratio); None with ``profile``."""
    record: dict[str, Any]
    """JSON-able: ``status`` (analytical, no-torch, as-is, device-not-here, rescaled) and, where a
    fingerprint was taken or a probe ran, the fingerprints, scales and spreads."""


class Prober:
    """Probes of one run's profile. ``active`` is False where no probe runs (analytical profile, no
    torch, ``as_is``, a device this machine lacks); then :meth:`probe` does nothing and
    :meth:`finish` returns no profile, with the reason in the record's ``status``."""

    def __init__(self, cfg: RunConfig, *, as_is: bool, measure: Callable | None = None,
                 emit: Callable[[str], None] = print) -> None:
        from sparsebalance.simulator.cost.calibration import (
            fingerprint_mismatch,
            needs_probe,
            same_device_kind,
        )
        from sparsebalance.simulator.cost.catalog import load_profile
        from sparsebalance.simulator.cost.profilecheck import check_tp_overlap

        self.cfg, self.measure, self.emit = cfg, measure, emit
        self.tables: list[pd.DataFrame] = []
        self.seconds = 0.0
        self.active = False
        self.prof = load_profile(cfg.profile, cfg.base_dir)
        check_tp_overlap(self.prof, cfg.cluster)  # refused before a probe spends time on it
        meta = self.prof.meta
        if not needs_probe(self.prof):
            self.record: dict[str, Any] = {"applied": False, "status": "analytical"}
            return
        try:
            from sparsebalance.kernels.calibrate import machine_fingerprint, profile_threads
        except ImportError as e:  # base install: no torch to run the probe with
            emit(f"calibration: skipped, the probe needs the [train] extra ({e}); profile used as is")
            self.record = {"applied": False, "status": "no-torch"}
            return
        # threads as the run uses them (realrun.threads), else as the probe measures (the profile's)
        threads = (cfg.realrun or {}).get("threads", 1) if cfg.realrun else profile_threads(self.prof)
        import torch

        # a CUDA profile on a machine without CUDA: this machine's fingerprint says cpu, so the
        # profile is used as is (a probe would fail to build its model on the GPU)
        cuda = meta.device_kind == "cuda" and torch.cuda.is_available()
        self.here = machine_fingerprint("cuda" if cuda else "cpu", threads=threads)
        mismatch = fingerprint_mismatch(meta.machine, self.here)
        fp_note = (f"fingerprint differs: {'; '.join(mismatch)}" if mismatch else
                   "the profile records no machine fingerprint" if not meta.machine else
                   "fingerprint matches")
        fp = {"fingerprint_here": self.here, "fingerprint_profile": meta.machine,
              "fingerprint_mismatch": mismatch}
        if as_is:
            emit(f"calibration: off (--profile-as-is), profile {cfg.profile} used as measured; {fp_note}")
            self.record = {"applied": False, "status": "as-is", **fp}
        elif not same_device_kind(self.prof, self.here):
            emit(f"calibration: profile {cfg.profile} was measured on {meta.device!r}, "
                 f"which this machine cannot run; used as is ({fp_note})")
            self.record = {"applied": False, "status": "device-not-here", **fp}
        else:
            from sparsebalance.simulator.cost.calibration import probe_grid

            self.active = True
            self.grid = probe_grid(self.prof, max_len=getattr(cfg.data, "max_length", None),
                                   budget=cfg.policy.k0)

    def probe(self) -> int | None:
        """One probe of the grid now (seconds); kept for :meth:`finish`. Returns its index (None
        when inactive)."""
        if not self.active:
            return None
        from sparsebalance.kernels.calibrate import timed_probe

        table, secs = timed_probe(self.prof, self.grid, self.measure)
        self.tables.append(table)
        self.seconds += secs
        return len(self.tables) - 1

    def scales(self) -> list[dict[str, float]]:
        """Each probe's own per-op scales, of the ops that carry the time (``Calibration.timed_ops``):
        what ``analysis/disturbance.probe_disagreement`` compares; [] when inactive."""
        if not self.tables:
            return []
        from sparsebalance.simulator.cost.calibration import fit

        timed = set(fit(self.prof, self.tables[0]).timed_ops)
        return [{op: s for op, s in fit(self.prof, t).scales.items() if op in timed} for t in self.tables]

    def finish(self, only: Sequence[int] | None = None) -> Calibrated:
        """The rescaled profile and its record; an active prober needs at least one :meth:`probe`
        first. Every probe's points (or those of the probes ``only`` names: validate leaves out the
        probes of rounds it does not report) enter one fit: an op's scale is the geometric mean over
        its points of all probes, its spread includes the drift between probes."""
        if not self.active:
            return Calibrated(profile=None, points=None, record=self.record)
        from sparsebalance.simulator.cost.calibration import fit, rescale

        used = self.tables if only is None else [self.tables[i] for i in only]
        cal = fit(self.prof, pd.concat(used, ignore_index=True), fingerprint_here=self.here,
                  seconds=self.seconds)
        probes, left = len(used), len(self.tables) - len(used)
        self.emit(cal.line(applied=True) + (f" ({probes} probes, one per round)" if probes > 1 else "")
                  + (f"; {left} probe(s) of repeated or left-out rounds not used" if left else ""))
        return Calibrated(profile=rescale(self.prof, cal), points=cal.points,
                          record={"status": "rescaled", "probes": probes, "probes_taken": len(self.tables),
                                  **cal.to_dict(applied=True)})


def calibrate_profile(cfg: RunConfig, *, as_is: bool, measure: Callable | None = None,
                      emit: Callable[[str], None] = print) -> Calibrated:
    """One probe now and the rescaled profile (``simulate``); see :class:`Prober`."""
    prober = Prober(cfg, as_is=as_is, measure=measure, emit=emit)
    prober.probe()
    return prober.finish()
