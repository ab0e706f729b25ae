"""``StageCost``: what one (virtual) stage costs for many micro-batches at once -- the array form of
``LatencyModel.stage_time``, and its one home.

A stage's forward (or backward, or one part of a split backward) for a micro-batch is

    layers x (sum of its sequences' attention at their budget)  + layers x dense(tokens)
    + embedding(tokens) on virtual stage 0  + LM head(tokens) on the last virtual stage

with the terms added in that order and a micro-batch's attention summed over its sequences left to
right. The executor (every simulated iteration), dst-cp's stage tables and schedule-aware ordering
ask this class, and ``LatencyModel.stage_time`` is its one-element view (:meth:`StageCost.stage`,
the same additions on one micro-batch, so the same bits: tests/simulator/test_stagecost.py); none
restates the formula. A new cost term (a recompute forward, a context-parallel exchange) is added in
:meth:`StageCost.compose_terms` alone.

Shapes: M micro-batches, V = pp x virtual_stages virtual stages; seconds throughout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from sparsebalance.simulator.plan import split_pad

if TYPE_CHECKING:
    from sparsebalance.simulator.cost.latency import LatencyModel

#: mode -> (backward, part of a split backward): F, B, and the split backward's I and W
MODES = {"F": (False, None), "B": (True, None), "I": (True, "input"), "W": (True, "weight")}


class StageCost:
    """Stage times of a latency model (``LatencyModel.cost``), array-first."""

    def __init__(self, lm: LatencyModel) -> None:
        self.lm = lm
        self.layers = np.array([len(r) for r in lm.layout.vstage_ranges], dtype=np.int64)
        """[V] layers of each virtual stage (``Layout.vstage_ranges``)."""
        self._n = self.layers.tolist()  # the same counts as Python ints: cheaper in the scalar view

    def attention_sums(self, lengths: np.ndarray, counts: np.ndarray, k: np.ndarray, *,
                       backward: bool) -> np.ndarray:
        """[M] one layer's attention of each micro-batch: its sequences' attention summed left to
        right. ``lengths`` [sum counts] the sequences of micro-batch 0, then 1, ...; ``counts`` [M];
        ``k`` [sum counts] an int budget per sequence (one vectorised look-up)."""
        return self.with_call(self.per_microbatch(self.lm.attention_many(lengths, k, backward=backward), counts),
                              counts, backward=backward)

    def with_call(self, sums: np.ndarray, counts, *, backward: bool) -> np.ndarray:
        """[M] one layer's attention of each micro-batch from its sequences' sum ``sums``: + the call's
        fixed seconds once for every non-empty micro-batch (``LatencyModel.call``: the varlen kernel
        launches once per packed micro-batch, not per sequence)."""
        call = self.lm.call[backward]
        if not call:
            return sums
        return sums + np.where(np.asarray(counts) > 0, call, 0.0)

    @staticmethod
    def per_microbatch(values: np.ndarray, counts) -> np.ndarray:
        """[M] ``values`` (one per sequence, micro-batch 0's first) summed per micro-batch, left to
        right from 0.0: the order ``stage_time``'s ``sum`` adds them, so the same bits."""
        counts = np.asarray(counts, dtype=np.int64)
        starts = np.cumsum(counts) - counts
        out = np.zeros(len(counts))
        for p in range(int(counts.max()) if len(counts) else 0):
            has = counts > p
            out[has] = out[has] + values[starts[has] + p]
        return out

    def compose(self, attention: np.ndarray, tokens: np.ndarray, *, backward: bool,
                part: str | None = None) -> np.ndarray:
        """[V, M] seconds of every virtual stage: ``attention`` [M] (one layer's, already summed
        over each micro-batch's sequences) x the stage's layers + its dense layers, embedding and
        head at ``tokens`` [M]. ``part`` "weight" wants ``attention`` zero (it has no weights)."""
        attention = np.asarray(attention, dtype=float)
        return self.compose_terms(self.layers[:, None] * attention[None, :], tokens, backward=backward,
                                  part=part)

    def compose_terms(self, attention: np.ndarray, tokens: np.ndarray, *, backward: bool,
                      part: str | None = None, stages=None) -> np.ndarray:
        """[len(stages), M] seconds of virtual stages ``stages`` (all when None) from each one's
        whole attention term ``attention`` [len(stages), M] (its layers' attention, summed): the
        one place the terms of a stage are added, in the order the module docstring gives."""
        lm = self.lm
        tokens = np.asarray(tokens, dtype=np.int64)
        stages = range(len(self.layers)) if stages is None else stages
        dense = lm.per_token_many("layer", tokens, backward=backward, part=part)
        out = np.empty((len(stages), len(tokens)))
        for row, vs in enumerate(stages):
            out[row] = self._add(attention[row], dense, vs,
                                 lambda op: lm.per_token_many(op, tokens, backward=backward, part=part))
        return out

    def stage(self, attention: float, tokens: int, vstage: int, *, backward: bool,
              part: str | None = None) -> float:
        """Seconds of virtual stage ``vstage`` for one micro-batch of ``tokens`` tokens whose layers'
        attention there sums to ``attention``: :meth:`compose_terms`'s additions on one element,
        with the latency model's scalar look-ups (the same values as its vectorised ones)."""
        lm = self.lm
        per_token = {"embed": lm.embed, "head": lm.head}
        return float(self._add(attention, lm.dense(tokens, backward=backward, part=part), vstage,
                               lambda op: per_token[op](tokens, backward=backward, part=part)))

    def _add(self, attention, dense, vs: int, per_token):
        """The terms of virtual stage ``vs``, added in this order (arrays or scalars alike): its
        attention, its layers' dense parts, the embedding on the first, the LM head on the last."""
        st = 0.0 + attention
        st = st + self._n[vs] * dense
        if vs == 0:
            st = st + per_token("embed")
        if vs == len(self._n) - 1:
            st = st + per_token("head")
        return st

    def times(self, microbatches, k: np.ndarray, modes=("F", "B")) -> dict[str, np.ndarray]:
        """Seconds [V, M] per mode of micro-batch i (a tuple of lengths) at the int budget ``k[i]``
        on every virtual stage: the attention in one vectorised call per direction."""
        split = [split_pad(mb) for mb in microbatches]  # a slot's padding: tokens, no attention
        counts = np.array([len(docs) for docs, _ in split], dtype=np.int64)
        lengths = np.fromiter((L for docs, _ in split for L in docs), dtype=np.int64, count=int(counts.sum()))
        tokens = np.array([t for _, t in split], dtype=np.int64)
        ks = np.repeat(np.asarray(k, dtype=np.int64), counts)
        out, attn_of = {}, {}
        for mode in modes:
            bw, part = MODES[mode]
            if part == "weight":  # attention has no weights: none of its backward is W
                attn = np.zeros(len(counts))
            else:
                if bw not in attn_of:
                    attn_of[bw] = self.attention_sums(lengths, counts, ks, backward=bw)
                attn = attn_of[bw]
            out[mode] = self.compose(attn, tokens, backward=bw, part=part)
        return out
