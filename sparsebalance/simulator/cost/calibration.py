"""Profiles that travel: check a measured profile against the machine it is used on, and rescale it.

A measured latency profile describes one machine in one state. Before a profile is trusted on the
machine where ``validate`` / ``simulate`` runs, a short **probe** re-measures a few of its points
there (``kernels/calibrate.py``: the profiler's own timed closures, same statistic and concurrency).
This module is the pure part (no torch):

* :func:`probe_grid`: which points to probe (a few lengths x budgets of the attention grid, a few
  token counts of the dense ops), inside the profile's grid and the run's lengths;
* :func:`fit`: per op, the ratio probe / profile at every probed point; the op's **scale** is the
  geometric mean of its ratios (costs multiply), its **spread** the standard deviation of the log
  ratios (how far one factor is from describing the op: a shape change, or probe noise);
* :func:`rescale`: the profile with every op multiplied by its scale (ops not probed take the median
  scale of the probed ones), the calibration recorded in the sidecar;
* :func:`fingerprint_mismatch`: what differs between the machine a profile was measured on (sidecar
  ``machine``) and this one.

Why a per-op factor and not a re-profile by default: the probe takes seconds, a profile minutes;
the factor absorbs a machine that is uniformly faster or slower per op (another CPU of the same
kind, clocks, a busier host), which is what the issue saw (1.2-1.3x per op). When the spread is
large the shape differs too, and the report says to re-profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from sparsebalance.simulator.cost.profile import ATTENTION_OPS, Profile

#: Spread (sd of log ratios) above which one factor per op does not describe the machine.
RESHAPE_SPREAD = 0.15
#: Ops whose probed points are shorter than this are timer noise for the shape test and the
#: pooled point error (an embedding lookup of 0.1 ms); they are still rescaled.
MIN_SECONDS = 1e-3
#: Fingerprint keys compared (others are informational).
FINGERPRINT_KEYS = ("device_kind", "cpu_model", "cores", "torch_threads", "gpu_name", "gpu_sm_clock_max_mhz",
                    "gpu_memory_clock_max_mhz", "gpu_count")


@dataclass(kw_only=True, slots=True)
class ProbeGrid:
    """The points a probe measures (a small rectilinear grid, the profiler's format)."""

    seq_lens: tuple[int, ...]
    """Attention lengths (tokens), from the profile's grid."""
    budgets: tuple[int, ...]
    """Attention top-k values, from the profile's grid."""
    tokens: tuple[int, ...]
    """Token counts of the dense ops (layer, embed, head), from the profile's grid."""


def _pick(values: list[int], n: int) -> tuple[int, ...]:
    """``n`` values spread over ``values`` (sorted), ends included."""
    if len(values) <= n:
        return tuple(values)
    idx = np.unique(np.round(np.linspace(0, len(values) - 1, n)).astype(int))
    return tuple(values[i] for i in idx)


def probe_grid(profile: Profile, *, max_len: int | None = None, budget: int | None = None,
               lengths: int = 2, budgets: int = 2, tokens: int = 2) -> ProbeGrid:
    """A few points of the profile's own grid: the longest lengths up to ``max_len`` (where the run's
    time goes: cost grows with length) and the grid budgets from the run's default ``budget`` up
    (where its budgets lie; DST moves around it), else budgets spread over the grid."""
    attn = profile.rows("attn_fwd")
    ls = sorted(int(x) for x in attn["seq_len"].unique())
    usable = [x for x in ls if max_len is None or x <= max_len] or ls[:1]
    # the top `lengths` usable lengths, 2x apart where the grid allows: long sequences dominate
    chosen = [usable[-1]]
    for x in reversed(usable[:-1]):
        if len(chosen) == lengths:
            break
        if x <= chosen[-1] // 2:
            chosen.append(x)
    ks = sorted(int(x) for x in attn["budget"].unique())
    if budget is not None:
        at = [k for k in ks if k >= budget] or ks[-1:]
        start = max(0, min(ks.index(at[0]), len(ks) - budgets))
        chosen_k = tuple(ks[start:start + budgets])
    else:
        chosen_k = _pick([k for k in ks if k > 1] or ks, budgets)
    dense = profile.rows("layer_fwd")
    ts = sorted(int(x) for x in dense["seq_len"].unique())
    usable_t = [x for x in ts if max_len is None or x <= max_len] or ts[:1]
    return ProbeGrid(seq_lens=tuple(sorted(chosen)), budgets=chosen_k,
                     tokens=_pick(usable_t[len(usable_t) // 2:], tokens))


@dataclass(kw_only=True, slots=True)
class Calibration:
    """What a probe found: per-op scale and spread, the points, and the fingerprints."""

    scales: dict[str, float]
    """op -> factor applied (probe / profile, geometric mean over its probed points)."""
    spreads: dict[str, float]
    """op -> standard deviation of log(probe / profile) over its points (0 with one point)."""
    points: pd.DataFrame
    """op, seq_len, budget, profile_s, probe_s, ratio: every probed point."""
    probed_ops: tuple[str, ...]
    """Ops the probe measured; the others take the median scale."""
    seconds: float = 0.0
    """Wall time the probe took."""
    fingerprint_here: dict = field(default_factory=dict)
    fingerprint_profile: dict | None = None
    mismatch: list[str] = field(default_factory=list)
    """Fingerprint differences (empty: same machine kind, or nothing recorded)."""

    @property
    def default_scale(self) -> float:
        vals = [self.scales[o] for o in self.probed_ops]
        return float(np.median(vals)) if vals else 1.0

    @property
    def timed_ops(self) -> tuple[str, ...]:
        """Probed ops whose points take >= MIN_SECONDS (median): the ones that carry the time."""
        med = self.points.groupby("op")["profile_s"].median()
        return tuple(op for op in self.probed_ops if med.get(op, 0.0) >= MIN_SECONDS)

    @property
    def reshape(self) -> bool:
        """True when one factor per op does not describe this machine (re-profile advised)."""
        return any(self.spreads[op] > RESHAPE_SPREAD for op in self.timed_ops)

    def line(self, applied: bool) -> str:
        """The one-line report."""
        parts = ", ".join(f"{op} x{self.scales[op]:.2f}" for op in self.probed_ops)
        what = "rescaled per op" if applied else "NOT applied (--profile-as-is)"
        fp = (f"; fingerprint differs: {'; '.join(self.mismatch)}" if self.mismatch
              else ("" if self.fingerprint_profile else "; the profile records no machine fingerprint"))
        worst = max(self.timed_ops, key=lambda op: self.spreads[op], default=None)
        advice = (f"; shapes differ too ({worst} spread {self.spreads[worst]:.2f} > {RESHAPE_SPREAD}): "
                  "re-measure with `sparsebalance profile`") if self.reshape and worst is not None else ""
        return (f"calibration: probed {len(self.points)} profile points in {self.seconds:.0f} s on this "
                f"machine: {parts}; {what}{fp}{advice}")

    def to_dict(self, applied: bool) -> dict[str, Any]:
        return {"applied": applied, "scales": self.scales, "spreads": self.spreads,
                "probed_ops": list(self.probed_ops), "default_scale": self.default_scale,
                "points": len(self.points), "seconds": self.seconds, "reshape_advised": self.reshape,
                "timed_ops": list(self.timed_ops),
                "fingerprint_here": self.fingerprint_here, "fingerprint_profile": self.fingerprint_profile,
                "fingerprint_mismatch": self.mismatch}


def _profile_value(profile: Profile, op: str, seq_len: int, budget: int) -> float:
    rows = profile.rows(op)
    hit = rows[(rows["seq_len"] == seq_len) & (rows["budget"] == budget)]
    if hit.empty:
        raise ValueError(f"calibration: {op} ({seq_len}, {budget}) is not a point of the profile")
    return float(hit["latency_s"].iloc[0])


def fit(profile: Profile, probe: pd.DataFrame, *, fingerprint_here: dict | None = None,
        seconds: float = 0.0) -> Calibration:
    """Compare a probe table (``op, seq_len, budget, latency_s``, at points of the profile's grid)
    with the profile. Rows of ops the profile lacks, and zero latencies, are ignored."""
    rows = []
    for r in probe.itertuples(index=False):
        if r.op not in profile.ops:
            continue
        ref = _profile_value(profile, r.op, int(r.seq_len), int(r.budget))
        if ref > 0 and r.latency_s > 0:
            rows.append((r.op, int(r.seq_len), int(r.budget), ref, float(r.latency_s), r.latency_s / ref))
    pts = pd.DataFrame(rows, columns=["op", "seq_len", "budget", "profile_s", "probe_s", "ratio"])
    scales, spreads = {}, {}
    for op, g in pts.groupby("op", sort=False):
        logs = np.log(g["ratio"].to_numpy())
        scales[op] = float(math.exp(logs.mean()))
        spreads[op] = float(logs.std(ddof=1)) if len(logs) > 1 else 0.0
    recorded = profile.meta.machine
    here = dict(fingerprint_here or {})
    return Calibration(scales=scales, spreads=spreads, points=pts, probed_ops=tuple(scales),
                       seconds=seconds, fingerprint_here=here, fingerprint_profile=recorded,
                       mismatch=fingerprint_mismatch(recorded, here) if here else [])


PROXIES = {"attn_fwd_cp_step": ("attn_fwd_cp", "attn_fwd"), "attn_bwd_cp_step": ("attn_bwd_cp", "attn_bwd")}
"""Unprobed ops that take the scale of the first probed op named here (the same kernels: a ring
step is attention on the CP path, whose rows the probe cannot re-measure by point)."""


def scale_of(cal: Calibration, op: str) -> float:
    """An op's scale: its own where probed, else its first probed proxy's (:data:`PROXIES`), else the
    median scale."""
    for name in (op, *PROXIES.get(op, ())):
        if name in cal.scales:
            return cal.scales[name]
    return cal.default_scale


def rescale(profile: Profile, cal: Calibration) -> Profile:
    """``profile`` with each op's latencies multiplied by its scale (:func:`scale_of`; unprobed ops:
    their proxy's, else the median scale); the sidecar records the calibration and keeps the original
    ``machine`` fingerprint."""
    t = profile.table.copy()
    factor = t["op"].map(lambda op: scale_of(cal, op)).astype(float)
    t["latency_s"] = t["latency_s"] * factor
    calibration = {"scales": {op: scale_of(cal, op) for op in profile.ops},
                   "spreads": cal.spreads, "probed_points": len(cal.points),
                   "machine": cal.fingerprint_here, "source": profile.source}
    meta = replace(profile.meta, calibration=calibration,
                   how=f"{profile.meta.how} | rescaled per op by a calibration probe on this machine")
    return Profile(table=t, meta=meta, source=f"{profile.source} (calibrated on this machine)")


def fingerprint_mismatch(recorded: dict | None, here: dict) -> list[str]:
    """``key: profile value -> this machine's value`` for every compared key that differs (keys
    missing on either side are skipped); [] when nothing was recorded."""
    if not recorded:
        return []
    out = []
    for key in FINGERPRINT_KEYS:
        a, b = recorded.get(key), here.get(key)
        if a is not None and b is not None and a != b:
            out.append(f"{key}: {a} -> {b}")
    return out


def same_device_kind(profile: Profile, here: dict) -> bool:
    """Whether this machine can run the profile's device: a CPU profile on any CPU, a CUDA profile
    only where a GPU is visible (a laptop predicting an H200 cluster cannot probe its profile)."""
    kind = profile.meta.device_kind
    return here.get("device_kind") == kind or (kind == "cuda" and here.get("gpu_name") is not None)


def needs_probe(profile: Profile) -> bool:
    """Only measured profiles are probed (an analytical one is a model, not a measurement)."""
    return not profile.meta.analytical


__all__ = ["ATTENTION_OPS", "Calibration", "ProbeGrid", "fingerprint_mismatch", "fit", "needs_probe",
           "probe_grid", "rescale", "same_device_kind"]
