"""``sparsebalance simulate --config FILE [--iterations N] [--out DIR] [--set key=value ...]``.

Loads a run config (TOML), applies overrides, runs the simulated loop and writes ``--out`` (default
``<output_dir>/<name>/``; see docs/formats.md): config.toml (resolved), metrics.csv, trace.csv,
trace.json (Chrome), timeline.png/.svg, summary.json (the figures of the summary, and ``warnings``: those
that change what the numbers mean). Prints a short summary. ``--no-trace`` / ``--trace-limit``
keep big runs from spending longer writing traces than simulating.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

from sparsebalance.commands._args import (
    DeprecatedAlias,
    add_config,
    add_out,
    add_output_flags,
    check_out,
    positive_int,
    progress_enabled,
    resolve_out,
)
from sparsebalance.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sparsebalance.commands._common import TRACE_LIMIT

    add_config(p)
    p.add_argument("--iterations", type=positive_int, default=None, metavar="N",
                   help="iterations to simulate (overrides the config's `iterations`)")
    add_out(p, "<output_dir>/<name>")
    p.add_argument("--output", action=DeprecatedAlias, new="--out DIR/<name>", default=None,
                   metavar="DIR", dest="output_root",
                   help="deprecated: results root (files go to DIR/<name>/); use --out")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="dotted override, value parsed as a TOML scalar, e.g. --set cluster.pp=8 "
                        "--set policy.batching=sab (repeatable)")
    p.add_argument("--allow-nonmonotone", action="store_true",
                   help="use a profile whose latency falls as work grows (a warning lists the points)")
    p.add_argument("--no-trace", action="store_true",
                   help="write no trace.csv / trace.json / timeline (big runs)")
    p.add_argument("--trace-limit", type=positive_int, default=TRACE_LIMIT, metavar="N",
                   help=f"write at most N traced actions, whole iterations first (default {TRACE_LIMIT:,})")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (iteration time, achieved model FLOP/s per GPU, ...) instead of the table")
    p.add_argument("--profile-as-is", action="store_true",
                   help="trust a measured profile as it is: no calibration probe on this machine "
                        "(by default a measured CPU/GPU profile whose device this machine has is probed "
                        "at a few points and rescaled per op; analytical profiles are never probed)")
    add_output_flags(p)


def parse_override(item: str) -> tuple[str, Any]:
    """``"a.b=3"`` -> ``("a.b", 3)``; values are TOML scalars (``8``, ``2.5``, ``true``, ``"x"``,
    ``[1, 2]``); a bare word that is not TOML is taken as a string."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set: expected KEY=VALUE with a dotted KEY, got {item!r}")
    raw = raw.strip()
    try:
        return key, tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        if not raw:
            raise ConfigError(f"--set {key}: empty value") from None
        return key, raw


