"""The cost model (simulator/cost/kernelcost.py) against what the shipped kernel really plans and runs:
executed pairs counted from real plan tables and a real selection, the launches and ATen ops of
each phase counted with the Triton kernels stubbed out (kernels/moba/opcount.py). No kernel runs:
fast on the CPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from sparsebalance.kernels.moba import launch, plan, triton_impl, work
from sparsebalance.kernels.moba.opcount import measure
from sparsebalance.simulator.cost import kernelcost as kc


def test_mirrored_launch_constants_match_the_kernel():
    cfg = {k: launch.Config.parse(launch.CHOSEN[(k, 128)]) for k in launch.KERNELS}
    assert (cfg["fwd_past"].block_m, cfg["fwd_past"].block_n) == kc.FWD_TILE
    assert (cfg["fwd_own_merge"].block_m, cfg["fwd_own_merge"].block_n) == kc.OWN_TILE
    assert (cfg["bwd_dq_own"].block_m, cfg["bwd_dq_own"].block_n) == kc.OWN_TILE
    assert cfg["bwd_dq_past"].block_m == kc.FWD_TILE[0]
    assert (cfg["bwd_kv"].block_m, cfg["bwd_kv"].block_n) == kc.KV_TILE
    assert cfg["gate"].block_m == kc.GATE_ROWS and launch.GATE_WARPS == kc.GATE_WARPS
    assert plan.GATE_MAX_KW == kc.GATE_MAX_KW
    assert triton_impl.PARTIAL_BYTES == kc.PARTIAL_BYTES and triton_impl.BWD_ENTRIES == kc.BWD_ENTRIES
    assert plan.BWD_ENTRIES_MAX == kc.BWD_ENTRIES_MAX and plan.PROGRAMS == kc.PROGRAMS
    for e, subs in ((0, 4), (10**5, 4), (3_700_000, 4), (66_000_000, 8)):
        assert plan.bwd_entries(e, subs, kc.BWD_ENTRIES) == int(kc.bwd_piece(e, subs)), e


def _plan_and_counts(L, k, H, Hk, D, B, path, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, kk = torch.randn(L, H, D, generator=g), torch.randn(L, Hk, D, generator=g)
    p = triton_impl.plan_for(q, kk, [0, L], [k], B, path=path)
    sel = work.selection(q, kk, [0, L], B, [k], p.k1p)
    return p, work.bucket_counts(p, sel=sel)


@pytest.mark.parametrize("L,k,H,Hk,B", [(4096, 4, 4, 2, 128), (3000, 8, 4, 1, 64), (5000, 40, 2, 2, 128),
                                        (2000, 1, 2, 1, 64), (2048, 6, 8, 1, 256)])
def test_executed_pairs_match_the_plan_tables(L, k, H, Hk, B):
    """Forward, dK/dV and dQ executed pairs: exact where the model is exact (own loops, dense path,
    k = 1), within 1 % where it takes the expected padding of each gathered bucket."""
    s = kc.Shape(heads=H, kv_heads=Hk, head_dim=16, block=B, dtype_bytes=4)
    p, counts = _plan_and_counts(L, k, H, Hk, 16, B, "sparse")
    w = {a: float(v) for a, v in kc.work(L, k, s, "sparse").items()}
    got = work.executed(p, counts)
    assert w["attended"] == work.attended_pairs([L], B, [k], H)
    assert w["entries"] == counts.sum() == p.entries
    exact = k == 1 or k >= -(-L // B)
    for key in ("fwd", "kv", "dq"):
        assert w[key] == got[key] if exact else w[key] == pytest.approx(got[key], rel=0.01), key


@pytest.mark.parametrize("L,k,H,Hk,B", [(3000, 4, 4, 2, 128), (2048, 6, 8, 1, 256), (4096, 30, 4, 1, 64)])
def test_masked_path_executes_the_dense_tiles(L, k, H, Hk, B):
    s = kc.Shape(heads=H, kv_heads=Hk, head_dim=16, block=B, dtype_bytes=4)
    p, counts = _plan_and_counts(L, k, H, Hk, 16, B, "masked")
    got = work.executed(p, counts)
    w = kc.work(L, k, s, "masked")
    dense = kc.work(L, L, s)
    for key in ("fwd", "kv", "dq"):
        assert float(w[key]) == got[key] == float(dense[key]), key
    assert counts.sum() == 0


@pytest.mark.parametrize("L,k,H,Hk,D,B,path", [(3000, 4, 4, 2, 64, 128, "sparse"), (2048, 6, 8, 1, 128, 256, "sparse"),
                                               (4096, 30, 4, 1, 64, 64, "masked")])
def test_launches_and_index_bytes_match_the_model(L, k, H, Hk, D, B, path):
    """ATen ops and Triton launches of each phase (kernels stubbed): the gate's 2 launches, the index's
    3 ATen ops + 1 kernel (the model adds the sort's internal kernels), the backward's Triton kernels
    only; index bytes = the ATen counter's + the radix passes it cannot see."""
    m = measure(L, k, heads=H, kv_heads=Hk, dim=D, block=B, masked=path == "masked")
    s = kc.Shape(heads=H, kv_heads=Hk, head_dim=D, block=B, dtype_bytes=2)
    g, ix = kc.gate_counts(L, k, s, path), kc.index_counts(L, k, s, path)
    assert m["gate"].ops == 0 and int(g["launches"]) == sum(v for n, v in m["gate"].by_op.items() if "triton" in n)
    bwd = kc.kernel_counts(L, k, s, backward=True, path=path)
    assert m["backward"].ops == 0 and int(bwd["launches"]) == sum(m["backward"].by_op.values())
    assert m["gate"].syncs == m["index"].syncs == m["backward"].syncs == 0
    if path == "masked":
        assert m["index"].ops == 0 and float(ix["bytes"]) == 0
        return
    assert m["index"].by_op == {"sort": 1, "index_select": 1, "searchsorted": 1, "triton:items": 1}
    passes, kb = (int(x) for x in kc.sort_passes(L, k, s, path))
    assert int(ix["launches"]) == (passes + 3) + 2 + 1
    e = float(kc.work(L, k, s, path)["entries"])
    unseen = e * (passes * 2 * (kb + 8) + kb + 8 - (2 * kb + 8))  # the counter sees one pass: keys in, out, index
    assert float(ix["bytes"]) == pytest.approx(m["index"].bytes + unseen, rel=0.05)
