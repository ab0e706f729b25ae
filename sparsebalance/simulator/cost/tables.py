"""The profile's ops as interpolation tables: what one op costs at any length, budget or token count.

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

Split backward (zero-bubble schedules): a profile without split rows (format 1) takes I = W = half
of ``layer_bwd`` / ``head_bwd`` (the input- and weight-gradient GEMMs of a linear layer have equal
FLOPs), so B = I + W; the first split query says so once (a warning) and :attr:`OpTables.notes`
records it.

Recomputation (``cluster.recompute``, docs/costmodel.md 'Recomputation'): the forward a backward
runs again is folded into the backward ops once, when the tables are built
(:meth:`OpTables.fold_recompute`): ``selective`` adds ``attn_fwd`` to ``attn_bwd`` at every grid
point; ``full`` also adds ``layer_fwd`` to ``layer_bwd`` and to its input part ``layer_bwd_input``.
Sums on the profile's grid, so interpolating the sum equals summing the interpolations wherever the
two ops share a grid. Context parallelism folds into the same tables (:mod:`.cp.pricing`).

Every look-up has a scalar and a vectorised form with the same arithmetic, so the same bits.
"""

from __future__ import annotations

import warnings
from bisect import bisect_right

import numpy as np

from sparsebalance.data.sequence import blocks
from sparsebalance.errors import ConfigError, MeaningWarning, NoteWarning, check_choice
from sparsebalance.simulator.config import ClusterConfig, ModelConfig
from sparsebalance.simulator.cost.profile import CP_ATTENTION_OPS, CP_STEP_OPS, Profile

EXTRAPOLATE = ("warn", "error", "clamp")
PARTS = ("input", "weight")
"""Parts of a split backward: input gradient (I) and weight gradient (W)."""
ATTENTION = {False: "attn_fwd", True: "attn_bwd"}
"""The attention op of each pass (backward?)."""


def _segment(xs: list[float], x: float) -> tuple[int, float]:
    """Index i of the grid segment [xs[i], xs[i+1]] used for x and the (unclamped) position in it."""
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


class Curve:
    """Piecewise-linear y(x) on sorted grid points."""

    __slots__ = ("xs", "ys")

    def __init__(self, xs, ys) -> None:
        self.xs, self.ys = [float(x) for x in xs], [float(y) for y in ys]

    def __call__(self, x: float) -> float:
        i, t = _segment(self.xs, x)
        return max(0.0, self.ys[i] + t * (self.ys[i + 1] - self.ys[i]))


class Surface:
    """Piecewise-bilinear z(seq_len, budget) on a rectilinear grid."""

    __slots__ = ("ks", "xs", "zs")

    def __init__(self, xs: list[float], ks: list[float], zs: list[list[float]]) -> None:
        self.xs, self.ks, self.zs = xs, ks, zs

    @classmethod
    def of(cls, rows) -> Surface:
        """The surface of a profile op's rows (``seq_len, budget, latency_s``)."""
        xs = sorted({float(v) for v in rows["seq_len"]})
        ks = sorted({float(v) for v in rows["budget"]})
        z = {(float(s), float(k)): float(v) for s, k, v in zip(rows["seq_len"], rows["budget"],
                                                                rows["latency_s"])}
        return cls(xs, ks, [[z[(s, k)] for k in ks] for s in xs])

    def copy(self) -> Surface:
        """The same grid with its own rows of values."""
        return Surface(self.xs, self.ks, [list(row) for row in self.zs])

    def __call__(self, x: float, k: float) -> float:
        i, t = _segment(self.xs, x)
        j, u = _segment(self.ks, k)
        lo, hi = self.zs[i], self.zs[i + 1]
        a = lo[j] + u * (lo[j + 1] - lo[j])
        b = hi[j] + u * (hi[j + 1] - hi[j])
        return max(0.0, a + t * (b - a))


