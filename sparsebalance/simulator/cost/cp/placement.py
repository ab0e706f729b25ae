"""A CP degree per sequence (``cluster.cp_split = "per-sequence"``): where a packed micro-batch's
sequences lie on their stage's CP group, and what each stage then costs.

Splitting every sequence over all ``cp`` ranks (``cp_split = "whole"``) is what dense CP does; for
sparse attention at fixed k a short sequence's ring is mostly transfers and launch floors, work the
other ranks could spend on something else. Here each sequence of a micro-batch gets a degree ``d``
(``ClusterConfig.cp_degrees``: 1, the powers of two dividing cp, cp) and an aligned group of ``d``
ranks, chosen by :func:`place` from the model's own prices: per rank, one layer's
forward + backward attention of the sequence on ``d`` ranks (``LatencyModel.attention_at_degree``:
the ring or all-gather of section 11 at degree ``d``, one GPU at 1) + the dense part of its
``L / d`` tokens. A degree a sequence is too short for (fewer blocks than its layout needs) is not
offered. The placement is made once per (micro-batch, budget) and serves every stage and pass, as a
data loader's sharding would.

**A stage's time** for the micro-batch is its slowest rank's:

    max over ranks r of  [ layers x (sum of r's pieces' attention + the call's fixed part)
                           + layers x dense(r's tokens) + embedding / LM head of r's tokens ]

(:meth:`StageCost.compose_terms` on one column per rank). Exact for the model when a layer's rings
run in decreasing degree (``place``'s docstring: the groups nest, so a ring's ranks start it
together); every rank waits for the slowest at the layer's end. P2P and memory follow the busiest
rank's tokens (:meth:`PerSequenceCP.busiest_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sparsebalance.data.sequence import blocks
from sparsebalance.simulator.cost.cp.shards import min_blocks
from sparsebalance.simulator.cost.modes import MODES

if TYPE_CHECKING:
    from sparsebalance.simulator.cost.stagecost import StageCost


def place(cost: np.ndarray, degrees: tuple[int, ...], cp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A CP degree and an aligned rank group for each sequence of a micro-batch (``cp_split =
    "per-sequence"``). ``cost`` [N, D]: seconds each rank of the group spends on sequence i at degree
    ``degrees[j]`` (inf where it may not take it); ``degrees`` ascending, each dividing ``cp``, their
    aligned groups nested. Returns (degree [N], first rank [N], load [cp] seconds per rank).

    Degrees are searched, groups follow from them (:func:`groups`: by decreasing degree, then cost,
    each sequence on the aligned group whose busiest rank ends first). Steepest descent over one
    sequence's degree one allowed step up or down, minimising the makespan, then the total work (a
    ring's transfers and launch floors are work the other ranks could do), from three starts: every
    sequence at its least allowed degree; at its largest (the whole group where it may, as ``cp_split
    = "whole"``); and the least raised while a sequence's per-rank cost exceeds the lower bound on
    the makespan (the mean load, and the largest of the pieces' least costs). Within 1.25x of the
    optimum on enumerated small cases (tests). A rank's load is the sum of its pieces, which is the
    time it needs when a layer's rings run in decreasing degree: every rank of a group has then done
    the same larger rings (the groups nest), so a ring's ranks start it together."""
    cost = np.asarray(cost, dtype=float)
    n = cost.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(cp)
    finite = np.isfinite(cost)
    if not finite.any(axis=1).all():
        raise ValueError("place: every sequence needs at least one degree it may take")
    deg = np.asarray(degrees, dtype=np.int64)
    rows = np.arange(n)
    up = [[q for q in range(len(degrees)) if finite[i, q]] for i in range(n)]  # allowed, ascending

    def score(j):
        start, load = groups(cost[rows, j], deg[j], cp)
        return (float(load.max()), float((deg[j] * cost[rows, j]).sum())), start, load, j

    def descend(j):  # steepest descent over one sequence's degree one allowed step up or down
        best = score(j)
        while True:
            moves = []
            for i in range(n):
                at = up[i].index(int(best[3][i]))
                for q in (at - 1, at + 1):
                    if 0 <= q < len(up[i]):
                        x = best[3].copy()
                        x[i] = up[i][q]
                        moves.append(score(x))
            if not moves:
                return best
            step = min(moves, key=lambda t: t[0])
            if not step[0] < best[0]:
                return best
            best = step

    least = np.array([u[0] for u in up])
    floor = float(np.where(finite, cost, np.inf).min(axis=1).max())  # no makespan is below any piece's least
    j = least.copy()
    for _ in range(len(degrees)):
        c = cost[rows, j]
        target = max(float((deg[j] * c).sum()) / cp, floor)
        step = np.array([next((q for q in up[i] if q > x), -1) for i, x in enumerate(j.tolist())])
        grow = (c > target) & (step >= 0)
        if not grow.any():
            break
        j = np.where(grow, step, j)
    starts = {tuple(x.tolist()): x for x in (j, least, np.array([u[-1] for u in up]))}
    _, start, load, j = min((descend(x) for x in starts.values()), key=lambda t: t[0])
    return deg[j], start, load


