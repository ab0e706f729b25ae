"""Host-side cost of dispatching one small PyTorch op (the floor of a kernel launch's fixed cost).

    .venv/bin/python benchmarks/bench_dispatch.py [--calls 20000] [--rounds 7]

Times ``torch.add(a, b, out=c)`` on 1-element CPU tensors (one thread): Python call + ATen dispatch,
no work. On a GPU machine a CUDA launch adds the driver's launch latency on top, so this is a lower
bound of the per-op fixed cost the analytical roofline charges (``Hardware.launch_overhead``).
Prints the median and the min-max over rounds, in microseconds per op.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    """The benchmark, then the host's load over it (other processes' cores) and DISTURBED with the
    reason when it was not a quiet machine's (``analysis/disturbance.py``)."""
    from sparsebalance.commands._hostload import judged_window

    with judged_window("the benchmark", cores=1):
        return _main(argv)


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    a, b, c = torch.ones(1), torch.ones(1), torch.empty(1)
    per = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(args.calls):
            torch.add(a, b, out=c)
        per.append((time.perf_counter() - t0) / args.calls * 1e6)
    print(f"torch {torch.__version__}: {statistics.median(per):.2f} us per op "
          f"(min {min(per):.2f}, max {max(per):.2f}, {args.rounds} rounds x {args.calls} calls)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
