"""What the CP group did in an iteration, for the executor: per-iteration figures and trace rows.

The executor times each (virtual stage, micro-batch) action as one block on its device; the CP group
inside it runs one ring (or all-gather) per micro-batch and layer (``cp_split = "whole"``: every
sequence on it, ``CPPricing.joint``), or one per split sequence (``"per-sequence"``). Here those
rings are read back from the latency model (:meth:`LatencyQuery.cp_joint`,
:meth:`LatencyQuery.cp_report`, :meth:`LatencyQuery.cp_placement`), each micro-batch at its mean
budget (rounded, at least 1):

* :func:`figures`: per iteration, the mean over its micro-batches of one layer's forward on the
  group: worker and step imbalance, exposed communication (s), ring efficiency
  (:func:`.ring.combine`; with per-sequence degrees, worker imbalance over the group's ranks);
* :func:`rows`: trace rows inside each F and backward (B or I) action: ``CP``, one per ring step
  (the step's slowest rank's compute), and ``CP_COMM``, one per transfer (a ring hop, the
  all-gather, dK/dV's hop home or reduce-scatter: its slowest rank's seconds), each summed over the
  micro-batch's sequences and the stage's layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from sparsebalance.simulator.cost.cp.ring import RingReport, combine
from sparsebalance.simulator.layout import Layout
from sparsebalance.simulator.plan import MicroBatch, Plan

if TYPE_CHECKING:
    import pandas as pd

    from sparsebalance.simulator.cost.query import LatencyQuery

FIGURES = ("cp_worker_imbalance", "cp_step_imbalance", "cp_exposed_s", "cp_efficiency")
"""The per-iteration CP figures of :func:`figures` (columns of ``metrics.csv``)."""


def budget_of(mean_budget: float) -> int:
    """The budget a micro-batch's rings are priced at: its mean budget, rounded, at least 1."""
    return max(1, round(float(mean_budget)))


def reports(latency: LatencyQuery, mb: MicroBatch, mean_budget: float, *, backward: bool) -> list[RingReport]:
    """One layer of ``mb`` on the CP group at the micro-batch's mean budget: with ``cp_split =
    "whole"`` and more than one sequence, its one ring (``LatencyQuery.cp_joint``: every sequence,
    the whole ones too); else each of its sequences split over the group (one that stays whole on
    one rank has none)."""
    k = budget_of(mean_budget)
    docs = [L for L in mb.lengths if L > 0]
    if len(docs) > 1 and (joint := latency.cp_joint(docs, k, backward=backward)) is not None:
        return [joint]
    placed = latency.cp_placement(mb.lengths, k)
    degrees = [None] * len(mb.lengths) if placed is None else placed.degree.tolist()
    return [rep for L, d in zip(mb.lengths, degrees)
            if d != 1 and (rep := latency.cp_report(L, k, backward=backward, degree=d)) is not None]


def figures(latency: LatencyQuery, plan: Plan, mean_budget: np.ndarray) -> dict[str, float]:
    """Per iteration, over its micro-batches (mean): :data:`FIGURES` (module docstring)."""
    out = []
    for r, j, mb in plan.microbatches():
        row = combine(reports(latency, mb, mean_budget[r, j], backward=False))
        placed = latency.cp_placement(mb.lengths, budget_of(mean_budget[r, j]))
        if placed is not None and placed.load.mean() > 0:  # per-sequence degrees: the group's ranks
            row["cp_worker_imbalance"] = float(placed.load.max() / placed.load.mean())
        out.append(row)
    return {key: float(np.mean([row[key] for row in out])) for key in FIGURES}


def rows(latency: LatencyQuery, layout: Layout, plan: Plan, mean_budget: np.ndarray, *, kinds: list[str],
         start: np.ndarray, end: np.ndarray, iteration: int, columns: tuple[str, ...]) -> pd.DataFrame:
    """Trace rows (``columns``: the trace schema) of the CP attention inside each F and backward
    action, whose start and end are ``start``, ``end`` [dp, kinds, V, m] (the engine's, ``kinds``
    naming the second axis). Drawn from the action's start (the dense parts are not drawn): the
    steps back to back after the first transfer (the all-gather; none in a ring), the hop bringing
    step s beside step s - 1, the last transfer after the last step; clipped to the action's end."""
    import pandas as pd

    n_layers, devices = layout.layer_counts, np.asarray(layout.devices)
    frames = []
    for kind in [k for k in kinds if k in ("F", "B", "I")]:
        ki = kinds.index(kind)
        per_mb = {}  # (r, j) -> ([S] step seconds, [S + 1] transfer seconds), summed over sequences, one layer
        for r, j, mb in plan.microbatches():
            reps = reports(latency, mb, mean_budget[r, j], backward=kind != "F")
            if reps:
                width = max(rep.steps.shape[1] for rep in reps)
                step, comm = np.zeros(width), np.zeros(width + 1)
                for rep in reps:
                    n = rep.steps.shape[1]
                    step[:n] += rep.steps.max(axis=0)
                    comm[:n] += rep.transfers[:, :n].max(axis=0)
                    comm[-1] += rep.transfers[:, -1].max()
                per_mb[(r, j)] = (step, comm)
        if not per_mb:
            continue
        width = max(len(v[0]) for v in per_mb.values())
        keys = list(per_mb)
        steps, comms = np.zeros((len(keys), width)), np.zeros((len(keys), width + 1))
        for i, key in enumerate(keys):
            step, comm = per_mb[key]
            steps[i, : len(step)] = step
            comms[i, : len(step)] = comm[:-1]
            comms[i, -1] = comm[-1]
        r_of = np.array([key[0] for key in keys])
        j_of = np.array([key[1] for key in keys])
        dur = steps[:, None, :] * n_layers[None, :, None]  # [mbs, V, S]
        xfer = comms[:, None, :] * n_layers[None, :, None]  # [mbs, V, S + 1]
        t_start = start[r_of, ki, :, j_of][..., None]  # [mbs, V, 1]
        t_end = end[r_of, ki, :, j_of][..., None]
        first = t_start + xfer[..., :1]  # step 0 starts once the first transfer is in
        c1 = first + np.cumsum(dur, axis=2)
        c0 = c1 - dur
        # transfer s (s >= 1) beside step s - 1; transfer 0 at the action's start; the last after the last step
        x0 = np.concatenate([t_start, c0[..., :-1], c1[..., -1:]], axis=2)
        x1 = x0 + xfer
        tokens = np.array([plan.ranks[r][j].tokens for r, j in keys])
        budget = np.array([float(budget_of(mean_budget[r, j])) for r, j in keys])  # as reports
        for op, a, b in (("CP", c0, c1), ("CP_COMM", x0, x1)):
            shape = a.shape
            real = (b - a > 0).ravel()  # padding (fewer steps; all-gather: one) and no-transfer slots dropped
            a, b = np.minimum(a, t_end), np.minimum(b, t_end)
            frames.append(pd.DataFrame({
                "iteration": np.full(int(real.sum()), iteration, dtype=np.int64),
                "dp_rank": np.broadcast_to(r_of[:, None, None], shape).ravel()[real],
                "stage": np.broadcast_to(devices[None, :, None], shape).ravel()[real],
                "microbatch": np.broadcast_to(j_of[:, None, None], shape).ravel()[real],
                "op": op, "start_s": a.ravel()[real], "end_s": b.ravel()[real],
                "tokens": np.broadcast_to(tokens[:, None, None], shape).ravel()[real],
                "budget": np.broadcast_to(budget[:, None, None], shape).ravel()[real]},
                columns=list(columns)))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(columns))
