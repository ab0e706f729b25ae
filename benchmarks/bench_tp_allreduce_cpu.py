"""The CPU's collectives (gloo) for a CPU run's link constants, timed per call and fitted by least
squares over the sizes (prints the table and the fit; not a test):

* ``--op allreduce`` (default): ring all-reduce of a [tokens, hidden] float32 activation between the
  ranks of a TP group, fitted as ``latency + 2 (tp - 1) / tp x bytes / bandwidth``: ``cluster.tp_latency``
  / ``tp_bandwidth`` of a TP run, ``allreduce_*`` of the gradient reduction;
* ``--op allgather``: the CP all-gather of K/V (``kernels/moba/cp.py``: every rank's [tokens / n,
  hidden] float32 share), fitted as the simulator prices it (``cp.ring.layer_time``:
  ``(n - 1) x latency + (n - 1) / n x gathered bytes / bandwidth``): ``cluster.p2p_latency`` and, inside
  one node, ``tp_bandwidth`` of a CP run's transfers;
* ``--op p2p``: one hop of the CP ring (``kernels/moba/cp_ring.py``: every rank sends its [tokens / n,
  hidden] float32 share to the next rank and receives the previous one's), fitted as the simulator
  prices a hop (``latency + bytes / bandwidth``, the bytes of one share): a ring run's
  ``cluster.p2p_latency`` and, inside one node, ``tp_bandwidth``.

    flock -x /work/locks/cpu.lock .venv/bin/python benchmarks/bench_tp_allreduce_cpu.py [--groups 2] [--op allgather]

``--groups G`` runs G TP groups at once (G x tp processes), as a PP G x TP tp run has G stages'
TP groups all-reducing on the same host. Each process pins itself to one core when the host has
enough (as realrun's workers do); with more processes than cores they share.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


def _worker(rank: int, world: int, tp: int, hidden: int, sizes: list[int], repeats: int, port: int, q,
            op: str = "allreduce", isolated: bool = False) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= world:
        os.sched_setaffinity(0, {cores[rank]})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(world // tp)]
    group = groups[rank // tp]
    out = {}
    for tokens in sizes:
        if op == "allreduce":
            x = torch.randn(tokens, hidden)
            call = lambda x=x: dist.all_reduce(x, group=group)
        elif op == "allgather":  # tokens: the gathered total; each rank holds 1/tp of them
            x = torch.randn(tokens // tp, hidden)
            parts = [torch.empty_like(x) for _ in range(tp)]
            call = lambda x=x, parts=parts: dist.all_gather(parts, x, group=group)
        else:  # one ring hop of a 1/tp share, as cp_ring._shift sends it
            x, into = torch.randn(tokens // tp, hidden), torch.empty(tokens // tp, hidden)
            me, ranks = rank % tp, list(range((rank // tp) * tp, (rank // tp + 1) * tp))

            def call(x=x, into=into, me=me, ranks=ranks):
                send = dist.isend(x, ranks[(me + 1) % tp], group=group)
                dist.recv(into, ranks[(me - 1) % tp], group=group)
                send.wait()
        for _ in range(3):
            call()
        dist.barrier()
        ts = []
        for _ in range(repeats):
            if isolated:  # as in a run: the call after other work, not right behind the previous one
                dist.barrier(group=group)
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
        out[tokens] = statistics.fmean(ts)
    q.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--groups", type=int, default=2, help="TP groups at once (PP stages of the run)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (tiny: 64)")
    ap.add_argument("--sizes", default="64,128,256,512,1024,2048,4096,8192", help="tokens per all-reduce")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--op", choices=("allreduce", "allgather", "p2p"), default="allreduce")
    ap.add_argument("--isolated", action="store_true",
                    help="a barrier before each timed call (a run's collectives come between compute), "
                         "instead of calls back to back")
    args = ap.parse_args()
    import multiprocessing as mp

    import numpy as np

    sizes = [int(s) for s in args.sizes.split(",")]
    world = args.tp * args.groups
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, args.tp, args.hidden, sizes, args.repeats, args.port, q,
                                                    args.op, args.isolated))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict(q.get() for _ in procs)
    for p in procs:
        p.join()
    mean = {s: float(np.mean([results[r][s] for r in results])) for s in sizes}
    nbytes = np.array([s * args.hidden * 4 for s in sizes], dtype=float)
    n = args.tp
    ring = (nbytes / n if args.op == "p2p"  # one share per hop
            else (2 if args.op == "allreduce" else 1) * (n - 1) / n * nbytes)
    calls = np.full_like(ring, n - 1.0 if args.op == "allgather" else 1.0)  # latency paid per call / per step
    A = np.vstack([calls, ring]).T
    (lat, inv_bw), *_ = np.linalg.lstsq(A, np.array([mean[s] for s in sizes]), rcond=None)
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; load "
          f"{os.getloadavg()[0]:.2f}; {args.op}, {args.tp} ranks x {args.groups} group(s), hidden "
          f"{args.hidden}, float32, mean of {args.repeats}{', isolated calls' if args.isolated else ''}")
    print(f"{'tokens':>8} {'bytes':>10} {'seconds':>12} {'fit':>12}")
    for s, b, r, c in zip(sizes, nbytes, ring, calls):
        print(f"{s:>8} {int(b):>10} {mean[s]:12.3e} {lat * c + inv_bw * r:12.3e}")
    names = ("tp_latency", "tp_bandwidth") if args.op == "allreduce" else ("p2p_latency", "tp_bandwidth (CP)")
    print(f"fit: {names[0]} = {lat:.3e} s, {names[1]} = {1 / inv_bw:.3e} bytes/s")


if __name__ == "__main__":
    main()
