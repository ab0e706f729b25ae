"""``sparsebalance accuracy [pretrain]``: does DST keep accuracy, at speed? (long-context recall, tiny
model, CPU)

``sparsebalance accuracy`` (``--executor realrun``, the default) runs the measured grid
(``accuracy/measured.py``: fixed k0, SAB-fixed, SAB + DST and LBB + DST x anchors x p, FREE) on the
real run's PP 2 workers on gloo, one torchrun launch per seed, from the shipped long-context
checkpoint ``sparsebalance/data/checkpoints/recall-long``: every arm's iteration times (measured and
simulated) and its held-out accuracy come from the same runs (``commands/_accuracy_measured.py``
lists the files). ``--quick``: fixed and MEAN0.1, one seed, 4 iterations, 4 held-out examples per
bucket.

``--executor single`` runs the earlier experiment (``accuracy/experiment.py``): a single-process
trainer on the short checkpoint ``recall-tiny`` (64-1,024 tokens) whose speed is the H200
simulation of its plans; it writes ``rows.csv``, ``summary.csv``, ``accuracy_vs_speedup.png`` and
``config.json``; ``--json`` prints its rows ``{config, anchor, p, seed, bucket, accuracy,
mean_budget, coverage, cpu_time_s, sim_speedup}``.

``sparsebalance accuracy pretrain`` trains a base model (``accuracy/pretrain.py``) and writes a
checkpoint (default ``results/accuracy/checkpoint``); the shipped ones were made by that command
(see their checkpoint.json).
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
                   help="experiment settings (TOML): the fields of accuracy/measured.py's MeasuredConfig "
                        "(realrun) or experiment.py's ExperimentConfig (single); flags given on the "
                        "command line override it")
    p.add_argument("--executor", choices=("realrun", "single"), default="realrun",
                   help="realrun (default): the measured grid on the real run's PP 2 workers; single: the "
                        "earlier single-process trainer with simulated H200 speed")
    add_out(p, "results/accuracy")
    p.add_argument("--json", action="store_true", help="print the result rows as JSON (stdout) only")
    add_output_flags(p)
    g = p.add_argument_group("run")
    g.add_argument("--quick", action="store_true",
                   help="fixed and SAB + DST MEAN0.1, one seed, a short continuation")
    g.add_argument("--resume", action="store_true",
                   help="realrun: keep the seeds a previous call finished in --out, run the others")
    g.add_argument("--jobs", type=positive_int, default=1,
                   help="single: configurations run in parallel (processes)")
    g.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2)")
    g.add_argument("--iterations", type=positive_int, default=None,
                   help="realrun: iterations per arm (default 8; the first is left out of the speeds)")
    g.add_argument("--batchings", default=None, help="realrun: batching of the DST arms (default sab,lbb)")
    g.add_argument("--steps", type=positive_int, default=None, help="single: continuation steps (default 96)")
    g.add_argument("--anchors", default=None, help="DST anchors (default mean,min,max)")
    g.add_argument("--ps", default=None, help="DST thresholds p (default 0.1,0.2,0.3)")
    g.add_argument("--k0", type=positive_int, default=None,
                   help="default budget in blocks (realrun default 32, single 8)")
    g.add_argument("--buckets", default=None,
                   help="held-out lengths (realrun default 1024,4096,8192; single 64,256,1024)")
    g.add_argument("--heldout", type=int, default=None,
                   help="held-out examples per bucket (realrun default 8, single 64)")
    g.add_argument("--coverage-agg", default=None, help="micro-batch coverage: tokens (default) or min")
    g.add_argument("--base", default=None,
                   help="reference arms besides DST (realrun: fixed,SAB-fixed,fixed-dense,FREE; single: dense,fixed; "
                        "fixed is the speedup reference)")
    g = p.add_argument_group("pretrain")
    g.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help="most dense steps on short examples (default 8000; stops at --target)")
    g.add_argument("--moba-steps", type=int, default=None, help="MoBA steps on the full mix (default 1500)")
    g.add_argument("--extra-steps", type=int, default=None,
                   help="most further MoBA steps while below --target (default 1500)")
    g.add_argument("--target", type=float, default=None, help="stop at this shortest-bucket accuracy")
    g.add_argument("--init", metavar="DIR", default=None,
                   help="continue this checkpoint (a directory, or a shipped name: recall-tiny, recall-long) "
                        "instead of training from scratch: the dense warm-up is skipped")
    g.add_argument("--rope-theta", type=float, default=None, help="RoPE base of the model (default 10000)")
    g.add_argument("--max-positions", type=positive_int, default=None,
                   help="longest sequence the model takes (default 2048)")
    g.add_argument("--min-length", type=positive_int, default=None, help="shortest training example (default 64)")
    g.add_argument("--max-length", type=positive_int, default=None, help="longest training example (default 1024)")
    g.add_argument("--tail", type=float, default=None, help="Pareto exponent of the length mix (default 0.5)")
    g.add_argument("--moba-batch", type=positive_int, default=None, help="examples per MoBA step (default 16)")
    g.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 3e-3)")
    g.add_argument("--lr-warmup", type=int, default=None, help="steps of learning-rate warm-up (default 100)")
    g.add_argument("--coverage-layer-rule", choices=("flattest", "sharpest"), default=None,
                   help="the layer DST watches: lowest (default) or highest coverage at k0")


def _list(text: str, name: str, conv=str) -> tuple:
    from sparsebalance.commands._args import comma_list

    return tuple(comma_list(text, f"--{name}", conv))


def _config_file(path: str, cls) -> dict:
    """``cls`` fields (MeasuredConfig or ExperimentConfig) from a TOML file, checked: unknown keys and
    bad types are one line."""
    import dataclasses
    import tomllib

    from sparsebalance.errors import ConfigError

    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config: {path} is not valid TOML: {e}") from None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for key, val in raw.items():
        if key not in fields:
            raise ConfigError(f"--config: unknown key {key!r}; allowed: {', '.join(sorted(fields))}")
        want = fields[key].default
        if want is None:  # an optional int (token_cap)
            want = 0
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
    """The experiment's config from --config and the flags (MeasuredConfig for realrun,
    ExperimentConfig for single); a flag of the other executor is one line."""
    from sparsebalance.errors import ConfigError

    single = args.executor == "single"
    if single:
        from sparsebalance.accuracy.experiment import ExperimentConfig as cls
        from sparsebalance.accuracy.experiment import quick
    else:
        from sparsebalance.accuracy.measured import MeasuredConfig as cls
        from sparsebalance.accuracy.measured import quick
    other = ("iterations", "batchings", "resume") if single else ("steps", "jobs")
    for flag in other:
        val = getattr(args, flag)
        if val not in (None, False) and not (flag == "jobs" and val == 1):
            raise ConfigError(f"--{flag}: not an option of --executor {args.executor}")
    over = _config_file(args.config, cls) if args.config else {}
    for flag, conv in (("seeds", int), ("anchors", str), ("ps", float), ("base", str), ("batchings", str)):
        if getattr(args, flag, None) is not None:
            over[flag] = _list(getattr(args, flag), flag, conv)
    for flag in ("steps", "iterations", "k0", "heldout", "coverage_agg"):
        if getattr(args, flag, None) is not None:
            over[flag] = getattr(args, flag)
    if args.buckets is not None:
        over["buckets"] = _list(args.buckets, "buckets", int)
    cfg = cls(**over)
    return quick(cfg) if args.quick else cfg


def _pretrain(args) -> int:
    from dataclasses import replace

    from sparsebalance.accuracy.model import NetConfig
    from sparsebalance.accuracy.pretrain import PretrainConfig, pretrain
    from sparsebalance.data.recall import RecallConfig

    over = {k: getattr(args, k) for k in ("warmup_steps", "moba_steps", "extra_steps", "target", "k0", "moba_batch",
                                          "lr", "lr_warmup", "coverage_layer_rule", "heldout")
            if getattr(args, k) is not None}
    cfg = replace(PretrainConfig(), **over)
    init = None
    if args.init is not None:
        from sparsebalance.accuracy.model import load, shipped_path

        shipped = shipped_path(args.init)
        init = load(shipped if "/" not in args.init and shipped.is_dir() else args.init)
    net = replace(init.net if init else NetConfig(), seed=args.seed,
                  **{k: getattr(args, k) for k in ("rope_theta", "max_positions") if getattr(args, k) is not None})
    task = replace(init.task if init else RecallConfig(), seed=args.seed,
                   **{k: getattr(args, k) for k in ("min_length", "max_length", "tail") if getattr(args, k) is not None})
    buckets = list(_list(args.buckets, "buckets", int)) if args.buckets else [64, 256, 1024]
    from sparsebalance.accuracy.experiment import ExperimentConfig, check_buckets
    from sparsebalance.errors import check

    check(task.max_length <= net.max_positions, "--max-length",
          f"must be <= the model's positions ({net.max_positions}; --max-positions), got {task.max_length}")
    check_buckets(replace(ExperimentConfig(), buckets=tuple(buckets)), task, net.max_positions)

    out = Path(args.checkpoint or "results/accuracy/checkpoint")
    check(args.force or not (out / "checkpoint.json").exists(), "--checkpoint",
          f"{out} already holds a checkpoint; pass --force to replace it")
    command = "sparsebalance accuracy " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["accuracy"] else
                                                   sys.argv[1:])
    # progress lines unless refused (pretraining runs for tens of minutes, usually into a log file)
    log = (lambda m: None) if args.progress is False else (lambda m: print(m, file=sys.stderr, flush=True))
    rec = pretrain(net, task, cfg, buckets, out, command.strip(), log=log, init=init)
    print(json.dumps({k: rec[k] for k in ("steps", "cpu_time_s", "wall_time_s", "heldout_accuracy",
                                          "coverage_layer", "coverage_rate")}, default=str))
    return 0


def run(args) -> int:
    from sparsebalance.commands._args import resolve_out
    from sparsebalance.errors import check

    if args.stage == "pretrain":
        return _pretrain(args)
    cfg = _experiment(args)
    if args.executor == "realrun":
        from sparsebalance.commands._accuracy_measured import run_measured

        return run_measured(args, cfg)
    from sparsebalance.accuracy.experiment import check_buckets, grid, rows, run_job, to_json
    from sparsebalance.accuracy.model import check_task_fits, load

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