def run(args: argparse.Namespace) -> int:
    import json
    from dataclasses import replace

    from sparsebalance.calibrate import calibrate_profile
    from sparsebalance.commands._calibrate import save_calibrated
    from sparsebalance.commands._common import prepare, run_simulation, write_results
    from sparsebalance.commands._warnings import SUMMARY, meaning_warnings
    from sparsebalance.fsutil import atomic_write_json, atomic_write_text
    from sparsebalance.runconfig import load_run_config

    overrides = dict(parse_override(item) for item in args.overrides)
    if args.iterations is not None:
        overrides["iterations"] = args.iterations
    if args.allow_nonmonotone:
        overrides["allow_nonmonotone"] = True
    if args.output_root is not None:
        if args.out is not None:
            raise ConfigError("--output: give --out only (--output is its deprecated spelling)")
        overrides["output_dir"] = args.output_root
    cfg = load_run_config(args.config, overrides)
    # a bad --out is refused before the probe (seconds) below
    check_out(args.out, Path(cfg.output_dir) / cfg.name, force=args.force)
    # the data first (a bad file is one line in a second, not after the probe below)
    from sparsebalance.data import load_sequences

    sequences = load_sequences(cfg.data, base_dir=cfg.base_dir)
    # a measured profile is probed on this machine and rescaled before it is trusted, so that the
    # run is prepared once, with the profile it runs on
    calibrated = calibrate_profile(cfg, as_is=args.profile_as_is)
    # data, profile, policies: every input checked before any output
    prepared = prepare(cfg, profile=calibrated.profile, sequences=sequences)
    # the results directory is created and probed before simulating: a bad path costs nothing
    out = resolve_out(args.out, Path(cfg.output_dir) / cfg.name, force=args.force, verb="simulate")
    # nothing is written into it before the run ends: a run stopped by an error, a signal or (--strict)
    # a warning leaves no directory
    result = run_simulation(cfg, progress=progress_enabled(args), prepared=replace(prepared, cfg=cfg))
    cfg = save_calibrated(cfg, out, calibrated)  # the results' config names the profile it ran on
    calibration = calibrated.record
    out = write_results(cfg, result, out, trace=not args.no_trace, trace_limit=args.trace_limit)
    if calibration["status"] != "analytical":
        atomic_write_text(out / "calibration.json", json.dumps(calibration, indent=2, default=str))
    m = result.metrics
    c = cfg.cluster
    # achieved model FLOP/s per GPU (simulator/flops.py: Megatron's convention, no recompute forward)
    tflops = m["model_flops"] / m["iteration_time_s"] / c.gpus / 1e12
    summary = {
        "name": cfg.name, "results": str(out), "iterations": len(m), "gpus": c.gpus,
        "iteration_time_s": {"mean": float(m["iteration_time_s"].mean()),
                             "min": float(m["iteration_time_s"].min()),
                             "max": float(m["iteration_time_s"].max())},
        "model_tflops_per_gpu": float(tflops.mean()),
        "flop_convention": "model FLOPs (Megatron, Korthikanti et al. 2022 Eq. 7): 3 x forward, full "
                           "L x L attention, LM head included, recompute forward not counted",
        "bubble_fraction": float(m["bubble_fraction"].mean()),
        "peak_memory_gb": float(m["peak_memory_gb"].max()) if "peak_memory_gb" in m else None,
        "warnings": meaning_warnings(),  # what the numbers depend on (the CLI adds any later one)
    }
    atomic_write_json(out / SUMMARY, summary, indent=2)
    if args.json:
        print(json.dumps(summary))
        return 0
    cp = f" x CP{c.cp} ({c.cp_layout}, {c.cp_comm})" if c.cp > 1 else ""
    print(f"{cfg.name}: {cfg.model.name} on {c.name} (DP{c.dp} x PP{c.pp}{cp} x TP{c.tp}, {c.schedule}), "
          f"policy {cfg.policy.batching}+{cfg.policy.tuning}, {len(m)} iterations")
    rows = [
        ("iteration time (s)", m["iteration_time_s"]),
        ("imbalance (max/mean)", m["imbalance"]),
        ("bubble fraction", m["bubble_fraction"]),
        ("model TFLOP/s per GPU", tflops),
    ]
    rows += [(label, m[col]) for label, col in (("CP worker imbalance", "cp_worker_imbalance"),
                                                 ("CP step imbalance", "cp_step_imbalance"),
                                                 ("CP exposed comm (s)", "cp_exposed_s"),
                                                 ("CP ring efficiency", "cp_efficiency")) if col in m]
    if "peak_memory_gb" in m:
        rows.append(("peak memory (GB)", m["peak_memory_gb"]))
        rows += [(f"  stage {c.rsplit('_s', 1)[1]} (GB)", m[c]) for c in m.columns
                 if c.startswith("peak_memory_gb_s")]
    print(f"  {'metric':<22}{'mean':>12}{'min':>12}{'max':>12}")
    for label, col in rows:
        print(f"  {label:<22}{col.mean():>12.4f}{col.min():>12.4f}{col.max():>12.4f}")
    if c.cp > 1:
        print(f"  CP attention work priced from {prepared.latency.cp_attention}")
    print(f"results: {out}")
    return 0
