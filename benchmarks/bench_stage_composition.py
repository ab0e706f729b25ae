"""Does a pipeline stage cost the sum of its profiled ops? The CPU residual, measured.

In one process pinned to one core, each stage of the tiny model (PP 2) runs its F/B actions in the
1F1B order realrun uses (stage 0 holds two micro-batches in flight, the last stage one) over a mix
of lengths, and the profiler's own op closures (``attn_*`` per sequence, ``layer_*``, ``embed_*``,
``head_*``) are timed in interleaved rounds beside it. Per stage and direction it prints the real
actions' and the ops' sums of wall, thread-CPU and system seconds and minor page faults, and the
ratio real / ops, for the two allocator settings:

* ``default``: glibc's defaults (large blocks mmapped per allocation, heap top trimmed);
* ``steady``: ``kernels/cpuclock.steady_allocator()`` (what realrun and the profiler now use).

Each setting runs in its own process (mallopt acts on the process). A benchmark: run it on a quiet
machine (exclusive CPU lock) for figures you report.

    flock -x /work/locks/cpu.lock .venv/bin/python benchmarks/bench_stage_composition.py --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

LENGTHS = (2048, 1500, 2048, 700, 300, 2048, 1024, 130)
"""One global batch of the cpu_pp2 kind: 39 % of sequences at the 2048 cap, a long tail below."""


def _usage():
    import resource

    import numpy as np

    r = resource.getrusage(resource.RUSAGE_THREAD)
    return np.array([time.perf_counter(), r.ru_utime + r.ru_stime, r.ru_stime, r.ru_minflt])


def measure(mode: str, rounds: int, budget: int, core: int) -> dict:
    import numpy as np
    import torch

    from sparsebalance.kernels.cpuclock import steady_allocator
    from sparsebalance.kernels.profiler import Bench, ProfileGrid
    from sparsebalance.kernels.qwen2 import MobaArgs, build_qwen2, pack
    from sparsebalance.realrun.stage import build_stage, stage_layers
    from sparsebalance.simulator.config import tiny
    from sparsebalance.simulator.schedule.schedules import stage_orders

    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    if mode == "steady":
        steady_allocator()
    m = tiny()
    net = build_qwen2(m, seed=0)
    stages = [build_stage(net, s, 2, stage_layers(m.layers, 2, s)) for s in range(2)]
    rng = np.random.default_rng(0)
    bench = Bench(m, ProfileGrid())
    ops = {}
    for n in sorted(set(LENGTHS)):
        for op, k in (("attn", budget), ("layer", 0), ("embed", 0), ("head", 0)):
            for name, fn, setup in bench.items(op, n, k):
                ops[(name[0], n)] = (fn, setup)
    real: dict = {}

    def stage_iteration(s: int, record: bool) -> None:
        saved = {}
        for op, _, j in stage_orders("1f1b", 2, len(LENGTHS))[s]:
            u0 = _usage()
            if op == "F":
                b = pack([rng.integers(0, m.vocab, LENGTHS[j])])
                x = None if s == 0 else torch.randn(1, LENGTHS[j], m.hidden, requires_grad=True)
                saved[j] = stages[s](x, b, MobaArgs(cu_seqlens=b.cu_seqlens, budget=budget,
                                                    block_size=m.block_size))
            else:
                out = saved.pop(j)
                out.backward(torch.ones_like(out) if s == 0 else None)
            if record:
                real.setdefault((s, op), []).append(_usage() - u0)

    keys = list(ops)
    samples = {k: [] for k in keys}
    for fn, setup in ops.values():  # warm-up
        fn(setup() if setup else None)
    for s in (0, 1):
        stage_iteration(s, False)
    for _ in range(rounds):
        for s in (0, 1):
            stage_iteration(s, True)
        for i in rng.permutation(len(keys)):
            fn, setup = ops[keys[i]]
            arg = setup() if setup else None
            u0 = _usage()
            fn(arg)
            samples[keys[i]].append(_usage() - u0)
    mean = {k: np.mean(v, axis=0) for k, v in samples.items()}
    out = {}
    for s in (0, 1):
        n_layers = len(stage_layers(m.layers, 2, s))
        for op, suf in (("F", "fwd"), ("B", "bwd")):
            pred = sum(n_layers * (mean[(f"attn_{suf}", n)] + mean[(f"layer_{suf}", n)])
                       + mean[((f"embed_{suf}" if s == 0 else f"head_{suf}"), n)] for n in LENGTHS)
            got = np.sum(real[(s, op)], axis=0) / rounds
            out[f"stage{s} {op}"] = {"real": got.tolist(), "ops": pred.tolist()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--core", type=int, default=1, help="core to pin the measuring process to")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.rounds, args.budget, args.core)))
        return
    print(f"lengths {LENGTHS}, budget {args.budget}, {args.rounds} rounds, 1 thread, pinned to core "
          f"{args.core}; per iteration sums (wall s, CPU s, system s, minor faults)")
    for mode in ("default", "steady"):
        res = subprocess.run([sys.executable, __file__, "--child", mode, "--rounds", str(args.rounds),
                              "--budget", str(args.budget), "--core", str(args.core)],
                             capture_output=True, text=True, check=True)
        data = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"\nallocator {mode}")
        print(f"{'':10}{'real wall':>10}{'ops wall':>10}{'ratio':>7}{'real cpu':>10}{'ops cpu':>9}"
              f"{'ratio':>7}{'real sys':>10}{'ops sys':>9}{'real flt':>10}{'ops flt':>9}")
        for name, d in data.items():
            r, o = d["real"], d["ops"]
            print(f"{name:10}{r[0]:10.3f}{o[0]:10.3f}{r[0] / o[0]:7.3f}{r[1]:10.3f}{o[1]:9.3f}"
                  f"{r[1] / o[1]:7.3f}{r[2]:10.3f}{o[2]:9.3f}{r[3]:10.0f}{o[3]:9.0f}")


if __name__ == "__main__":
    main()
