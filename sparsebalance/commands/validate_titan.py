"""``sparsebalance validate --trainer torchtitan --config PRESET``: the torchtitan job (a preset of
``sparsebalance.titan.config_registry``, or ``MODULE:PRESET``) run with its run config's policy and
with the baseline LBB + fixed (torchtitan's own token-count balancing, in the same fixed slots), each
``--rounds`` times in ABBA order (``commands/_rounds.py``: host load judged, disturbed rounds run
again), every step measured inside torchtitan's trainer (``--sparsebalance.measure``); the simulator
replays the same plans and budgets (``titan/measure.py``); the tables, headline error, speed-ups
with their CIs and ranking are ``validate``'s (``analysis/validate.py``).

Both jobs are checked (torchtitan config parsed, SparseBalance side resolved, documents loaded)
before any process starts: a bad input is one line, exit code 2. The op calibration probe is not
run (it times realrun's model, not torchtitan's); instead, unless ``--profile-as-is``, a **trainer
probe** starts every round: one job of the policies in turn on plans of its own, whose actions give
the fit of what the trainer adds to each action (``commands/_titan_probe.py``,
``simulator/cost/actioncalibration.py``); every prediction uses the fit of the reported rounds'
probes, and ``summary.json`` keeps it (``trainer_probe``) and the error without it (``uncalibrated``).
Outputs under ``--out`` (default ``results/validate-titan-<preset>``): ``iterations.csv``,
``stages.csv``, ``ops.csv``, ``op_summary.csv``, ``actions.csv``, ``speedup.csv``, ``runs.csv``,
``summary.json``, ``validate.png``, ``runs/<policy>/round<r>/`` (each job's dump folder: trace,
losses, log), ``probe/<policy>-<k>/`` (the k-th probe's).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

BASELINE = {"batching": "lbb", "tuning": "fixed"}
"""torchtitan's own balancing (token counts), in the same slots: the baseline of the torchtitan jobs."""


def _overrides(sets: list[str]) -> list[str]:
    from sparsebalance.errors import ConfigError

    out = []
    for s in sets:
        key, eq, value = s.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set: expected KEY=VALUE (a torchtitan config field), got {s!r}")
        out += [f"--{key.strip()}", value.strip()]
    return out


def _variant(setup, policy: dict, out: Path, label: str, *, seed_offset: int = 0) -> str:
    """A run config TOML like the job's, with ``policy`` fields replaced (the baseline's) and, for
    the trainer probe (``seed_offset``: ``_titan_probe.PROBE_SEED``), its seeds and its data's moved
    (``run-<label>.toml``, the probe's ``probe-<label>.toml``)."""
    from sparsebalance.runconfig import dump_toml

    run = setup.run
    data = run.data
    if data.path and data.path != "stdlib":  # the copy lives elsewhere: its data stays where it was
        data = replace(data, path=str(run.resolve(data.path).resolve()))
    if seed_offset:
        data = replace(data, seed=(run.seed if data.seed is None else data.seed) + seed_offset)
    cfg = replace(run, policy=replace(run.policy, **policy), data=data, seed=run.seed + seed_offset)
    path = out / f"{'probe' if seed_offset else 'run'}-{label.replace('+', '_')}.toml"
    path.write_text(dump_toml(replace(cfg, base_dir=run.base_dir)))
    return str(path)


