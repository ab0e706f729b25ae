"""Does a measurement judge itself trustworthy? One pure judge for every verb and benchmark that times.

A timing on a shared host is only the machine's figure when the machine was ours: other processes
taking cores (or the hypervisor taking them for other guests: steal) stretch some runs and not
others, and the calibration probes, which re-measure the same profile points once per round, then
disagree. The judge reads what the measurement recorded of itself (``commands/_hostload.py``: other
processes' cores over each run's window; ``calibrate.py``: each probe's per-op scale; where the
caller can read them, each run's mean iteration time against the same plans' runs in other rounds)
and returns a :class:`Verdict`. :func:`repeat_disturbed` repeats a disturbed round a bounded number of
times and :func:`select` keeps the rounds a result is reported from. No I/O, no clock: tests feed
generated records.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sparsebalance.simulator.cost.calibration import RESHAPE_SPREAD

FOREIGN_MEAN_SHARE = 0.05
"""Other processes' cores, averaged over a round's runs (wall-weighted), as a share of the cores the
run uses, above which the round is disturbed. Why 5 %: work competing for the run's cores stretches
it by up to that share, and 5 % is validate's own error target; on the 2-core VM with a PP-2 run it
is 0.10 cores (the issue's quiet call had 0.003 and 2.8 % error, the disturbed one 0.16 and 23.9 %)."""
FOREIGN_MAX_SHARE = 0.10
"""The same for the single most loaded run of a round. Why 10 %: a speedup is the ratio of two runs,
so one run stretched alone moves it by that share, about half the effect it is judged on (SAB + DST
predicted ~1.2x); a round's mean can stay under 5 % while one of its runs is past this."""
PROBE_TOLERANCE = RESHAPE_SPREAD
"""Largest |log| distance of a probe's per-op scale from the median of the call's probes. Why this
value: it is the calibration's own stated tolerance (``RESHAPE_SPREAD``: the spread of log ratios
beyond which one factor per op no longer describes the machine); probes further apart than that saw
different machines, so the rounds beside them did too."""
RUN_TOLERANCE = math.log(1.5)
"""Largest |log| distance of a run's mean iteration time from the median of the same policy's runs
in the call's other tries (the same plans, so the same expected time). Why 1.5x: one run's ordinary
round-to-round spread on this VM is within +-20 % (torchtitan PP 2, 2026-11-29: 0.376-0.459 s over
six rounds of one plan set); a run 1.5x off is a disturbance no load figure saw (measured the same
day: a baseline run at 2.0x its five other rounds with 0.03 cores of steal and no other process)."""
MIN_OTHER_RUNS = 3
"""Fewest runs of the same policy in other tries a run is judged against: their median stays an
undisturbed run's time while one of them is disturbed."""
ENOUGH_ROUNDS = 2
"""Undisturbed rounds a result is reported from on their own: two give a confidence interval."""

T = TypeVar("T")


@dataclass(slots=True)
class Verdict:
    """Whether a measurement was disturbed, and why (one short reason per criterion exceeded)."""

    disturbed: bool
    reasons: list[str] = field(default_factory=list)
    severity: float = 0.0
    """Largest measured / threshold ratio (< 1: within every threshold; 0: nothing to judge)."""

    def tag(self) -> str:
        """``DISTURBED (reason; ...)`` or the empty string."""
        return f"DISTURBED ({'; '.join(self.reasons)})" if self.disturbed else ""

    def to_dict(self) -> dict[str, Any]:
        return {"disturbed": self.disturbed, "disturbed_reasons": list(self.reasons)}


def run_cores(workers: int, threads: int, host_cores: int) -> int:
    """Cores a run can use: its workers x threads, at most the host's (an oversubscribed run of 4
    workers on 2 cores uses 2)."""
    return max(1, min(workers * threads, host_cores))


def window_load(loads: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Other processes' and other guests' cores over several runs: wall-weighted ``foreign_mean``,
    the worst run's ``foreign_max`` and ``steal_mean`` (None where no run recorded them)."""
    def mean(key: str) -> float | None:
        xs = [(d[key], d.get("wall_s") or 0.0) for d in loads if d.get(key) is not None]
        wall = sum(w for _, w in xs)
        if not xs:
            return None
        return sum(v * w for v, w in xs) / wall if wall > 0 else sum(v for v, _ in xs) / len(xs)

    vals = [d["foreign_cores"] for d in loads if d.get("foreign_cores") is not None]
    return {"foreign_mean": mean("foreign_cores"), "foreign_max": max(vals) if vals else None,
            "steal_mean": mean("steal_cores")}


def probe_disagreement(scales: Sequence[Mapping[str, float]], which: int) -> tuple[float, str] | None:
    """(largest |log(scale / median scale)|, its op) of probe ``which`` among ``scales`` (each
    probe's per-op scales, ops that carry the time), or None with fewer than two probes: one probe
    has nothing to disagree with."""
    if len(scales) < 2:
        return None
    worst: tuple[float, str] | None = None
    for op, s in scales[which].items():
        logs = [math.log(p[op]) for p in scales if p.get(op, 0) > 0]
        if s <= 0 or len(logs) < 2:
            continue
        d = abs(math.log(s) - statistics.median(logs))
        if worst is None or d > worst[0]:
            worst = (d, op)
    return worst


def run_disagreement(runs: Sequence[tuple[str, float]],
                     others: Sequence[tuple[str, float]]) -> tuple[float, str] | None:
    """(largest |log(seconds / median of the same policy's ``others``)|, its policy) over ``runs``
    ((policy, mean iteration seconds) of one try), or None where no run's policy has
    :data:`MIN_OTHER_RUNS` others (with two, one disturbed run would move the median of the rest)."""
    worst: tuple[float, str] | None = None
    for policy, sec in runs:
        same = [o for p, o in others if p == policy and o > 0]
        if sec <= 0 or len(same) < MIN_OTHER_RUNS:
            continue
        d = abs(math.log(sec / statistics.median(same)))
        if worst is None or d > worst[0]:
            worst = (d, policy)
    return worst


def judge(loads: Sequence[Mapping[str, Any]], *, cores: int, host_cores: int,
          probe: tuple[float, str] | None = None, run: tuple[float, str] | None = None) -> Verdict:
    """The verdict on one round (or one timing window) from its runs' host-load records and, where
    probed, its probe's disagreement (:func:`probe_disagreement`), and where given its runs'
    disagreement with the same plans' other runs (:func:`run_disagreement`). Load on the host's spare
    cores (``host_cores - cores``) does not compete for the run's and is not counted; steal is."""
    w = window_load(loads)
    spare = max(0, host_cores - cores)
    reasons, ratios = [], [0.0]

    def check(value: float | None, share: float, words: str) -> None:
        if value is None:
            return
        limit = share * cores
        competing = max(0.0, value - spare)
        ratios.append(competing / limit)
        if competing > limit:
            beyond = f", {competing:.2f} beyond the {spare} spare," if spare else ""
            reasons.append(f"{words} {value:.2f} cores{beyond} > {limit:.2f} ({share:.0%} of the run's {cores})")

    check(w["foreign_mean"], FOREIGN_MEAN_SHARE, "other processes used")
    if len(loads) > 1:  # one window: its max is its mean
        check(w["foreign_max"], FOREIGN_MAX_SHARE, "other processes used in one run")
    if w["steal_mean"] is not None:
        ratios.append(w["steal_mean"] / (FOREIGN_MEAN_SHARE * cores))
        if w["steal_mean"] > FOREIGN_MEAN_SHARE * cores:
            reasons.append(f"the hypervisor took {w['steal_mean']:.2f} cores (steal) > "
                           f"{FOREIGN_MEAN_SHARE * cores:.2f}")
    if probe is not None:
        ratios.append(probe[0] / PROBE_TOLERANCE)
        if probe[0] > PROBE_TOLERANCE:
            reasons.append(f"calibration probe off the others' median by {math.expm1(probe[0]):+.0%} "
                           f"on {probe[1]} (tolerance {math.expm1(PROBE_TOLERANCE):.0%})")
    if run is not None:
        ratios.append(run[0] / RUN_TOLERANCE)
        if run[0] > RUN_TOLERANCE:
            reasons.append(f"the {run[1]} run off the median of the same plans' other runs by a factor "
                           f"{math.exp(run[0]):.2f} (tolerance {math.exp(RUN_TOLERANCE):.2f})")
    return Verdict(disturbed=bool(reasons), reasons=reasons, severity=max(ratios))


@dataclass(slots=True)
class Attempt(Generic[T]):
    """One try of one round: its verdict and what the caller measured (``payload``)."""

    round: int
    attempt: int
    verdict: Verdict
    payload: T


def repeat_disturbed(rounds: int, retries: int,
                     attempt: Callable[[int, int], tuple[Verdict, T]]) -> list[list[Attempt[T]]]:
    """Run ``attempt(round, try)`` for each round, again while its verdict is disturbed, at most
    ``retries`` more times (0: never); every try is kept, in order, per round."""
    if retries < 0:
        raise ValueError(f"retries: must be >= 0, got {retries}")
    out: list[list[Attempt[T]]] = []
    for r in range(rounds):
        tries: list[Attempt[T]] = []
        for a in range(retries + 1):
            verdict, payload = attempt(r, a)
            tries.append(Attempt(r, a, verdict, payload))
            if not verdict.disturbed:
                break
        out.append(tries)
    return out


@dataclass(slots=True)
class Selection(Generic[T]):
    """The tries a result is reported from, and the verdict on that result."""

    kept: list[Attempt[T]]
    """One try per round reported (each round's undisturbed try, else its least disturbed)."""
    dropped: list[int]
    """Rounds left out: disturbed, while enough undisturbed rounds remained."""
    verdict: Verdict


def select(tries: Sequence[Sequence[Attempt[T]]], enough: int = ENOUGH_ROUNDS) -> Selection[T]:
    """Per round its last try when undisturbed, else its least disturbed one; then, when at least
    ``min(enough, rounds)`` rounds are undisturbed, those only (the result is not disturbed);
    otherwise every round, and the result is disturbed with each disturbed round's reasons."""
    best = [next((t for t in ts if not t.verdict.disturbed), None) or
            min(ts, key=lambda t: t.verdict.severity) for ts in tries]
    clean = [t for t in best if not t.verdict.disturbed]
    if len(clean) >= min(enough, len(best)):
        return Selection(kept=clean, dropped=[t.round for t in best if t.verdict.disturbed],
                         verdict=Verdict(False, [], max((t.verdict.severity for t in clean), default=0.0)))
    reasons = [f"round {t.round}: {r}" for t in best if t.verdict.disturbed for r in t.verdict.reasons]
    return Selection(kept=list(best), dropped=[],
                     verdict=Verdict(True, reasons, max(t.verdict.severity for t in best)))


def host_line(loads: Sequence[Mapping[str, Any]], verdict: Verdict, *, cores: int, what: str) -> str:
    """One line: other processes' cores beside the figures of ``what``, and the verdict."""
    w = window_load(loads)
    if w["foreign_mean"] is None:
        return f"host during {what}: not recorded (no /proc/stat)"
    most = f", at most {w['foreign_max']:.2f} in one run" if len(loads) > 1 else ""
    steal = f", steal {w['steal_mean']:.2f}" if w["steal_mean"] else ""
    return (f"host during {what}: other processes used {w['foreign_mean']:.2f} cores on average{most}"
            f"{steal} (the run uses {cores}); " + (verdict.tag() or "quiet: within the thresholds"))