class OpTables:
    """The ops of one profile for one (model, cluster): attention surfaces and per-token curves,
    with the range handling of ``extrapolate``. Built by ``LatencyModel`` (module docstring)."""

    def __init__(self, profile: Profile, model: ModelConfig, cluster: ClusterConfig, *,
                 extrapolate: str = "warn") -> None:
        check_choice(extrapolate, "extrapolate", EXTRAPOLATE)
        self.profile, self.extrapolate = profile, extrapolate
        self.block_size = model.block_size
        self.surfaces = {op: Surface.of(profile.rows(op)) for op in ATTENTION.values()}
        """One layer's attention of one sequence per op (after the folds: on its CP group)."""
        self.cp_work = {bw: Surface.of(profile.rows(op)) for op, bw in zip(CP_ATTENTION_OPS, (False, True))
                        if op in profile.ops}
        """The profile's measured CP group work (``attn_*_cp``; forward, backward), when it has them."""
        self.cp_steps = {bw: profile.rows(op) for op, bw in zip(CP_STEP_OPS, (False, True)) if op in profile.ops}
        """The profile's measured ring-step calls (``attn_*_cp_step``: pairs in ``seq_len``, budget,
        seconds; forward, backward), when it has them."""
        self.curves = {op: Curve(r["seq_len"], r["latency_s"]) for op in profile.ops
                       if op not in self.surfaces and op not in CP_ATTENTION_OPS + CP_STEP_OPS
                       for r in [profile.rows(op)]}
        """Per-token ops (``layer_*``, ``embed_*``, ``head_*``) and ``optim`` (per parameter)."""
        self.notes: list[str] = []
        """What the tables derived rather than read from the profile (e.g. the split backward)."""
        self._derived_split = self._derive_split()
        call = profile.meta.attention_call_s or {}
        self.call = {False: float(call.get("fwd", 0.0)), True: float(call.get("bwd", 0.0))}
        """Seconds of one layer's attention call paid once per packed micro-batch (forward, backward;
        the sidecar's ``attention_call_s``, 0 for a measured table whose rows include it)."""
        self.whole: dict[bool, Surface] | None = None
        """With CP: per pass the one-GPU surface of a sequence too short for the layout, which stays
        whole on one rank (set by the CP fold, recomputation folded in alike)."""
        self.whole_max = 0
        """Longest sequence (tokens) that stays whole on one CP rank (0 without CP)."""
        self.warned: set[str] = set()
        self._attn: dict[tuple[int, int, bool], float] = {}
        self._op: dict[tuple[str, int], float] = {}

    def _derive_split(self) -> list[str]:
        """I and W curves of ``layer_bwd`` / ``head_bwd`` where the profile has no split rows:
        each half of the whole (see the module docstring). Returns the ops derived."""
        derived = []
        for name in ("layer", "head"):
            whole = self.curves.get(f"{name}_bwd")
            if whole is None or f"{name}_bwd_input" in self.curves:
                continue
            half = Curve(whole.xs, [y / 2 for y in whole.ys])
            self.curves[f"{name}_bwd_input"] = self.curves[f"{name}_bwd_weight"] = half
            derived.append(name)
        return derived

    def fold_recompute(self, mode: str, pairs: list[dict[bool, Surface]]) -> None:
        """Add the forward that recomputation (``mode``) runs again to the backward ops (module
        docstring); ``pairs``: further (forward, backward) surfaces to fold alike (CP degrees)."""
        if mode == "none":
            return
        f, b = self.surfaces["attn_fwd"], self.surfaces["attn_bwd"]
        if f.xs != b.xs or f.ks != b.ks:
            raise ConfigError(f"cluster.recompute: {mode!r} needs the profile's attn_fwd and attn_bwd on the "
                              f"same (seq_len, budget) grid ({self.profile.source} has different grids)")
        for fs, bs in [(f, b)] + [(x[False], x[True]) for x in pairs]:
            bs.zs = [[v + u for u, v in zip(ru, rv)] for ru, rv in zip(fs.zs, bs.zs)]
        self.call[True] = self.call[True] + self.call[False]  # the forward call again
        fwd = self.curves.get("layer_fwd")
        if mode == "full" and fwd is not None:
            for op in ("layer_bwd", "layer_bwd_input"):
                c = self.curves[op]
                self.curves[op] = Curve(c.xs, [y + fwd(x) for x, y in zip(c.xs, c.ys)])

    def _note_split(self) -> None:
        if self._derived_split and not self.notes:
            ops = " and ".join(f"{n}_bwd" for n in self._derived_split)
            self.notes.append(f"profile {self.profile.source} (format {self.profile.meta.format_version}) "
                              f"has no split-backward rows: I = W = half of {ops} (B = I + W)")
            warnings.warn("latency: " + self.notes[0], NoteWarning, stacklevel=4)

    # -- range handling -------------------------------------------------------------------------
    def place(self, op: str, what: str, x: float, lo: float, hi: float) -> float:
        """``x`` where the look-up of ``op`` reads it: as it is inside [lo, hi]; outside, as
        ``extrapolate`` says (warn once per op and extrapolate, error, or clamp)."""
        if lo <= x <= hi:
            return x
        rng = f"[{lo:g}, {hi:g}]"
        if self.extrapolate == "error":
            raise ConfigError(f"latency: {op} {what} {x:g} is outside the profiled range {rng} of "
                              f"{self.profile.source} (set extrapolate to 'warn' or 'clamp' to allow it)")
        if self.extrapolate == "clamp":
            return min(max(x, lo), hi)
        if op not in self.warned:
            self.warned.add(op)
            warnings.warn(f"latency: {op} {what} {x:g} is outside the profiled range {rng} of "
                          f"{self.profile.source}; extrapolating linearly (warned once per op)",
                          MeaningWarning, stacklevel=5)
        return x

    def effective_budget(self, seq_len: int, budget: int) -> int:
        """min(budget, number of blocks): a top-k at or beyond the block count is dense."""
        return min(int(budget), blocks(int(seq_len), self.block_size))

    def read(self, surf: Surface, op: str, seq_len: int, k: int) -> float:
        """``surf`` at (``seq_len``, effective budget ``k``), each placed in its range."""
        return surf(self.place(op, "seq_len", float(seq_len), surf.xs[0], surf.xs[-1]),
                    self.place(op, "budget", float(k), surf.ks[0], surf.ks[-1]))

    # -- attention ------------------------------------------------------------------------------
    def attention(self, seq_len: int, budget: int, *, backward: bool = False) -> float:
        """Seconds of one layer's MoBA attention for one sequence of ``seq_len`` tokens."""
        key = (seq_len, budget, backward)
        hit = self._attn.get(key)
        if hit is not None:
            return hit
        if seq_len < 1 or budget < 1:
            raise ConfigError(f"latency: attention needs seq_len >= 1 and budget >= 1, "
                              f"got {seq_len} and {budget}")
        op = ATTENTION[backward]
        # with CP a sequence too short for the layout stays whole on one rank: the one-GPU surface
        # (with recomputation folded in, as the main surfaces)
        surf = self.surfaces[op] if self.whole is None or seq_len > self.whole_max else self.whole[backward]
        k = self.effective_budget(seq_len, budget)
        value = self._attn[key] = self.read(surf, op, seq_len, k)
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
        the profile's grid as :class:`Surface` computes it. The length's interpolation (row i,
        weight t) is per sequence; the budget's (j, u, and the grid rows a, b along it) depends only
        on the row and the effective budget: computed once per (row, budget), then gathered."""
        surf = self.surfaces[ATTENTION[backward]]
        xs, ks, zs = np.asarray(surf.xs), np.asarray(surf.ks), np.asarray(surf.zs)
        x = L.astype(float)
        i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
        t = (x - xs[i]) / (xs[i + 1] - xs[i])
        kn = np.minimum(k, np.repeat(blocks(L, self.block_size), counts))  # the effective budget, an int
        kk = kn.astype(float)
        inside = np.repeat((x >= xs[0]) & (x <= xs[-1]) & (x > self.whole_max), counts) \
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

    # -- per-token ops --------------------------------------------------------------------------
    def op(self, op: str, x: int) -> float:
        """Seconds of per-token op ``op`` at ``x`` tokens (parameters for ``optim``); 0 where the
        profile has no such op or at 0."""
        key = (op, x)
        hit = self._op.get(key)
        if hit is not None:
            return hit
        curve = self.curves.get(op)
        if curve is None or x == 0:
            value = 0.0
        else:
            what = "parameters" if op == "optim" else "tokens"
            value = curve(self.place(op, what, float(x), curve.xs[0], curve.xs[-1]))
        self._op[key] = value
        return value

    def op_many(self, op: str, x) -> np.ndarray:
        """Vectorised :meth:`op` for an array of token counts: bitwise its values (same
        arithmetic); points outside the profiled range, and 0 tokens, take the scalar path."""
        x = np.asarray(x, dtype=np.int64)
        curve = self.curves.get(op)
        if curve is None:
            return np.zeros(x.shape)
        xs, ys = np.asarray(curve.xs), np.asarray(curve.ys)
        xf = x.astype(float)
        i = np.clip(np.searchsorted(xs, xf, side="right") - 1, 0, len(xs) - 2)
        t = (xf - xs[i]) / (xs[i + 1] - xs[i])
        out = np.maximum(0.0, ys[i] + t * (ys[i + 1] - ys[i]))
        for idx in np.flatnonzero((xf < xs[0]) | (xf > xs[-1]) | (x == 0)):
            out[idx] = self.op(op, int(x[idx]))
        return out

    def op_name(self, name: str, backward: bool, part: str | None) -> str:
        """The profile op of per-token term ``name`` (layer, embed, head) in that pass and part;
        ConfigError for a part without ``backward``. The first split query notes a derived split."""
        if part is None:
            return f"{name}_bwd" if backward else f"{name}_fwd"
        if part not in PARTS or not backward:
            raise ConfigError(f"latency: part must be one of {', '.join(PARTS)} with backward=True, "
                              f"got {part!r}")
        self._note_split()
        return f"{name}_bwd_{part}"

    def warn_missing_ops(self) -> None:
        """Warn once per missing embedding / LM head op: it costs 0 s (checked when the model is built)."""
        for op in ("embed_fwd", "embed_bwd", "head_fwd", "head_bwd"):
            if op not in self.curves:
                warnings.warn(f"profile {self.profile.source} has no {op} rows; that op costs 0 s", MeaningWarning,
                              stacklevel=4)