def run(args: argparse.Namespace) -> int:
    from sparsebalance.analysis import validate as V
    from sparsebalance.analysis.disturbance import run_cores
    from sparsebalance.calibrate import Prober
    from sparsebalance.commands._args import finish_outputs, resolve_out, take_positional_config
    from sparsebalance.commands._hostload import HostLoad, host_cores
    from sparsebalance.commands._rounds import LaunchFailed, run_rounds
    from sparsebalance.commands._validate_report import finish
    from sparsebalance.errors import ConfigError, HostError
    from sparsebalance.titan.launch import check_job, module_and_preset, run_job
    from sparsebalance.titan.measure import measured, replay

    take_positional_config(args)
    preset, nproc = args.config, args.nproc
    base = _overrides(args.set) + (["--training.steps", str(args.iterations)] if args.iterations else [])
    setup = check_job(preset, nproc, base)
    if (setup.run.policy.batching, setup.run.policy.tuning) == tuple(BASELINE.values()):
        raise ConfigError("policy: validate compares the run config's policy with the baseline lbb + fixed; "
                          "set another pair (e.g. sab + dst)")
    name = module_and_preset(preset)[1]
    out = resolve_out(args.out, Path(setup.run.output_dir) / f"validate-titan-{name}", force=args.force,
                      verb="validate")
    label, base_label = f"{setup.run.policy.batching}+{setup.run.policy.tuning}", "baseline"
    # the run configs pinned in files: the data path resolved against the original run config
    sets = base + ["--dataloader.run_config", _variant(setup, {}, out, label)]
    base_sets = base + ["--dataloader.run_config", _variant(setup, BASELINE, out, base_label)]
    base_setup = check_job(preset, nproc, base_sets)
    steps = parse_steps(preset, base)
    pair = ((base_label, base_setup, base_sets), (label, setup, sets))
    emit = (lambda line: print(line, file=sys.stderr)) if args.json else print

    def launch(s: list[str], _setup, d: Path) -> tuple[int, dict]:
        load = HostLoad().start()
        try:
            run_job(preset, nproc, d, [*s, "--sparsebalance.measure"], check=False)
        except HostError as e:
            load.stop()
            print(f"sparsebalance validate: {e}", file=sys.stderr)
            return 1, load.record()
        load.stop()
        return 0, load.record()

    hc = host_cores()
    cores = run_cores(nproc, 1, hc)
    if args.profile_as_is:
        prober: Any = Prober(setup.run, as_is=True, emit=emit)
    else:  # a trainer probe at the start of every round (commands/_titan_probe.py); the op probe
        # re-times realrun's model, not torchtitan's
        from sparsebalance.commands._titan_probe import PROBE_SEED, TrainerProber

        prober = TrainerProber([(lab, base + ["--dataloader.run_config",
                                              _variant(setup, pol, out, lab, seed_offset=PROBE_SEED)])
                                for lab, pol in ((base_label, BASELINE), (label, {}))],
                               preset=preset, nproc=nproc, steps=steps, out=out, launch=launch, emit=emit)
    try:
        chosen, tries = run_rounds(pair, out, rounds=args.rounds, retries=args.retries, prober=prober,
                                   cores=cores, host_cores=hc, emit=emit, launch=launch,
                                   run_time=lambda d: _run_time(d, steps > 1))
    except LaunchFailed as e:
        finish_outputs(False)
        return e.code
    except HostError as e:  # a probe job failed (its one line)
        print(f"sparsebalance validate: {e}", file=sys.stderr)
        finish_outputs(False)
        return 1
    calibration, probe_record = None, {"status": "off (--profile-as-is)"}
    if not args.profile_as_is:
        calibration, probe_record = prober.finish(only=[t.payload.probe for t in chosen.kept])
    from sparsebalance.titan.launch import read_trace

    def sides_of(cal) -> list:
        sides, predicted = [], {}
        for t in chosen.kept:
            for name, st, d in t.payload.runs:
                if name not in predicted:
                    predicted[name] = replay(st, steps, calibration=cal)
                pm, pt, plans = predicted[name]
                mm, mt = measured(read_trace(d), plans)
                sides.append(V.Side(policy=name, round=t.round, predicted_metrics=pm, measured_metrics=mm,
                                    predicted_trace=pt, measured_trace=mt))
        return sorted(sides, key=lambda sd: (sd.policy != base_label, sd.round))

    loads = [ld for t in chosen.kept for ld in t.payload.loads]
    warm = steps > 1
    tables, summary = V.tables_and_headline(sides_of(calibration), loads, base_label, label, warmup_excluded=warm)
    summary["trainer_probe"] = probe_record
    if calibration is not None:  # the profile alone, for comparison: what the probe changed
        raw = V.tables_and_headline(sides_of(None), loads, base_label, label, warmup_excluded=warm)[1]
        summary["uncalibrated"] = {k: raw[k] for k in ("mean_abs_error", "mean_abs_error_by_policy",
                                                        "predicted_speedup")}
        emit(f"without the trainer probe: error {100 * raw['mean_abs_error']:.1f} %, "
             f"predicted speedup {raw['predicted_speedup']:.3f}")
    summary["trainer"] = "torchtitan"
    summary["preset"] = preset
    summary["nproc"] = nproc
    summary["profile"] = setup.run.profile
    return finish(args, out, tables, summary, chosen=chosen, tries=tries, prober=prober, cores=cores,
                  host_cores=hc, title=f"torchtitan {preset}: {label} vs {base_label} "
                                      f"(profile {setup.run.profile})")


def _run_time(dump: Path, warmup_excluded: bool) -> float | None:
    """A torchtitan job's mean step seconds (its measured trace's OPTIM ends), for the rounds' judge."""
    from sparsebalance.commands._rounds import mean_iteration_s
    from sparsebalance.errors import HostError
    from sparsebalance.titan.launch import read_trace

    try:
        tr = read_trace(dump)
    except HostError:
        return None
    ends = tr[tr["op"] == "OPTIM"].groupby("iteration")["end_s"].max()
    return mean_iteration_s([(int(i), float(e)) for i, e in ends.items()], warmup_excluded=warmup_excluded)


def parse_steps(preset: str, overrides: list[str]) -> int:
    from sparsebalance.titan.launch import parse_job

    return int(parse_job(preset, overrides).training.steps)
