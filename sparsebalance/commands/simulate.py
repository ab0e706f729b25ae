"""``sparsebalance simulate --config FILE [--iterations N] [--output DIR] [--set key=value ...]``.

Loads a run config (TOML), applies overrides, runs the simulated loop and writes
``<output_dir>/<name>/``: config.toml (resolved), metrics.csv, trace.csv, trace.json (Chrome),
timeline.png/.svg. Prints a short summary.
"""

from __future__ import annotations

import argparse
import tomllib
from typing import Any

from sparsebalance.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="FILE", help="run config (TOML or JSON)")
    p.add_argument("--iterations", type=int, default=None, metavar="N",
                   help="iterations to simulate (overrides the config's `iterations`)")
    p.add_argument("--output", default=None, metavar="DIR",
                   help="results root (overrides `output_dir`); files go to DIR/<name>/")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="dotted override, value parsed as a TOML scalar, e.g. --set cluster.pp=8 "
                        "--set policy.batching=sab (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--profile-as-is", action="store_true",
                   help="trust a measured profile as it is: no calibration probe on this machine "
                        "(by default a measured CPU/GPU profile whose device this machine has is probed "
                        "at a few points and rescaled per op; analytical profiles are never probed)")


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
    from sparsebalance.commands._common import run_simulation, write_results
    from sparsebalance.runconfig import load_run_config

    overrides = dict(parse_override(item) for item in args.overrides)
    if args.iterations is not None:
        if args.iterations < 1:
            raise ConfigError(f"--iterations: must be >= 1, got {args.iterations}")
        overrides["iterations"] = args.iterations
    if args.output is not None:
        overrides["output_dir"] = args.output
    cfg = load_run_config(args.config, overrides)
    import json
    from pathlib import Path

    from sparsebalance.commands._calibrate import calibrate_run

    out_dir = Path(cfg.output_dir) / cfg.name
    cfg, calibration = calibrate_run(cfg, out_dir, as_is=args.profile_as_is)
    result = run_simulation(cfg, progress=not args.no_progress)
    out = write_results(cfg, result)
    if calibration["status"] != "analytical":
        (out / "calibration.json").write_text(json.dumps(calibration, indent=2, default=str))
    m = result.metrics
    c = cfg.cluster
    print(f"{cfg.name}: {cfg.model.name} on {c.name} (DP{c.dp} x PP{c.pp} x TP{c.tp}, {c.schedule}), "
          f"policy {cfg.policy.batching}+{cfg.policy.tuning}, {len(m)} iterations")
    rows = [
        ("iteration time (s)", m["iteration_time_s"]),
        ("imbalance (max/mean)", m["imbalance"]),
        ("bubble fraction", m["bubble_fraction"]),
    ]
    print(f"  {'metric':<22}{'mean':>12}{'min':>12}{'max':>12}")
    for label, col in rows:
        print(f"  {label:<22}{col.mean():>12.4f}{col.min():>12.4f}{col.max():>12.4f}")
    print(f"results: {out}")
    return 0
