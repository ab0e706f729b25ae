"""``sparsebalance validate --config RUN.toml``: run realrun for the baseline and the config's policy, replay
each run's exact plans and budgets through the simulator, and compare predicted with measured.

Steps: (1) validate both configs (the config's policy and the baseline ``sequential`` + ``fixed``,
the ablation's baseline) before any process starts; (1b) a measured profile is probed at a few
points on this machine before every round (seconds each) and rescaled per op by all probes
together for the replays (``sparsebalance/calibrate.py``; ``--profile-as-is`` skips it); (2) run each under torchrun with the same seed and
data order, ``--rounds`` times, interleaved ABBA (baseline, policy, policy, baseline, ...) so that a
drift of the shared machine's speed during the call falls on both policies alike
(``<out>/runs/<policy>/round<r>/``); (3) read each run's ``plans.json`` back and execute it with
``SimulatorExecutor`` on the (calibrated) profile; (4) print and save per-iteration, per-stage and per-op
predicted vs measured (Δ %), the mean absolute iteration-time error (of the per-iteration means over
rounds; warm-up iteration 0 excluded when there is more than one iteration: see
analysis/validate.py) and the speedups side by side, the measured one with a 95 % CI over rounds
(is the ranking resolved at all?) and the predicted one with its range from the profile's per-point
error (``analysis/uncertainty.py``); each run's host load (other processes' cores) and the workers'
CPU share of their F/B wall time (``runs.csv``). (5) Each round is judged (``commands/_rounds.py``):
other processes' load during its runs, its probe against the others; a disturbed round is run again
(``--retries``, default 2), and the result is reported from undisturbed rounds when there are two,
else flagged ``DISTURBED (reason)`` in the summary line and ``disturbed`` in ``summary.json``.

Outputs under ``--out`` (default ``results/validate-<name>/``): ``config.toml`` (resolved, the
config's policy), ``iterations.csv``, ``stages.csv``, ``ops.csv``, ``op_summary.csv``,
``actions.csv``, ``speedup.csv``, ``runs.csv``, ``summary.json``, ``validate.png`` / ``.svg``,
``calibration.csv`` + ``profile-calibrated/`` (when probed) and ``runs/`` (``round<r>-try<a>/``: repeats).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BASELINE = {"batching": "sequential", "tuning": "fixed"}
"""The baseline every policy is measured against (the ablation's)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sparsebalance.commands._args import (
        add_config,
        add_launch_flags,
        add_out,
        add_output_flags,
        nonneg_int,
        positive_int,
    )

    add_config(p, help="run config (TOML or JSON) with a [realrun] table; with --trainer torchtitan a "
                       "preset of sparsebalance.titan.config_registry, or MODULE:PRESET of one's own", positional=True)
    p.add_argument("--trainer", default="realrun", choices=("realrun", "torchtitan"),
                   help="who executes the runs: realrun (default) or torchtitan's own trainer "
                        "(sparsebalance.titan, extra [titan]; baseline lbb + fixed in the same slots)")
    p.add_argument("--nproc", type=positive_int, default=2,
                   help="--trainer torchtitan: processes of the job (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object (stdout) only")
    p.add_argument("--iterations", type=positive_int, default=None,
                   help="iterations per run (default: the config's)")
    p.add_argument("--rounds", type=positive_int, default=4,
                   help="real runs per policy, interleaved ABBA (baseline, policy, policy, baseline, ...) "
                        "so that drift of the machine's speed falls on both alike (default 4)")
    p.add_argument("--retries", type=nonneg_int, default=2,
                   help="run a round again when other processes' load or a probe's disagreement says it "
                        "was disturbed, at most this many more times (default 2; 0 = never)")
    add_out(p, "<output_dir>/validate-<name>")
    add_launch_flags(p, example="data.max_length=1024; with --trainer torchtitan a torchtitan field, "
                     "e.g. --set training.steps=8")
    p.add_argument("--profile-as-is", action="store_true",
                   help="trust the profile as measured: no calibration probe on this machine (by default "
                        "a measured profile is probed at a few points here and rescaled per op; with "
                        "--trainer torchtitan a trainer probe, one job per round on plans of its own, "
                        "fits what the trainer adds to each action)")
    add_output_flags(p)


def _run_time(run_dir: Path, warmup_excluded: bool) -> float | None:
    """A realrun run's mean iteration seconds (its metrics.csv), for the rounds' judge."""
    import pandas as pd

    from sparsebalance.commands._rounds import mean_iteration_s

    f = run_dir / "metrics.csv"
    if not f.is_file():
        return None
    m = pd.read_csv(f)
    return mean_iteration_s(list(zip(m["iteration"], m["iteration_time_s"])), warmup_excluded=warmup_excluded)


def _policy_label(policy) -> str:
    return f"{policy.batching}+{policy.tuning}"


