"""``StageCost``: what one (virtual) stage costs for many micro-batches at once -- the array form of
``LatencyModel.stage_time``, and its one home.

A stage's forward (or backward, or one part of a split backward) for a micro-batch is

    layers x (sum of its sequences' attention at their budget)  + layers x dense(tokens)
    + embedding(tokens) on virtual stage 0  + LM head(tokens) on the last virtual stage

with the terms added in that order and a micro-batch's attention summed over its sequences left to
right -- the order ``stage_time`` adds them, so every array here equals the scalar method bit for
bit (tests/simulator/test_stagecost.py). The executor (every simulated iteration), dst-cp's stage
tables and schedule-aware ordering ask this class; none restates the formula. A new cost term (a
recompute forward, a context-parallel exchange) is added here and in ``stage_time``.

Shapes: M micro-batches, V = pp x virtual_stages virtual stages; seconds throughout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

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

    def attention_sums(self, lengths: np.ndarray, counts: np.ndarray, k: np.ndarray, *,
                       backward: bool) -> np.ndarray:
        """[M] one layer's attention of each micro-batch: its sequences' attention summed left to
        right. ``lengths`` [sum counts] the sequences of micro-batch 0, then 1, ...; ``counts`` [M];
        ``k`` [sum counts] an int budget per sequence (one vectorised look-up)."""
        return self.per_microbatch(self.lm.attention_many(lengths, k, backward=backward), counts)

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
        lm = self.lm
        tokens = np.asarray(tokens, dtype=np.int64)
        dense = lm.per_token_many("layer", tokens, backward=backward, part=part)
        nv = len(self.layers)
        out = np.empty((nv, len(tokens)))
        for vs in range(nv):
            st = 0.0 + self.layers[vs] * attention
            st = st + self.layers[vs] * dense
            if vs == 0:
                st = st + lm.per_token_many("embed", tokens, backward=backward, part=part)
            if vs == nv - 1:
                st = st + lm.per_token_many("head", tokens, backward=backward, part=part)
            out[vs] = st
        return out

    def times(self, microbatches, k: np.ndarray, modes=("F", "B")) -> dict[str, np.ndarray]:
        """Seconds [V, M] per mode of micro-batch i (a tuple of lengths) at the int budget ``k[i]``
        on every virtual stage: the attention in one vectorised call per direction."""
        counts = np.array([len(mb) for mb in microbatches], dtype=np.int64)
        lengths = np.fromiter((L for mb in microbatches for L in mb), dtype=np.int64, count=int(counts.sum()))
        tokens = np.array([sum(mb) for mb in microbatches], dtype=np.int64)
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
