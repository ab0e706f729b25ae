"""Uncertainty of validate's speedups: how sure the measured one is, and how sure the predicted one.

* **Measured**: the rounds of a validate call are paired (each round runs the baseline and the
  policy back to back, ABBA), so each round gives one speedup; their logs are roughly normal and
  the round-to-round spread is the machine's noise. :func:`speedup_ci` is the Student-t 95 %
  interval of the mean log speedup (exponentiated): with few rounds or a noisy host it is wide,
  and when it contains 1 the call has **not resolved** the ranking.
* **Predicted**: the simulator's speedup is exact for a given profile, but the profile's points
  carry measurement error relative to this machine now, which the calibration probe estimates
  (``simulator/cost/calibration.py``: spread of log(probe / profile) within an op). :func:`predicted_interval`
  redraws every profile point with that error (independent log-normal factors, ``sigma``), replays
  the runs' own plans on each draw and reports the 2.5-97.5 % range of the predicted speedup.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from sparsebalance.analysis.stats import mean_ci
from sparsebalance.simulator.config import ClusterConfig, ModelConfig
from sparsebalance.simulator.cost.profile import Profile

if TYPE_CHECKING:
    from sparsebalance.simulator.cost.query import LatencyQuery
    from sparsebalance.simulator.engine.iteration import Executor


def speedup_ci(per_round: Sequence[float], level: float = 0.95) -> dict:
    """``{"lo", "hi", "se_log", "n"}``: t interval of the geometric-mean speedup over rounds (the
    interval of the mean log speedup, :func:`.stats.mean_ci`, exponentiated); lo/hi None with fewer
    than 2 rounds."""
    logs = np.log(np.asarray([x for x in per_round if x > 0], dtype=float))
    n = len(logs)
    if n < 2:
        return {"lo": None, "hi": None, "se_log": None, "n": n}
    _, lo, hi = mean_ci(logs, level)
    return {"lo": math.exp(lo), "hi": math.exp(hi), "se_log": float(logs.std(ddof=1) / math.sqrt(n)), "n": n}


MAX_ROUNDS_ADVISED = 1000
"""Largest round count :func:`rounds_to_resolve` searches (beyond it: None, not worth running)."""


def rounds_to_resolve(per_round: Sequence[float], speedup: float, level: float = 0.95) -> int | None:
    """Fewest rounds whose :func:`speedup_ci` would exclude 1 for a true speedup ``speedup`` (the
    predicted one) at these rounds' spread: the least n >= 2 with ``t_{level, n-1} x sd / sqrt(n) <
    |log speedup|``, sd the standard deviation of the rounds' log speedups. None with fewer than 2
    rounds, no effect (``speedup`` 1) or above ``MAX_ROUNDS_ADVISED``. A planning figure: the
    spread is itself estimated from these rounds."""
    logs = np.log(np.asarray([x for x in per_round if x > 0], dtype=float))
    effect = abs(math.log(speedup)) if speedup > 0 else 0.0
    if len(logs) < 2 or effect == 0.0:
        return None
    sd = float(logs.std(ddof=1))
    from scipy.stats import t

    n = np.arange(2, MAX_ROUNDS_ADVISED + 1)
    ok = t.ppf(0.5 + level / 2, n - 1) * sd / np.sqrt(n) < effect
    return int(n[np.argmax(ok)]) if ok.any() else None


def pooled_spread(spreads: dict[str, float], counts: dict[str, int]) -> float | None:
    """One per-point error (sd of log ratios) pooled over ops: sqrt(sum (n_op - 1) s_op^2 /
    sum (n_op - 1)); None when no op has two points."""
    dof = sum(max(counts.get(op, 0) - 1, 0) for op in spreads)
    if dof == 0:
        return None
    return math.sqrt(sum(max(counts.get(op, 0) - 1, 0) * s * s for op, s in spreads.items()) / dof)


def perturbed(profile: Profile, sigma: float, rng: np.random.Generator) -> Profile:
    """``profile`` with every point multiplied by exp(N(0, sigma)), independently."""
    t = profile.table.copy()
    t["latency_s"] = t["latency_s"] * np.exp(rng.normal(0.0, sigma, len(t)))
    return Profile(table=t, meta=profile.meta, source=profile.source)


def predicted_interval(profile: Profile, model: ModelConfig, cluster: ClusterConfig, runs: dict[str, list], *,
                       executor: Callable[[LatencyQuery, ModelConfig, ClusterConfig], Executor], baseline: str,
                       policy: str, sigma: float, draws: int = 48, seed: int = 0,
                       skip_first: bool = True, extrapolate: str = "clamp") -> dict:
    """``runs``: policy -> list of (plans, budgets), one per round (rounds that ran identical plans
    may pass the same object: it is replayed once per draw); ``executor(latency, model, cluster)``
    replays them (the simulator's, ``SimulatorExecutor``: the caller's choice, so analysis never
    imports the engine). Returns ``{"lo", "hi", "se_log", "draws", "sigma"}`` of the predicted
    speedup (mean baseline / mean policy iteration time over counted iterations) under ``draws``
    redraws of the profile."""
    from sparsebalance.simulator.cost.latency import LatencyModel

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(draws):
        lm = LatencyModel(perturbed(profile, sigma, rng), model, cluster, extrapolate=extrapolate)
        ex = executor(lm, model, cluster)
        means, cache = {}, {}
        for name in (baseline, policy):
            times = []
            for plans, budgets in runs[name]:
                if id(plans) not in cache:  # rounds that ran the same plans replay them once
                    cache[id(plans)] = [ex.execute(it, plan, bud).iteration_time_s
                                        for it, (plan, bud) in enumerate(zip(plans, budgets))
                                        if not (skip_first and it == 0)]
                times += cache[id(plans)]
            means[name] = float(np.mean(times))
        out.append(means[baseline] / means[policy])
    logs = np.log(out)
    lo, hi = np.percentile(out, [2.5, 97.5])
    return {"lo": float(lo), "hi": float(hi), "se_log": float(logs.std(ddof=1)) if draws > 1 else 0.0,
            "draws": draws, "sigma": sigma}


def consistent(measured: float, se_measured: float | None, predicted: float,
               se_predicted: float | None) -> bool | None:
    """Whether measured and predicted speedups agree within their combined 95 % uncertainty
    (|log difference| <= 1.96 x sqrt(se_m^2 + se_p^2)); None when neither uncertainty is known."""
    if se_measured is None and se_predicted is None:
        return None
    se = math.sqrt((se_measured or 0.0) ** 2 + (se_predicted or 0.0) ** 2)
    return abs(math.log(measured) - math.log(predicted)) <= 1.96 * se
