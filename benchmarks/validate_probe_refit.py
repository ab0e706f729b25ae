"""One validate call's runs, predicted again with the profile calibrated four ways: as measured, by
the first probe only (one probe before the runs), by the last probe only, by all of the call's
probes (the default, one per round). The runs and the probe points are the call's own
(``runs/``, ``calibration.csv``), so the four errors differ only in the calibration.

    .venv/bin/python benchmarks/validate_probe_refit.py results/bench-validate-cpu/call1 [call2 ...]

Prints, per call directory, the mean absolute iteration-time error (round means, warm-up iteration
excluded, as ``validate`` computes it) of each prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import warnings
from pathlib import Path

import pandas as pd

from sparsebalance.analysis import validate as V
from sparsebalance.commands.train import validate_for_launch
from sparsebalance.commands.validate import BASELINE, _policy_label, replay_side
from sparsebalance.simulator.cost.calibration import fit, rescale
from sparsebalance.simulator.cost.catalog import load_profile


def call_error(call: Path, profile: str | None) -> float:
    """Mean absolute iteration-time error of ``call``'s runs replayed with ``profile`` (None: the
    configured one)."""
    base_sets = [f'policy.{k}="{v}"' for k, v in BASELINE.items()]
    cfg = validate_for_launch(str(call / "config.toml"), [])
    sides, labels = [], ("baseline", _policy_label(cfg.policy))
    for label, sets in zip(labels, (base_sets, [])):
        c = validate_for_launch(str(call / "config.toml"), sets)
        c = dataclasses.replace(c, profile=profile) if profile else c
        for r, run_dir in enumerate(sorted((call / "runs" / label.replace("+", "_")).glob("round*"))):
            sides.append(replay_side(c, label, r, run_dir))
    kw = {"warmup_excluded": cfg.iterations > 1}
    its = pd.concat([V.iteration_table(s, **kw) for s in sides], ignore_index=True)
    return 100 * V.headline(its, "baseline", labels[1], **kw)["mean_abs_error"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("calls", nargs="+", type=Path, help="validate results directories (probed, not --profile-as-is)")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    for call in args.calls:
        summary = json.loads((call / "summary.json").read_text())
        probes = int(summary["calibration"].get("probes", 1))
        cfg = validate_for_launch(str(call / "config.toml"), [])
        prof = load_profile(cfg.profile, cfg.base_dir)
        pts = pd.read_csv(call / "calibration.csv").rename(columns={"probe_s": "latency_s"})
        n = len(pts) // probes
        errors = {"as measured": call_error(call, None)}
        subsets = {"first probe": pts.iloc[:n], "last probe": pts.iloc[-n:], f"all {probes} probes": pts}
        with tempfile.TemporaryDirectory() as tmp:
            for name, sub in subsets.items():
                scaled = rescale(prof, fit(prof, sub[["op", "seq_len", "budget", "latency_s"]]))
                target = Path(tmp) / name.replace(" ", "-")
                scaled.save(target)
                errors[name] = call_error(call, str(target))
        print(f"{call}: " + ", ".join(f"{k} {v:.1f} %" for k, v in errors.items()), flush=True)


if __name__ == "__main__":
    main()
