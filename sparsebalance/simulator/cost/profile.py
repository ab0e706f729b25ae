"""The latency profile format: a CSV table plus a JSON sidecar, versioned and validated on load.

A profile is a directory ``NAME/`` holding

* ``profile.csv`` with columns ``op, seq_len, budget, latency_s`` (one row per grid point):

  - ``attn_fwd``, ``attn_bwd``: MoBA attention of ONE decoder layer for ONE sequence;
    ``seq_len`` = that sequence's length in tokens, ``budget`` = MoBA top-k (own block included).
    The (seq_len, budget) points of each attention op must form a full rectilinear grid.
  - ``layer_fwd``, ``layer_bwd``: the dense part of one decoder layer (norms, QKV/O projections,
    MLP); ``seq_len`` = tokens in the micro-batch, ``budget`` = 0.
  - ``layer_bwd_input``, ``layer_bwd_weight`` (format 2, required there): the two parts of
    ``layer_bwd`` that zero-bubble schedules run apart: the gradient with respect to the layer's
    input (I) and with respect to its weights (W). Attention's backward is all input gradient.
  - ``head_bwd_input``, ``head_bwd_weight``: the same split of ``head_bwd``. Optional.
  - ``embed_fwd``, ``embed_bwd``, ``head_fwd``, ``head_bwd``: embedding lookup; final norm + LM head
    + loss; ``seq_len`` = tokens, ``budget`` = 0. Optional (absent = no cost, with a warning).
  - ``optim``: one AdamW step; ``seq_len`` = number of parameters, ``budget`` = 0. Optional.
  - ``attn_fwd_cp``, ``attn_bwd_cp`` (optional, together, only with a sidecar ``cp`` > 1 and
    ``cp_layout``): ONE sequence's attention of one layer on a context-parallel group of ``cp`` ranks
    laid out by ``cp_layout``, the all-gather variant as the real run executes it
    (``kernels/moba/cp.py``): the sum over the ranks of each rank's compute, collectives excluded
    (the latency model prices them). Points from the layout's shortest split sequence up; a grid like
    the attention ops'.
  - ``attn_fwd_cp_step``, ``attn_bwd_cp_step`` (optional, together): ONE ring step's attention call
    of one layer, as a CP ring runs it (``kernels/moba/ring_step.py``): a rank's queries against the
    keys it holds at that step, forward with its merge into the step's accumulator (the first step
    also with the rank's gate, run once before the ring), backward with its gradients' accumulation.
    Here ``seq_len`` = the (query, key) pairs the call attends, per head, and ``budget`` = the MoBA
    top-k of the sequence it belongs to; points need not form a grid (``profile --cp``: one rank's
    steps at every split grid point, equal calls averaged). The latency model prices each ring step
    by the seconds per pair of the measured call of its size (``simulator/cost/cp/calls.py``).

  ``latency_s`` is seconds on one GPU (one TP rank) of the recorded parallel plan.
* ``profile.json``, the sidecar: :class:`~sparsebalance.simulator.cost.profilemeta.ProfileMeta`
  (``profilemeta.py``), one field per key.

Here: the format (:class:`Profile`, validated when built; :meth:`Profile.save`, the one writer). Where
a run's profile comes from -- a shipped name, a directory or CSV, ``analytical-<gpu>`` built on the
fly -- and loading it: ``catalog.py`` (:func:`~sparsebalance.simulator.cost.catalog.load_profile`).
Shipped profiles live in ``sparsebalance/data/profiles/<name>/``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from sparsebalance.data.sequence import blocks
from sparsebalance.errors import ConfigError
from sparsebalance.simulator.cost.profilemeta import ProfileMeta

COLUMNS = ("op", "seq_len", "budget", "latency_s")
ATTENTION_OPS = ("attn_fwd", "attn_bwd")
CP_ATTENTION_OPS = ("attn_fwd_cp", "attn_bwd_cp")
"""A CP group's attention work, measured (``profile --cp``): see the module docstring."""
CP_STEP_OPS = ("attn_fwd_cp_step", "attn_bwd_cp_step")
"""One CP ring step's attention call, measured (``profile --cp``): ``seq_len`` holds its pairs."""
DENSE_OPS = ("layer_fwd", "layer_bwd", "embed_fwd", "embed_bwd", "head_fwd", "head_bwd",
             "layer_bwd_input", "layer_bwd_weight", "head_bwd_input", "head_bwd_weight")
