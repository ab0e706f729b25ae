"""The latency model: stage and micro-batch seconds from a profile, plus P2P, all-reduce and optimizer.

Interpolation (why this way):

* attention is piecewise **bilinear** over the profile's (seq_len, budget) grid, evaluated at the
  *effective* budget ``min(budget, ceil(seq_len / block_size))`` (a top-k at or beyond the number of
  blocks is dense attention). Linear in budget is the physics: each extra selected block adds
  ``block_size`` keys to every query, so cost is affine in k at fixed length. In seq_len the cost is
  between linear (sparse, L >> k x block) and quadratic (dense); with the 1.5x/2x grid spacing of the
  shipped profiles, linear interpolation of a pure quadratic overestimates by at most 4 % mid-segment
  (x^2 on [a, 1.5a]) and is exact on the grid, monotone, and never explodes when extrapolating
  (log-log would be exact for a pure power law but is undefined at zero latency and extrapolates
  super-linearly). Both ends of each segment are exact grid values.
* dense ops (``layer_*``, ``embed_*``, ``head_*``) and ``optim`` are piecewise linear over tokens
  (parameters for ``optim``): GEMM cost is affine in the token count.
* outside the profiled range: ``extrapolate="warn"`` warns once per op and continues the end segment
  linearly (floored at 0 s); ``"error"`` raises ConfigError naming op, value and range; ``"clamp"``
  uses the nearest profiled value.

Split backward (zero-bubble schedules): the backward of a stage splits into its input-gradient
part I (attention's whole backward, since attention has no weights, + each layer's
``layer_bwd_input`` + the LM head's ``head_bwd_input``) and its weight-gradient part W (each layer's
``layer_bwd_weight`` + ``head_bwd_weight`` + the embedding's whole backward: its input is token ids).
A profile without split rows (format 1) takes I = W = half of ``layer_bwd`` / ``head_bwd`` (the
input- and weight-gradient GEMMs of a linear layer have equal FLOPs), so B = I + W; the first
split query says so once (a warning) and :attr:`LatencyModel.notes` records it.

Tensor parallelism: a profile's numbers are one TP rank's. An analytical profile includes the TP
all-reduces of a Megatron layer (the roofline's); a profile measured on one shard (``profile --tp N``,
sidecar ``tp_comm_included`` false or absent) does not, and the model adds them from the cluster:
2 all-reduces of the layer's activation (tokens x hidden x dtype bytes) per layer forward (after the
row-parallel attention output and MLP down projections) and 2 in the input-gradient part of its
backward (the column-parallel inputs' gradients), each ``tp_latency + 2 (tp - 1) / tp x bytes /
tp_bandwidth`` (:meth:`LatencyModel.tp_allreduce_time`).

Recomputation (``cluster.recompute``, docs/costmodel.md 'Recomputation'): the forward a backward
runs again is priced inside the backward ops, once, when the model is built, so every consumer of a
backward (stage times, the policies' fused micro-batch latency, dst-cp's tables) includes it:
``selective`` adds ``attn_fwd`` to ``attn_bwd`` at every grid point (the attention core is run
again); ``full`` also adds ``layer_fwd`` to ``layer_bwd`` and to its input part
``layer_bwd_input`` (the weight part needs no activations the input part has not rebuilt), and the
forward's 2 TP all-reduces to the backward's (measured-shard profiles). Embedding and LM head are
not recomputed (Megatron recomputes the transformer layers). Sums on the profile's grid, so
interpolating the sum equals summing the interpolations wherever the two ops share a grid.

Profile vs run: a measured profile must match the run's ``model.block_size``, ``cluster.tp`` and the
per-layer dims (hidden, heads, kv_heads, head_dim, ffn, vocab) or loading fails with ConfigError, since
its numbers cannot be rescaled faithfully; ``layers`` may differ (the table is per layer). An
analytical profile is instead re-derived for the run's dims, TP and block size from the hardware
parameters in its sidecar (``sparsebalance.simulator.cost.roofline``).
"""

from __future__ import annotations

import warnings
from bisect import bisect_right
from collections import Counter
from numbers import Integral

import numpy as np

from sparsebalance.data.sequence import blocks
from sparsebalance.errors import ConfigError, MeaningWarning, check_choice
from sparsebalance.simulator.budget import Budget
from sparsebalance.simulator.config import QWEN2_ARCH, ClusterConfig, ModelConfig
from sparsebalance.simulator.cost.hybrid import PerSequenceCP, uniform_budgets
from sparsebalance.simulator.cost.profile import CP_ATTENTION_OPS, Profile, load_profile, monotone_violations
from sparsebalance.simulator.cost.profilemeta import ProfileMeta
from sparsebalance.simulator.cost.query import ScalarStageLatency
from sparsebalance.simulator.cost.stagecost import StageCost
from sparsebalance.simulator.layout import layout_of
from sparsebalance.simulator.plan import split_pad

EXTRAPOLATE = ("warn", "error", "clamp")
PARTS = ("input", "weight")
"""Parts of a split backward: input gradient (I) and weight gradient (W)."""
_CHECKED_DIMS = ("hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab")
ADAMW_BYTES_PER_PARAM = 32
"""HBM bytes one mixed-precision AdamW step moves per parameter with bf16 gradients (the optimizer
estimate of a profile without ``optim`` rows): read the fp32 master weight, Adam's two fp32 moments
(12) and the gradient (2); write the master and the moments (12) and the bf16 weight the next forward
uses (2); read the gradient once more for the global norm of gradient clipping (2) and zero it (2).
The gradient's three passes follow its buffer's dtype (:func:`adamw_bytes`)."""
ADAMW_GRAD_PASSES = 3
"""Passes over the gradient buffer in one step: the clipping norm's read, the step's read, the zeroing."""


def adamw_bytes(grad_bytes: int) -> int:
    """HBM bytes per parameter of one AdamW step whose gradient buffer holds ``grad_bytes`` per
    element (``cluster.grad_reduce_bytes``: Megatron-LM keeps a bf16 model's gradients in an fp32
    ``main_grad`` buffer, 4): ``ADAMW_BYTES_PER_PARAM`` with the three gradient passes at that width."""
    return ADAMW_BYTES_PER_PARAM + ADAMW_GRAD_PASSES * (grad_bytes - 2)


def _segment(xs: list[float], x: float) -> tuple[int, float]:
    """Index i of the grid segment [xs[i], xs[i+1]] used for x and the (unclamped) position in it."""
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


class _Curve:
    """Piecewise-linear y(x) on sorted grid points."""

    __slots__ = ("xs", "ys")

    def __init__(self, xs, ys):
        self.xs, self.ys = [float(x) for x in xs], [float(y) for y in ys]

    def __call__(self, x: float) -> float:
        i, t = _segment(self.xs, x)
        return max(0.0, self.ys[i] + t * (self.ys[i + 1] - self.ys[i]))


