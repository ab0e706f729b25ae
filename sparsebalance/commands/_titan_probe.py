"""The trainer probe of ``validate --trainer torchtitan``: at the start of every round, one job of
the round's alternating policy on plans of its own (the run config's seed + :data:`PROBE_SEED`, so
no global batch of the judged runs is among them), run and measured as the rounds' jobs are; the
probes of the rounds reported give the
:class:`~sparsebalance.simulator.cost.actioncalibration.ActionCalibration` every prediction uses
(``simulator/cost/actioncalibration.py``: why, and the fit).

Why a probe of the trainer and not of the ops: the profile already times torchtitan's own pieces;
what it lacks is what the trainer does around them per action (the pipeline stage's input and
output handling, FSDP2's per-unit hooks, the collectives on a host whose cores the communication
thread shares), which only the trainer running shows. Why one per round and not one before them:
this VM's speed drifts by 10-20 % within a call (measured: rounds 0-1 of a PP 2 call ran 1.2x
rounds 2-5); a probe taken at one moment rescales the whole call by that moment's speed, probes
spread over the rounds see the speed the runs saw (as ``calibrate.Prober``'s op probes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

PROBE_SEED = 7919
"""Added to the run config's seed (and its data's) for the probe's plans: other documents, other
budgets, the same job."""


class TrainerProber:
    """``run_rounds``' prober for torchtitan: :meth:`probe` runs one probe job (policies in turn) and
    returns its index; :meth:`finish` fits the calibration to the probes of the rounds reported."""

    def __init__(self, jobs: list[tuple[str, list[str]]], *, preset: str, nproc: int, steps: int,
                 out: Path, launch: Callable[[list[str], Any, Path], tuple[int, dict]],
                 emit: Callable[[str], None]) -> None:
        from sparsebalance.titan.launch import check_job

        self.jobs = [(label, sets, check_job(preset, nproc, sets)) for label, sets in jobs]
        self.steps, self.out, self.launch, self.emit = steps, out, launch, emit
        self.runs: list[tuple[str, Any, Path, dict]] = []
        """Per probe job: (policy label, its setup, its dump folder, its host-load record)."""

    def probe(self) -> int:
        from sparsebalance.errors import HostError

        k = len(self.runs)
        label, sets, setup = self.jobs[k % len(self.jobs)]
        d = self.out / "probe" / f"{label.replace('+', '_')}-{k}"
        d.mkdir(parents=True, exist_ok=True)
        rc, load = self.launch(sets, setup, d)
        if rc != 0:
            raise HostError(f"validate: trainer probe {k} ({label}) failed (exit {rc}); its log is in {d}")
        self.runs.append((label, setup, d, load))
        return k

    def scales(self) -> list:
        """No per-op scales: a round is judged on its host load alone (``_rounds._verdict``)."""
        return []

    def finish(self, only: list[int]) -> tuple[Any, dict]:
        """(calibration, record) from the probes ``only`` names: lines from their F and B actions
        after warm-up, then the per-step constant from their iterations replayed with the lines."""
        import pandas as pd

        from sparsebalance.analysis import validate as V
        from sparsebalance.simulator.cost.actioncalibration import ActionCalibration, fit
        from sparsebalance.titan.launch import read_trace
        from sparsebalance.titan.measure import measured, replay

        used = [self.runs[k] for k in sorted(set(only))]
        warm, steps = self.steps > 1, self.steps
        meas, preds = [], {}
        for label, setup, d, _ in used:
            if label not in preds:
                preds[label] = replay(setup, steps)
            meas.append((label, setup, measured(read_trace(d), preds[label][2])))

        def sides(cal: Any) -> list:
            got: dict[str, Any] = {}
            for label, setup, _ in meas:
                if label not in got:
                    got[label] = replay(setup, steps, calibration=cal) if cal is not None else preds[label]
            return [V.Side(policy=label, predicted_metrics=got[label][0], measured_metrics=mm,
                           predicted_trace=got[label][1], measured_trace=mt) for label, _, (mm, mt) in meas]

        actions = pd.concat([V.action_table(s, warmup_excluded=warm) for s in sides(None)], ignore_index=True)
        lines = fit(actions[~actions["warmup"]])
        its = pd.concat([V.iteration_table(s, warmup_excluded=warm) for s in sides(ActionCalibration(lines=lines))],
                        ignore_index=True)
        its = its[~its["warmup"]]
        cal = ActionCalibration(lines=lines, step_s=float((its["measured"] - its["predicted"]).mean()))
        record = cal.record() | {"seed_offset": PROBE_SEED, "probes": [str(d) for _, _, d, _ in used],
                                 "probes_taken": len(self.runs), "iterations": len(its),
                                 "foreign_cores": [ld.get("foreign_cores") for *_, ld in used]}
        self.emit(f"trainer probe ({len(used)} jobs, one per round): "
                  + "; ".join(f"stage {s} {op} x{ln.scale:.2f} {ln.offset_s * 1e3:+.1f} ms ({ln.method}, r={ln.r:.2f})"
                              for (s, op), ln in sorted(lines.items()))
                  + f"; {cal.step_s * 1e3:+.1f} ms per step")
        return cal, record
