"""``sparsebalance accuracy [pretrain]``: does DST keep accuracy? (long-context recall, tiny model, CPU)

``sparsebalance accuracy pretrain`` trains the base model (``accuracy/pretrain.py``) and writes a
checkpoint (default ``results/accuracy/checkpoint``; the shipped one is
``sparsebalance/data/checkpoints/recall-tiny``, made by that command, see its checkpoint.json).

``sparsebalance accuracy`` continues that checkpoint under every configuration (``accuracy/
experiment.py``: dense, fixed k0, SAB + DST x anchors x p) for the same steps, seeds and data
order, evaluates each per length bucket and writes ``rows.csv`` (config x seed x bucket),
``summary.csv`` (mean and 95 % CI over seeds), ``accuracy_vs_speedup.png``/``.svg`` and
``config.json`` under ``--out``. ``--quick``: fixed and MEAN0.1, one seed, 24 steps. ``--json``
prints the rows ``{config, anchor, p, seed, bucket, accuracy, mean_budget, coverage, cpu_time_s,
sim_speedup}`` only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sparsebalance.data.sequence import blocks


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sparsebalance.commands._args import add_out, add_output_flags, positive_int

    p.add_argument("stage", nargs="?", default="run", choices=("run", "pretrain"),
                   help="run the experiment (default) or pretrain the base model")
    p.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="checkpoint directory (run: default the shipped one; pretrain: where to write, "
                        "default results/accuracy/checkpoint)")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="experiment settings (TOML): any of steps, seeds, anchors, ps, base, k0, lr, pool, "
                        "buckets, heldout, coverage_agg, global_batch, scale, token_cap; flags given on "
                        "the command line override it")
    add_out(p, "results/accuracy")
    p.add_argument("--json", action="store_true", help="print the result rows as JSON (stdout) only")
    add_output_flags(p)
    g = p.add_argument_group("run")
    g.add_argument("--quick", action="store_true", help="fixed and DST MEAN0.1, one seed, 24 steps")
    g.add_argument("--jobs", type=positive_int, default=1, help="configurations run in parallel (processes)")
    g.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2)")
    g.add_argument("--steps", type=positive_int, default=None, help="continuation steps (default 96)")
    g.add_argument("--anchors", default=None, help="DST anchors (default mean,min,max)")
    g.add_argument("--ps", default=None, help="DST thresholds p (default 0.1,0.2,0.3)")
    g.add_argument("--k0", type=positive_int, default=None, help="default budget in blocks (default 8)")
    g.add_argument("--buckets", default=None, help="held-out lengths (default 64,256,1024)")
    g.add_argument("--heldout", type=int, default=None, help="held-out examples per bucket (default 64)")
    g.add_argument("--coverage-agg", default=None, help="micro-batch coverage: tokens (default) or min")
    g.add_argument("--base", default=None,
                   help="reference configurations run besides DST (default dense,fixed; fixed is the "
                        "speedup reference)")
    g = p.add_argument_group("pretrain")
    g.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help="most dense steps on short examples (default 8000; stops at --target)")
    g.add_argument("--moba-steps", type=int, default=None, help="MoBA steps on the full mix (default 1500)")
    g.add_argument("--extra-steps", type=int, default=None,
                   help="most further MoBA steps while below --target (default 1500)")
    g.add_argument("--target", type=float, default=None, help="stop at this shortest-bucket accuracy")


def _list(text: str, name: str, conv=str) -> tuple:
    from sparsebalance.commands._args import comma_list

    return tuple(comma_list(text, f"--{name}", conv))


def _config_file(path: str) -> dict:
    """ExperimentConfig fields from a TOML file, checked: unknown keys and bad types are one line."""
    import dataclasses
    import tomllib

    from sparsebalance.accuracy.experiment import ExperimentConfig
    from sparsebalance.errors import ConfigError

    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config: {path} is not valid TOML: {e}") from None
    fields = {f.name: f for f in dataclasses.fields(ExperimentConfig)}
    out = {}
    for key, val in raw.items():
        if key not in fields:
            raise ConfigError(f"--config: unknown key {key!r}; allowed: {', '.join(sorted(fields))}")
        want = fields[key].default
        if isinstance(want, tuple):
            if not isinstance(val, list) or not val:
                raise ConfigError(f"--config: {key} must be a non-empty list, got {val!r}")
            val = tuple(val)
            kind = type(want[0])
            if not all(isinstance(v, kind) or (kind is float and isinstance(v, int)) for v in val):
                raise ConfigError(f"--config: {key} must be a list of {kind.__name__}, got {list(val)!r}")
        elif isinstance(val, bool) or not isinstance(val, (float, int) if isinstance(want, float)
                                                     else type(want)):
            raise ConfigError(f"--config: {key} must be {type(want).__name__}, got {val!r}")
        out[key] = val
    return out


def _experiment(args):

    from sparsebalance.accuracy.experiment import ExperimentConfig, quick

    over = _config_file(args.config) if args.config else {}
    for flag, conv in (("seeds", int), ("anchors", str), ("ps", float), ("base", str)):
        if getattr(args, flag) is not None:
            over[flag] = _list(getattr(args, flag), flag, conv)
    for flag, key in (("steps", "steps"), ("k0", "k0"), ("heldout", "heldout"),
                      ("coverage_agg", "coverage_agg")):
        if getattr(args, flag) is not None:
            over[key] = getattr(args, flag)
    if args.buckets is not None:
        over["buckets"] = _list(args.buckets, "buckets", int)
    cfg = ExperimentConfig(**over)
    return quick(cfg) if args.quick else cfg


def _pretrain(args) -> int:
    from dataclasses import replace

    from sparsebalance.accuracy.model import NetConfig
    from sparsebalance.accuracy.pretrain import PretrainConfig, pretrain
    from sparsebalance.data.recall import RecallConfig

    over = {k: getattr(args, k) for k in ("warmup_steps", "moba_steps", "extra_steps", "target", "k0")
            if getattr(args, k) is not None}
    cfg = replace(PretrainConfig(), **over)
    net = NetConfig(seed=args.seed)
    task = RecallConfig(seed=args.seed)
    buckets = list(_list(args.buckets, "buckets", int)) if args.buckets else [64, 256, 1024]
    from sparsebalance.accuracy.experiment import ExperimentConfig, check_buckets

    check_buckets(replace(ExperimentConfig(), buckets=tuple(buckets)), task, net.max_positions)
    from sparsebalance.errors import check

    out = Path(args.checkpoint or "results/accuracy/checkpoint")
    check(args.force or not (out / "checkpoint.json").exists(), "--checkpoint",
          f"{out} already holds a checkpoint; pass --force to replace it")
    command = "sparsebalance accuracy " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["accuracy"] else
                                                   sys.argv[1:])
    # progress lines unless refused (pretraining runs for tens of minutes, usually into a log file)
    log = (lambda m: None) if args.progress is False else (lambda m: print(m, file=sys.stderr, flush=True))
    rec = pretrain(net, task, cfg, buckets, out, command.strip(), log=log)
    print(json.dumps({k: rec[k] for k in ("steps", "cpu_time_s", "wall_time_s", "heldout_accuracy",
                                          "coverage_layer", "coverage_rate")}, default=str))
    return 0


def run(args) -> int:
    from sparsebalance.commands._args import resolve_out
    from sparsebalance.errors import check

    if args.stage == "pretrain":
        return _pretrain(args)
    from sparsebalance.accuracy.experiment import check_buckets, grid, rows, run_job, to_json
    from sparsebalance.accuracy.model import check_task_fits, load

    cfg = _experiment(args)
    ckpt = load(args.checkpoint)
    for key in ("coverage_rate", "coverage_layer"):
        check(key in ckpt.meta, f"checkpoint.{key}", "missing (re-run `sparsebalance accuracy pretrain`)")
    check_task_fits(ckpt, list(cfg.buckets))
    check_buckets(cfg, ckpt.task, ckpt.net.max_positions)
    ckpt.load_model()  # weights that do not fit fail here, once, not in every worker
    B = ckpt.net.dims.block_size
    dense_k = blocks(max(ckpt.task.max_length, *cfg.buckets), B)
    jobs = grid(cfg, dense_k)
    out = resolve_out(args.out, "results/accuracy", force=args.force, verb="accuracy")
    t0 = time.time()
    results = _run_all([(j, cfg, args.checkpoint) for j in jobs], args, run_job, out / "jobs.jsonl")
    import pandas as pd

    from sparsebalance.analysis import accuracy as A

    df = pd.DataFrame(rows(results))
    df.to_csv(out / "rows.csv", index=False)
    summary = A.summarize_rows(df)
    summary.to_csv(out / "summary.csv", index=False)
    (out / "summary.md").write_text(A.markdown_table(summary) + "\n")
    A.plot_accuracy_vs_speedup(summary, out / "accuracy_vs_speedup")
    from dataclasses import asdict

    (out / "config.json").write_text(json.dumps(
        {"experiment": asdict(cfg), "checkpoint": str(ckpt.path), "checkpoint_steps": ckpt.meta.get("steps"),
         "coverage_layer": ckpt.meta["coverage_layer"], "coverage_rate": ckpt.meta["coverage_rate"],
         "wall_time_s": round(time.time() - t0, 1),
         "cpu_time_s_total": round(sum(r["cpu_time_s"] for r in results), 1)}, indent=2, default=str))
    if args.json:
        print(to_json(df.to_dict("records")))
        return 0
    print(A.format_summary(summary))
    print(f"rows: {out / 'rows.csv'}  summary: {out / 'summary.csv'}  "
          f"figure: {out / 'accuracy_vs_speedup.png'}  ({time.time() - t0:.0f} s)")
    return 0


def _run_all(jobs: list, args, fn, log: Path | None = None) -> list[dict]:
    """Run the jobs (in ``--jobs`` spawned processes), reporting each finished one on stderr and
    appending its whole result to ``log`` (JSON lines) as it finishes, so that an interrupted
    experiment keeps the runs it finished."""
    quiet = args.json or args.progress is False  # one line per finished run, unless refused
    done = []
    if log is not None:
        log.write_text("")

    def report(r: dict) -> None:
        done.append(r)
        if log is not None:
            with log.open("a") as f:
                f.write(json.dumps(r, default=str) + "\n")
        if not quiet:
            j = r["job"]
            print(f"accuracy: {len(done)}/{len(jobs)} {j['config']} seed {j['seed']}: "
                  + " ".join(f"{b}:{a:.3f}" for b, a in r["accuracy"].items())
                  + f" budget {r['mean_budget']:.2f} coverage {r['coverage']:.3f} "
                    f"cpu {r['cpu_time_s']:.0f}s", file=sys.stderr, flush=True)

    if args.jobs > 1 and len(jobs) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
            for f in as_completed([pool.submit(fn, j) for j in jobs]):
                report(f.result())
    else:
        for j in jobs:
            report(fn(j))
    order = {(j[0].config, j[0].seed): i for i, j in enumerate(jobs)}
    return sorted(done, key=lambda r: order[(r["job"]["config"], r["job"]["seed"])])