class _Surface:
    """Piecewise-bilinear z(seq_len, budget) on a rectilinear grid."""

    __slots__ = ("ks", "xs", "zs")

    def __init__(self, rows):
        self.xs = sorted({float(v) for v in rows["seq_len"]})
        self.ks = sorted({float(v) for v in rows["budget"]})
        z = {(float(s), float(k)): float(v) for s, k, v in zip(rows["seq_len"], rows["budget"],
                                                                rows["latency_s"])}
        self.zs = [[z[(s, k)] for k in self.ks] for s in self.xs]

    def __call__(self, x: float, k: float) -> float:
        i, t = _segment(self.xs, x)
        j, u = _segment(self.ks, k)
        lo, hi = self.zs[i], self.zs[i + 1]
        a = lo[j] + u * (lo[j + 1] - lo[j])
        b = hi[j] + u * (hi[j + 1] - hi[j])
        return max(0.0, a + t * (b - a))


class LatencyModel(ScalarStageLatency):
    """Predicts seconds of attention, dense layers, stages and micro-batches; P2P, all-reduce and
    optimizer time. Build it with :func:`load_latency_model`. Lengths and tokens are in tokens,
    budgets are MoBA top-k (an int, or a tuple with one entry per global layer)."""

    def __init__(self, profile: Profile, model: ModelConfig, cluster: ClusterConfig, *,
                 extrapolate: str = "warn"):
        check_choice(extrapolate, "extrapolate", EXTRAPOLATE)
        self.profile, self.model, self.cluster, self.extrapolate = profile, model, cluster, extrapolate
        self.block_size = model.block_size
        self._surfaces = {op: _Surface(profile.rows(op)) for op in ("attn_fwd", "attn_bwd")}
        self._cp_work = {bw: _Surface(profile.rows(op)) for op, bw in zip(CP_ATTENTION_OPS, (False, True))
                         if op in profile.ops}
        """The profile's measured CP group work (``attn_*_cp``; forward, backward), when it has them."""
        self._curves = {op: _Curve(r["seq_len"], r["latency_s"]) for op in profile.ops
                        if op not in self._surfaces and op not in CP_ATTENTION_OPS for r in [profile.rows(op)]}
        meta = profile.meta
        included = meta.analytical if meta.tp_comm_included is None else meta.tp_comm_included
        self._tp_comm = cluster.tp > 1 and not included
        """Whether the dense ops lack the TP all-reduces (added here, see the module docstring)."""
        self.notes: list[str] = []
        """What the model derived rather than read from the profile (e.g. the split backward)."""
        self._derived_split = self._derive_split()
        call = meta.attention_call_s or {}
        self.call = {False: float(call.get("fwd", 0.0)), True: float(call.get("bwd", 0.0))}
        """Seconds of one layer's attention call paid once per packed micro-batch (forward, backward;
        the sidecar's ``attention_call_s``, 0 for a measured table whose rows include it)."""
        self._tp_bwd = 4 if cluster.recompute == "full" else 2
        """TP all-reduces in a layer's backward (input part): its own 2, + the forward's 2 again
        under full recomputation."""
        self._cp_floor: dict[bool, float] = {}
        self._cp_reports: dict[tuple[int, int, bool, int], object] = {}
        self._one_gpu: dict[bool, _Surface] = {}
        self._degree_surf: dict[int, dict[bool, _Surface]] = {}
        """Per CP degree d < cp (with CP): one layer's attention of a sequence on d ranks, per pass, on
        the profile's grid (d = 1: one GPU; recomputation folded in like the main surfaces)."""
        self._degree_attn: dict[tuple[int, int, int, bool], float] = {}
        self._whole_max = 0
        """Longest sequence (tokens) that stays whole on one CP rank: too few blocks for the layout."""
        self.cp_attention = ("the one-GPU attention rows split by pair counts" if not self._cp_work else
                             f"the profile's measured CP rows (attn_*_cp) on all-gather groups of cp "
                             f"{profile.meta.cp} laid out {profile.meta.cp_layout}; the one-GPU rows split by "
                             "pair counts elsewhere")
        """What prices CP attention work (``cluster.cp`` > 1), in words: the profile's ``attn_*_cp``
        rows where they match the group (degree, layout, all-gather), else the one-GPU rows split by
        pairs (:meth:`_group_work`)."""
        self._fold_cp()
        self._fold_recompute()
        self._warned: set[str] = set()
        self._attn: dict[tuple[int, int, bool], float] = {}
        self._attn_fb: dict[tuple[int, int], float] = {}
        self._dense: dict[tuple[str, int], float] = {}
        self._mb: dict[tuple, float] = {}
        self._counts: dict[Budget, tuple[tuple[int, int], ...]] = {}
        self.layout = layout_of(model, cluster)
        """Where the layers and parameters live (``simulator/layout.py``): the one split."""
        self.cost = StageCost(self)
        self.per_sequence = PerSequenceCP(self) if cluster.cp_split == "per-sequence" else None
        """``cluster.cp_split = "per-sequence"``: each micro-batch placed on its CP group with a
        degree per sequence (``simulator/cost/hybrid.py``); stage and micro-batch times go through it."""
        """Stage times of many micro-batches at once (``simulator/cost/stagecost.py``): the one array form."""
        self._fast_attn, self._fast_dense = self._fused()
        for op in ("embed_fwd", "embed_bwd", "head_fwd", "head_bwd"):
            if op not in self._curves:
                warnings.warn(f"profile {profile.source} has no {op} rows; that op costs 0 s", MeaningWarning,
                              stacklevel=3)

    def _derive_split(self) -> list[str]:
        """I and W curves of ``layer_bwd`` / ``head_bwd`` where the profile has no split rows:
        each half of the whole (see the module docstring). Returns the ops derived."""
        derived = []
        for name in ("layer", "head"):
            whole = self._curves.get(f"{name}_bwd")
            if whole is None or f"{name}_bwd_input" in self._curves:
                continue
            half = _Curve(whole.xs, [y / 2 for y in whole.ys])
            self._curves[f"{name}_bwd_input"] = self._curves[f"{name}_bwd_weight"] = half
            derived.append(name)
        return derived

    def _fold_cp(self) -> None:
        """Context parallelism (``cluster.cp > 1``, docs/costmodel.md section 11): every per-token
        op runs on 1/cp of the tokens (its curve's token axis stretched by cp), and attention at each
        profiled (length, budget) becomes the CP group's layer time (:meth:`cp_report`, from the
        profile's one-GPU time at that point), so every consumer prices CP through the usual ops."""
        c = self.cluster
        if c.cp == 1:
            return
        from sparsebalance.simulator.cost.contextparallel import min_blocks

        self._whole_max = (min_blocks(c.cp_layout, c.cp) - 1) * self.block_size
        # a ring step costs at least the profile's cheapest attention point (a near-empty call)
        self._cp_floor = {bw: min(min(row) for row in self._surfaces[op].zs)
                          for op, bw in (("attn_fwd", False), ("attn_bwd", True))}
        for op, curve in list(self._curves.items()):
            if op != "optim":
                self._curves[op] = _Curve([x * c.cp for x in curve.xs], curve.ys)
        for op, bw in (("attn_fwd", False), ("attn_bwd", True)):  # the one-GPU surfaces, kept for cp_report
            surf = self._surfaces[op]
            one = self._one_gpu[bw] = _Surface.__new__(_Surface)
            one.xs, one.ks, one.zs = surf.xs, surf.ks, [list(row) for row in surf.zs]
        degrees = [1] + ([d for d in c.cp_degrees if 1 < d < c.cp] if c.cp_split == "per-sequence" else [])
        for d in degrees:  # before the fold below replaces the main surfaces' values
            self._degree_surf[d] = {bw: self._cp_surface(self._one_gpu[bw], bw, d) for bw in (False, True)}
        for op, bw in (("attn_fwd", False), ("attn_bwd", True)):
            surf = self._surfaces[op]
            surf.zs = self._cp_surface(surf, bw, c.cp).zs

    def _cp_surface(self, one: _Surface, backward: bool, degree: int) -> _Surface:
        """A copy of the one-GPU surface ``one`` whose points are one layer's time of the sequence on
        ``degree`` CP ranks (the one-GPU value where the sequence stays whole, and at degree 1)."""
        out = _Surface.__new__(_Surface)
        out.xs, out.ks = one.xs, one.ks
        out.zs = [[z if degree == 1 or (rep := self.cp_report(int(x), int(k), backward=backward, degree=degree)) is None
                   else rep.time for k, z in zip(one.ks, row)] for x, row in zip(one.xs, one.zs)]
        return out

    def _one_gpu_seconds(self, L: int, k: int, backward: bool) -> float:
        """The profile's attention of one sequence on one GPU (before the CP fold)."""
        one = self._one_gpu[backward]
        op = "attn_bwd" if backward else "attn_fwd"
        return one(self._place(op, "seq_len", float(L), one.xs[0], one.xs[-1]),
                   self._place(op, "budget", float(k), one.ks[0], one.ks[-1]))

    def cp_report(self, L: int, k: int, *, backward: bool = False, degree: int | None = None):
        """One layer of a sequence of ``L`` tokens at budget ``k`` on the CP group
        (``contextparallel.RingReport``, with the layout and comm it ran on), or None when the
        sequence is too short for the layout and stays whole on one rank. ``cp_layout = "best"``:
        the candidate (zigzag or stripe on ``cp_comm``, or all-gather) with the least forward +
        backward time for this sequence and budget, the same for both passes. ``degree``: on an
        aligned group of that many of the CP ranks (default: all ``cp``; ``cp_split =
        "per-sequence"``), a ring inside one node when the group fits in one."""
        from sparsebalance.simulator.cost import contextparallel as cpm

        c = self.cluster
        d = c.cp if degree is None else int(degree)
        k = self.effective_budget(L, k)
        key = (L, k, backward, d)
        hit = self._cp_reports.get(key)
        if hit is not None or c.cp == 1 or d == 1:
            return hit
        n = blocks(L, self.block_size)
        if n < cpm.min_blocks(c.cp_layout, d):
            return None
        comm = c.cp_comm if d > c.cp_ranks_per_node or c.cp_comm != "hierarchical" else "ring"
        if c.cp_layout != "best":
            rep = self._cp_layer(L, k, c.cp_layout, comm, backward, d)
        else:
            cands = [(lay, comm) for lay in ("zigzag", "stripe") if n >= cpm.min_blocks(lay, d)]
            cands += [("stripe", "allgather")] if comm != "allgather" else []
            both = [(self._cp_layer(L, k, lay, cm, False, d), self._cp_layer(L, k, lay, cm, True, d))
                    for lay, cm in dict.fromkeys(cands)]
            f, b = min(both, key=lambda fb: fb[0].time + fb[1].time)
            self._cp_reports[(L, k, False, d)], self._cp_reports[(L, k, True, d)] = f, b
            return b if backward else f
        self._cp_reports[key] = rep
        return rep

    def _cp_layer(self, L: int, k: int, layout: str, comm: str, backward: bool, degree: int):
        from sparsebalance.simulator.cost import contextparallel as cpm

        c, m = self.cluster, self.model
        n = blocks(L, self.block_size)
        inner = min(c.cp_ranks_per_node, degree)
        pairs = cpm.rank_pairs(L, self.block_size, k, degree, layout, c.cp_selection)
        if comm == "allgather":
            steps = pairs.sum(axis=1, keepdims=True)
        else:
            steps = np.take_along_axis(pairs, cpm.ring_order(degree, comm, inner), axis=1)
        sizes = cpm.block_sizes(L, self.block_size)
        tokens = np.array([sizes[part].sum() for part in cpm.shards(n, degree, layout)])
        kv_dim = -(-m.kv_heads // c.tp) * m.head_dim
        return cpm.layer_time(steps, self._group_work(L, k, backward, layout, comm, degree),
                              self._cp_floor[backward], comm=comm,
                              kv_bytes=tokens * 2 * kv_dim * m.dtype_bytes, intra=c.tp_bandwidth,
                              inter=c.p2p_bandwidth, latency=c.p2p_latency, inner=inner,
                              backward=backward, layout=layout,
                              grad_ratio=max(4, m.dtype_bytes) / m.dtype_bytes)  # dK/dV in fp32

    def _group_work(self, L: int, k: int, backward: bool, layout: str, comm: str, degree: int) -> float:
        """Seconds of a CP group's attention work on one sequence (summed over its ranks, before
        :func:`contextparallel.layer_time` spreads it over ranks and steps by pairs). The one-GPU
        time, times the measured ratio of the group's work to it where the profile has CP rows for
        this group (``attn_*_cp``: degree, layout, all-gather; the CP path's own work, such as
        placing every rank's K/V and a partial layout's fixed costs), read at the nearest profiled
        point: the ratio holds below the shortest split length of the grid and above its longest."""
        one = self._one_gpu_seconds(L, k, backward)
        work, meta = self._cp_work.get(backward), self.profile.meta
        if work is None or (comm, degree, layout) != ("allgather", meta.cp, meta.cp_layout):
            return one
        x = min(max(float(L), work.xs[0]), work.xs[-1])
        kk = min(max(float(k), work.ks[0]), work.ks[-1])
        base = self._one_gpu[backward](x, kk)
        return one * work(x, kk) / base if base > 0 else one

    def cp_placement(self, lengths, budget):
        """:meth:`.hybrid.PerSequenceCP.placement` under ``cp_split = "per-sequence"``, else None."""
        if self.per_sequence is None:
            return None
        return self.per_sequence.placement(lengths, int(uniform_budgets([budget])[0]))

    def cp_tokens(self, lengths, budget) -> int:
        """Tokens the busiest CP rank holds x cp (P2P and memory divide by cp): the micro-batch's
        tokens unless each sequence has its own CP degree."""
        if self.per_sequence is None:
            return split_pad(lengths)[1]
        return self.per_sequence.busiest_tokens(lengths, int(uniform_budgets([budget])[0]))

    def attention_at_degree(self, seq_len: int, budget: int, degree: int, *, backward: bool = False) -> float:
        """One layer's attention of one sequence split over ``degree`` of the CP ranks (seconds;
        ``cp_split = "per-sequence"``): the main surface at degree cp (:meth:`attention`), the
        degree's own surface below it, the one-GPU one at 1 (recomputation folded in alike)."""
        if degree == self.cluster.cp:
            return self.attention(seq_len, budget, backward=backward)
        key = (seq_len, budget, degree, backward)
        hit = self._degree_attn.get(key)
        if hit is None:
            surf = self._degree_surf[degree][backward]
            op = "attn_bwd" if backward else "attn_fwd"
            k = self.effective_budget(seq_len, budget)
            hit = self._degree_attn[key] = surf(self._place(op, "seq_len", float(seq_len), surf.xs[0], surf.xs[-1]),
                                                self._place(op, "budget", float(k), surf.ks[0], surf.ks[-1]))
        return hit

    def _fold_recompute(self) -> None:
        """Add the forward that recomputation runs again to the backward ops (module docstring)."""
        mode = self.cluster.recompute
        if mode == "none":
            return
        f, b = self._surfaces["attn_fwd"], self._surfaces["attn_bwd"]
        if f.xs != b.xs or f.ks != b.ks:
            raise ConfigError(f"cluster.recompute: {mode!r} needs the profile's attn_fwd and attn_bwd on the "
                              f"same (seq_len, budget) grid ({self.profile.source} has different grids)")
        for fs, bs in [(f, b)] + [(x[False], x[True]) for x in self._degree_surf.values()]:
            bs.zs = [[v + u for u, v in zip(ru, rv)] for ru, rv in zip(fs.zs, bs.zs)]
        self.call[True] = self.call[True] + self.call[False]  # the forward call again
        fwd = self._curves.get("layer_fwd")
        if mode == "full" and fwd is not None:
            for op in ("layer_bwd", "layer_bwd_input"):
                c = self._curves[op]
                self._curves[op] = _Curve(c.xs, [y + fwd(x) for x, y in zip(c.xs, c.ys)])

    def _note_split(self) -> None:
        if self._derived_split and not self.notes:
            ops = " and ".join(f"{n}_bwd" for n in self._derived_split)
            self.notes.append(f"profile {self.profile.source} (format {self.profile.meta.format_version}) "
                              f"has no split-backward rows: I = W = half of {ops} (B = I + W)")
            warnings.warn("latency: " + self.notes[0], RuntimeWarning, stacklevel=3)

    def _fused(self):
        """Pre-summed tables for microbatch_latency's hot path: attention F + B on the shared grid, and
        the whole model's non-attention F + B (layers x layer + embed + head) on the union of the
        token grids. Interpolation is linear, so interpolating a sum equals summing interpolations;
        queries outside either table's range take the per-op path (which warns, errors or clamps)."""
        f, b = self._surfaces["attn_fwd"], self._surfaces["attn_bwd"]
        fast_attn = None
        if f.xs == b.xs and f.ks == b.ks:
            fast_attn = _Surface.__new__(_Surface)
            fast_attn.xs, fast_attn.ks = f.xs, f.ks
            fast_attn.zs = [[u + v for u, v in zip(ru, rv)] for ru, rv in zip(f.zs, b.zs)]
        weights = {"layer_fwd": self.model.layers, "layer_bwd": self.model.layers, "embed_fwd": 1,
                   "embed_bwd": 1, "head_fwd": 1, "head_bwd": 1}
        curves = [(w, self._curves[op]) for op, w in weights.items() if op in self._curves]
        lo = max(c.xs[0] for _, c in curves)
        hi = min(c.xs[-1] for _, c in curves)
        xs = sorted({x for _, c in curves for x in c.xs if lo <= x <= hi})
        fast_dense = _Curve(xs, [sum(w * c(x) for w, c in curves) for x in xs]) if len(xs) > 1 else None
        return fast_attn, fast_dense

    # -- range handling -------------------------------------------------------------------------
    def _place(self, op: str, what: str, x: float, lo: float, hi: float) -> float:
        if lo <= x <= hi:
            return x
        rng = f"[{lo:g}, {hi:g}]"
        if self.extrapolate == "error":
            raise ConfigError(f"latency: {op} {what} {x:g} is outside the profiled range {rng} of "
                              f"{self.profile.source} (set extrapolate to 'warn' or 'clamp' to allow it)")
        if self.extrapolate == "clamp":
            return min(max(x, lo), hi)
        if op not in self._warned:
            self._warned.add(op)
            warnings.warn(f"latency: {op} {what} {x:g} is outside the profiled range {rng} of "
                          f"{self.profile.source}; extrapolating linearly (warned once per op)",
                          MeaningWarning, stacklevel=4)
        return x

    def effective_budget(self, seq_len: int, budget: int) -> int:
        """min(budget, number of blocks): a top-k at or beyond the block count is dense."""
        return min(int(budget), blocks(int(seq_len), self.block_size))

    # -- per layer ------------------------------------------------------------------------------
    def attention(self, seq_len: int, budget: int, *, backward: bool = False) -> float:
        """Seconds of one layer's MoBA attention for one sequence of ``seq_len`` tokens."""
        key = (seq_len, budget, backward)
        hit = self._attn.get(key)
        if hit is not None:
            return hit
        if seq_len < 1 or budget < 1:
            raise ConfigError(f"latency: attention needs seq_len >= 1 and budget >= 1, "
                              f"got {seq_len} and {budget}")
        op = "attn_bwd" if backward else "attn_fwd"
        # with CP a sequence too short for the layout stays whole on one rank: the one-GPU surface
        # (with recomputation folded in, as the main surfaces)
        surf = self._degree_surf[1][backward] if seq_len <= self._whole_max else self._surfaces[op]
        k = self.effective_budget(seq_len, budget)
        x = self._place(op, "seq_len", float(seq_len), surf.xs[0], surf.xs[-1])
        kk = self._place(op, "budget", float(k), surf.ks[0], surf.ks[-1])
        value = self._attn[key] = surf(x, kk)
        return value

    def attention_many(self, seq_len, budget, *, backward: bool = False) -> np.ndarray:
        """Vectorised :meth:`attention` (seconds, one layer) for arrays of lengths and budgets:
        the same arithmetic, so bitwise the same values; points outside the profiled grid take the
        scalar path (which warns, errors or clamps as configured)."""
        L = np.asarray(seq_len, dtype=np.int64)
        k = np.broadcast_to(np.asarray(budget, dtype=np.int64), L.shape)
        if L.size and (L.min() < 1 or k.min() < 1):
            raise ConfigError("latency: attention needs seq_len >= 1 and budget >= 1")
        flat, k = L.reshape(-1), k.reshape(-1)
        # runs of one length (a caller's sequence at many budgets): the length's part once per run
        starts = np.flatnonzero(np.concatenate(([True], flat[1:] != flat[:-1]))) if flat.size else flat
        counts = np.diff(np.append(starts, flat.size))
        return self._attention_runs(flat[starts], counts, k, backward).reshape(L.shape)

    def _attention_runs(self, L: np.ndarray, counts: np.ndarray, k: np.ndarray, backward: bool) -> np.ndarray:
        """Length ``L[s]`` at the next ``counts[s]`` budgets of ``k``, for every s; bilinear in
        the profile's grid as :class:`_Surface` computes it. The length's interpolation (row i,
        weight t) is per sequence; the budget's (j, u, and the grid rows a, b along it) depends only
        on the row and the effective budget: computed once per (row, budget), then gathered."""
        surf = self._surfaces["attn_bwd" if backward else "attn_fwd"]
        xs, ks, zs = np.asarray(surf.xs), np.asarray(surf.ks), np.asarray(surf.zs)
        x = L.astype(float)
        i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
        t = (x - xs[i]) / (xs[i + 1] - xs[i])
        kn = np.minimum(k, np.repeat(blocks(L, self.block_size), counts))  # the effective budget, an int
        kk = kn.astype(float)
        inside = np.repeat((x >= xs[0]) & (x <= xs[-1]) & (x > self._whole_max), counts) \
            & (kk >= ks[0]) & (kk <= ks[-1])  # sequences whole on one CP rank: the scalar path
        kf = np.arange(int(kn.max()) + 1 if kn.size else 1).astype(float)
        j = np.clip(np.searchsorted(ks, kf, side="right") - 1, 0, len(ks) - 2)
        u = (kf - ks[j]) / (ks[j + 1] - ks[j])
        a = zs[:-1, j] + u * (zs[:-1, j + 1] - zs[:-1, j])  # [grid rows - 1, budgets]
        b = zs[1:, j] + u * (zs[1:, j + 1] - zs[1:, j])
        row = np.repeat(i, counts)
        a, b = a[row, kn], b[row, kn]
        out = np.maximum(0.0, a + np.repeat(t, counts) * (b - a))
        if not inside.all():
            seq = np.repeat(np.arange(len(L)), counts)
            for idx in np.flatnonzero(~inside).tolist():
                out[idx] = self.attention(int(L[seq[idx]]), int(k[idx]), backward=backward)
        return out

    def _op(self, op: str, x: int) -> float:
        key = (op, x)
        hit = self._dense.get(key)
        if hit is not None:
            return hit
        curve = self._curves.get(op)
        if curve is None or x == 0:
            value = 0.0
        else:
            what = "parameters" if op == "optim" else "tokens"
            value = curve(self._place(op, what, float(x), curve.xs[0], curve.xs[-1]))
        self._dense[key] = value
        return value

    def _bwd_op(self, name: str, backward: bool, part: str | None) -> str:
        if part is None:
            return f"{name}_bwd" if backward else f"{name}_fwd"
        if part not in PARTS or not backward:
            raise ConfigError(f"latency: part must be one of {', '.join(PARTS)} with backward=True, "
                              f"got {part!r}")
        self._note_split()
        return f"{name}_bwd_{part}"

    def op_many(self, op: str, x) -> np.ndarray:
        """Vectorised per-token op (``layer_fwd``, ``embed_bwd``, ``head_fwd``, ...) for an array of
        token counts: bitwise :meth:`dense` / :meth:`embed` / :meth:`head`'s values (same
        arithmetic); points outside the profiled range, and 0 tokens, take the scalar path."""
        x = np.asarray(x, dtype=np.int64)
        curve = self._curves.get(op)
        if curve is None:
            return np.zeros(x.shape)
        xs, ys = np.asarray(curve.xs), np.asarray(curve.ys)
        xf = x.astype(float)
        i = np.clip(np.searchsorted(xs, xf, side="right") - 1, 0, len(xs) - 2)
        t = (xf - xs[i]) / (xs[i + 1] - xs[i])
        out = np.maximum(0.0, ys[i] + t * (ys[i + 1] - ys[i]))
        for idx in np.flatnonzero((xf < xs[0]) | (xf > xs[-1]) | (x == 0)):
            out[idx] = self._op(op, int(x[idx]))
        return out

    def per_token_many(self, name: str, tokens, *, backward: bool = False, part: str | None = None) -> np.ndarray:
        """Vectorised :meth:`dense` (``name`` "layer"), :meth:`embed` or :meth:`head` (with their
        ``part`` of a split backward and the TP all-reduces) for an array of token counts: the same
        arithmetic, so bitwise the scalar methods' values."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if name == "embed":
            if part is not None and (part not in PARTS or not backward):
                self._bwd_op("embed", backward, part)  # raises: a part needs backward=True
            if part == "input":
                return np.zeros(tokens.shape)
            return self.op_many("embed_bwd" if backward else "embed_fwd", tokens)
        out = self.op_many(self._bwd_op(name, backward, part), tokens)
        if name == "layer" and self._tp_comm and part != "weight":
            out = out + (self._tp_bwd if backward else 2) * self.tp_allreduce_time(tokens.astype(float))
        return out

    def dense(self, tokens: int, *, backward: bool = False, part: str | None = None) -> float:
        """Seconds of one layer's dense part (norms, QKV/O projections, MLP) on ``tokens`` tokens;
        ``part`` "input" / "weight": that part of the backward (None: the whole). Includes the
        layer's two TP all-reduces (none in the weight part)."""
        t = self._op(self._bwd_op("layer", backward, part), tokens)
        if self._tp_comm and part != "weight":
            t += (self._tp_bwd if backward else 2) * self.tp_allreduce_time(tokens)
        return t

    def tp_allreduce_time(self, tokens):
        """Seconds of one ring all-reduce of a [tokens, hidden] activation across the TP group
        (0 at tp = 1); numpy-broadcastable in ``tokens``."""
        c = self.cluster
        if c.tp == 1:
            return 0.0 * tokens
        nbytes = (tokens / c.cp if c.cp > 1 else tokens) * self.model.hidden * self.model.dtype_bytes
        return c.tp_latency + 2 * (c.tp - 1) / c.tp * nbytes / c.tp_bandwidth

    def embed(self, tokens: int, *, backward: bool = False, part: str | None = None) -> float:
        """Embedding lookup; its backward is all weight gradient (the input is token ids)."""
        if part is not None and (part not in PARTS or not backward):
            self._bwd_op("embed", backward, part)  # raises: a part needs backward=True
        if part == "input":
            return 0.0
        return self._op("embed_bwd" if backward else "embed_fwd", tokens)

    def head(self, tokens: int, *, backward: bool = False, part: str | None = None) -> float:
        """Final norm + LM head + loss."""
        return self._op(self._bwd_op("head", backward, part), tokens)

    # -- stages and micro-batches -----------------------------------------------------------------
    def stage_layers(self, stage: int, chunk: int = 0) -> range:
        """Global layer indices of model chunk ``chunk`` on pipeline stage ``stage``
        (:meth:`Layout.stage_layers`)."""
        return self.layout.stage_layers(stage, chunk)

    @staticmethod
    def _plain(budget: Budget | int) -> int | Budget:
        """A uniform budget as its int (the key every cache and array path uses); a per-layer
        :class:`Budget` as it is. Anything else is refused here, at the model's door."""
        if type(budget) is int:
            return budget
        if isinstance(budget, Budget):
            return budget.value if budget.is_uniform else budget
        if isinstance(budget, Integral) and not isinstance(budget, bool):
            return int(budget)
        raise ConfigError(f"budget: expected an int or a Budget (Budget.per_layer for one int per layer), "
                          f"got {budget!r}")

    def _budget_counts(self, budget: int | Budget, layers: range | None = None) -> tuple[tuple[int, int], ...]:
        """((k, number of layers with budget k), ...) over ``layers`` (all layers when None) of an
        int or a per-layer :class:`Budget` (from :meth:`_plain`)."""
        if type(budget) is int:
            return ((budget, len(layers) if layers is not None else self.model.layers),)
        if layers is None:
            hit = self._counts.get(budget)
            if hit is not None:
                return hit
        per_layer = budget.check_layers(self.model.layers).value
        part = per_layer if layers is None else per_layer[layers.start:layers.stop]
        counts = tuple(sorted(Counter(part).items()))
        if layers is None:
            self._counts[budget] = counts
        return counts

    def stage_time(self, lengths, budget, stage: int, *, backward: bool, chunk: int = 0,
                   part: str | None = None) -> float:
        """Seconds of one (virtual) stage's forward or backward for a micro-batch of ``lengths``:
        its layers' attention (per sequence) + dense part (all tokens), + embedding on virtual
        stage 0, + LM head on the last virtual stage. ``part`` ("input" / "weight", backward only):
        that part of the split backward (attention is all input gradient)."""
        if self.per_sequence is not None:
            mode = "F" if not backward else {None: "B", "input": "I", "weight": "W"}[part]
            return float(self.per_sequence.times([tuple(lengths)], uniform_budgets([budget]), (mode,))[mode][
                chunk * self.cluster.pp + stage, 0])
        layers = self.stage_layers(stage, chunk)
        docs, tokens = split_pad(lengths)
        attention = 0.0
        if part != "weight":
            call = self.call[backward] if docs else 0.0
            for k, n in self._budget_counts(self._plain(budget), layers):
                attention += n * (sum(self.attention(L, k, backward=backward) for L in docs) + call)
        return self.cost.stage(attention, tokens, chunk * self.cluster.pp + stage, backward=backward,
                               part=part)

    def stage_times(self, microbatches, budgets, modes=("F", "B")) -> dict[str, np.ndarray]:
        """Seconds [V, M] per mode ("F", "B", and a split backward's "I", "W") of micro-batch i (a
        tuple of lengths) at ``budgets[i]`` on every virtual stage: :class:`StageCost` when every
        budget is uniform, else :meth:`stage_time` per element (memoised: per-layer budgets recur)."""
        if self.per_sequence is not None:
            return self.per_sequence.times(microbatches, uniform_budgets(budgets), modes)
        plain = [self._plain(b) for b in budgets]
        if all(type(b) is int for b in plain):
            return self.cost.times(microbatches, np.array(plain, dtype=np.int64), modes)
        return super().stage_times(microbatches, plain, modes)

    def _attention_fb(self, L: int, k: int) -> float:
        hit = self._attn_fb.get((L, k))
        if hit is None:
            fast = self._fast_attn
            ke = min(k, blocks(L, self.block_size))
            if fast is not None and fast.xs[0] <= L <= fast.xs[-1] and fast.ks[0] <= ke <= fast.ks[-1] \
                    and L > self._whole_max:
                hit = fast(L, ke)
            else:
                hit = self.attention(L, k) + self.attention(L, k, backward=True)
            self._attn_fb[(L, k)] = hit
        return hit

    def _dense_fb(self, tokens: int) -> float:
        """Non-attention F + B of the whole model: layers x dense + embedding + head."""
        hit = self._dense.get(("all", tokens))
        if hit is None:
            fast = self._fast_dense
            if fast is not None and fast.xs[0] <= tokens <= fast.xs[-1]:
                hit = fast(tokens)
                if self._tp_comm:  # the fused table holds the ops alone: 2 + 2 (+ 2) all-reduces per layer
                    hit += self.model.layers * (2 + self._tp_bwd) * self.tp_allreduce_time(tokens)
            else:
                hit = (self.model.layers * (self.dense(tokens) + self.dense(tokens, backward=True))
                       + self.embed(tokens) + self.embed(tokens, backward=True)
                       + self.head(tokens) + self.head(tokens, backward=True))
            self._dense[("all", tokens)] = hit
        return hit

    def microbatch_latency(self, lengths, budget) -> float:
        """Seconds of forward + backward of a micro-batch over the whole model (all stages and
        chunks, no P2P): what the policies balance. Cached per (lengths, budget)."""
        budget = self._plain(budget)
        key = (tuple(lengths), budget)
        hit = self._mb.get(key)
        if hit is not None:
            return hit
        if self.per_sequence is not None:  # every stage's slowest CP rank, forward + backward
            got = self.per_sequence.times([key[0]], uniform_budgets([budget]))
            hit = self._mb[key] = float(got["F"].sum() + got["B"].sum())
            return hit
        lengths, tokens = split_pad(key[0])
        call = self.call[False] + self.call[True] if lengths else 0.0
        if type(budget) is int:
            if budget < 1:
                raise ConfigError(f"budget: must be >= 1 (MoBA top-k), got {budget}")
            total = self.model.layers * (sum(self._attention_fb(L, budget) for L in lengths) + call)
        else:
            total = 0.0
            for k, n in self._budget_counts(budget):
                total += n * (sum(self._attention_fb(L, k) for L in lengths) + call)
        total += self._dense_fb(tokens)
        if len(self._mb) > 1_000_000:  # bound memory in very long runs
            self._mb.clear()
        self._mb[key] = total
        return total

    def microbatch_latencies(self, microbatches, budgets) -> np.ndarray:
        """Vectorised :meth:`microbatch_latency` for many micro-batches at once (seconds, shape [M]).

        ``microbatches``: M sequences of lengths; ``budgets``: one int for all, or M ints or
        :class:`Budget` (per-layer ones take the scalar path). Points outside the profiled range take the scalar path,
        so warnings, errors and clamping are the same. About 30x faster per micro-batch than the
        scalar call when the caches are cold (e.g. DST scanning many budgets)."""
        if self.per_sequence is not None:  # a placement per micro-batch: no shared vectorised pass
            ks = [budgets] * len(microbatches) if isinstance(budgets, Integral) else budgets
            return np.array([self.microbatch_latency(mb, k) for mb, k in zip(microbatches, ks)], dtype=float)
        counts = np.fromiter((len(mb) for mb in microbatches), dtype=np.int64, count=len(microbatches))
        if isinstance(budgets, Integral) and not isinstance(budgets, bool):
            budgets = np.full(len(counts), int(budgets), dtype=np.int64)
        elif any(isinstance(b, Budget) for b in budgets):
            budgets = [self._plain(b) for b in budgets]
            if any(isinstance(b, Budget) for b in budgets):
                return np.array([self.microbatch_latency(mb, b) for mb, b in zip(microbatches, budgets)])
        k_mb = np.asarray(budgets, dtype=np.int64)
        if k_mb.shape != counts.shape:
            raise ConfigError(f"budget: expected one budget per micro-batch ({len(counts)}), got {k_mb.shape}")
        if (k_mb < 1).any():
            raise ConfigError(f"budget: must be >= 1 (MoBA top-k), got {int(k_mb.min())}")
        lengths = np.fromiter((L for mb in microbatches for L in mb), dtype=np.int64, count=int(counts.sum()))
        k = np.repeat(k_mb, counts)
        doc = lengths > 0  # a negative entry is a slot's padding: tokens, no attention (plan.split_pad)
        per_seq = np.zeros(lengths.shape)
        per_seq[doc] = self.model.layers * self._attention_fb_array(lengths[doc], k[doc])
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        nonempty = counts > 0
        attn = np.zeros(len(counts))
        attn[nonempty] = np.add.reduceat(per_seq, starts[nonempty]) if per_seq.size else 0.0
        tokens = np.zeros(len(counts), dtype=np.int64)
        tokens[nonempty] = np.add.reduceat(np.abs(lengths), starts[nonempty]) if lengths.size else 0
        if not doc.all():  # the fixed call costs come with documents only
            nonempty = np.zeros(len(counts), dtype=bool)
            nonempty[np.unique(np.repeat(np.arange(len(counts)), counts)[doc])] = True
        call = self.call[False] + self.call[True]
        if call:
            attn = attn + np.where(nonempty, self.model.layers * call, 0.0)
        return attn + self._dense_fb_array(tokens)

    def _attention_fb_array(self, L: np.ndarray, k: np.ndarray) -> np.ndarray:
        fast = self._fast_attn
        out = np.empty(L.shape)
        ke = np.minimum(k, blocks(L, self.block_size))
        if fast is None:
            inside = np.zeros(L.shape, dtype=bool)
        else:
            xs, ks, zs = np.asarray(fast.xs), np.asarray(fast.ks), np.asarray(fast.zs)
            inside = (L >= xs[0]) & (L <= xs[-1]) & (ke >= ks[0]) & (ke <= ks[-1]) & (L > self._whole_max)
            x, kk = L[inside].astype(float), ke[inside].astype(float)
            i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
            j = np.clip(np.searchsorted(ks, kk, side="right") - 1, 0, len(ks) - 2)
            t = (x - xs[i]) / (xs[i + 1] - xs[i])
            u = (kk - ks[j]) / (ks[j + 1] - ks[j])
            a = zs[i, j] + u * (zs[i, j + 1] - zs[i, j])
            b = zs[i + 1, j] + u * (zs[i + 1, j + 1] - zs[i + 1, j])
            out[inside] = np.maximum(0.0, a + t * (b - a))
        for idx in np.flatnonzero(~inside):
            out[idx] = self._attention_fb(int(L[idx]), int(k[idx]))
        return out

    def _dense_fb_array(self, tokens: np.ndarray) -> np.ndarray:
        fast = self._fast_dense
        out = np.empty(tokens.shape)
        if fast is None:
            inside = np.zeros(tokens.shape, dtype=bool)
        else:
            xs, ys = np.asarray(fast.xs), np.asarray(fast.ys)
            inside = (tokens >= xs[0]) & (tokens <= xs[-1])
            out[inside] = np.interp(tokens[inside].astype(float), xs, ys)
            if self._tp_comm:
                out[inside] += self.model.layers * (2 + self._tp_bwd) * self.tp_allreduce_time(
                    tokens[inside].astype(float))
        for idx in np.flatnonzero(~inside):
            out[idx] = self._dense_fb(int(tokens[idx]))
        return out

    # -- communication and optimizer ------------------------------------------------------------
    def p2p_time(self, tokens: int) -> float:
        """Seconds to send one micro-batch's activations (tokens x hidden x dtype bytes) to the next stage."""
        c = self.cluster
        if c.cp > 1:  # each CP rank sends its own share, all at once
            tokens = tokens / c.cp
        return c.p2p_latency + tokens * self.model.hidden * self.model.dtype_bytes / c.p2p_bandwidth

    def stage_params(self, stage: int) -> int:
        """Parameters held by device ``stage`` before TP splitting (:meth:`Layout.device_params`)."""
        return self.layout.device_params(stage)

    def _grad_buckets(self, stage: int) -> list[tuple[float, float]]:
        """(share of the device's parameters up to and including the bucket, seconds of its
        collective) per gradient bucket, in the order the backward fills them: one bucket without
        ``dp_overlap``; each a ring all-reduce ``2 (n-1)/n x bytes / bw + latency``, or with
        ``zero1`` a reduce-scatter ``(n-1)/n x bytes / bw + latency`` (bytes = params / tp x
        ``cluster.grad_reduce_bytes``, default the model's dtype bytes). Empty at dp = 1."""
        c = self.cluster
        n = c.dp * c.cp  # the CP ranks of a stage hold the same weights: they reduce together
        if n == 1:
            return []
        params = self.stage_params(stage) / c.tp
        size = params
        if c.dp_overlap:
            size = c.grad_bucket_params or max(40_000_000, 1_000_000 * n)
        steps = (n - 1) / n if c.zero1 else 2 * (n - 1) / n
        db = c.grad_reduce_bytes or self.model.dtype_bytes
        out, done = [], 0.0
        while done < params:
            p = min(size, params - done)
            done += p
            out.append((done / params, steps * (p * db) / c.allreduce_bandwidth
                        + c.allreduce_latency))
        return out

    def allreduce_time(self, stage: int) -> float:
        """Seconds of the DP gradient synchronisation of stage ``stage`` when nothing overlaps it:
        its buckets' collectives one after another (:meth:`_grad_buckets`; without ``dp_overlap``
        one ring all-reduce ``2 (n-1)/n x bytes / bandwidth + latency``); 0 when dp = 1."""
        return float(sum(sec for _, sec in self._grad_buckets(stage)))

    def grad_sync_exposed(self, stage: int, window: float) -> float:
        """Seconds of stage ``stage``'s gradient synchronisation left after its last backward action
        (``window`` seconds long) with ``dp_overlap``: bucket i is ready when the action has run
        its share of the parameters (gradients come out evenly over it), and the collectives run
        one at a time, ``end_i = max(ready_i, end_(i-1)) + seconds_i``; exposed = end - window.
        Equal buckets (n_b of them, T seconds in all): ``max(T / n_b, T - window (n_b - 1) / n_b)``."""
        end = 0.0
        for share, sec in self._grad_buckets(stage):
            end = max(end, window * share) + sec
        return max(0.0, end - window)

    def optimizer_time(self, stage: int) -> float:
        """Seconds of one AdamW step over stage ``stage``'s parameters (its TP shard; with ``zero1``
        its 1/dp share, then the ring all-gather of the updated bf16 parameters, ``(n-1)/n x bytes
        / bandwidth + latency``): the profile's ``optim`` op at that parameter count, else params x
        :func:`adamw_bytes` (gradient buffer of ``grad_reduce_bytes``) / the sidecar's memory_bandwidth."""
        c = self.cluster
        params = round(self.stage_params(stage) / c.tp)
        n = c.dp * c.cp  # the data-parallel group of a stage's weights: DP x CP
        if c.zero1 and n > 1:
            gather = ((n - 1) / n * params * self.model.dtype_bytes / c.allreduce_bandwidth
                      + c.allreduce_latency)
            return self._optimizer_step(round(params / n)) + gather
        return self._optimizer_step(params)

    def _optimizer_step(self, params: int) -> float:
        if "optim" in self._curves:
            return self._op("optim", params)
        bw = self.profile.meta.memory_bandwidth
        if bw:
            return params * adamw_bytes(self.cluster.grad_reduce_bytes or self.model.dtype_bytes) / bw
        if "optim" not in self._warned:
            self._warned.add("optim")
            warnings.warn(f"profile {self.profile.source} has neither optim rows nor memory_bandwidth; "
                          "the optimizer step costs 0 s", RuntimeWarning, stacklevel=3)
        return 0.0


def _mismatches(meta: ProfileMeta, model: ModelConfig, cluster: ClusterConfig) -> list[str]:
    out = []
    if meta.block_size != model.block_size:
        out.append(f"block_size {meta.block_size} (run: model.block_size = {model.block_size})")
    if meta.tp != cluster.tp:
        out.append(f"tp {meta.tp} (run: cluster.tp = {cluster.tp})")
    for dim in _CHECKED_DIMS:
        if dim in meta.model and meta.model[dim] != getattr(model, dim):
            out.append(f"model.{dim} {meta.model[dim]} (run: {getattr(model, dim)})")
    # a sidecar records only the architecture fields that differ from Qwen2's (ModelConfig.arch)
    for key, default in QWEN2_ARCH.items():
        have = meta.model.get(key, default)
        if have != getattr(model, key):
            out.append(f"model.{key} {have!r} (run: {getattr(model, key)!r})")
    return out


def check_tp_overlap(prof: Profile, cluster: ClusterConfig) -> None:
    """``cluster.tp_overlap`` is priced by analytical profiles only: a measured one refuses it in one
    line (checked before a calibration probe spends time on it, and when the model is built)."""
    if cluster.tp_overlap and cluster.tp > 1 and not prof.meta.analytical:
        raise ConfigError(f"cluster.tp_overlap: priced by analytical profiles only (profile = \"analytical-<gpu>\"); "
                          f"{prof.source} is measured, its TP collectives are added whole: set tp_overlap = false")


def load_latency_model(profile: str | Profile, model: ModelConfig, cluster: ClusterConfig, *,
                       base_dir: str = ".", extrapolate: str = "warn",
                       allow_nonmonotone: bool = False) -> LatencyModel:
    """Load ``profile`` (shipped name, directory or CSV path, or a Profile) and build the latency model
    for ``model`` on ``cluster``. See the module docstring for matching and extrapolation rules.

    A profile whose latency falls as length or budget grows is refused (ConfigError listing the
    points) unless ``allow_nonmonotone`` or its sidecar carries a ``nonmonotone`` note saying why the
    points are acceptable; then a warning lists them."""
    check_choice(extrapolate, "extrapolate", EXTRAPOLATE)
    prof = profile if isinstance(profile, Profile) else _built(profile, model, cluster, base_dir)
    prof = prof if prof is not None else load_profile(profile, base_dir)
    bad = _mismatches(prof.meta, model, cluster)
    sp = cluster.sequence_parallel and cluster.tp > 1
    overlap = cluster.tp_overlap and cluster.tp > 1
    if prof.meta.analytical and bool(prof.meta.sequence_parallel) != sp:  # a measured table is as measured
        bad.append(f"sequence_parallel {bool(prof.meta.sequence_parallel)} (run: {sp})")
    if prof.meta.analytical and bool(prof.meta.tp_overlap) != overlap:
        bad.append(f"tp_overlap {bool(prof.meta.tp_overlap)} (run: {overlap})")
    check_tp_overlap(prof, cluster)
    if bad and prof.meta.analytical and prof.meta.roofline is not None:
        from sparsebalance.simulator.cost.roofline import Hardware, build_profile

        hw = Hardware(**prof.meta.roofline)
        _check_derivable(prof, hw, build_profile)
        derived = build_profile(hw, model, cluster.tp, sequence_parallel=sp, tp_overlap=overlap)
        derived.source = f"{prof.source} (analytical, re-derived for {model.name}, tp {cluster.tp})"
        prof = derived
    elif bad:
        raise ConfigError(f"profile: {prof.source} does not match the run: " + "; ".join(bad)
                          + ". Measure a profile for this model and plan (sparsebalance profile)")
    _check_monotone(prof, model.block_size, allow_nonmonotone)
    device = prof.meta.device
    # A measured profile names the device in full ("cpu x86_64, 1 thread(s)", "NVIDIA H200"): the
    # cluster's short label matches when it is a word of that name.
    words = device.lower().replace(",", " ").split()
    if device and cluster.device and cluster.device.lower() not in words + [device.lower()]:
        warnings.warn(f"profile {prof.source} is for device {device!r} but cluster.device is "
                      f"{cluster.device!r}; predictions follow the profile", MeaningWarning, stacklevel=2)
    return LatencyModel(prof, model, cluster, extrapolate=extrapolate)


def _built(name: str, model: ModelConfig, cluster: ClusterConfig, base_dir: str) -> Profile | None:
    """``analytical-<gpu>`` with no shipped profile or directory of that name: the roofline's profile
    for this model and TP on that GPU, built now (None: load ``name`` as a file)."""
    from sparsebalance.simulator.cost.profile import built_gpu

    gpu = built_gpu(name, base_dir)
    if gpu is None:
        return None
    from sparsebalance.simulator.cost.roofline import HARDWARE, build_profile

    prof = build_profile(HARDWARE[gpu], model, cluster.tp, sequence_parallel=cluster.sequence_parallel,
                         tp_overlap=cluster.tp_overlap)
    prof.source = f"{name} (analytical, built for {model.name}, tp {cluster.tp})"
    return prof


def _check_derivable(prof: Profile, hw, build_profile) -> None:
    """An analytical profile is re-derived for another model from its sidecar; that is only the same
    profile if its table is what the sidecar derives for the sidecar's own model. An edited table
    (every latency x10, say) would be silently replaced: refuse it in one line instead."""
    meta = prof.meta
    try:
        own = ModelConfig(**meta.model, block_size=meta.block_size)
        want = build_profile(hw, own, meta.tp, sequence_parallel=bool(meta.sequence_parallel),
                             tp_overlap=bool(meta.tp_overlap)).table
    except (TypeError, KeyError, ValueError, ConfigError) as e:
        raise ConfigError(f"profile: {prof.source}: its sidecar cannot re-derive it ({e}); "
                          "regenerate it with python -m sparsebalance.simulator.cost.roofline") from None
    keys = ["op", "seq_len", "budget"]
    a = prof.table.sort_values(keys, kind="stable").reset_index(drop=True)
    b = want.sort_values(keys, kind="stable").reset_index(drop=True)
    same = len(a) == len(b) and (a[keys].to_numpy() == b[keys].to_numpy()).all()
    off = 0 if not same else int((~np.isclose(a["latency_s"], b["latency_s"], rtol=1e-9, atol=0)).sum())
    if not same or off:
        what = f"{off} of {len(a)} latencies differ" if same else "its rows differ"
        raise ConfigError(f"profile: {prof.source} is analytical, so it is re-derived for this run from its "
                          f"sidecar, but its table is not what that sidecar derives ({what}: edited?). "
                          "To use the table as it is, set \"analytical\": false in profile.json and match "
                          "the run's model and plan; or regenerate it (python -m sparsebalance.simulator.cost.roofline)")


def _check_monotone(prof: Profile, block_size: int, allow: bool) -> None:
    bad = monotone_violations(prof, block_size)
    if not bad:
        return
    shown = "; ".join(bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "")
    note = prof.meta.nonmonotone
    if allow or note:
        why = f" (accepted: {note})" if note else " (accepted: --allow-nonmonotone)"
        warnings.warn(f"profile {prof.source}: latency falls as work grows at {len(bad)} point(s)"
                      f"{why}: {shown}", stacklevel=3)
        return
    raise ConfigError(f"profile: {prof.source}: latency falls as work grows at {len(bad)} point(s): "
                      f"{shown}. Re-measure, or pass --allow-nonmonotone (allow_nonmonotone = true) "
                      "to use it anyway")


__all__ = ["EXTRAPOLATE", "LatencyModel", "load_latency_model"]
