"""How much attention work a CP group does, measured on real gloo ranks, beside what the latency model
prices (prints a table; not a test). It is the measurement behind ``profile --cp``'s ``attn_*_cp``
and ``attn_*_cp_step`` rows (docs/costmodel.md section 11, docs/results.md):

* **measured, on the group**: the config's CP group as gloo processes (one core each where the host
  has them) run the real run's CP attention of the config's ``cp_comm`` (all-gather:
  ``kernels/moba/cp.py: moba_attention_cp``; ring: ``kernels/moba/cp_ring.py``) on one packed
  micro-batch of ``--lengths`` at ``--budget``, forward and backward; each rank's compute is its call
  time less the CP collectives' time (``recording``), the median over ``--repeats``;
* **measured, one process**: ``moba_attention`` on each sequence alone (what a one-GPU profile holds),
  summed over the sequences;
* **priced**: the latency model of ``--config`` (its profile, calibration not applied) -- each rank's
  compute summed over the sequences (``cp_report(...).steps``), with the profile's CP rows (``attn_*_cp``
  for the all-gather, ``attn_*_cp_step`` for a ring) where it has them and without (the one-GPU rows
  split by pairs).

    flock -x /work/locks/cpu.lock .venv/bin/python benchmarks/bench_cp_work.py --lengths 2048,900,400,150
    flock -x /work/locks/cpu.lock .venv/bin/python benchmarks/bench_cp_work.py --config examples/cpu_cp2_ring.toml
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path


def _inputs(lengths: list[int], heads: int, kv_heads: int, head_dim: int):
    import torch

    g = torch.Generator().manual_seed(0)
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, head_dim, generator=g) + 0.1 for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return q, k, v, cu


def _rank(rank: int, world: int, store: str, out: str, a: argparse.Namespace, dims: tuple) -> None:
    import torch
    import torch.distributed as dist

    from sparsebalance.kernels.cpuclock import pin_to_core
    from sparsebalance.kernels.moba.cp import cp_token_index, group_index, moba_attention_cp, recording
    from sparsebalance.kernels.moba.cp_ring import moba_attention_cp_ring

    pin_to_core(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    q, k, v, cu = _inputs(a.lengths, *dims)
    per = cp_token_index(cu, a.block_size, world, a.layout)
    rows = []
    for rep in range(a.repeats + 3):  # 3 warm-up calls
        idx = group_index(per, rank)
        ql, kl, vl = (x[per[rank]].clone().requires_grad_(True) for x in (q, k, v))
        up = torch.randn_like(ql)
        fc: list[float] = []
        bc: list[float] = []
        dist.barrier()
        t0 = time.perf_counter()
        with recording(time.perf_counter, lambda s, e, fc=fc: fc.append(e - s)):
            o = (moba_attention_cp_ring if a.comm == "ring" else moba_attention_cp)(ql, kl, vl, idx, cu,
                                                                                 a.block_size, a.budget)
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        with recording(time.perf_counter, lambda s, e, bc=bc: bc.append(e - s)):
            o.backward(up)
        t3 = time.perf_counter()
        if rep >= 3:
            rows.append((t1 - t0 - sum(fc), t3 - t2 - sum(bc)))
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump([statistics.median(x) for x in zip(*rows)], f)
    dist.barrier()
    dist.destroy_process_group()


def _one_process(a: argparse.Namespace, dims: tuple) -> list[float]:
    import torch

    from sparsebalance.kernels import moba_attention

    torch.set_num_threads(1)
    q, k, v, _ = _inputs(a.lengths, *dims)
    total = [0.0, 0.0]
    for L in a.lengths:
        fs, bs = [], []
        for rep in range(a.repeats + 3):
            ql, kl, vl = (x[:L].clone().requires_grad_(True) for x in (q, k, v))
            cu = torch.tensor([0, L], dtype=torch.int32)
            t0 = time.perf_counter()
            o = moba_attention(ql, kl, vl, cu, a.block_size, a.budget)
            t1 = time.perf_counter()
            o.backward(torch.ones_like(o))
            t2 = time.perf_counter()
            if rep >= 3:
                fs.append(t1 - t0)
                bs.append(t2 - t1)
        total[0] += statistics.median(fs)
        total[1] += statistics.median(bs)
    return total


def _priced(a: argparse.Namespace, cfg, prof) -> list[list[float]]:
    """[pass][rank] seconds of compute the model prices for the micro-batch."""
    from sparsebalance.simulator.cost.latency import load_latency_model

    lm = load_latency_model(prof, cfg.model, cfg.cluster, allow_nonmonotone=True, extrapolate="clamp")
    out = []
    for bw in (False, True):
        per = [0.0] * a.cp
        for L in a.lengths:
            rep = lm.cp_report(L, a.budget, backward=bw)
            if rep is not None:
                for r in range(a.cp):
                    per[r] += float(rep.steps[r].sum())
        out.append(per)
    return out


def main() -> None:
    import warnings
    from dataclasses import replace

    import torch.multiprocessing as mp

    from sparsebalance.runconfig import load_run_config
    from sparsebalance.simulator.cost.catalog import load_profile
    from sparsebalance.simulator.cost.profile import CP_ATTENTION_OPS, CP_STEP_OPS, Profile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="examples/cpu_cp2.toml", help="run config: model, profile, CP group")
    p.add_argument("--lengths", default="2048,900,400,150", help="the packed micro-batch's sequence lengths")
    p.add_argument("--budget", type=int, default=8, help="MoBA top-k")
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args()
    a.lengths = [int(x) for x in a.lengths.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.simplefilter("ignore")
    cfg = load_run_config(a.config)
    m, c = cfg.model, cfg.cluster
    a.cp, a.layout, a.block_size, a.comm = c.cp, c.cp_layout, m.block_size, c.cp_comm
    dims = (m.heads, m.kv_heads, m.head_dim)
    d = tempfile.mkdtemp()
    mp.spawn(_rank, args=(a.cp, f"{d}/store", f"{d}/res", a, dims), nprocs=a.cp, join=True)
    ranks = [pickle.loads(Path(f"{d}/res.{r}").read_bytes()) for r in range(a.cp)]
    one = _one_process(a, dims)
    prof = load_profile(cfg.profile, cfg.base_dir)
    plain = Profile(table=prof.table[~prof.table["op"].isin(CP_ATTENTION_OPS + CP_STEP_OPS)],
                    meta=replace(prof.meta, cp=None, cp_layout=None), source=prof.source)
    with_rows, without = _priced(a, cfg, prof), _priced(a, cfg, plain)
    print(f"lengths {a.lengths}, budget {a.budget}, cp {a.cp} {a.layout} {a.comm}, {a.repeats} repeats "
          f"(median); profile {cfg.profile} (not calibrated); ms")
    print(f"{'pass':5} {'rank':>4} {'measured':>9} {'priced (CP rows)':>17} {'priced (one-GPU rows)':>22}")
    for i, name in enumerate(("F", "B")):
        for r in range(a.cp):
            print(f"{name:5} {r:>4} {ranks[r][i] * 1e3:9.2f} {with_rows[i][r] * 1e3:17.2f} {without[i][r] * 1e3:22.2f}")
        group = sum(x[i] for x in ranks)
        print(f"{name:5} {'sum':>4} {group * 1e3:9.2f} {sum(with_rows[i]) * 1e3:17.2f} {sum(without[i]) * 1e3:22.2f}"
              f"   one process: {one[i] * 1e3:.2f} (group / one process = {group / one[i]:.2f}x)")


if __name__ == "__main__":
    main()
