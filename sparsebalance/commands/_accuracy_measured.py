"""``sparsebalance accuracy`` (the default, ``--executor realrun``): the measured grid, one torchrun
launch of ``accuracy/pipeline.py`` per seed on the real run's PP 2 workers, then the tables.

Under ``--out``: ``hf/`` (the checkpoint exported for the stages), ``seeds/seed<s>/`` (``spec.json``,
``iterations.jsonl``, ``heldout.jsonl``, ``host.json``: wall time and other processes' load during
the launch, ``launch.log``, ``ranks/``), then ``iterations.csv``, ``per_seed.csv`` (the speed join),
``heldout.csv``, ``summary.csv``, ``speedups.csv`` (against ``fixed`` and ``fixed-dense``),
``summary.md`` (with the target check), ``accuracy_at_speed.png``/``.svg`` and
``config.json``. ``--resume`` keeps the seeds a previous call finished in ``--out`` and runs the
others, so a long study can be run in parts (each under the CPU lock).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

SHIPPED_LONG = "recall-long"
"""The measured experiment's shipped checkpoint (``sparsebalance/data/checkpoints/recall-long``)."""


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_checkpoint(ckpt, cfg) -> None:
    """What the measured run needs of the checkpoint: the coverage fit and held-out buckets that fit."""
    from sparsebalance.accuracy.model import check_task_fits
    from sparsebalance.data.recall import min_length
    from sparsebalance.errors import check

    for key in ("coverage_rate", "coverage_layer"):
        check(key in ckpt.meta, f"checkpoint.{key}", "missing (re-run `sparsebalance accuracy pretrain`)")
    check_task_fits(ckpt, list(cfg.buckets))
    for b in cfg.buckets:
        check(b >= min_length(ckpt.task.pairs), "buckets",
              f"bucket {b} has no held-out examples: a recall example with {ckpt.task.pairs} pairs needs "
              f">= {min_length(ckpt.task.pairs)} tokens")
    if cfg.token_cap is not None:
        check(ckpt.task.max_length <= cfg.token_cap, "token_cap",
              f"must hold the task's longest example ({ckpt.task.max_length} tokens), got {cfg.token_cap}")


def check_same_setting(d: Path, cfg, grid: list, checkpoint: str) -> None:
    """A kept seed must come from the same setting, arms and checkpoint as this call (seeds aside)."""
    from sparsebalance.errors import check

    spec = json.loads((d / "spec.json").read_text())
    then = {k: v for k, v in spec["experiment"].items() if k != "seeds"}
    now = {k: v for k, v in json.loads(json.dumps(asdict(cfg))).items() if k != "seeds"}
    diff = sorted(k for k in set(then) | set(now) if then.get(k) != now.get(k))
    diff += ["arms"] if spec["arms"] != grid else []
    diff += ["checkpoint"] if spec["checkpoint"] != checkpoint else []
    check(not diff, "--resume",
          f"{d} was run with another setting ({', '.join(diff)} differ); use another --out")


def seed_done(d: Path) -> bool:
    return (d / "heldout.jsonl").is_file() and (d / "host.json").is_file()


