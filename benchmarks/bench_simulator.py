"""Simulator speed: replay throughput and one 1,024-GPU iteration. Prints a table (not a test).

    .venv/bin/python benchmarks/bench_simulator.py [--repeats 3]

Rows:
* replay 64 x 8 x 64: 64 DP replicas x 8 stages x 64 micro-batches of random heterogeneous F/B
  durations through 1F1B with P2P, all-reduce and optimizer (65,536 F/B actions); actions/s counts
  F/B actions only, the trace (F, B, P2P, ALLREDUCE, OPTIM rows) is built inside the timing;
* iteration PP 8 x DP 128 x 64 (replay): the same for 1,024 devices (131,072 F/B actions);
* iteration PP 8 x DP 128 x 64 (executor): the full SimulatorExecutor path for Qwen2.5-3B with the
  analytical H200 profile (latency look-ups + engine + trace), lengths drawn from chatqa2-like.
Best of ``--repeats`` runs, wall clock and process CPU time (the simulator is single-threaded, so
CPU time is one core's time even when other jobs share the machine).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np


def replay(dp: int, pp: int, m: int, seed: int = 0):
    from sparsebalance.simulator.engine import PipelineInput, simulate

    rng = np.random.default_rng(seed)
    inp = PipelineInput(schedule="1f1b", pp=pp, forward=rng.uniform(0.5, 1.5, (dp, pp, m)),
                        backward=rng.uniform(1.0, 3.0, (dp, pp, m)),
                        p2p=rng.uniform(0, 0.01, (dp, pp - 1, m)),
                        allreduce=0.1, optimizer=0.01)
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(inp)
    return time.perf_counter() - t0, time.process_time() - c0, 2 * dp * pp * m, len(res.trace)


def executor_iteration(dp: int, pp: int, m: int, seed: int = 0):
    from dataclasses import replace

    from sparsebalance.data.sequence import Sequence
    from sparsebalance.simulator.config import h200_4x8, qwen25_3b
    from sparsebalance.simulator.executor import SimulatorExecutor
    from sparsebalance.simulator.latency import load_latency_model
    from sparsebalance.simulator.plan import Plan, uniform_budgets

    model = qwen25_3b()
    cluster = replace(h200_4x8(), name="pp8-dp128", pp=pp, dp=dp, tp=1, global_batch=dp * m)
    lm = load_latency_model("analytical-h200", model, cluster, extrapolate="clamp")
    try:
        from sparsebalance.data import load_sequences
        from sparsebalance.data.config import DataConfig

        seqs = load_sequences(DataConfig(distribution="chatqa2-like", num_sequences=dp * m, seed=seed))
        lengths = [s.length for s in seqs]
    except Exception:  # data part unavailable: log-uniform 1K-32K
        lengths = np.exp(np.random.default_rng(seed).uniform(np.log(1024), np.log(32768), dp * m)).astype(int)
    plan = Plan.from_lists([[[Sequence(id=r * m + j, length=int(lengths[r * m + j]))] for j in range(m)]
                            for r in range(dp)])
    ex = SimulatorExecutor(lm, model, cluster)
    t0, c0 = time.perf_counter(), time.process_time()
    res = ex.execute(0, plan, uniform_budgets(plan, 32))
    return time.perf_counter() - t0, time.process_time() - c0, 2 * dp * pp * m, len(res.trace)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for label, fn, shape in [("replay 64 x 8 x 64", replay, (64, 8, 64)),
                             ("iteration PP8 x DP128 x 64 (replay)", replay, (128, 8, 64)),
                             ("iteration PP8 x DP128 x 64 (executor)", executor_iteration, (128, 8, 64))]:
        runs = [fn(*shape) for _ in range(args.repeats)]
        wall, cpu = min(r[0] for r in runs), min(r[1] for r in runs)
        rows.append((label, runs[0][2], runs[0][3], wall, cpu, runs[0][2] / wall, runs[0][2] / cpu))
    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"{os.cpu_count()} cpus visible, best of {args.repeats}")
    print(f"{'case':<40}{'F/B actions':>12}{'trace rows':>12}{'wall s':>9}{'cpu s':>9}"
          f"{'actions/s wall':>16}{'actions/s cpu':>15}")
    for label, n, nrows, wall, cpu, rate_w, rate_c in rows:
        print(f"{label:<40}{n:>12,}{nrows:>12,}{wall:>9.3f}{cpu:>9.3f}{rate_w:>16,.0f}{rate_c:>15,.0f}")


if __name__ == "__main__":
    main()
