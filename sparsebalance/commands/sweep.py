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
wall_s), ``warnings.csv`` (run x warning that changes what its numbers mean; their texts in
``summary.json``) and ``grid.json`` are rebuilt from it atomically, during the sweep and at its end.
``configs/<run_id>.toml`` holds each resolved config. A run's id hashes its full resolved config
(``sweep_exec.run_id``), so a re-run into the same ``--out`` skips exactly the runs already done
with the same settings and runs any whose settings changed. Ctrl-C or SIGTERM stops the workers at
once and keeps every finished run; re-running the same command finishes the sweep. Runs execute
through ``sweep_exec.LocalBackend`` (``--jobs`` processes) or, with ``--backend ray``, as Ray
tasks (``sweep_ray.RayBackend``: an embedded Ray with ``--jobs`` CPUs, or the cluster at
``--address``); the coordinating process stores records the same way, so results, resume and
progress are the same.
"""

from __future__ import annotations

import argparse
import fcntl
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from sparsebalance.commands._args import (
    MARKER,
    add_config,
    add_out,
    add_output_flags,
    positive_int,
    progress_enabled,
    resolve_out,
)
from sparsebalance.commands.sweep_grid import (  # noqa: F401  (expand, load_grid: public here too)
    coordinates,
    expand,
    load_grid,
    plan_runs,
)
from sparsebalance.errors import ConfigError, MeaningWarning


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
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="worker processes (default 1); with --backend ray and no --address, the CPUs "
                        "of the embedded Ray (default: all)")
    p.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="run points as local processes (default) or as Ray tasks (extra [cluster])")
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="with --backend ray: join the Ray cluster at HOST:PORT (default: start an "
                        "embedded one here)")
    add_out(p, "results/sweep; a sweep directory is resumed, --force starts it afresh")
    add_output_flags(p)


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
        self._warnings(records)
        return pd.DataFrame(summary)

    def _warnings(self, records) -> None:
        """``warnings.csv`` (run_id, coordinates, warning: one row per run x warning that changes what
        its numbers mean) and their distinct texts in ``summary.json``'s ``warnings``."""
        import pandas as pd

        from sparsebalance.commands._warnings import SUMMARY
        from sparsebalance.fsutil import atomic_to_csv, atomic_write_json

        rows = [{"run_id": r.run_id, **r.coords, "warning": w} for r in records for w in r.warnings or ()]
        df = pd.DataFrame(rows, columns=None if rows else ["run_id", "warning"])
        atomic_to_csv(df[[c for c in df.columns if c != "warning"] + ["warning"]], self.out / "warnings.csv")
        texts = list(dict.fromkeys(df["warning"]))
        atomic_write_json(self.out / SUMMARY, {"runs": len(records), "warnings": texts}, indent=2)