def _launch(config: str, sets: list[str], nproc: int, outdir: Path, args) -> tuple[int, dict]:
    """Run realrun under torchrun into ``outdir`` (``realrun/launch.py``: own process group, ended on
    any exit; the rank that failed first named in one line); returns (the exit code (0 = ok), the
    host's load during the run: our CPU seconds, other processes' cores, steal)."""
    from sparsebalance.commands._args import progress_enabled
    from sparsebalance.commands._hostload import HostLoad
    from sparsebalance.realrun.launch import launch

    # the workers' stdout goes to our stderr: with --json, stdout carries the one JSON object only
    load = HostLoad().start()
    outcome = launch(config, nproc, out_dir=outdir, sets=sets, master_port=args.master_port,
                     quiet=args.json or not progress_enabled(args), console=sys.stderr, what="validate")
    load.stop()
    if outcome.returncode != 0:
        print(f"sparsebalance {outcome.message}", file=sys.stderr)
    return outcome.returncode, load.record()


def replay(cfg, run_dir: Path):
    """Predicted side of one real run: its plans.json through SimulatorExecutor with ``cfg.profile``.
    Returns (metrics: iteration, iteration_time_s, tokens; trace in TRACE_COLUMNS)."""
    import pandas as pd

    from sparsebalance.realrun.results import load_plans
    from sparsebalance.simulator.cost.latency import load_latency_model
    from sparsebalance.simulator.engine.executor import SimulatorExecutor

    latency = load_latency_model(cfg.profile, cfg.model, cfg.cluster, base_dir=cfg.base_dir,
                                 extrapolate=cfg.latency_extrapolate,
                                 allow_nonmonotone=cfg.allow_nonmonotone)
    executor = SimulatorExecutor(latency, cfg.model, cfg.cluster, engine=cfg.engine)
    plans, budgets = load_plans(run_dir / "plans.json")
    rows, traces = [], []
    for it, (plan, bud) in enumerate(zip(plans, budgets)):
        res = executor.execute(it, plan, bud)
        rows.append({"iteration": it, "iteration_time_s": res.iteration_time_s,
                     "tokens": sum(s.length for s in plan.sequences())})
        traces.append(res.trace)
    return pd.DataFrame(rows), pd.concat(traces, ignore_index=True)


def replay_side(cfg, policy: str, round_: int, run_dir: Path):
    """One real run beside its replay with ``cfg.profile``: an ``analysis.validate.Side``."""
    import pandas as pd

    from sparsebalance.analysis import validate as V

    pm, pt = replay(cfg, run_dir)
    return V.Side(policy=policy, round=round_, predicted_metrics=pm,
                  measured_metrics=pd.read_csv(run_dir / "metrics.csv"), predicted_trace=pt,
                  measured_trace=pd.read_csv(run_dir / "measured_trace.csv"))


