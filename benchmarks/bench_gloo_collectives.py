"""Gloo's collectives between processes of this host, as FSDP2 and DDP call them on a CPU: median
and minimum microseconds of all-gather, reduce-scatter and all-reduce per message size, each process
on one thread (as the torchtitan and realrun CPU jobs run). The CPU presets' link constants
(``titan-cpu``: 2 GB/s, 50 us) are assumptions; this is what they are checked against.

    flock /work/cpu.lock .venv/bin/python benchmarks/bench_gloo_collectives.py [--out DIR] [--repeats N]

Prints a table and writes ``gloo_collectives.csv`` (size, collective, median_us, min_us) to --out.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path

SIZES = (4096, 65536, 262144, 1048576, 4194304)
KINDS = ("allgather", "reducescatter", "allreduce")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for nbytes in SIZES:
        n = nbytes // 4  # fp32 elements of the whole (gathered / reduced) tensor
        shard, whole = torch.randn(n // world), torch.randn(n)
        gathered, scattered = torch.empty(n), torch.empty(n // world)
        calls = {"allgather": lambda g=gathered, s=shard: dist.all_gather_into_tensor(g, s),
                 "reducescatter": lambda o=scattered, w=whole: dist.reduce_scatter_tensor(o, w),
                 "allreduce": lambda w=whole: dist.all_reduce(w)}
        for kind in KINDS:
            times = []
            for _ in range(repeats + 5):  # the first 5 warm up
                dist.barrier()
                t = time.perf_counter()
                calls[kind]()
                times.append(time.perf_counter() - t)
            times = sorted(times[5:])
            rows.append((nbytes, kind, 1e6 * times[len(times) // 2], 1e6 * times[0]))
    if rank == 0:
        import pandas as pd

        df = pd.DataFrame(rows, columns=["bytes", "collective", "median_us", "min_us"])
        df.to_csv(Path(out) / "gloo_collectives.csv", index=False)
        print(df.to_string(index=False, float_format=lambda v: f"{v:.0f}"))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/bench-gloo", help="directory for gloo_collectives.csv")
    ap.add_argument("--repeats", type=int, default=25, help="timed calls per (size, collective), after 5 warm-ups")
    ap.add_argument("--world", type=int, default=2, help="processes (default 2, as the CPU jobs)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.world < 2:
        ap.error("--repeats must be >= 1 and --world >= 2")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(args.world, _free_port(), args.repeats, args.out), nprocs=args.world)
    print(f"host: {os.cpu_count()} cores; {args.world} processes x 1 thread; written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
