"""``validate``'s rounds: real runs in ABBA order, a calibration probe per try, each round judged.

A round is one probe and one real run of each policy (baseline first in even rounds, the config's
policy first in odd ones, so that a linear drift of the machine falls on both alike). After the
round the judge (``analysis/disturbance.py``) reads the runs' host-load records and the probe's
distance from the call's other probes; a disturbed round is run again, at most ``retries`` more
times, into ``round<r>-try<a>/``. Every try is kept on disk and in the summary. At the end every try
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


class LaunchFailed(Exception):
    """A real run exited non-zero (its one line is already printed); carries the exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(f"exit code {code}")
        self.code = code


def run_dir(out: Path, name: str, round_: int, attempt: int) -> Path:
    return out / "runs" / name.replace("+", "_") / (f"round{round_}" if attempt == 0 else
                                                    f"round{round_}-try{attempt}")


def _verdict(t: Try, scales: Sequence[dict], cores: int, host_cores: int) -> Verdict:
    probe = probe_disagreement(scales, t.probe) if t.probe is not None else None
    return judge(t.loads, cores=cores, host_cores=host_cores, probe=probe)


def run_rounds(pair: Sequence[tuple[str, Any, list[str]]], out: Path, *, rounds: int, retries: int,
               prober: Any, launch: Callable[[list[str], Any, Path], tuple[int, dict]], cores: int,
               host_cores: int, emit: Callable[[str], None]) -> tuple[Selection[Try], list[list[Attempt[Try]]]]:
    """Every round of the call (``pair``: (label, config, --set list) of the baseline and the
    policy; ``launch(sets, cfg, run_dir) -> (exit code, host-load record)``); returns the selection
    reported and every try. Raises :class:`LaunchFailed` when a run fails."""

    def attempt(r: int, a: int) -> tuple[Verdict, Try]:
        t = Try(probe=prober.probe())
        for name, c, s in (pair if r % 2 == 0 else pair[::-1]):
            d = run_dir(out, name, r, a)
            rc, load = launch(s, c, d)
            if rc != 0:
                raise LaunchFailed(rc)
            t.loads.append({"policy": name, "round": r, "attempt": a, **load})
            t.runs.append((name, c, d))
        v = _verdict(t, prober.scales(), cores, host_cores)
        if v.disturbed:
            again = "; running it again" if a < retries else "; no retries left"
            emit(f"validate: round {r} (try {a + 1}) {v.tag()}{again}")
        return v, t

    tries = repeat_disturbed(rounds, retries, attempt)
    scales = prober.scales()
    for ts in tries:  # judged again against every probe of the call
        for t in ts:
            t.verdict = _verdict(t.payload, scales, cores, host_cores)
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
                         "runs": [str(d) for _, _, d in t.payload.runs]})
    return rows
