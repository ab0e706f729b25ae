"""``sparsebalance pipeline --config FILE --schedule NAME [--json [--ops]] [--out DIR]``.

Replays explicit durations through a schedule (gpipe, 1f1b, interleaved with ``--virtual-stages
N``, zb-h1, zbv, dualpipev). FILE (the durations JSON, docs/formats.md) holds seconds throughout::

    {"forward": [[f00, f01, ...], ...], "backward": [[...], ...],
     "p2p_latency": 0.0, "allreduce_time": 0.0, "optimizer_time": 0.0}

The zero-bubble schedules (zb-h1, zbv, dualpipev) split a backward into its input-gradient and
weight-gradient parts and need ``backward_input`` and ``backward_weight`` too (same shape);
``backward`` is what a backward they run whole costs. zbv and dualpipev place two virtual stages
per device in a V (rows = 2 x pp; row ``vs`` lives on device ``vs`` or ``2 pp - 1 - vs``).

``forward[s][j]`` is micro-batch j on (virtual) stage s; with the interleaved schedule there are
pp x N rows, row ``c * pp + s`` being chunk c of physical stage s. For data parallelism:
``{"replicas": [{"forward": ..., "backward": ...}, ...], "p2p_latency": ..., "allreduce_time": ...}``.
``p2p_latency`` is the seconds of one transfer; ``allreduce_time`` and ``optimizer_time`` (optional,
default 0) are a number or one per physical stage.

``--json`` prints one JSON object with the iteration's figures (``iteration_time``, ``bubble_fraction``,
``stage_busy``, imbalances, ``microbatch_latency``); ``--ops`` adds ``ops``, one record per trace row
(F, B, P2P, ALLREDUCE, OPTIM), streamed out in chunks (a 65,536-action iteration has ~120,000).
``--out DIR`` also writes ``result.json`` (the ``--json`` figures), ``trace.csv`` and ``trace.json``
(Chrome/Perfetto) there.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from sparsebalance.commands._args import (
    add_config,
    add_out,
    positive_int,
    resolve_out,
    take_positional_config,
)
from sparsebalance.errors import ConfigError, check_finite
from sparsebalance.readfile import load_json

_MATRICES = ("forward", "backward", "backward_input", "backward_weight")
"""Per-replica matrices (the last two only for the zero-bubble schedules)."""
_TOP_KEYS = {*_MATRICES, "replicas", "p2p_latency", "allreduce_time", "optimizer_time"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, help="durations JSON: seconds per stage and micro-batch (format: docs/formats.md)",
               positional=True)
    from sparsebalance.simulator.config import SCHEDULES

    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule (default 1f1b)")
    p.add_argument("--virtual-stages", type=positive_int, default=None, metavar="N",
                   help="model chunks per stage for --schedule interleaved (default 2; zbv and "
                        "dualpipev: 2); rows = pp x N")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--ops", action="store_true",
                   help="with --json: add one record per action (F, B, P2P, ALLREDUCE, OPTIM)")
    add_out(p, "none: print only")


def _matrix(value: Any, where: str) -> list[list[float]]:
    if not isinstance(value, list) or not value or not all(isinstance(r, list) for r in value):
        raise ConfigError(f"{where}: expected a non-empty list of rows (one per stage) of seconds")
    width = len(value[0])
    if width == 0:
        raise ConfigError(f"{where}[0]: needs at least one micro-batch")
    # fast path: exact numbers in equal rows (bool is an int subclass, hence the type() test)
    if all(len(row) == width and all(type(x) is float or type(x) is int for x in row) for row in value):
        import numpy as np

        try:
            arr = np.array(value, dtype=float)
        except OverflowError:  # an integer beyond any float: the loop below names it
            arr = np.array([math.inf])
        if np.isfinite(arr).all() and (arr >= 0).all():
            return arr  # type: ignore[return-value]
    for s, row in enumerate(value):
        if len(row) != width:
            raise ConfigError(f"{where}: ragged rows: row 0 has {width} micro-batches, "
                              f"row {s} has {len(row)}")
        for j, x in enumerate(row):
            _seconds(x, f"{where}[{s}][{j}]")
    return [[float(x) for x in row] for row in value]


def _seconds(x: Any, where: str) -> float:
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) > 1e300:  # float(x) would overflow
        raise ConfigError(f"{where}: a {len(str(abs(x)))}-digit number of seconds is out of range "
                          "(at most 1e300)")
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ConfigError(f"{where}: expected a number of seconds, got {x!r}")
    if x < 0:
        raise ConfigError(f"{where}: must be >= 0 seconds, got {x!r}")
    return float(x)


def _per_stage(value: Any, where: str, pp: int) -> float | list[float]:
    if isinstance(value, list):
        if len(value) != pp:
            raise ConfigError(f"{where}: expected a number or {pp} values (one per stage), got {len(value)}")
        return [_seconds(x, f"{where}[{i}]") for i, x in enumerate(value)]
    return _seconds(value, where)


def load_durations(path: str | Path, schedule: str, virtual_stages: int):
    """Parse and validate a durations file into a ``PipelineInput`` (ConfigError naming the problem)."""
    import numpy as np

    from sparsebalance.simulator.engine import PipelineInput

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: no such file {str(path)!r}")
    data = load_json(path, "--config")  # undecodable, invalid, nested too deep: one line naming it
    if not isinstance(data, dict):
        raise ConfigError("--config: expected a JSON object with keys forward, backward (or replicas)")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key; allowed keys are {', '.join(sorted(_TOP_KEYS))}")
    if "replicas" in data:
        if "forward" in data or "backward" in data:
            raise ConfigError("replicas: give either replicas or top-level forward/backward, not both")
        reps = data["replicas"]
        if not isinstance(reps, list) or not reps or not all(isinstance(r, dict) for r in reps):
            raise ConfigError("replicas: expected a non-empty list of {\"forward\": ..., \"backward\": ...}")
        sources = [(r, f"replicas[{i}].") for i, r in enumerate(reps)]
    else:
        sources = [(data, "")]
    mats: dict[str, list] = {k: [] for k in _MATRICES}
    for src, where in sources:
        for key in _MATRICES:
            if key not in src:
                if key in ("forward", "backward"):
                    raise ConfigError(f"{where}{key}: missing key (seconds per stage and micro-batch)")
                continue
            mats[key].append(_matrix(src[key], where + key))
        extra = sorted(set(src) - set(_MATRICES)) if where else []
        if extra:
            raise ConfigError(f"{where}{extra[0]}: unknown key; a replica has forward and backward "
                              "(and backward_input, backward_weight)")
    for key in ("backward_input", "backward_weight"):
        if mats[key] and len(mats[key]) != len(sources):
            raise ConfigError(f"{key}: give it for every replica or for none")
    fwd, bwd = mats["forward"], mats["backward"]
    shape = (len(fwd[0]), len(fwd[0][0]))
    for i in range(len(fwd)):
        for name in (k for k in _MATRICES if mats[k]):
            mat = mats[name][i]
            if (len(mat), len(mat[0])) != shape:
                where = f"replicas[{i}].{name}" if len(fwd) > 1 else name
                raise ConfigError(f"{where}: shape {len(mat)} x {len(mat[0])} differs from forward's "
                                  f"{shape[0]} x {shape[1]} (stages x micro-batches)")
    nv = shape[0]
    if nv % virtual_stages:
        raise ConfigError(f"forward: {nv} rows is not a multiple of --virtual-stages {virtual_stages}")
    pp = nv // virtual_stages
    split = {k: np.array(mats[k]) for k in ("backward_input", "backward_weight") if mats[k]}
    return PipelineInput(
        schedule=schedule, pp=pp, virtual_stages=virtual_stages, forward=np.array(fwd),
        backward=np.array(bwd), **split, p2p=_seconds(data.get("p2p_latency", 0.0), "p2p_latency"),
        allreduce=_per_stage(data.get("allreduce_time", 0.0), "allreduce_time", pp),
        optimizer=_per_stage(data.get("optimizer_time", 0.0), "optimizer_time", pp))


def run(args: argparse.Namespace) -> int:
    from sparsebalance.simulator.engine import simulate

    take_positional_config(args)
    v = args.virtual_stages
    if v is None:
        v = 2 if args.schedule in ("interleaved", "zbv", "dualpipev") else 1
    if args.ops and not args.json:
        raise ConfigError("--ops: only with --json (the table prints per-device figures)")
    inp = load_durations(args.config, args.schedule, v)
    out = resolve_out(args.out, "", force=args.force, verb="pipeline") if args.out else None
    res = simulate(inp)
    check_finite({"iteration_time": res.iteration_time, "bubble_fraction": res.bubble_fraction,
                  "imbalance": res.imbalance, "stage_imbalance": res.stage_imbalance}, "result")
    doc = {"schedule": args.schedule, "virtual_stages": v, "iteration_time": res.iteration_time,
           "bubble_fraction": res.bubble_fraction, "stage_busy": res.stage_busy.tolist(),
           "imbalance": res.imbalance, "stage_imbalance": res.stage_imbalance,
           "microbatch_latency": res.microbatch_latency.tolist()}
    if out:
        _write(out, doc, res.trace)
    if args.json:
        text = json.dumps(doc, allow_nan=False)
        if not args.ops:
            sys.stdout.write(text + "\n")
            return 0
        sys.stdout.write(text[:-1] + ', "ops": [')
        _stream_ops(res.trace, sys.stdout)
        sys.stdout.write("]}\n")
        return 0
    _print_table(args.schedule, v, res)
    return 0


def _write(out: Path, doc: dict, trace) -> None:
    from sparsebalance.fsutil import atomic_to_csv, atomic_write_json, atomic_write_text
    from sparsebalance.simulator.engine.trace import TRACE_COLUMNS, to_chrome_trace

    atomic_write_json(out / "result.json", doc)
    atomic_to_csv(trace[list(TRACE_COLUMNS)], out / "trace.csv")
    atomic_write_text(out / "trace.json", json.dumps(to_chrome_trace(trace)))


def _stream_ops(tr, out, chunk: int = 20_000) -> None:
    """Write the trace rows as JSON records, ``chunk`` rows per write (floats as ``repr``, which is
    what ``json.dumps`` writes; the trace holds only finite numbers)."""
    cols = [tr[c].tolist() for c in ("dp_rank", "stage", "microbatch", "op", "start_s", "end_s")]
    rows = list(zip(*cols))
    for lo in range(0, len(rows), chunk):
        part = ",".join(f'{{"replica": {r}, "stage": {s}, "microbatch": {j}, "op": "{op}", '
                        f'"start": {a!r}, "end": {b!r}}}' for r, s, j, op, a, b in rows[lo:lo + chunk])
        out.write(part if lo == 0 else "," + part)


def _print_table(schedule: str, v: int, res) -> None:
    import pandas as pd

    dp, pp = res.device_busy.shape
    print(f"schedule {schedule}" + (f" (virtual stages {v})" if v > 1 else "")
          + f", {dp} replica(s) x {pp} stage(s) x {res.microbatch_latency.shape[1]} micro-batches")
    print(f"iteration time   {res.iteration_time:.6g} s")
    print(f"bubble fraction  {res.bubble_fraction:.4f}")
    print(f"imbalance        {res.imbalance:.4f} (max/mean micro-batch F+B)")
    tr = res.trace
    fb = tr[tr["op"].isin(["F", "B", "I", "W"])]
    per = fb.groupby(["dp_rank", "stage"]).agg(first_start_s=("start_s", "min"),
                                               last_end_s=("end_s", "max"))
    per["busy_s"] = res.device_busy.ravel()
    per["idle_s"] = res.iteration_time - per["busy_s"]
    per["order"] = [" ".join(f"{o}{j}" for o, j in zip(g["op"], g["microbatch"]))
                    for _, g in fb.groupby(["dp_rank", "stage"])]
    with pd.option_context("display.width", 160, "display.max_colwidth", 70, "display.max_rows", 200):
        print(per.reset_index().rename(columns={"dp_rank": "replica"}).to_string(index=False))
