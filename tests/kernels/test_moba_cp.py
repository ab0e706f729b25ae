"""MoBA on a context-parallel group (kernels/moba/cp.py, the all-gather variant; cp_ring.py, the P2P ring) against the
single-process float64 reference: forward and every gradient, on 2 and 4 gloo ranks, for each
layout, with packed ragged sequences, GQA and per-sequence budgets (fresh random inputs, no zeros);
and one timed row per collective, forward and backward (the real run's CP_COMM rows)."""

from __future__ import annotations

import itertools
import os
import pickle
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

LAYOUTS = ("contiguous", "zigzag", "stripe")
LENGTHS = [130, 40, 257, 64]  # ragged; 40 tokens (3 blocks) stays whole under zigzag at cp 2
BLOCK, H, H_KV, D = 16, 4, 2, 8
TOPK = [3, 2, 4, 1]


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64) + 0.1
    k = torch.randn(T, H_KV, D, generator=g, dtype=torch.float64) + 0.1
    v = torch.randn(T, H_KV, D, generator=g, dtype=torch.float64) + 0.1
    up = torch.randn(T, H, D, generator=g, dtype=torch.float64) + 0.1  # upstream gradient
    cu = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.int64)
    return q, k, v, up, cu


def _worker(rank: int, world: int, store: str, out: str) -> None:
    import time

    import torch.distributed as dist

    from sparsebalance.kernels.moba.cp import cp_token_index, moba_attention_cp, recording
    from sparsebalance.kernels.moba.cp_ring import moba_attention_cp_ring

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    res = {}
    for comm, fn in (("allgather", moba_attention_cp), ("ring", moba_attention_cp_ring)):
        for layout in LAYOUTS:
            q, k, v, up, cu = inputs(7)
            idx = cp_token_index(cu, BLOCK, world, layout)[rank]
            ql, kl, vl = (x[idx].clone().requires_grad_(True) for x in (q, k, v))
            fwd, bwd = [], []  # the CP collectives' (t0, t1), as the real run's CP_COMM rows
            with recording(time.perf_counter, lambda a, b, fwd=fwd: fwd.append((a, b))):
                o = fn(ql, kl, vl, idx, cu, BLOCK, torch.tensor(TOPK))
            with recording(time.perf_counter, lambda a, b, bwd=bwd: bwd.append((a, b))):
                (o * up[idx]).sum().backward()
            res[(comm, layout)] = {"index": idx, "out": o.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
                                   "fwd": fwd, "bwd": bwd}
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_matches_the_float64_reference(world, tmp_path):
    import torch.multiprocessing as mp

    from sparsebalance.kernels.moba.cp import cp_token_index
    from sparsebalance.kernels.moba.naive import moba_attention_naive

    sys.path.insert(0, str(Path(__file__).parent))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), str(tmp_path / "res")), nprocs=world, join=True)
    q, k, v, up, cu = inputs(7)
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    ref = moba_attention_naive(q, k, v, cu, BLOCK, torch.tensor(TOPK))
    (ref * up).sum().backward()
    for key in [(c, lay) for c in ("allgather", "ring") for lay in LAYOUTS]:
        layout = key[1]
        got = [pickle.loads((tmp_path / f"res.{r}").read_bytes())[key] for r in range(world)]
        idx = torch.cat([g["index"] for g in got])
        assert sorted(idx.tolist()) == list(range(sum(LENGTHS)))  # every token on exactly one rank
        assert [g["index"].tolist() for g in got] == [t.tolist() for t in cp_token_index(cu, BLOCK, world, layout)]
        for name, want in (("out", ref.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            mine = torch.cat([g[name] for g in got])
            assert torch.allclose(mine, want[idx], rtol=1e-10, atol=1e-12), (key, name)
        # one timed row per collective: all-gather: the index (no group_index here) and K/V, then
        # K/V gathered again and the gradients' all-reduce; ring: the index, the gate's pooled
        # means and world - 1 hops of K/V, then world - 1 hops of K/V with dK/dV and dK/dV's home
        want_rows = {"allgather": (2, 2), "ring": (world + 1, world)}[key[0]]
        for g in got:
            assert (len(g["fwd"]), len(g["bwd"])) == want_rows, key
            spans = g["fwd"] + g["bwd"]
            assert all(a <= b for a, b in spans) and all(b <= c for (_, b), (c, _) in itertools.pairwise(spans))


def test_token_index_deals_blocks_by_layout():
    from sparsebalance.kernels.moba.cp import cp_token_index

    cu = torch.tensor([0, 64, 64 + 20], dtype=torch.int64)  # 4 blocks of 16; then 20 tokens (2 blocks)
    got = [t.tolist() for t in cp_token_index(cu, 16, 2, "zigzag")]
    # zigzag over 2 ranks: runs 0 and 3 on rank 0, 1 and 2 on rank 1; the short sequence (2 blocks <
    # 2 cp) whole on rank 1 (its index in the batch mod cp)
    assert got[0] == list(range(16)) + list(range(48, 64))
    assert got[1] == list(range(16, 48)) + list(range(64, 84))
    stripe = [t.tolist() for t in cp_token_index(cu, 16, 2, "stripe")]
    assert stripe[0][:16] == list(range(16)) and stripe[0][16:32] == list(range(32, 48))


@pytest.mark.parametrize("wanted", [((0, 5, 6, 7, 8), (2,), ()), ((1, 3), (0, 1, 2), (4,))])
def test_chunked_on_some_query_blocks_equals_the_whole_on_them(wanted, monkeypatch):
    """The CPU path restricted to some query blocks (a CP rank's share): the wanted rows' output and
    every gradient equal the whole computation's, also where the batch's last token (which a partial
    block's padding rows point at) is not wanted and uncomputed memory holds NaN."""
    from sparsebalance.kernels.moba.chunked import moba_attention_chunked

    lengths, block = [140, 40, 70], 16  # the last block of each sequence is partial
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int64)
    g = torch.Generator().manual_seed(3)
    T = sum(lengths)
    q, up = (torch.randn(T, 4, 8, generator=g, dtype=torch.float64) + 0.1 for _ in range(2))
    k, v = (torch.randn(T, 2, 8, generator=g, dtype=torch.float64) + 0.1 for _ in range(2))
    rows = torch.cat([torch.arange(a + j * block, min(a + (j + 1) * block, b))
                      for (a, b), js in zip(zip(cu[:-1].tolist(), cu[1:].tolist()), wanted) for j in js])
    topk = torch.tensor([3, 2, 2])

    def run(**kw):
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o = moba_attention_chunked(*x, cu, block, topk, **kw)[rows]
        (o * up[rows]).sum().backward()
        return [o.detach()] + [t.grad for t in x]

    whole = run()
    empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *size, **kw: empty(self, *size, **kw).fill_(float("nan")))
    part = run(query_blocks=wanted)
    for a, b in zip(whole, part):
        assert torch.isfinite(b).all() and torch.allclose(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_rank_alone_computes_its_share(layout, monkeypatch):
    """moba_attention_cp_alone (what the profiler's attn_*_cp rows time): each rank's share computed in
    one process with no group, the gather's result given up front, gives that rank's output and query
    gradients of the float64 reference; its dK/dV are its own contributions: summed with the other
    ranks' (the collective's work, done here by hand through a hook) they are the reference's."""
    from sparsebalance.kernels.moba.cp import cp_token_index, group_index, moba_attention_cp_alone
    from sparsebalance.kernels.moba.naive import moba_attention_naive

    world = 2
    q, k, v, up, cu = inputs(11)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    ref = moba_attention_naive(qr, kr, vr, cu, BLOCK, torch.tensor(TOPK))
    (ref * up).sum().backward()
    from sparsebalance.kernels.moba import cp as cp_mod

    sums = []  # each rank's dK/dV contributions at every packed position, as it hands them to the sum
    monkeypatch.setattr(cp_mod._Given, "reduce", lambda self, x: sums.append(x.clone()))
    per = cp_token_index(cu, BLOCK, world, layout)
    rows = [torch.cat([k, v], dim=-1)[p] for p in per]
    for r in range(world):
        ql, kl, vl = (x[per[r]].clone().requires_grad_(True) for x in (q, k, v))
        out = moba_attention_cp_alone(ql, kl, vl, group_index(per, r), cu, BLOCK, torch.tensor(TOPK), rows)
        (out * up[per[r]]).sum().backward()
        assert torch.allclose(out.detach(), ref.detach()[per[r]], rtol=1e-10, atol=1e-12), (layout, r)
        assert torch.allclose(ql.grad, qr.grad[per[r]], rtol=1e-10, atol=1e-12), (layout, r)
    from sparsebalance.errors import ConfigError

    with pytest.raises(ConfigError, match="^index: moba_attention_cp_alone needs the group's index"):
        moba_attention_cp_alone(q[per[0]], k[per[0]], v[per[0]], per[0].clone(), cu, BLOCK, 2, rows)
    total = sum(sums)
    assert len(sums) == world
    assert torch.allclose(total[..., :D], kr.grad, rtol=1e-10, atol=1e-12), layout
    assert torch.allclose(total[..., D:], vr.grad, rtol=1e-10, atol=1e-12), layout
