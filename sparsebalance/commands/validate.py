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
CPU share of their F/B wall time (``runs.csv``).

Outputs under ``--out`` (default ``results/validate-<name>/``): ``config.toml`` (resolved, the
config's policy), ``iterations.csv``, ``stages.csv``, ``ops.csv``, ``op_summary.csv``,
``actions.csv``, ``speedup.csv``, ``runs.csv``, ``summary.json``, ``validate.png`` / ``.svg``,
``calibration.csv`` + ``profile-calibrated/`` (when probed) and ``runs/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

BASELINE = {"batching": "sequential", "tuning": "fixed"}
"""The baseline every policy is measured against (the ablation's)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sparsebalance.commands._args import add_config, add_out, add_output_flags, port, positive_int

    add_config(p, help="run config (TOML or JSON) with a [realrun] table", positional=True)
    p.add_argument("--json", action="store_true", help="print one JSON object (stdout) only")
    p.add_argument("--iterations", type=positive_int, default=None,
                   help="iterations per run (default: the config's)")
    p.add_argument("--rounds", type=positive_int, default=4,
                   help="real runs per policy, interleaved ABBA (baseline, policy, policy, baseline, ...) "
                        "so that drift of the machine's speed falls on both alike (default 4)")
    add_out(p, "<output_dir>/validate-<name>")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set data.max_length=1024 (repeatable)")
    p.add_argument("--allow-nonmonotone", action="store_true",
                   help="use a profile whose latency falls as work grows (a warning lists the points)")
    p.add_argument("--master-port", type=port, default=None,
                   help="rendezvous port on localhost (default: a free one)")
    p.add_argument("--profile-as-is", action="store_true",
                   help="trust the profile as measured: no calibration probe on this machine (by default "
                        "a measured profile is probed at a few points here and rescaled per op)")
    add_output_flags(p)


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


def _print_report(out: Path, tables: dict, summary: dict) -> None:
    from sparsebalance.analysis.validate import round_means

    its, stages, ops = tables["iterations"], tables["stages"], tables["op_summary"]
    cols = ["policy", "iteration", "predicted", "measured", "delta_pct", "rounds"]
    print(f"per iteration: iteration time (s), mean over {summary['rounds']} round(s); "
          "delta = (predicted - measured) / measured")
    print(round_means(its)[cols].round(4).to_string(index=False))
    st = stages[~stages["warmup"]].groupby(["policy", "dp_rank", "stage"], sort=False)[
        ["predicted", "measured"]].mean().reset_index()
    st["delta_pct"] = (st["predicted"] - st["measured"]) / st["measured"] * 100
    print("\nper stage: F + B busy seconds per iteration (mean over counted iterations)")
    print(st.round(4).to_string(index=False))
    # P2P and untraced mean different things on the two sides (a real receive wait vs a simulated
    # transfer; framework time vs pipeline idle), so they are listed measured-only.
    same = ops["op"].isin(["F", "B", "I", "W", "ALLREDUCE", "OPTIM", "idle"])
    # a schedule without split backward has no I/W rows on either side: not listed
    same &= ~(ops["op"].isin(["I", "W", "B"]) & (ops["predicted"] == 0) & (ops["measured"] == 0))
    print("\nper op: seconds per iteration (idle = iteration time - F - B, or F - I - W)")
    print(ops[same].round(4).to_string(index=False))
    extra = ops[~same][["policy", "stage", "op", "measured"]]
    print("measured only: P2P = receive wait, untraced = time outside any traced action")
    print(extra.round(4).to_string(index=False))
    w = "excluded (first-iteration one-off costs)" if summary["warmup_excluded"] else "included"
    print(f"\nmean absolute iteration-time error: {summary['mean_abs_error'] * 100:.1f} % "
          f"(round means; warm-up iteration 0 {w}; with it: "
          f"{summary['mean_abs_error_with_warmup'] * 100:.1f} %; over single runs' iterations: "
          f"{summary['mean_abs_error_per_run'] * 100:.1f} %)")
    print(f"speedup of {summary['policy']} over {summary['baseline']}: predicted "
          f"{summary['predicted_speedup']:.3f}x{_range(summary.get('predicted_speedup_ci95'), 'range')}, "
          f"measured {summary['measured_speedup']:.3f}x{_range(summary.get('measured_speedup_ci95'), 'CI')} "
          f"(delta {summary['speedup_delta_pct']:+.1f} %; per round: "
          f"{', '.join(f'{v:.3f}' for v in summary['measured_speedup_by_round'].values())}); ranking "
          f"{'agrees' if summary['ranking_agrees'] else 'DISAGREES'}, "
          f"{_word(summary.get('ranking_resolved'), 'resolved', 'NOT resolved (CI contains 1)', 'unresolved: 1 round')}"
          f"; measured inside the predicted range: "
          f"{_word(summary.get('measured_in_predicted_range'), 'yes', 'NO', 'unknown')}, within the "
          f"combined uncertainty: {_word(summary.get('speedup_consistent'), 'yes', 'NO', 'unknown')}")
    h = summary.get("host") or {}
    if h.get("foreign_cores_mean") is not None:
        print(f"host during the runs: other processes used {h['foreign_cores_mean']:.2f} cores on average "
              f"(max {h['foreign_cores_max']:.2f}); the workers ran "
              f"{100 * (h.get('cpu_busy_mean') or float('nan')):.0f} % of their F/B wall time "
              "(runs.csv; quiet machine: ~0 cores and ~100 %)")
    print(f"tables and figure: {out} (validate.png)")


def _range(iv, what: str) -> str:
    return f" (95 % {what} {iv[0]:.3f}-{iv[1]:.3f})" if iv else ""


def _word(flag, yes: str, no: str, none: str) -> str:
    return none if flag is None else (yes if flag else no)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    import pandas as pd

    from sparsebalance.analysis import validate as V
    from sparsebalance.analysis.compare import speedup_table
    from sparsebalance.calibrate import Prober
    from sparsebalance.commands._args import resolve_out, take_positional_config
    from sparsebalance.commands._calibrate import save_calibrated
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
    done, loads = [], []
    for r in range(args.rounds):
        prober.probe()
        # ABBA: linear drift of a shared machine over the call cancels in the pooled means
        for name, c, s in (pair if r % 2 == 0 else pair[::-1]):
            run_dir = out / "runs" / name.replace("+", "_") / f"round{r}"
            rc, load = _launch(args.config, s, world_size(c), run_dir, args)
            if rc != 0:
                return rc
            loads.append({"policy": name, "round": r, **load})
            done.append((name, r, c, run_dir))
    probed = prober.finish()
    calibrated, calibration = save_calibrated(cfg, out, probed), probed.record
    sides = [replay_side(dataclasses.replace(c, profile=calibrated.profile), name, r, run_dir)
             for name, r, c, run_dir in done]
    sides.sort(key=lambda sd: (sd.policy != base_label, sd.round))
    kw = {"warmup_excluded": warmup_excluded}
    tables = {
        "iterations": pd.concat([V.iteration_table(s, **kw) for s in sides], ignore_index=True),
        "stages": pd.concat([V.stage_table(s, **kw) for s in sides], ignore_index=True),
        "ops": pd.concat([V.op_table(s, **kw) for s in sides], ignore_index=True),
        "actions": pd.concat([V.action_table(s, **kw) for s in sides], ignore_index=True),
        "runs": V.run_table(sides, loads, **kw),
    }
    tables["op_summary"] = V.op_summary(tables["ops"])
    its = tables["iterations"]
    tables["speedup"] = speedup_table(its[~its["warmup"]], base_label)
    summary = V.headline(its, base_label, label, **kw)
    summary.update(_uncertainty(calibrated, out, summary, calibration, base_label, label, warmup_excluded))
    summary["calibration"] = calibration
    summary["host"] = V.host_summary(tables["runs"])
    summary["load_average"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    summary["out"] = str(out)
    for name, t in tables.items():
        t.to_csv(out / f"{name}.csv", index=False)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    V.plot_validation(its, tables["speedup"], out / "validate.png",
                      title=f"{cfg.name}: {label} vs {base_label} (profile {cfg.profile}"
                            f"{', calibrated here' if calibration.get('applied') else ''})")
    if args.json:
        print(json.dumps(summary, default=str))
    else:
        _print_report(out, tables, summary)
    return 0


def _uncertainty(cfg, out: Path, summary: dict, calibration: dict, base_label: str, label: str,
                 warmup_excluded: bool) -> dict:
    """The predicted speedup's 95 % range from the calibration's per-point error (redrawn profiles,
    the runs' own plans replayed), and whether the measured speedup lies within both uncertainties."""
    import pandas as pd

    from sparsebalance.analysis.uncertainty import consistent, pooled_spread, predicted_interval
    from sparsebalance.realrun.results import load_plans
    from sparsebalance.simulator.cost.profile import load_profile

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
            for f in sorted((out / "runs" / name.replace("+", "_")).glob("round*/plans.json")):
                text = f.read_text()
                seen.setdefault(text, load_plans(f))
                lst.append(seen[text])
        prof = load_profile(cfg.profile, cfg.base_dir)
        iv = predicted_interval(prof, cfg.model, cfg.cluster, runs, baseline=base_label,
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