def run(args: argparse.Namespace) -> int:
    if args.trainer == "torchtitan":
        from sparsebalance.commands import validate_titan

        return validate_titan.run(args)
    import dataclasses

    from sparsebalance.analysis import validate as V
    from sparsebalance.analysis.disturbance import run_cores
    from sparsebalance.calibrate import Prober
    from sparsebalance.commands._args import finish_outputs, resolve_out, take_positional_config
    from sparsebalance.commands._calibrate import save_calibrated
    from sparsebalance.commands._hostload import host_cores
    from sparsebalance.commands._rounds import LaunchFailed, run_rounds
    from sparsebalance.commands.train import validate_for_launch
    from sparsebalance.errors import ConfigError
    from sparsebalance.realrun.config import world_size
    from sparsebalance.runconfig import dump_toml

    take_positional_config(args)
    sets = list(args.set) + ([f"iterations={args.iterations}"] if args.iterations else [])
    sets += ["allow_nonmonotone=true"] if args.allow_nonmonotone else []
    cfg = validate_for_launch(args.config, sets)
    base_sets = sets + [f'policy.{k}="{v}"' for k, v in BASELINE.items()]
    base_cfg = validate_for_launch(args.config, base_sets)
    label, base_label = _policy_label(cfg.policy), "baseline"
    if (cfg.policy.batching, cfg.policy.tuning) == tuple(BASELINE.values()):
        raise ConfigError("policy: validate compares the config's policy with the baseline "
                          "sequential + fixed; set policy.batching / policy.tuning to another pair "
                          "(e.g. sab + dst)")
    out = resolve_out(args.out, Path(cfg.output_dir) / f"validate-{cfg.name}", force=args.force,
                      verb="validate")
    (out / "config.toml").write_text(dump_toml(cfg))
    # A measured profile is probed on this machine once per round, between the real runs, and the
    # replays use all probes together: the machine's speed drifts over minutes, and probes spread
    # over the call see the speed its runs saw, where one probe before them sees one moment. The
    # runs' policies keep the configured profile: their plans stay the same from call to call, so
    # calls differ only in measurement, not in what was measured.
    emit = (lambda line: print(line, file=sys.stderr)) if args.json else print
    prober = Prober(cfg, as_is=args.profile_as_is, emit=emit)
    warmup_excluded = cfg.iterations > 1
    pair = ((base_label, base_cfg, base_sets), (label, cfg, sets))
    hc = host_cores()
    cores = run_cores(world_size(cfg), int((cfg.realrun or {}).get("threads", 1)), hc)
    try:
        chosen, tries = run_rounds(
            pair, out, rounds=args.rounds, retries=args.retries, prober=prober, cores=cores, host_cores=hc,
            emit=emit, launch=lambda s, c, d: _launch(args.config, s, world_size(c), d, args),
            run_time=lambda d: _run_time(d, warmup_excluded))
    except LaunchFailed as e:
        finish_outputs(False)  # the runs before the failed one stay, marked incomplete (not a result)
        return e.code
    probed = prober.finish(only=[t.payload.probe for t in chosen.kept if t.payload.probe is not None])
    calibrated, calibration = save_calibrated(cfg, out, probed), probed.record
    done = [(name, t.round, c, d) for t in chosen.kept for name, c, d in t.payload.runs]
    loads = [ld for t in chosen.kept for ld in t.payload.loads]
    sides = [replay_side(dataclasses.replace(c, profile=calibrated.profile), name, r, run_dir)
             for name, r, c, run_dir in done]
    sides.sort(key=lambda sd: (sd.policy != base_label, sd.round))
    tables, summary = V.tables_and_headline(sides, loads, base_label, label, warmup_excluded=warmup_excluded)
    dirs = {name: [d for n, _, _, d in done if n == name] for name in (base_label, label)}
    summary.update(_uncertainty(calibrated, out, summary, calibration, dirs, base_label, label,
                                warmup_excluded))
    summary["calibration"] = calibration
    from sparsebalance.commands._validate_report import finish

    return finish(args, out, tables, summary, chosen=chosen, tries=tries, prober=prober, cores=cores,
                  host_cores=hc, title=f"{cfg.name}: {label} vs {base_label} (profile {cfg.profile}"
                                      f"{', calibrated here' if calibration.get('applied') else ''})")



def _uncertainty(cfg, out: Path, summary: dict, calibration: dict, dirs: dict[str, list[Path]],
                 base_label: str, label: str, warmup_excluded: bool) -> dict:
    """The predicted speedup's 95 % range from the calibration's per-point error (redrawn profiles,
    the reported runs' own plans replayed: ``dirs`` per policy), and whether the measured speedup
    lies within both uncertainties."""
    import pandas as pd

    from sparsebalance.analysis.uncertainty import consistent, pooled_spread, predicted_interval
    from sparsebalance.realrun.results import load_plans
    from sparsebalance.simulator.cost.catalog import load_profile
    from sparsebalance.simulator.engine.executor import SimulatorExecutor

    res: dict = {"predicted_speedup_ci95": None, "measured_in_predicted_range": None,
                 "speedup_consistent": None}
    sigma = None
    if calibration.get("applied"):
        # ops of a millisecond or more carry the time; sub-millisecond ones (embedding lookups)
        # have timer-noise ratios that would inflate the error without moving predictions
        counts = pd.read_csv(out / "calibration.csv").groupby("op").size().to_dict()
        sigma = pooled_spread({op: calibration["spreads"][op] for op in calibration["timed_ops"]}, counts)
    if sigma:
        runs: dict[str, list] = {base_label: [], label: []}
        seen: dict[str, tuple] = {}
        for name, lst in runs.items():
            for f in (d / "plans.json" for d in dirs[name]):
                text = f.read_text()
                seen.setdefault(text, load_plans(f))
                lst.append(seen[text])
        prof = load_profile(cfg.profile, cfg.base_dir)
        iv = predicted_interval(prof, cfg.model, cfg.cluster, runs, executor=SimulatorExecutor, baseline=base_label,
                                policy=label, sigma=sigma, skip_first=warmup_excluded,
                                extrapolate=cfg.latency_extrapolate if cfg.latency_extrapolate != "warn"
                                else "clamp")
        res["predicted_speedup_ci95"] = [iv["lo"], iv["hi"]]
        res["measured_in_predicted_range"] = bool(iv["lo"] <= summary["measured_speedup"] <= iv["hi"])
        res["predicted_speedup_se_log"] = iv["se_log"]
        res["profile_point_error"] = sigma
    res["speedup_consistent"] = consistent(summary["measured_speedup"], summary.get("measured_speedup_se_log"),
                                           summary["predicted_speedup"], res.get("predicted_speedup_se_log"))
    return res
