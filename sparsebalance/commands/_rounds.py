"""``validate``'s rounds: real runs in ABBA order, a calibration probe per try, each round judged.

A round is one probe and one real run of each policy (baseline first in even rounds, the config's
policy first in odd ones, so that a linear drift of the machine falls on both alike). After the
round the judge (``analysis/disturbance.py``) reads the runs' host-load records, the probe's
distance from the call's other probes and, where the caller reads them, each run's mean iteration
time against the same policy's runs in the other tries (the same plans); a disturbed round is run
again, at most ``retries`` more times, into ``round<r>-try<a>/``. Every try is kept on disk and in the summary. At the end every try
is judged again against all probes (a first probe has nothing to disagree with until later ones
exist), and :func:`~sparsebalance.analysis.disturbance.select` picks the rounds reported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparsebalance.analysis.disturbance import (
    Attempt,
    Selection,
    Verdict,
    judge,
    probe_disagreement,
    repeat_disturbed,
    run_disagreement,
    select,
    window_load,
)


@dataclass(slots=True)
class Try:
    """What one try of a round measured."""

    probe: int | None
    """Index of its calibration probe in the prober (None: not probed)."""
    loads: list[dict] = field(default_factory=list)
    """Per run: policy, round, attempt and its host-load record (``_hostload.HostLoad.record``)."""
    runs: list[tuple[str, Any, Path]] = field(default_factory=list)
    """Per run: (policy label, its run config, its directory)."""
    times: list[tuple[str, float]] = field(default_factory=list)
    """Per run the caller could read it: (policy label, mean iteration seconds after warm-up)."""


class LaunchFailed(Exception):
    """A real run exited non-zero (its one line is already printed); carries the exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(f"exit code {code}")
        self.code = code


def run_dir(out: Path, name: str, round_: int, attempt: int) -> Path:
    return out / "runs" / name.replace("+", "_") / (f"round{round_}" if attempt == 0 else
                                                    f"round{round_}-try{attempt}")


def _verdict(t: Try, scales: Sequence[dict], cores: int, host_cores: int, others: Sequence[Try] = ()) -> Verdict:
    probe = probe_disagreement(scales, t.probe) if t.probe is not None else None
    run = run_disagreement(t.times, [x for o in others if o is not t for x in o.times])
    return judge(t.loads, cores=cores, host_cores=host_cores, probe=probe, run=run)


def run_rounds(pair: Sequence[tuple[str, Any, list[str]]], out: Path, *, rounds: int, retries: int,
               prober: Any, launch: Callable[[list[str], Any, Path], tuple[int, dict]], cores: int,
               host_cores: int, emit: Callable[[str], None],
               run_time: Callable[[Path], float | None] | None = None,
               ) -> tuple[Selection[Try], list[list[Attempt[Try]]]]:
    """Every round of the call (``pair``: (label, config, --set list) of the baseline and the
    policy; ``launch(sets, cfg, run_dir) -> (exit code, host-load record)``; ``run_time(run_dir)``,
    where given, a run's mean iteration seconds, judged against the same policy's other runs);
    returns the selection reported and every try. Raises :class:`LaunchFailed` when a run fails."""
    done: list[Try] = []

    def attempt(r: int, a: int) -> tuple[Verdict, Try]:
        t = Try(probe=prober.probe())
        for name, c, s in (pair if r % 2 == 0 else pair[::-1]):
            d = run_dir(out, name, r, a)
            rc, load = launch(s, c, d)
            if rc != 0:
                raise LaunchFailed(rc)
            t.loads.append({"policy": name, "round": r, "attempt": a, **load})
            t.runs.append((name, c, d))
            sec = run_time(d) if run_time is not None else None
            if sec is not None:
                t.times.append((name, sec))
        v = _verdict(t, prober.scales(), cores, host_cores, done)
        done.append(t)
        if v.disturbed:
            again = "; running it again" if a < retries else "; no retries left"
            emit(f"validate: round {r} (try {a + 1}) {v.tag()}{again}")
        return v, t

    tries = repeat_disturbed(rounds, retries, attempt)
    scales = prober.scales()
    for ts in tries:  # judged again against every probe and run of the call
        for t in ts:
            t.verdict = _verdict(t.payload, scales, cores, host_cores, done)
    return select(tries), tries


def tries_record(tries: Sequence[Sequence[Attempt[Try]]], chosen: Selection[Try],
                 scales: Sequence[dict]) -> list[dict]:
    """One JSON-able row per try: round, attempt, kept, disturbed and reasons, the load figures and
    the probe's disagreement (|log| distance from the probes' median, on its worst op)."""
    kept = {(t.round, t.attempt) for t in chosen.kept}
    rows = []
    for ts in tries:
        for t in ts:
            dis = probe_disagreement(scales, t.payload.probe) if t.payload.probe is not None else None
            rows.append({"round": t.round, "attempt": t.attempt, "kept": (t.round, t.attempt) in kept,
                         **t.verdict.to_dict(), **window_load(t.payload.loads),
                         "probe_disagreement": None if dis is None else dis[0],
                         "probe_disagreement_op": None if dis is None else dis[1],
                         "run_seconds": [{"policy": p, "mean_iteration_s": sec} for p, sec in t.payload.times],
                         "runs": [str(d) for _, _, d in t.payload.runs]})
    return rows


def mean_iteration_s(times: Sequence[tuple[int, float]], *, warmup_excluded: bool) -> float | None:
    """A run's mean iteration seconds from its (iteration, seconds) rows, iteration 0 left out when
    ``warmup_excluded`` (as the headline counts them); None without a row to count."""
    xs = [sec for it, sec in times if not (warmup_excluded and it == 0)]
    return sum(xs) / len(xs) if xs else None
