"""``sparsebalance sweep``: a grid of runs (policies x anchors x p x seeds x cluster shapes) in parallel.

Grid file (TOML; ``examples/sweep_anchor_p.toml``)::

    base = "run.toml"            # optional base run config, relative to this file
    iterations = 10              # optional: overrides the base's iterations
    [grid]                       # dotted run-config keys -> lists of values (the cross product)
    "policy.tuning" = ["fixed", "dst"]
    "policy.anchor" = ["mean", "min", "max"]
    seed = [0, 1]
    cluster = [{dp = 2, pp = 4}, {dp = 4, pp = 2}]   # tables: each merged into [cluster]
    [baseline]                   # what speedup is measured against (added to the grid if absent)
    "policy.batching" = "sequential"
    "policy.tuning" = "fixed"

Flags (``--batching lbb,sab --tuning dst --anchor mean,max --p 0.1,0.2 --seeds 0,1 --clusters 2x4``)
add to or replace grid axes. Runs with ``tuning = "fixed"`` ignore DST's keys (anchor, p,
anchor_scope, per_layer) and are run once. Results: ``<out>/results.csv`` (tidy: run x metric),
``<out>/summary.csv`` (one row per run), ``<out>/configs/<run_id>.toml`` (resolved configs). A
re-run skips runs whose ``run_id`` (a hash of its grid coordinates) is already in results.csv.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import tomllib
from pathlib import Path
from typing import Any

import pandas as pd

from sparsebalance.errors import ConfigError

DST_KEYS = ("policy.anchor", "policy.p", "policy.anchor_scope", "policy.per_layer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="base run config (TOML); default: the built-in defaults")
    p.add_argument("--grid", help="grid file (TOML, see the module docstring)")
    p.add_argument("--batching", help="comma-separated batching policies")
    p.add_argument("--tuning", help="comma-separated tuning policies")
    p.add_argument("--anchor", help="comma-separated DST anchors (mean, min, max)")
    p.add_argument("--p", help="comma-separated DST thresholds in (0, 1)")
    p.add_argument("--seeds", help="comma-separated seeds")
    p.add_argument("--clusters", help="comma-separated DPxPP shapes, e.g. 2x4,4x2")
    p.add_argument("--iterations", type=int, help="iterations per run")
    p.add_argument("--baseline", default=None,
                   help="BATCHING+TUNING speedup is measured against (default sequential+fixed)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--out", default="results/sweep", help="output directory (default results/sweep)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _split(text: str, conv=str) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        return [conv(t) for t in items]
    except ValueError:
        raise ConfigError(f"sweep: cannot read {text!r} as a list of {conv.__name__}") from None


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
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--grid: {path} is not valid TOML: {e}") from None
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
        if base is None and "base" in data:
            base = str(path.parent / data["base"])
    flag_axes = {"policy.batching": (args.batching, str), "policy.tuning": (args.tuning, str),
                 "policy.anchor": (args.anchor, str), "policy.p": (args.p, float),
                 "seed": (args.seeds, int)}
    for key, (text, conv) in flag_axes.items():
        if text:
            axes[key] = _split(text, conv)
    if args.clusters:
        axes["cluster"] = [_shape(t) for t in _split(args.clusters)]
    if args.iterations:
        extra["iterations"] = args.iterations
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
        key = run_id(run)
        if key not in seen:
            seen.add(key)
            runs.append(run)

    for combo in itertools.product(*(axes[k] for k in keys)):
        add(dict(zip(keys, combo)))
    others = [k for k in keys if not k.startswith("policy.")]
    for combo in itertools.product(*(axes[k] for k in others)):
        add(dict(zip(others, combo)) | baseline)
    return runs


def run_id(run: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(run, sort_keys=True, default=str).encode()).hexdigest()[:12]


def coordinates(run: dict[str, Any]) -> dict[str, Any]:
    """Tidy columns of a run: the last part of each dotted key; cluster tables spread out."""
    out: dict[str, Any] = {}
    for k, v in run.items():
        if isinstance(v, dict):
            out.update({kk: vv for kk, vv in v.items()})
        else:
            out[k.split(".")[-1]] = v
    return out


def _config(base: dict[str, Any], run: dict[str, Any], extra: dict[str, Any], base_dir: str):
    from sparsebalance.runconfig import apply_override, run_config_from_mapping

    data = json.loads(json.dumps(base))
    for k, v in (extra | run).items():
        if isinstance(v, dict):
            data.setdefault(k, {}).update(v)
        else:
            apply_override(data, k, v)
    if "seed" in run:  # a seed axis reseeds the data draw and shuffle as well as the run
        data.setdefault("data", {})["seed"] = run["seed"]
    return run_config_from_mapping(data, base_dir=base_dir)


def run_one(job: tuple[str, dict, dict, dict, str, str]) -> list[dict[str, Any]]:
    """Worker: one run -> its tidy rows; writes the resolved config beside the results."""
    from sparsebalance.analysis.sweep import summarize
    from sparsebalance.commands._common import run_simulation
    from sparsebalance.runconfig import dump_toml

    rid, base, run, extra, base_dir, out = job
    cfg = _config(base, run, extra, base_dir)
    (Path(out) / "configs" / f"{rid}.toml").write_text(dump_toml(cfg))
    metrics = summarize(run_simulation(cfg, progress=False).metrics)
    coords = coordinates(run)
    return [{"run_id": rid, **coords, "metric": m, "value": v} for m, v in metrics.items()]


def run(args) -> int:
    from tqdm import tqdm

    from sparsebalance.analysis.sweep import METRICS, wide, with_speedup
    METRIC_COLUMNS = set(METRICS) | {"speedup"}
    from sparsebalance.runconfig import RunConfig, load_run_config

    axes, baseline, extra, base_path = load_grid(args)
    base_cfg = load_run_config(base_path) if base_path else RunConfig()
    base = base_cfg.to_dict()
    base.pop("base_dir", None)
    runs = expand(axes, baseline)
    for r in runs:  # validate every run before starting any (names, ranges, shapes)
        cfg = _config(base, r, extra, base_cfg.base_dir)
        from sparsebalance.policies.registry import make_batching, make_tuning
        make_batching(cfg.policy), make_tuning(cfg.policy)
    out = Path(args.out)
    (out / "configs").mkdir(parents=True, exist_ok=True)
    table = out / "results.csv"
    done = pd.read_csv(table) if table.is_file() else pd.DataFrame()
    done_ids = set(done["run_id"]) if len(done) else set()
    jobs = [(run_id(r), base, r, extra, base_cfg.base_dir, str(out)) for r in runs
            if run_id(r) not in done_ids]
    rows = done[done.metric != "speedup"].to_dict("records") if len(done) else []
    print(f"sweep: {len(runs)} runs, {len(runs) - len(jobs)} already in {table}, {len(jobs)} to run")
    bar = tqdm(total=len(jobs), desc="sweep", disable=args.no_progress)

    def save() -> pd.DataFrame:
        df = pd.DataFrame(rows)
        df.to_csv(table, index=False)
        return df

    if args.jobs > 1 and len(jobs) > 1:
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(run_one, j) for j in jobs]
            for f in as_completed(futures):
                rows.extend(f.result())
                save()
                bar.update()
    else:
        for j in jobs:
            rows.extend(run_one(j))
            save()
            bar.update()
    bar.close()
    df = with_speedup(save(), {k.split(".")[-1]: v for k, v in baseline.items()})
    df.to_csv(table, index=False)
    summary = wide(df)
    order = [c for c in summary.columns if c not in ("run_id",) and c not in METRIC_COLUMNS]
    summary = summary.sort_values(order, na_position="first", kind="stable").reset_index(drop=True)
    summary.to_csv(out / "summary.csv", index=False)
    (out / "grid.json").write_text(json.dumps({"axes": axes, "baseline": baseline, "extra": extra,
                                               "base": base_path}, indent=2, default=str))
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(summary.drop(columns=["run_id"]).round(4).to_string(index=False))
    print(f"results: {table}  summary: {out / 'summary.csv'}")
    _print_over_seeds(summary, METRIC_COLUMNS, out)
    return 0


def _print_over_seeds(summary: pd.DataFrame, values, out: Path) -> None:
    """Speedup and imbalance per grid point over its seeds: mean, 95 % CI, per-seed min/max
    (statistics in analysis/stats.py); written to summary_ci.csv."""
    from sparsebalance.analysis.stats import over_seeds

    ci = over_seeds(summary, values)
    if ci is None or ci["n_seeds"].max() < 2:
        return
    ci.to_csv(out / "summary_ci.csv", index=False)
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print("over seeds (mean, 95 % CI, per-seed min/max):")
        print(ci.round(4).to_string(index=False))
    print(f"per grid point: {out / 'summary_ci.csv'}")
