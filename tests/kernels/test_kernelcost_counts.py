"""The cost model (simulator/cost/kernelcost.py) against what the shipped kernel really builds and runs:
executed pairs counted from real index tables, and the PyTorch phases' ops and bytes counted by
intercepting every ATen call (kernels/moba/opcount.py). No kernel launch: fast on the CPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from sparsebalance.kernels.moba import triton_impl, triton_select, work
from sparsebalance.kernels.moba.opcount import measure
from sparsebalance.simulator.cost import kernelcost as kc


def test_mirrored_launch_constants_match_the_kernel():
    cfg = triton_impl.launch_config(256, 128, torch.bfloat16)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"]) == (kc.TILE_M, kc.TILE_N)
    assert triton_impl.PARTIAL_BYTES == kc.PARTIAL_BYTES and triton_impl.BWD_ROWS == kc.BWD_ROWS
    import inspect

    default = inspect.signature(triton_select.select_blocks).parameters["chunk_elems"].default
    assert default == kc.GATE_CHUNK_ELEMS


def _index(L, k, H, Hk, D, B, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, H, D, generator=g).to(dtype)
    kk = torch.randn(L, Hk, D, generator=g).to(dtype)
    return triton_select.build_index(q, kk, torch.tensor([0, L], dtype=torch.int32), B, torch.tensor([k]), min(64, B))


@pytest.mark.parametrize("L,k,H,Hk,B", [(4096, 4, 4, 2, 128), (3000, 8, 4, 1, 64), (5000, 40, 2, 2, 128),
                                        (2000, 1, 2, 1, 64)])
def test_executed_pairs_match_the_index_tables(L, k, H, Hk, B):
    """Forward and backward executed pairs: exact where the model is exact (own blocks, dense path,
    k = 1), within 1 % where it takes the expected padding of each gathered bucket."""
    idx = _index(L, k, H, Hk, 16, B)
    s = kc.Shape(heads=H, kv_heads=Hk, head_dim=16, block=B, dtype_bytes=4)
    w = {a: float(v) for a, v in kc.work(L, k, s).items()}
    bm = min(64, B)
    fwd = work.gather_work(idx, B, bm, bm, H, Hk)
    bwd = work.gather_work(idx, B, bm, bm, H, Hk, backward=True)
    assert w["attended"] == idx.attended_pairs
    assert w["entries"] == sum(c.codes.numel() for c in idx.chunks)
    exact = k == 1 or k >= -(-L // B)
    for model, counted in ((w["fwd"], fwd), (w["bwd"], bwd)):
        assert model == counted if exact else model == pytest.approx(counted, rel=0.01)


@pytest.mark.parametrize("L,k,H,Hk,D,B", [(3000, 4, 4, 2, 64, 128), (2048, 6, 8, 1, 128, 256)])
def test_pytorch_phase_counts_match_the_model(L, k, H, Hk, D, B):
    """Selection, index and backward-glue bytes within 5 % of the ATen counts; launch counts exact
    (the model adds the host-to-device copies and syncs a GPU sees and the CPU does not)."""
    m = measure(L, k, heads=H, kv_heads=Hk, dim=D, block=B)
    s = kc.Shape(heads=H, kv_heads=Hk, head_dim=D, block=B, dtype_bytes=2)
    g = {a: float(v) for a, v in kc.gate_counts(L, k, s).items()}
    ix = {a: float(v) for a, v in kc.index_counts(L, k, s).items()}
    assert g["bytes"] == pytest.approx(m["select"].bytes, rel=0.05)
    assert g["ops"] == m["select"].ops
    e = float(kc.work(L, k, s)["entries"])
    counted_index = m["index"].bytes + kc.SORT_EXTRA_BYTES_PER_ENTRY * e  # the counter sees one sort pass
    assert ix["bytes"] == pytest.approx(counted_index, rel=0.05)
    assert ix["ops"] == m["index"].ops + 2 * float(kc.forward_chunks(L, k, s)[0])
    gb = kc.BWD_GLUE_BYTES
    assert m["bwd_glue"].bytes == L * H * D * gb[0] + L * Hk * D * gb[1] + L * H * gb[2]
    assert m["bwd_glue"].ops == kc.BWD_GLUE_OPS


@pytest.mark.parametrize("L,k,H,Hk,D,B", [(3000, 4, 4, 2, 64, 128), (2048, 6, 8, 1, 128, 256), (4096, 30, 4, 1, 64, 64)])
def test_masked_path_counts_match_the_model(L, k, H, Hk, D, B):
    """The masked dense path: executed pairs from its tables = the dense tiles (exact); selection-bit
    bytes within 5 % of the ATen counts, ops exact (+ the 2 host-to-device tables per chunk)."""
    s = kc.Shape(heads=H, kv_heads=Hk, head_dim=D, block=B, dtype_bytes=2)
    g = torch.Generator().manual_seed(1)
    q, kk = torch.randn(L, H, D, generator=g), torch.randn(L, Hk, D, generator=g)
    idx = triton_select.build_index(q, kk, torch.tensor([0, L], dtype=torch.int32), B, torch.tensor([k]), min(64, B),
                                    masked=[True])
    w = {a: float(v) for a, v in kc.work(L, k, s, "masked").items()}
    bm = min(64, B)
    assert w["fwd"] == work.gather_work(idx, B, bm, bm, H, Hk) == float(kc.work(L, L, s)["fwd"])
    assert w["bwd"] == work.gather_work(idx, B, bm, bm, H, Hk, backward=True)
    m = measure(L, k, heads=H, kv_heads=Hk, dim=D, block=B, masked=True)
    ix = {a: float(v) for a, v in kc.index_counts(L, k, s, "masked").items()}
    assert ix["bytes"] == pytest.approx(m["index"].bytes, rel=0.05)
    assert ix["ops"] == m["index"].ops + 2 * float(w["chunks"])
