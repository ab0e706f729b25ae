"""What `make demo` runs: the main jobs on embedded defaults, each printing where its results went.

1. simulate the embedded default run (sparsebalance/data/presets/demo.toml): Qwen2.5-3B, DP4 x PP4 x
   TP2 on H200, SAB + DST;
2. the paper's Table I ablation, simulated, beside the paper's numbers;
3. a small anchor x p sweep;
4. a short predicted-vs-measured validation on this CPU (real torch.distributed run, gloo, PP 2);
5. the accuracy experiment, quick: fixed k0 vs SAB + DST MEAN0.1 continuing the shipped long-context
   recall model on this CPU's real PP 2 run (one seed, a few iterations; speed and accuracy measured
   in the same runs).
"""

from __future__ import annotations

import os
import sys
import time
from importlib import resources
from pathlib import Path

from sparsebalance.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent


def _step(title: str, argv: list[str], cores: int = 1) -> None:
    """One step, then its wall time and the host's load over it (other processes' cores, judged
    against the ``cores`` the step uses): a figure quoted from the demo carries its host load."""
    from sparsebalance.commands._hostload import judged_window

    print(f"\n=== {title}\n$ sparsebalance {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    with judged_window("this step", cores=cores, emit=lambda line: print(line, flush=True)):
        rc = cli(argv)
    if rc != 0:
        print(f"demo: step failed with exit code {rc}: sparsebalance {' '.join(argv)}", file=sys.stderr)
        sys.exit(rc)
    print(f"({time.perf_counter() - t0:.1f} s)", flush=True)


def main() -> None:
    t0 = time.perf_counter()
    os.environ.setdefault("MPLBACKEND", "Agg")
    demo_cfg = resources.files("sparsebalance.data") / "presets" / "demo.toml"
    _step("1. simulate the default cluster (Qwen2.5-3B, DP4 x PP4 x TP2, H200, SAB + DST)",
          ["simulate", "--config", str(demo_cfg)])
    _step("2. the paper's ablation (Table I), simulated", ["ablation"])
    _step("3. anchor x p sweep (SAB + DST, MEAN/MIN/MAX x p in {0.1, 0.2, 0.3}, 2 seeds)",
          ["sweep", "--grid", str(ROOT / "examples" / "sweep_anchor_p.toml"), "--iterations", "5",
           "--jobs", "2", "--out", "results/sweep-anchor-p", "--no-progress"], cores=2)
    _step("4. predicted vs measured on this CPU (real torchrun, gloo, PP 2: baseline and SAB + DST)",
          ["validate", "--config", str(ROOT / "examples" / "cpu_pp2.toml"), "--no-progress"], cores=2)
    _step("5. does DST keep accuracy at speed? (tiny recall model, real PP 2 run on this CPU, quick: "
          "fixed k0 vs MEAN0.1)",
          ["accuracy", "--quick", "--out", "results/accuracy-quick", "--force", "--no-progress"], cores=2)
    print(f"\nDone in {time.perf_counter() - t0:.0f} s. Results are under results/: demo/ (simulation: "
          "metrics.csv, trace.csv, trace.json for Perfetto, timeline.png), ablation/ (ablation.csv, "
          "ablation.png, anchors), sweep-anchor-p/ (results.csv), validate-cpu_pp2/ (iterations.csv, "
          "stages.csv, validate.png), accuracy-quick/ (summary.csv, summary.md, accuracy_at_speed.png)")


if __name__ == "__main__":
    main()