def run(args) -> int:
    from tqdm import tqdm

    from sparsebalance.analysis.store import ResultStore
    from sparsebalance.commands.sweep_exec import RunFailure
    from sparsebalance.commands.sweep_ray import make_backend
    from sparsebalance.fsutil import atomic_write_json, atomic_write_text

    specs, grid, baseline = plan_runs(args)
    backend = make_backend(args.backend, args.address, args.jobs)  # checked before any output
    if not args.force:  # a runs.sqlite that is no file: refused before the directory is touched
        ResultStore.check_not_other(args.out or "results/sweep")
    out = resolve_out(args.out, "results/sweep", force=args.force, verb="sweep",
                      reuse=lambda p: _is_sweep_dir(p) or _legacy_sweep_dir(p), ours=_legacy_sweep_dir)
    if _legacy_sweep_dir(out) and not _is_sweep_dir(out):
        print(f"sweep: {out} was written before the run store existed: its runs are run again and "
              "its tables replaced", file=sys.stderr)
    fresh = {c.name for c in out.iterdir()} <= {MARKER}  # this call made it: undone if no run is stored
    lock = open(out / ".sweep.lock", "w")  # noqa: SIM115  (held for the whole sweep)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(f"--out: another sweep is writing to {out}; wait for it or choose another "
                          "--out") from None
    (out / "configs").mkdir(exist_ok=True)
    for tmp in [*out.glob(".*.tmp"), *(out / "configs").glob(".*.tmp")]:
        tmp.unlink()  # a rename a kill interrupted: the complete file it was replacing is still there
    store = ResultStore(out, create=True)
    undo = False
    try:
        done = store.ids()
        todo = [s for s in specs if s.run_id not in done]
        atomic_write_json(out / "grid.json", grid, indent=2, default=str)
        print(f"sweep: {len(specs)} runs, {len(specs) - len(todo)} already in {store.path}, "
              f"{len(todo)} to run", flush=True)
        export = _Exporter(store, out, grid["run_ids"], baseline)
        failures: list[RunFailure] = []
        bar = tqdm(total=len(todo), desc="sweep", disable=not progress_enabled(args), file=sys.stderr)
        runs = backend.execute(todo)
        try:
            for spec, result in runs:
                if isinstance(result, RunFailure):
                    failures.append(result)
                else:
                    for text in result.warnings or ():  # shown; under --strict an error, not stored
                        warnings.warn(text, MeaningWarning, stacklevel=1)
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
        finally:
            runs.close()  # an error (a full disk): workers end now, not when the traceback is freed
        bar.close()
        summary = export.now()
    except BaseException:  # refused (--strict), failed or stopped before its first run was stored
        undo = fresh and _stored_nothing(store)
        raise
    finally:
        store.close()
        lock.close()
        if undo:
            _unmake(out)
    for f in failures[:10]:
        print(f"sweep: run {f.run_id} failed: {f.error}", file=sys.stderr)
    if summary is not None:
        import pandas as pd

        with pd.option_context("display.width", 160, "display.max_columns", 20):
            print(summary.drop(columns=["run_id"]).round(4).to_string(index=False))
    print(f"results: {out / 'results.csv'}  summary: {out / 'summary.csv'}  timing: {out / 'timing.csv'}")
    if summary is not None:
        _print_over_seeds(summary, out)
    if failures:
        print(f"sweep: {len(failures)} run(s) failed (not stored; the same command retries them)",
              file=sys.stderr)
        return 1
    return 0


def _stored_nothing(store) -> bool:
    try:
        return len(store) == 0
    except (ConfigError, OSError):  # a store that cannot say (a full disk): kept as it is
        return False


def _unmake(out: Path) -> None:
    """Undo what a fresh sweep made before any run was stored (store, grid.json, configs/, lock), so
    that the CLI removes the directory, then holding only its marker: a sweep refused (``--strict``) or
    stopped before its first result leaves nothing behind."""
    import contextlib

    from sparsebalance.analysis.store import FILENAME

    for name in (FILENAME, f"{FILENAME}-wal", f"{FILENAME}-shm", "grid.json", ".sweep.lock"):
        (out / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        (out / "configs").rmdir()


def _print_over_seeds(summary, out: Path) -> None:
    """Speedup and imbalance per grid point over its seeds: mean, 95 % CI, per-seed min/max
    (statistics in analysis/stats.py); written to summary_ci.csv."""
    import pandas as pd

    from sparsebalance.analysis.stats import over_seeds
    from sparsebalance.analysis.sweep import METRICS
    from sparsebalance.fsutil import atomic_to_csv

    ci = over_seeds(summary, {"speedup", *METRICS})
    if ci is None or ci["n_seeds"].max() < 2:
        return
    atomic_to_csv(ci, out / "summary_ci.csv")
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print("over seeds (mean, 95 % CI, per-seed min/max):")
        print(ci.round(4).to_string(index=False))
    print(f"per grid point: {out / 'summary_ci.csv'}")
