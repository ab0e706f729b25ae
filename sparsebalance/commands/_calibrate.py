"""``validate`` and ``simulate``: check a measured profile on this machine before trusting it.

:class:`Prober` probes a measured (non-analytical) profile whose device this machine has at a few
of its points here (seconds), once or several times, then rescales it per op by the ratios of all
probes together, writes the rescaled profile and the probe points beside the results, and returns
the run config pointing at it; one line says what happened. ``validate`` probes once per round,
between the real runs: this machine's speed drifts over minutes (on the project's VM by more than
the effect a prediction is judged on), and a probe taken at one moment rescales the whole call by
that moment's speed, while probes spread over the rounds see the speed the runs saw.
:func:`calibrate_run` is the one-probe case (``simulate``). ``as_is`` (``--profile-as-is``) keeps
the profile untouched and only reports a fingerprint mismatch. Analytical profiles are models, not
measurements: left alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CALIBRATED_DIR = "profile-calibrated"


class Prober:
    """Probes of one profile for one results directory. ``active`` is False where no probe runs
    (analytical profile, no torch, ``as_is``, a device this machine lacks); then :meth:`probe` does
    nothing and :meth:`finish` returns the config unchanged with the reason in ``status``."""

    def __init__(self, cfg: Any, out: Path, *, as_is: bool, measure: Callable | None = None,
                 emit: Callable[[str], None] = print) -> None:
        from sparsebalance.simulator.cost.calibration import (
            fingerprint_mismatch,
            needs_probe,
            same_device_kind,
        )
        from sparsebalance.simulator.cost.profile import load_profile

        self.cfg, self.out, self.measure, self.emit = cfg, out, measure, emit
        self.tables: list = []
        self.seconds = 0.0
        self.active = False
        self.prof = load_profile(cfg.profile, cfg.base_dir)
        if not needs_probe(self.prof):
            self.record = {"applied": False, "status": "analytical"}
            return
        try:
            from sparsebalance.kernels.calibrate import machine_fingerprint, profile_threads
        except ImportError as e:  # base install: no torch to run the probe with
            emit(f"calibration: skipped, the probe needs the [train] extra ({e}); profile used as is")
            self.record = {"applied": False, "status": "no-torch"}
            return
        # threads as the run uses them (realrun.threads), else as the probe measures (the profile's)
        threads = (cfg.realrun or {}).get("threads", 1) if cfg.realrun else profile_threads(self.prof)
        self.here = machine_fingerprint("cuda" if _is_cuda(self.prof) else "cpu", threads=threads)
        mismatch = fingerprint_mismatch(self.prof.meta.get("machine"), self.here)
        fp_note = (f"fingerprint differs: {'; '.join(mismatch)}" if mismatch else
                   "the profile records no machine fingerprint" if not self.prof.meta.get("machine") else
                   "fingerprint matches")
        fp = {"fingerprint_here": self.here, "fingerprint_profile": self.prof.meta.get("machine"),
              "fingerprint_mismatch": mismatch}
        if as_is:
            emit(f"calibration: off (--profile-as-is), profile {cfg.profile} used as measured; {fp_note}")
            self.record = {"applied": False, "status": "as-is", **fp}
        elif not same_device_kind(self.prof, self.here):
            emit(f"calibration: profile {cfg.profile} was measured on {self.prof.meta.get('device')!r}, "
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

    def finish(self, only: Sequence[int] | None = None) -> tuple[Any, dict]:
        """(config to run or replay with, a JSON-able record whose ``status`` is one of analytical,
        no-torch, as-is, device-not-here, rescaled); an active prober needs at least one
        :meth:`probe` first. Every probe's points (or those of the probes ``only`` names: validate
        leaves out the probes of rounds it does not report) enter one fit: an op's scale is the
        geometric mean over its points of all probes, its spread includes the drift between probes."""
        if not self.active:
            return self.cfg, self.record
        import pandas as pd

        from sparsebalance.simulator.cost.calibration import fit, rescale
        from sparsebalance.simulator.cost.profile import write_profile

        used = self.tables if only is None else [self.tables[i] for i in only]
        table = pd.concat(used, ignore_index=True)
        cal = fit(self.prof, table, fingerprint_here=self.here, seconds=self.seconds)
        scaled = rescale(self.prof, cal)
        target = self.out / CALIBRATED_DIR
        write_profile(scaled.table, scaled.meta, target)
        self.out.mkdir(parents=True, exist_ok=True)
        cal.points.to_csv(self.out / "calibration.csv", index=False)
        probes = len(used)
        left = len(self.tables) - probes
        self.emit(cal.line(applied=True) + (f" ({probes} probes, one per round)" if probes > 1 else "")
                  + (f"; {left} probe(s) of repeated or left-out rounds not used" if left else ""))
        return (dataclasses.replace(self.cfg, profile=str(target.resolve())),
                {"status": "rescaled", "probes": probes, "probes_taken": len(self.tables),
                 **cal.to_dict(applied=True)})


def calibrate_run(cfg: Any, out: Path, *, as_is: bool, measure: Callable | None = None,
                  emit: Callable[[str], None] = print) -> tuple[Any, dict]:
    """One probe now and the rescaled config (``simulate``); see :class:`Prober`."""
    prober = Prober(cfg, out, as_is=as_is, measure=measure, emit=emit)
    prober.probe()
    return prober.finish()


def _is_cuda(prof: Any) -> bool:
    kind = (prof.meta.get("machine") or {}).get("device_kind")
    return kind == "cuda" if kind else not str(prof.meta.get("device", "")).lower().startswith("cpu")