def run_measured(args, cfg) -> int:
    """Launch the seeds not yet done, then summarise every seed in ``--out``."""
    from sparsebalance.accuracy.measured import arms
    from sparsebalance.accuracy.model import export_hf, load
    from sparsebalance.commands._args import finish_outputs, progress_enabled, resolve_out
    from sparsebalance.commands._hostload import HostLoad
    from sparsebalance.realrun.launch import launch

    ckpt = load(args.checkpoint, default=SHIPPED_LONG)
    check_checkpoint(ckpt, cfg)
    ckpt.load_model()  # weights that do not fit fail here, once, not in every worker
    grid = [asdict(a) for a in arms(cfg)]
    if args.resume and args.out:  # before the directory is opened: a refused call leaves it as it was
        for seed in cfg.seeds:
            if seed_done(Path(args.out) / "seeds" / f"seed{seed}"):
                check_same_setting(Path(args.out) / "seeds" / f"seed{seed}", cfg, grid, str(ckpt.path))
    out = resolve_out(args.out, "results/accuracy", force=args.force, verb="accuracy",
                      reuse=(lambda p: bool(args.resume) and (p / "seeds").is_dir()))
    hf = export_hf(ckpt, out / "hf")
    t0 = time.time()
    for seed in cfg.seeds:
        d = out / "seeds" / f"seed{seed}"
        if seed_done(d):
            print(f"accuracy: seed {seed} already in {d}; kept", file=sys.stderr)
            continue
        d.mkdir(parents=True, exist_ok=True)
        spec = {"seed": seed, "checkpoint": str(ckpt.path), "hf_dir": str(hf.resolve()),
                "coverage_rate": ckpt.meta["coverage_rate"], "coverage_layer": ckpt.meta["coverage_layer"],
                "experiment": asdict(cfg), "arms": grid}
        (d / "spec.json").write_text(json.dumps(spec, indent=2))
        load0, host = os.getloadavg()[0], HostLoad().start()
        outcome = launch(str(d / "spec.json"), 2, out_dir=d, quiet=args.json, progress=progress_enabled(args),
                         console=sys.stderr, what="accuracy", module="sparsebalance.accuracy.pipeline")
        host.stop()
        if outcome.returncode != 0:
            print(f"sparsebalance {outcome.message}", file=sys.stderr)
            finish_outputs(False)
            return outcome.returncode
        (d / "host.json").write_text(json.dumps({**host.record(), "load_average_start_end":
                                                 [round(load0, 2), round(os.getloadavg()[0], 2)]}))
    return summarize(out, cfg, ckpt, args, time.time() - t0)


def summarize(out: Path, cfg, ckpt, args, wall_s: float) -> int:
    import pandas as pd

    from sparsebalance.analysis import accuracy_speed as A

    seeds = [out / "seeds" / f"seed{s}" for s in cfg.seeds]
    its = pd.DataFrame([r for d in seeds for r in _read_jsonl(d / "iterations.jsonl")])
    held = pd.DataFrame([r for d in seeds for r in _read_jsonl(d / "heldout.jsonl")])
    hosts = {d.name: json.loads((d / "host.json").read_text()) for d in seeds}
    its.to_csv(out / "iterations.csv", index=False)
    A.per_seed(its).to_csv(out / "per_seed.csv", index=False)
    A.heldout_accuracy(held).to_csv(out / "heldout.csv", index=False)
    s = A.summary(its, held)
    s.to_csv(out / "summary.csv", index=False)
    speed = A.speed_table(its)
    speed.to_csv(out / "speedups.csv", index=False)
    target = A.target_check(speed)
    (out / "summary.md").write_text(A.markdown_table(s) + "\n\nSpeedups against each reference (95 % CI over "
                                    "seeds):\n\n" + A.speed_markdown(speed) + "\n\n" + target + "\n")
    A.plot(s, out / "accuracy_at_speed")
    (out / "config.json").write_text(json.dumps(
        {"experiment": asdict(cfg), "checkpoint": str(ckpt.path), "checkpoint_steps": ckpt.meta.get("steps"),
         "coverage_layer": ckpt.meta["coverage_layer"], "coverage_rate": ckpt.meta["coverage_rate"],
         "wall_time_s_this_call": round(wall_s, 1),
         "seeds": {k: {"wall_s": round(v.get("wall_s", 0.0), 1), "foreign_cores": v.get("foreign_cores"),
                       "load_average_start_end": v.get("load_average_start_end")} for k, v in hosts.items()},
         "wall_time_s_all_seeds": round(sum(v.get("wall_s", 0.0) for v in hosts.values()), 1)},
        indent=2, default=str))
    if args.json:
        rows = json.loads(s.to_json(orient="records"))
        print(json.dumps(rows))
        return 0
    print(A.markdown_table(s))
    print(target)
    print(f"summary: {out / 'summary.csv'}  figure: {out / 'accuracy_at_speed.png'}  "
          f"({sum(v.get('wall_s', 0.0) for v in hosts.values()):.0f} s of launches)")
    return 0