SPLIT_OPS = ("layer_bwd_input", "layer_bwd_weight")
"""Required in a format-2 profile."""
OPS = ATTENTION_OPS + DENSE_OPS + ("optim",) + CP_ATTENTION_OPS + CP_STEP_OPS
REQUIRED_OPS = ("attn_fwd", "attn_bwd", "layer_fwd", "layer_bwd")


@dataclass(kw_only=True, slots=True)
class Profile:
    """A loaded, validated profile."""

    table: pd.DataFrame
    """Rows ``op, seq_len, budget, latency_s`` (ints, ints, ints, float seconds), sorted."""
    meta: ProfileMeta
    """The sidecar, typed and validated."""
    source: str = "<memory>"
    """Where it was loaded from (named in error messages)."""

    def __post_init__(self) -> None:
        self.table = validate_table(self.table, self.source)
        check_split_ops(self.table, self.meta, self.source)
        self.meta.check_consistent(self.source)

    def save(self, directory: str | Path) -> Path:
        """Write ``profile.csv`` + ``profile.json`` into ``directory`` (the one writer of profiles);
        returns it."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        # repr-precision floats so that a reload gives back exactly the same numbers
        self.table.to_csv(out / "profile.csv", index=False, float_format="%.17g")
        (out / "profile.json").write_text(json.dumps(self.meta.to_json(), indent=2, sort_keys=True) + "\n")
        return out

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(op for op in OPS if (self.table["op"] == op).any())

    def rows(self, op: str) -> pd.DataFrame:
        """The rows of one op, sorted by (seq_len, budget)."""
        return self.table[self.table["op"] == op].reset_index(drop=True)


def check_split_ops(table: pd.DataFrame, meta: ProfileMeta, where: str) -> None:
    """A format-2 profile has ``layer_bwd_input`` and ``layer_bwd_weight``; the two ops of a split
    come as a pair in any format."""
    present = set(table["op"])
    if meta.format_version >= 2:
        absent = [op for op in SPLIT_OPS if op not in present]
        if absent:
            raise ConfigError(f"profile: {where}: format 2 needs op(s) {', '.join(absent)} (the split "
                              "backward); measure them, or write format_version 1 to have them derived")
    for pair in (["layer_bwd_input", "layer_bwd_weight"], ["head_bwd_input", "head_bwd_weight"],
                 list(CP_ATTENTION_OPS), list(CP_STEP_OPS)):
        if sum(op in present for op in pair) == 1:
            raise ConfigError(f"profile: {where}: ops {pair[0]} and {pair[1]} come together; only one "
                              "has rows")
    if CP_ATTENTION_OPS[0] in present and ((meta.cp or 1) < 2 or meta.cp_layout is None):
        raise ConfigError(f"profile: {where}: ops {', '.join(CP_ATTENTION_OPS)} need the sidecar's cp (> 1) "
                          f"and cp_layout (the group they were measured on); got cp {meta.cp!r}, "
                          f"cp_layout {meta.cp_layout!r}")


def validate_table(table: pd.DataFrame, where: str) -> pd.DataFrame:
    """Check columns, ops, values and grid shape; return the table typed and sorted."""
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise ConfigError(f"profile: {where}: missing column(s) {', '.join(missing)} "
                          f"(required: {', '.join(COLUMNS)})")
    t = table.loc[:, list(COLUMNS)].copy()
    if t.empty:
        raise ConfigError(f"profile: {where}: no rows")
    t["op"] = t["op"].astype(str)
    unknown = sorted(set(t["op"]) - set(OPS))
    if unknown:
        raise ConfigError(f"profile: {where}: unknown op {unknown[0]!r}; allowed ops are {', '.join(OPS)}")
    for col in ("seq_len", "budget"):
        num = pd.to_numeric(t[col], errors="coerce")
        if num.isna().any() or (num != num.round()).any():
            raise ConfigError(f"profile: {where}: column {col} must hold integers")
        t[col] = num.astype("int64")
    lat = pd.to_numeric(t["latency_s"], errors="coerce").astype(float)
    bad = lat.isna() | ~lat.map(math.isfinite) | (lat < 0)
    if bad.any():
        row = t[bad].iloc[0]
        raise ConfigError(f"profile: {where}: latency_s must be finite and >= 0 seconds; "
                          f"got {table.loc[row.name, 'latency_s']!r} for op {row.op} at "
                          f"seq_len {row.seq_len}, budget {row.budget}")
    t["latency_s"] = lat
    if (t["seq_len"] <= 0).any():
        raise ConfigError(f"profile: {where}: seq_len must be > 0 (tokens, or parameters for optim)")
    dup = t.duplicated(["op", "seq_len", "budget"])
    if dup.any():
        row = t[dup].iloc[0]
        raise ConfigError(f"profile: {where}: duplicated grid point op {row.op}, seq_len {row.seq_len}, "
                          f"budget {row.budget}")
    present = set(t["op"])
    absent = [op for op in REQUIRED_OPS if op not in present]
    if absent:
        raise ConfigError(f"profile: {where}: op(s) {', '.join(absent)} have no rows "
                          f"(required: {', '.join(REQUIRED_OPS)})")
    for op, rows in t.groupby("op"):
        _check_grid(op, rows, where)
    order = {op: i for i, op in enumerate(OPS)}
    t = t.sort_values(["op", "seq_len", "budget"], key=lambda s: s.map(order) if s.name == "op" else s)
    return t.reset_index(drop=True)


MONOTONE_TOLERANCE = 0.05
"""Relative drop between neighbouring grid points that counts as non-monotone (below it: timer noise)."""


def monotone_violations(profile: Profile, block_size: int | None = None,
                        tolerance: float = MONOTONE_TOLERANCE) -> list[str]:
    """Grid points where latency FALLS as work grows: along seq_len at a fixed budget and along the
    budget at a fixed seq_len (attention; a budget at or beyond the sequence's block count is the same
    dense work, so only budgets that add blocks are compared), and along tokens / parameters (dense
    ops, optim). A drop counts when the later point is below ``(1 - tolerance)`` x the earlier one.
    Returns one readable line per violation, the largest relative drop first (empty = monotone)."""
    bs = int(block_size or profile.meta.block_size)
    out: list[tuple[float, str]] = []
    for op in profile.ops:
        rows = profile.rows(op)
        if op in CP_STEP_OPS:  # measured calls, not a grid: a step's shape moves its time as much as its pairs
            continue
        if op in ATTENTION_OPS + CP_ATTENTION_OPS:
            for k, g in rows.groupby("budget"):
                out += _drops(op, f"budget {k}", "seq_len", g["seq_len"], g["latency_s"], tolerance)
            for n, g in rows.groupby("seq_len"):
                eff = [min(int(k), blocks(int(n), bs)) for k in g["budget"]]
                keep = [i for i in range(len(eff)) if i == 0 or eff[i] > eff[i - 1]]
                out += _drops(op, f"seq_len {n}", "budget", g["budget"].iloc[keep],
                              g["latency_s"].iloc[keep], tolerance)
        else:
            axis = "parameters" if op == "optim" else "tokens"
            out += _drops(op, "", axis, rows["seq_len"], rows["latency_s"], tolerance)
    return [text for _, text in sorted(out, key=lambda d: -d[0])]


def _drops(op: str, at: str, axis: str, xs, ys, tolerance: float) -> list[tuple[float, str]]:
    xs, ys = list(xs), list(ys)
    where = f"{op}" + (f" at {at}" if at else "")
    out = []
    for i in range(1, len(ys)):
        if ys[i] < (1 - tolerance) * ys[i - 1]:
            text = f"{where}: {axis} {xs[i - 1]} -> {xs[i]} falls {ys[i - 1]:.3g} s -> {ys[i]:.3g} s"
            out.append((1 - ys[i] / ys[i - 1], text))
    return out


def _check_grid(op: str, rows: pd.DataFrame, where: str) -> None:
    n_seq = rows["seq_len"].nunique()
    if op in CP_STEP_OPS:  # (pairs, budget) points of measured calls
        if (rows["budget"] < 1).any():
            raise ConfigError(f"profile: {where}: {op} budget must be >= 1 (MoBA top-k)")
        return
    if op in ATTENTION_OPS + CP_ATTENTION_OPS:
        if (rows["budget"] < 1).any():
            raise ConfigError(f"profile: {where}: {op} budget must be >= 1 (MoBA top-k)")
        n_k = rows["budget"].nunique()
        if n_seq * n_k != len(rows):
            raise ConfigError(f"profile: {where}: {op} grid is not rectilinear: {len(rows)} rows for "
                              f"{n_seq} seq_len x {n_k} budget values (every seq_len needs every budget)")
        if n_seq < 2 or n_k < 2:
            raise ConfigError(f"profile: {where}: {op} needs >= 2 seq_len and >= 2 budget values "
                              f"to interpolate, got {n_seq} x {n_k}")
    else:
        if (rows["budget"] != 0).any():
            raise ConfigError(f"profile: {where}: {op} rows must have budget 0 (dense op)")
        if n_seq < 2:
            raise ConfigError(f"profile: {where}: {op} needs >= 2 seq_len values to interpolate")
