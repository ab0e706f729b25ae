"""The sweep's grid: the grid file and axis flags, the cross product of runs, and each run's
resolved config and spec (validated before any run starts). Format: docs/formats.md (sweep grid).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from sparsebalance.commands._args import comma_list
from sparsebalance.errors import ConfigError
from sparsebalance.readfile import load_config_file, load_toml

DST_KEYS = ("policy.anchor", "policy.p", "policy.anchor_scope", "policy.per_layer")
"""Keys of DST only: runs with tuning = \"fixed\" drop them (and run once)."""


def _shape(text: str) -> dict[str, int]:
    try:
        dp, pp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--clusters: expected DPxPP such as 2x4, got {text!r}") from None
    return {"dp": dp, "pp": pp}


def load_grid(args) -> tuple[dict[str, list], dict[str, Any], dict[str, Any], str | None]:
    """(axes, baseline overrides, extra top-level overrides, base config path) from file + flags."""
    axes: dict[str, list] = {}
    baseline: dict[str, Any] = {"policy.batching": "sequential", "policy.tuning": "fixed"}
    extra: dict[str, Any] = {}
    base = args.config
    if args.grid:
        path = Path(args.grid)
        if not path.is_file():
            raise ConfigError(f"--grid: no such file {str(path)!r}")
        data = load_toml(path, "--grid")
        for key in ("grid", "baseline"):
            if not isinstance(data.get(key, {}), dict):
                raise ConfigError(f"grid file {key}: expected a table [{key}], got {data[key]!r}")
        unknown = set(data) - {"base", "iterations", "grid", "baseline"}
        if unknown:
            raise ConfigError(f"grid.{min(unknown)}: unknown key; allowed: base, iterations, "
                              "grid, baseline")
        for k, v in data.get("grid", {}).items():
            if not isinstance(v, list) or not v:
                raise ConfigError(f"grid.{k}: expected a non-empty list of values")
            axes[k] = v
        baseline = dict(data.get("baseline", baseline))
        if "iterations" in data:
            extra["iterations"] = data["iterations"]
        if "base" in data:
            grid_base = path.parent / str(data["base"])
            if base is None:
                base = str(grid_base)
            elif Path(base).resolve() != grid_base.resolve():
                raise ConfigError(f"--config: {base} differs from the grid's base {grid_base}; "
                                  "give the base in one place")
    flag_axes = {"policy.batching": (args.batching, str), "policy.tuning": (args.tuning, str),
                 "policy.anchor": (args.anchor, str), "policy.p": (args.p, float),
                 "seed": (args.seeds, int)}
    flags = {"policy.batching": "--batching", "policy.tuning": "--tuning", "policy.anchor": "--anchor",
             "policy.p": "--p", "seed": "--seeds"}
    for key, (text, conv) in flag_axes.items():
        if text is not None:
            axes[key] = comma_list(text, flags[key], conv, what="integers" if conv is int else
                                   "numbers" if conv is float else "names")
    if any(s < 0 for s in axes.get("seed", [])):
        raise ConfigError(f"--seeds: seeds must be integers >= 0, got {axes['seed']}")
    if args.clusters:
        axes["cluster"] = [_shape(t) for t in comma_list(args.clusters, "--clusters", what="DPxPP shapes")]
    if args.iterations is not None:
        extra["iterations"] = args.iterations
    if args.allow_nonmonotone:
        extra["allow_nonmonotone"] = True
    if args.baseline:
        try:
            b, t = args.baseline.split("+")
        except ValueError:
            raise ConfigError(f"--baseline: expected BATCHING+TUNING, got {args.baseline!r}") from None
        baseline = {"policy.batching": b, "policy.tuning": t}
    if not axes:
        raise ConfigError("sweep: empty grid; give --grid FILE or axis flags such as --batching")
    return axes, baseline, extra, base


def expand(axes: dict[str, list], baseline: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs (override mappings): the cross product, DST keys dropped for fixed tuning, the
    baseline added for every non-policy combination, duplicates removed (order kept)."""
    keys = list(axes)
    runs, seen = [], set()

    def add(run: dict[str, Any]) -> None:
        if run.get("policy.tuning") == "fixed":
            run = {k: v for k, v in run.items() if k not in DST_KEYS}
        key = json.dumps(run, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            runs.append(run)

    for combo in itertools.product(*(axes[k] for k in keys)):
        add(dict(zip(keys, combo)))
    others = [k for k in keys if not k.startswith("policy.")]
    for combo in itertools.product(*(axes[k] for k in others)):
        add(dict(zip(others, combo)) | baseline)
    return runs


def coordinates(run: dict[str, Any]) -> dict[str, Any]:
    """Tidy columns of a run: the last part of each dotted key; cluster tables spread out."""
    out: dict[str, Any] = {}
    for k, v in run.items():
        if isinstance(v, dict):
            out.update({kk: vv for kk, vv in v.items()})
        else:
            out[k.split(".")[-1]] = v
    return out


def build_config(base: dict[str, Any], run: dict[str, Any], extra: dict[str, Any], base_dir: str):
    """The RunConfig of one grid point: the base file's own table (unresolved, so ``seed`` keeps its
    one meaning), then ``extra`` (iterations, ...), then the point's overrides."""
    from sparsebalance.runconfig import apply_override, run_config_from_mapping

    data = json.loads(json.dumps(base))
    for k, v in (extra | run).items():
        if isinstance(v, dict):
            node = data.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"grid.{k}: the base's {k} is not a table")
            node.update(v)
        else:
            apply_override(data, k, v)
    return run_config_from_mapping(data, base_dir=base_dir)


def _base_table(path: str | None) -> tuple[dict[str, Any], str]:
    """The base run config as written (a table), and the directory its paths resolve against."""
    if path is None:
        return {}, "."
    from sparsebalance.runconfig import load_run_config

    cfg = load_run_config(path)  # validates the base on its own first
    return load_config_file(path, "--config"), cfg.base_dir


def plan_runs(args) -> tuple[list, dict[str, Any], dict[str, Any]]:
    """(specs, grid description for grid.json, baseline coordinates); every run validated."""
    import sys

    from tqdm import tqdm

    from sparsebalance.commands._args import progress_enabled
    from sparsebalance.commands.sweep_exec import make_spec
    from sparsebalance.policies.registry import make_batching, make_tuning
    from sparsebalance.runner import check_inputs

    axes, baseline, extra, base_path = load_grid(args)
    base, base_dir = _base_table(base_path)
    specs, seen, prepared = [], set(), set()
    runs = expand(axes, baseline)
    if len(runs) > 100:  # a big grid takes a while to validate: say how big before the first point
        print(f"sweep: {len(runs)} grid points; validating each before any runs", file=sys.stderr, flush=True)
    for run in tqdm(runs, desc="validating", unit="point", file=sys.stderr, disable=not progress_enabled(args)):
        # every run is validated before any starts
        cfg = build_config(base, run, extra, base_dir)
        make_batching(cfg.policy), make_tuning(cfg.policy)
        check_inputs([cfg], prepared)  # data, profile: checked once per distinct input
        spec = make_spec(cfg, coordinates(run))
        if spec.run_id not in seen:
            seen.add(spec.run_id)
            specs.append(spec)
    grid = {"axes": axes, "baseline": baseline, "extra": extra, "base": base_path,
            "run_ids": [s.run_id for s in specs]}
    return specs, grid, {k.split(".")[-1]: v for k, v in baseline.items()}
