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
anchor_scope, per_layer) and are run once. ``--config`` names the base when the grid file does not
(naming a different one is an error).

Crash safety (docs/reliability.md): every finished run is appended to ``<out>/runs.sqlite``
(``analysis/store.py``: SQLite WAL, one transaction per run) by this process; ``results.csv``
(tidy: run x metric), ``summary.csv`` (one row per run), ``timing.csv`` (wall clock: decision_ms,
wall_s) and ``grid.json`` are rebuilt from it atomically, during the sweep and at its end.
``configs/<run_id>.toml`` holds each resolved config. A run's id hashes its full resolved config
(``sweep_exec.run_id``), so a re-run into the same ``--out`` skips exactly the runs already done
with the same settings and runs any whose settings changed. Ctrl-C or SIGTERM stops the workers at
once and keeps every finished run; re-running the same command finishes the sweep. Runs execute
through ``sweep_exec.LocalBackend`` (``--jobs`` processes).
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from sparsebalance.commands._args import (
    add_config,
    add_out,
    add_output_flags,
    positive_int,
    progress_enabled,
    resolve_out,
)
from sparsebalance.errors import ConfigError

DST_KEYS = ("policy.anchor", "policy.p", "policy.anchor_scope", "policy.per_layer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config(p, required=False,
               help="base run config (TOML); default: the grid file's `base`, else the built-in "
                    "defaults (naming a different base than the grid's is an error)")
    p.add_argument("--grid", metavar="FILE", help="grid file (TOML; docs/formats.md)")
    p.add_argument("--batching", help="comma-separated batching policies")
    p.add_argument("--tuning", help="comma-separated tuning policies")
    p.add_argument("--anchor", help="comma-separated DST anchors (mean, min, max)")
    p.add_argument("--p", help="comma-separated DST thresholds in (0, 1)")
    p.add_argument("--seeds", help="comma-separated seeds")
    p.add_argument("--clusters", help="comma-separated DPxPP shapes, e.g. 2x4,4x2")
    p.add_argument("--iterations", type=positive_int, help="iterations per run")
    p.add_argument("--baseline", default=None,
                   help="BATCHING+TUNING speedup is measured against (default sequential+fixed)")
    p.add_argument("--allow-nonmonotone", action="store_true",
                   help="use a profile whose latency falls as work grows (a warning lists the points)")
    p.add_argument("--jobs", type=positive_int, default=1, help="worker processes (default 1)")
    add_out(p, "results/sweep; a sweep directory is resumed, --force starts it afresh")
    add_output_flags(p)


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
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--grid: cannot read {path}: {e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--grid: {path} is not valid TOML: {e}") from None
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
    for key, (text, conv) in flag_axes.items():
        if text:
            axes[key] = _split(text, conv)
    if any(s < 0 for s in axes.get("seed", [])):
        raise ConfigError(f"--seeds: seeds must be integers >= 0, got {axes['seed']}")
    if args.clusters:
        axes["cluster"] = [_shape(t) for t in _split(args.clusters)]
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
    p = Path(path)
    text = p.read_text()
    return (json.loads(text) if p.suffix == ".json" else tomllib.loads(text)), cfg.base_dir


def plan_runs(args) -> tuple[list, dict[str, Any], dict[str, Any]]:
    """(specs, grid description for grid.json, baseline coordinates); every run validated."""
    from sparsebalance.commands.sweep_exec import make_spec
    from sparsebalance.policies.registry import make_batching, make_tuning
    from sparsebalance.runner import prepare

    axes, baseline, extra, base_path = load_grid(args)
    base, base_dir = _base_table(base_path)
    specs, seen, prepared = [], set(), set()
    for run in expand(axes, baseline):  # validate every run before starting any
        cfg = build_config(base, run, extra, base_dir)
        make_batching(cfg.policy), make_tuning(cfg.policy)
        key = json.dumps([cfg.profile, cfg.model, cfg.cluster, cfg.data], default=str)
        if key not in prepared:  # data, profile: checked once per distinct input
            prepared.add(key)
            prepare(cfg)
        spec = make_spec(cfg, coordinates(run))
        if spec.run_id not in seen:
            seen.add(spec.run_id)
            specs.append(spec)
    grid = {"axes": axes, "baseline": baseline, "extra": extra, "base": base_path,
            "run_ids": [s.run_id for s in specs]}
    return specs, grid, {k.split(".")[-1]: v for k, v in baseline.items()}


def _is_sweep_dir(p: Path) -> bool:
    from sparsebalance.analysis.store import ResultStore

    return ResultStore.exists(p)


def _legacy_sweep_dir(p: Path) -> bool:  # written before the store existed: results.csv + configs/
    return (p / "results.csv").is_file() and (p / "configs").is_dir()


class _Exporter:
    """Rebuilds results.csv / summary.csv / timing.csv from the store, atomically, at most every
    ``every_s`` seconds during the sweep (and once at the end)."""

    def __init__(self, store, out: Path, ids: list[str], baseline: dict[str, Any], every_s: float = 2.0):
        self.store, self.out, self.ids, self.baseline = store, out, ids, baseline
        self.every_s, self.last = every_s, 0.0

    def maybe(self) -> None:
        if time.monotonic() - self.last >= self.every_s:
            self.now()

    def now(self):
        import pandas as pd

        from sparsebalance.analysis.sweep import METRICS, tidy, timing_table, wide, with_speedup
        from sparsebalance.fsutil import atomic_to_csv

        self.last = time.monotonic()
        order = {rid: i for i, rid in enumerate(self.ids)}
        records = sorted(self.store.records(self.ids), key=lambda r: order[r.run_id])
        if not records:
            return None
        df = with_speedup(tidy(records), self.baseline)
        atomic_to_csv(df, self.out / "results.csv")
        atomic_to_csv(timing_table(records), self.out / "timing.csv")
        summary = wide(df)
        skip = {"run_id", "speedup", *METRICS}
        order_cols = [c for c in summary.columns if c not in skip]
        summary = summary.sort_values(order_cols, na_position="first", kind="stable").reset_index(drop=True)
        atomic_to_csv(summary, self.out / "summary.csv")
        return pd.DataFrame(summary)


def run(args) -> int:
    from tqdm import tqdm

    from sparsebalance.analysis.store import ResultStore
    from sparsebalance.commands.sweep_exec import LocalBackend, RunFailure
    from sparsebalance.fsutil import atomic_write_json, atomic_write_text

    specs, grid, baseline = plan_runs(args)
    out = resolve_out(args.out, "results/sweep", force=args.force, verb="sweep",
                      reuse=_is_sweep_dir, ours=_legacy_sweep_dir)
    lock = open(out / ".sweep.lock", "w")  # noqa: SIM115  (held for the whole sweep)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(f"--out: another sweep is writing to {out}; wait for it or choose another "
                          "--out") from None
    (out / "configs").mkdir(exist_ok=True)
    store = ResultStore(out)
    try:
        done = store.ids()
        todo = [s for s in specs if s.run_id not in done]
        atomic_write_json(out / "grid.json", grid, indent=2, default=str)
        print(f"sweep: {len(specs)} runs, {len(specs) - len(todo)} already in {store.path}, "
              f"{len(todo)} to run", flush=True)
        export = _Exporter(store, out, grid["run_ids"], baseline)
        failures: list[RunFailure] = []
        bar = tqdm(total=len(todo), desc="sweep", disable=not progress_enabled(args), file=sys.stderr)
        try:
            for spec, result in LocalBackend(args.jobs).execute(todo):
                if isinstance(result, RunFailure):
                    failures.append(result)
                else:
                    store.append(result)
                    atomic_write_text(out / "configs" / f"{spec.run_id}.toml", result.config)
                    export.maybe()
                bar.update()
        except KeyboardInterrupt:
            bar.close()
            export.now()
            print(f"sweep: stopped; {len(store.ids() & set(grid['run_ids']))} of {len(specs)} runs are "
                  f"in {store.path} (results.csv rebuilt); the same command finishes the sweep",
                  file=sys.stderr)
            raise
        bar.close()
        summary = export.now()
    finally:
        store.close()
        lock.close()
    for f in failures[:10]:
        print(f"sweep: run {f.run_id} failed: {f.error}", file=sys.stderr)
    if summary is not None:
        import pandas as pd

        with pd.option_context("display.width", 160, "display.max_columns", 20):
            print(summary.drop(columns=["run_id"]).round(4).to_string(index=False))
    print(f"results: {out / 'results.csv'}  summary: {out / 'summary.csv'}  timing: {out / 'timing.csv'}")
    if failures:
        print(f"sweep: {len(failures)} run(s) failed (not stored; the same command retries them)",
              file=sys.stderr)
        return 1
    return 0
