"""``StageCost``: the one place a stage's time, and a micro-batch's over the whole model, is summed.

A stage's forward (or backward, or one part of a split backward) for a micro-batch is

    layers x (sum of its sequences' attention at their budget + the call's fixed part)
    + the per-token terms (:data:`TERMS`): layers x dense(tokens), embedding(tokens) on virtual
      stage 0, LM head(tokens) on the last virtual stage

with the terms added in that order and a micro-batch's attention summed over its sequences left to
right. ``dense`` is a layer's GEMMs (the profile's ``layer_*``) + its TP all-reduces where the
profile lacks them (``comm.py``). Everything that needs a stage's or a micro-batch's seconds asks
this class: the executor (every simulated iteration, :meth:`StageCost.times`), the scalar
``stage_time`` (:meth:`StageCost.stage_time`, the same additions on one element, so the same bits:
tests/simulator/cost/test_stagecost.py), dst-cp's stage tables and sab-order (:meth:`budget_free`:
a stage's time less its attention term), the policies' whole-model forward + backward
(:meth:`microbatch_latency`, :meth:`microbatch_latencies`, what SAB, LBB and DST balance; summed
from the same :data:`TERMS`, with private pre-summed tables for speed, :mod:`.presum`) and the
per-sequence CP split (one column per rank, :mod:`.cp.placement`). Adding a term: docs/architecture.md,
"Adding a cost term".

Shapes: M micro-batches, V = pp x virtual_stages virtual stages; seconds throughout.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import numpy as np

from sparsebalance.simulator.budget import Budget
from sparsebalance.simulator.cost import presum
from sparsebalance.simulator.cost.comm import Communication
from sparsebalance.simulator.cost.modes import MODES, plain, uniform_budgets
from sparsebalance.simulator.cost.tables import PARTS, OpTables
from sparsebalance.simulator.layout import Layout
from sparsebalance.simulator.plan import split_pad

TERMS: tuple[tuple[str, str], ...] = (("layer", "layers"), ("embed", "first"), ("head", "last"))
"""The per-token terms of a stage's time, in the order they are added after its attention: (name,
where): ``layers`` counts once per decoder layer of the stage, ``first`` / ``last`` once on the first
/ last virtual stage. A term's seconds: :meth:`StageCost.per_token` (scalar) and
:meth:`StageCost.per_token_many` (arrays); its profile ops ``<name>_fwd``, ``<name>_bwd``."""


class Attention(Protocol):
    """What a stage's attention term is read from: a latency model's per-layer attention (its own
    methods, so a model that overrides them, e.g. a test's, is priced throughout)."""

    def attention(self, seq_len: int, budget: int, *, backward: bool = False) -> float: ...

    def attention_many(self, seq_len, budget, *, backward: bool = False) -> np.ndarray: ...


class PerSequenceTimes(Protocol):
    """Stage times under ``cp_split = "per-sequence"`` (``cp/placement.py``)."""

    def times(self, microbatches, k: np.ndarray, modes=("F", "B")) -> dict[str, np.ndarray]: ...


class StageCost:
    """Stage and whole-model times of one latency model (``LatencyModel.cost``), array-first."""

    def __init__(self, attention: Attention, tables: OpTables, comm: Communication, layout: Layout) -> None:
        self.lm, self.tables, self.comm, self.layout = attention, tables, comm, layout
        self.layers = np.array([len(r) for r in layout.vstage_ranges], dtype=np.int64)
        """[V] layers of each virtual stage (``Layout.vstage_ranges``)."""
        self._n = self.layers.tolist()  # the same counts as Python ints: cheaper in the scalar view
        self.model_layers = layout.model.layers
        self.per_sequence: PerSequenceTimes | None = None
        """Set under ``cp_split = "per-sequence"``: stage and micro-batch times go through it."""
        self.joint: Callable[..., float] | None = None
        """Set with CP (``cp_split = "whole"``): ``joint(lengths, k, backward=...)``, the seconds
        that running a packed micro-batch's sequences on one ring adds to (or, mostly, takes from)
        one layer's attention summed over them (``CPPricing.joint_delta``), added once per
        micro-batch beside the call's fixed part."""
        self._counts: dict[Budget, tuple[tuple[int, int], ...]] = {}
        self._dense: dict[tuple[str, int], float] = {}
        self.terms: tuple[tuple[str, str], ...] = TERMS
        self._presum = presum.Presummed(self)

    # -- the per-token terms ----------------------------------------------------------------------
    def dense(self, tokens: int, *, backward: bool = False, part: str | None = None) -> float:
        """Seconds of one layer's dense part (norms, QKV/O projections, MLP) on ``tokens`` tokens;
        ``part`` "input" / "weight": that part of the backward (None: the whole). Includes the
        layer's TP all-reduces where the profile lacks them (none in the weight part)."""
        t = self.tables.op(self.tables.op_name("layer", backward, part), tokens)
        if self.comm.tp_added and part != "weight":
            t += (self.comm.tp_backward if backward else 2) * self.comm.tp_allreduce_time(tokens)
        return t

    def embed(self, tokens: int, *, backward: bool = False, part: str | None = None) -> float:
        """Embedding lookup; its backward is all weight gradient (the input is token ids)."""
        if part is not None and (part not in PARTS or not backward):
            self.tables.op_name("embed", backward, part)  # raises: a part needs backward=True
        if part == "input":
            return 0.0
        return self.tables.op("embed_bwd" if backward else "embed_fwd", tokens)

    def per_token(self, name: str, tokens: int, *, backward: bool = False, part: str | None = None) -> float:
        """Seconds of per-token term ``name`` (:data:`TERMS`) at ``tokens`` tokens: :meth:`dense`,
        :meth:`embed`, else the profile's op of that name (``head``: final norm + LM head + loss)."""
        if name == "layer":
            return self.dense(tokens, backward=backward, part=part)
        if name == "embed":
            return self.embed(tokens, backward=backward, part=part)
        return self.tables.op(self.tables.op_name(name, backward, part), tokens)

    def per_token_many(self, name: str, tokens, *, backward: bool = False, part: str | None = None) -> np.ndarray:
        """Vectorised :meth:`per_token` for an array of token counts: the same arithmetic, so bitwise
        the scalar methods' values."""
        tokens = np.asarray(tokens, dtype=np.int64)
        t = self.tables
        if name == "embed":
            if part is not None and (part not in PARTS or not backward):
                t.op_name("embed", backward, part)  # raises: a part needs backward=True
            if part == "input":
                return np.zeros(tokens.shape)
            return t.op_many("embed_bwd" if backward else "embed_fwd", tokens)
        out = t.op_many(t.op_name(name, backward, part), tokens)
        if name == "layer" and self.comm.tp_added and part != "weight":
            out = out + (self.comm.tp_backward if backward else 2) * self.comm.tp_allreduce_time(tokens.astype(float))
        return out

    # -- a stage -----------------------------------------------------------------------------------
    def _add(self, attention, vs: int, per_token: Callable[[str], object]):
        """The terms of virtual stage ``vs``, added in this order (arrays or scalars alike): its
        attention, then :data:`TERMS` where they count (``per_token(name)``: the term's seconds)."""
        st = 0.0 + attention
        last = len(self._n) - 1
        for name, where in TERMS:
            if where == "layers":
                st = st + self._n[vs] * per_token(name)
            elif (where == "first" and vs == 0) or (where == "last" and vs == last):
                st = st + per_token(name)
        return st

    def compose_terms(self, attention: np.ndarray, tokens: np.ndarray, *, backward: bool,
                      part: str | None = None, stages=None) -> np.ndarray:
        """[len(stages), M] seconds of virtual stages ``stages`` (all when None) from each one's
        whole attention term ``attention`` [len(stages), M] (its layers' attention, summed)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        stages = range(len(self.layers)) if stages is None else stages
        got: dict[str, np.ndarray] = {}

        def per_token(name: str) -> np.ndarray:  # each term's array once for all stages
            if name not in got:
                got[name] = self.per_token_many(name, tokens, backward=backward, part=part)
            return got[name]

        out = np.empty((len(stages), len(tokens)))
        for row, vs in enumerate(stages):
            out[row] = self._add(attention[row], vs, per_token)
        return out

    def compose(self, attention: np.ndarray, tokens: np.ndarray, *, backward: bool,
                part: str | None = None) -> np.ndarray:
        """[V, M] seconds of every virtual stage: ``attention`` [M] (one layer's, already summed
        over each micro-batch's sequences) x the stage's layers + its per-token terms at ``tokens``
        [M]. ``part`` "weight" wants ``attention`` zero (it has no weights)."""
        attention = np.asarray(attention, dtype=float)
        return self.compose_terms(self.layers[:, None] * attention[None, :], tokens, backward=backward,
                                  part=part)

    def budget_free(self, attention: np.ndarray, tokens: np.ndarray, *, backward: bool,
                    part: str | None = None) -> np.ndarray:
        """[V, M] the part of every stage's time that no budget moves: :meth:`compose` at one layer's
        attention ``attention`` [M] less its attention term (layers x attention). Adding layers x the
        attention at another budget gives the stage's time there (dst-cp's tables, sab-order)."""
        return self.compose(attention, tokens, backward=backward, part=part) - self.layers[:, None] * attention

    def stage(self, attention: float, tokens: int, vstage: int, *, backward: bool,
              part: str | None = None) -> float:
        """Seconds of virtual stage ``vstage`` for one micro-batch of ``tokens`` tokens whose layers'
        attention there sums to ``attention``: :meth:`compose_terms`'s additions on one element."""
        return float(self._add(attention, vstage, lambda name: self.per_token(name, tokens, backward=backward,
                                                                                part=part)))

    def budget_counts(self, budget: int | Budget, layers: range | None = None) -> tuple[tuple[int, int], ...]:
        """((k, number of layers with budget k), ...) over ``layers`` (all layers when None) of an
        int or a per-layer :class:`Budget` (from :func:`plain`)."""
        if type(budget) is int:
            return ((budget, len(layers) if layers is not None else self.model_layers),)
        assert isinstance(budget, Budget)
        if layers is None:
            hit = self._counts.get(budget)
            if hit is not None:
                return hit
        per_layer = budget.check_layers(self.model_layers).ks
        part = per_layer if layers is None else per_layer[layers.start:layers.stop]
        counts = tuple(sorted(Counter(part).items()))
        if layers is None:
            self._counts[budget] = counts
        return counts

    def stage_time(self, lengths: Sequence[int], budget, vstage: int, *, backward: bool,
                   part: str | None = None) -> float:
        """Seconds of virtual stage ``vstage``'s forward or backward for a micro-batch of ``lengths``
        (``LatencyModel.stage_time``): its layers' attention (per sequence, at each layer's budget)
        + its per-token terms. ``part`` ("input" / "weight", backward only): that part of the split
        backward (attention is all input gradient)."""
        if self.per_sequence is not None:
            mode = "F" if not backward else {None: "B", "input": "I", "weight": "W"}[part]
            return float(self.per_sequence.times([tuple(lengths)], uniform_budgets([budget]), (mode,))[mode][
                vstage, 0])
        layers = self.layout.vstage_ranges[vstage]
        docs, tokens = split_pad(lengths)  # a slot's padding: tokens, no attention
        attention = 0.0
        if part != "weight":
            call = self.tables.call[backward] if docs else 0.0
            for k, n in self.budget_counts(plain(budget), layers):
                attention += n * (sum(self.lm.attention(L, k, backward=backward) for L in docs)
                                  + self._joint_of(docs, k, backward) + call)
        return self.stage(attention, tokens, vstage, backward=backward, part=part)

    def _joint_of(self, docs: Sequence[int], k: int, backward: bool) -> float:
        """:attr:`joint` of a micro-batch's sequences ``docs`` at ``k`` (0.0 without it, or for one)."""
        if self.joint is None or len(docs) < 2:
            return 0.0
        return self.joint(docs, int(k), backward=backward)

    # -- one layer on one CP rank (the per-sequence split, cp/placement.py) --------------------------
    def layer_fb(self, attention_f: float, attention_b: float, tokens: int) -> float:
        """One layer's forward + backward on one rank of a CP group: a sequence's attention share
        in each pass + the dense part of its ``tokens`` (read at ``Layout.group_tokens``), added in
        that order: the price of a piece of a placement."""
        return attention_f + attention_b + self.dense(tokens) + self.dense(tokens, backward=True)

    def layer_fb_ranks(self, attention_f: np.ndarray, attention_b: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """[ranks] one layer's forward + backward on each rank of a CP group: its attention in each
        pass + the dense part (forward + backward) of its ``tokens`` (read at
        ``Layout.group_tokens``; none on a rank without tokens): a placement's load."""
        dense = np.array([self.dense(t) + self.dense(t, backward=True) if t else 0.0 for t in tokens.tolist()])
        return attention_f + attention_b + dense

    # -- many micro-batches --------------------------------------------------------------------------
    def attention_sums(self, lengths: np.ndarray, counts: np.ndarray | Sequence[int], k: np.ndarray, *,
                       backward: bool) -> np.ndarray:
        """[M] one layer's attention of each micro-batch: its sequences' attention summed left to
        right, + the call. ``lengths`` [sum counts] the sequences of micro-batch 0, then 1, ...;
        ``counts`` [M]; ``k`` [sum counts] an int budget per sequence (one vectorised look-up; with
        :attr:`joint`, a micro-batch's first sequence's is its ring's)."""
        sums = self.per_microbatch(self.lm.attention_many(lengths, k, backward=backward), counts)
        return self.with_call(sums + self.joint_deltas(lengths, counts, k, backward=backward), counts,
                              backward=backward)

    def joint_deltas(self, lengths: np.ndarray, counts, k: np.ndarray, *, backward: bool) -> np.ndarray | float:
        """[M] :attr:`joint` of each micro-batch (``lengths``, ``counts``, ``k`` as
        :meth:`attention_sums`), 0.0 without it."""
        counts = np.asarray(counts, dtype=np.int64)
        if self.joint is None or not (counts > 1).any():
            return 0.0
        out = np.zeros(len(counts))
        starts = (np.cumsum(counts) - counts).tolist()
        for i in np.flatnonzero(counts > 1).tolist():
            a = starts[i]
            out[i] = self._joint_of(lengths[a:a + counts[i]].tolist(), int(k[a]), backward)
        return out

    def with_call(self, sums: np.ndarray, counts, *, backward: bool) -> np.ndarray:
        """[M] one layer's attention of each micro-batch from its sequences' sum ``sums``: + the call's
        fixed seconds once for every non-empty micro-batch (``OpTables.call``: the varlen kernel
        launches once per packed micro-batch, not per sequence)."""
        call = self.tables.call[backward]
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

    def times(self, microbatches, k: np.ndarray, modes=("F", "B")) -> dict[str, np.ndarray]:
        """Seconds [V, M] per mode of micro-batch i (a tuple of lengths) at the int budget ``k[i]``
        on every virtual stage: the attention in one vectorised call per direction."""
        if self.per_sequence is not None:
            return self.per_sequence.times(microbatches, uniform_budgets(k), modes)
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

    # -- the whole model: forward + backward, what the policies balance ----------------------------
    def microbatch_latency(self, lengths: Sequence[int], budget) -> float:
        """Seconds of forward + backward of a micro-batch over the whole model (all stages and
        chunks, no P2P): ``layers x (sum of its sequences' attention F + B + the calls)`` + the
        per-token terms' F + B over the whole model. Cached per (lengths, budget)."""
        return self._presum.microbatch_latency(lengths, budget)

    def microbatch_latencies(self, microbatches, budgets) -> np.ndarray:
        """Vectorised :meth:`microbatch_latency` for many micro-batches at once (seconds, shape [M]).

        ``microbatches``: M sequences of lengths; ``budgets``: one int for all, or M ints or
        :class:`Budget` (per-layer ones take the scalar path). Points outside the profiled range
        take the scalar path, so warnings, errors and clamping are the same."""
        return self._presum.microbatch_latencies(microbatches, budgets)

    def whole_untabled(self, tokens):
        """The share of the per-token terms' forward + backward over the whole model that the
        profile's tables do not hold, which the pre-summed totals add after their table
        (:mod:`.presum`); None when there is none. Today: the dense term's TP all-reduces where the
        profile lacks them (2 in the forward and 2, or 4 with full recomputation, in the backward of
        every layer). Numpy-broadcastable in ``tokens``."""
        if not self.comm.tp_added:
            return None
        return self.model_layers * (2 + self.comm.tp_backward) * self.comm.tp_allreduce_time(tokens)

    def whole_terms(self, tokens: int) -> float:
        """Seconds of the per-token terms' forward + backward over the whole model at ``tokens``
        tokens, term by term (what the pre-summed table holds, :mod:`.presum`): a ``layers`` term
        counts ``model.layers`` times, ``first`` and ``last`` once."""
        total: float | None = None
        for name, where in TERMS:
            f = self.per_token(name, tokens)
            b = self.per_token(name, tokens, backward=True)
            if where == "layers":
                total = self.model_layers * (f + b) if total is None else total + self.model_layers * (f + b)
            else:
                total = (f if total is None else total + f) + b
        return cast(float, total)