def groups(c: np.ndarray, d: np.ndarray, cp: int) -> tuple[np.ndarray, np.ndarray]:
    """(first rank [N], load [cp]): sequences of per-rank cost ``c`` at degrees ``d``, by decreasing
    degree then cost (then index), each on the aligned group of ``d`` ranks whose busiest rank ends
    first (the lower rank on ties)."""
    start = np.zeros(len(c), dtype=np.int64)
    load = np.zeros(cp)
    for i in np.lexsort((np.arange(len(c)), -c, -d)).tolist():
        w = int(d[i])
        g = int(np.argmin(load.reshape(-1, w).max(axis=1)))
        start[i] = g * w
        load[g * w:(g + 1) * w] += c[i]
    return start, load


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a micro-batch's sequences lie on the CP group (arrays in the micro-batch's order)."""

    degree: np.ndarray
    """[N] CP degree of each sequence."""
    start: np.ndarray
    """[N] first rank of its aligned group."""
    tokens: np.ndarray
    """[cp] tokens each rank holds (a sequence's tokens dealt evenly over its group)."""
    attention: dict[bool, np.ndarray]
    """Per pass (backward?) [cp] one layer's attention per rank: its pieces' seconds + the call's
    fixed part once for a rank with any piece."""
    load: np.ndarray
    """[cp] seconds per rank of one layer, forward + backward (its pieces' attention, the call's
    fixed part once, the dense part of its tokens)."""


class PerSequenceCP:
    """Placement and stage times under ``cp_split = "per-sequence"`` (module docstring), for one
    latency model (``LatencyModel.per_sequence``): its stage cost ``cost`` and its attention of one
    sequence on ``degree`` ranks, ``attention_at_degree(L, k, degree, backward=)``."""

    def __init__(self, cost: StageCost, attention_at_degree: Callable[..., float]) -> None:
        self.cost, self.at_degree = cost, attention_at_degree
        self.layout = cost.layout
        cluster = self.layout.cluster
        self.cp = cluster.cp
        self.degrees = cluster.cp_degrees
        self.cp_layout = cluster.cp_layout
        self.block_size = self.layout.model.block_size
        self._placements: dict[tuple[tuple[int, ...], int], Placement] = {}

    def allowed(self, L: int, d: int) -> bool:
        """Whether a sequence of ``L`` tokens may be split over ``d`` ranks (enough blocks)."""
        return d == 1 or blocks(L, self.block_size) >= min_blocks(self.cp_layout, d)

    def placement(self, lengths, k: int) -> Placement:
        """The placement of a micro-batch of ``lengths`` at the uniform budget ``k`` (cached):
        :func:`place` on the model's per-rank prices, kept only where one layer
        priced in full (each rank's pieces, the call once, the dense part of its tokens) is not
        slower than every sequence at its largest allowed degree (``cp_split = "whole"``'s split)."""
        key = (tuple(int(x) for x in lengths), int(k))
        hit = self._placements.get(key)
        if hit is not None:
            return hit
        cp, at, lay = self.cp, self.at_degree, self.layout
        cost = np.full((len(key[0]), len(self.degrees)), np.inf)
        for i, L in enumerate(key[0]):
            for j, d in enumerate(self.degrees):
                if self.allowed(L, d):
                    # per rank: its attention share + the dense part of L / d tokens (the tables
                    # read a rank's t tokens at t x cp: Layout.group_tokens)
                    cost[i, j] = self.cost.layer_fb(at(L, k, d), at(L, k, d, backward=True), lay.group_tokens(L) // d)
        deg, start, _ = place(cost, self.degrees, cp)
        largest = np.array([max(d for d in self.degrees if self.allowed(L, d)) for L in key[0]], dtype=np.int64)
        alt_start, _ = groups(cost[np.arange(len(largest)), np.searchsorted(self.degrees, largest)], largest, cp)
        cands = [self._priced(key[0], k, deg, start), self._priced(key[0], k, largest, alt_start)]
        hit = min(cands, key=lambda pl: float(pl.load.max()))  # ties: the planner's
        self._placements[key] = hit
        if len(self._placements) > 200_000:  # bound memory in very long runs
            self._placements.clear()
        return hit

    def _priced(self, lengths, k: int, deg: np.ndarray, start: np.ndarray) -> Placement:
        """A placement with its tokens per rank and its load: one layer's forward + backward per
        rank priced in full (the pieces' attention, the call once, the dense part of its tokens)."""
        cp, call = self.cp, self.cost.tables.call
        tokens = np.zeros(cp, dtype=np.int64)
        attn = {False: np.zeros(cp), True: np.zeros(cp)}
        for L, d, a in zip(lengths, deg.tolist(), start.tolist()):
            tokens[a:a + d] += L // d + (np.arange(d) < L % d)
            for bw in (False, True):
                attn[bw][a:a + d] += self.at_degree(L, k, d, backward=bw)
        for bw in (False, True):
            attn[bw] = attn[bw] + np.where(tokens > 0, call[bw], 0.0)
        load = self.cost.layer_fb_ranks(attn[False], attn[True], self.layout.group_tokens(tokens))
        return Placement(degree=deg, start=start, tokens=tokens, attention=attn, load=load)

    def busiest_tokens(self, lengths, k: int) -> int:
        """The tokens of the busiest rank x cp: what P2P and memory, which take a micro-batch's
        tokens and divide them by cp (``Layout.rank_tokens``), should see."""
        return self.layout.group_tokens(int(self.placement(lengths, k).tokens.max()))

    def times(self, microbatches, k: np.ndarray, modes=("F", "B")) -> dict[str, np.ndarray]:
        """Seconds [V, M] per mode of micro-batch i (a tuple of lengths) at the int budget ``k[i]``:
        each virtual stage's slowest CP rank (module docstring)."""
        cost = self.cost
        m, cp = len(microbatches), self.cp
        tokens = np.zeros(m * cp, dtype=np.int64)
        attn = {bw: np.zeros(m * cp) for bw in (False, True)}
        for i, (mb, ki) in enumerate(zip(microbatches, np.asarray(k).tolist())):
            pl = self.placement(mb, ki)
            tokens[i * cp:(i + 1) * cp] = self.layout.group_tokens(pl.tokens)
            for bw in (False, True):
                attn[bw][i * cp:(i + 1) * cp] = pl.attention[bw]
        out = {}
        for mode in modes:
            bw, part = MODES[mode]
            a = np.zeros(m * cp) if part == "weight" else attn[bw]
            per_rank = cost.compose(a, tokens, backward=bw, part=part)  # [V, M x cp]
            out[mode] = per_rank.reshape(len(cost.layers), m, cp).max(axis=2)
        return out
