"""Chunked PyTorch MoBA against the float64 mask-based reference and dense SDPA, output and gradients."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sparsebalance.kernels.moba import chunked
from sparsebalance.kernels.moba.chunked import moba_attention_chunked
from sparsebalance.kernels.moba.gate import select_topk
from sparsebalance.kernels.moba.naive import moba_attention_naive, naive_selection

B = 16
CASES = [  # (id, heads, kv_heads, topk)
    ("mha-topk1", 4, 4, 1), ("mha-topk2", 4, 4, 2), ("gqa-topk3", 4, 2, 3), ("mqa-topk4", 4, 1, 4),
    ("gqa-topk-per-seq", 4, 2, "per-seq"), ("gqa-topk-full", 4, 2, 100),
]


def _topk(spec, n):
    return torch.tensor([2, 3, 1, 4, 5][:n]) if spec == "per-seq" else spec


@pytest.mark.parametrize("heads,kv_heads,topk", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_fp32_matches_float64_reference(heads, kv_heads, topk, make_packed, rel_err, forward_backward):
    p = make_packed(heads=heads, kv_heads=kv_heads)
    t = _topk(topk, len(p.lens))
    ref = forward_backward(moba_attention_naive, p, torch.float64, B, t)
    got = forward_backward(moba_attention_chunked, p, torch.float32, B, t)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert a.dtype == torch.float32
        assert rel_err(a, b) <= 1e-4, name


def test_bf16_matches_reference_within_bf16_rounding(make_packed, rel_err, forward_backward):
    p = make_packed()
    # Reference on the bf16-rounded inputs, so only the kernel's own rounding is measured.
    pr = make_packed()
    pr.q, pr.k, pr.v = (x.to(torch.bfloat16).double() for x in (p.q, p.k, p.v))
    ref = forward_backward(moba_attention_naive, pr, torch.float64, B, 3)
    got = forward_backward(moba_attention_chunked, pr, torch.bfloat16, B, 3)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert a.dtype == torch.bfloat16
        assert rel_err(a, b) <= 1e-2, name  # bf16 keeps 8 mantissa bits: ~4e-3 per rounding


def test_full_budget_equals_dense_sdpa_and_small_budget_does_not(packed, dense_causal):
    q, k, v = packed.cast(torch.float32)
    dense = dense_causal(q, k, v, packed.cu)
    assert torch.allclose(moba_attention_chunked(q, k, v, packed.cu, B, 9), dense, atol=2e-6)
    assert (moba_attention_chunked(q, k, v, packed.cu, B, 2) - dense).abs().max() > 1e-2


def test_small_chunks_give_the_same_result(monkeypatch, make_packed, rel_err, forward_backward):
    """Many chunks per sequence (the long-sequence path) must not change anything."""
    p = make_packed(lens=(300, 45))
    ref = forward_backward(moba_attention_naive, p, torch.float64, B, 3)
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 1)  # one query block per chunk
    got = forward_backward(moba_attention_chunked, p, torch.float32, B, 3)
    for a, b in zip(got, ref):
        assert rel_err(a, b) <= 1e-4


def test_gate_selection_matches_bruteforce_including_ties(make_packed):
    """gate.select_topk picks the same blocks as naive's stable sort, also on exact ties."""
    p = make_packed(lens=(150,), heads=4, kv_heads=2)
    k = p.k.clone()
    k[32:64] = k[0:32]  # blocks 2,3 duplicate blocks 0,1 -> exactly equal gate scores
    from sparsebalance.kernels.moba.gate import block_means, gate_scores, past_mask

    means = block_means(k, B)
    scores = gate_scores(p.q, means)
    past = past_mask(0, 150, means.shape[0], B)
    for topk in (2, 3, 5):
        idx, valid = select_topk(scores, past, topk - 1)
        got = torch.zeros(150, 4, means.shape[0], dtype=torch.int64)
        got.scatter_add_(2, idx, valid.long())  # unused slots add 0
        assert got.max() <= 1  # no block chosen twice
        assert torch.equal(got.bool(), naive_selection(p.q, k, B, topk)), topk


def test_many_small_tiles_and_chunks_give_the_same_result(monkeypatch, make_packed, rel_err, forward_backward):
    """Tiles of 4 rows (groups spread over several padded tiles) and one query block per chunk,
    several sequences per micro-batch: the grouping must not change anything."""
    from sparsebalance.kernels.moba import tiles

    p = make_packed(lens=(300, 45, 97), heads=4, kv_heads=2)
    t = torch.tensor([4, 2, 3])
    ref = forward_backward(moba_attention_naive, p, torch.float64, B, t)
    monkeypatch.setattr(tiles, "TILE_MIN", 4)
    monkeypatch.setattr(tiles, "TILE_MAX", 4)
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 1)
    got = forward_backward(moba_attention_chunked, p, torch.float32, B, t)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(a, b) <= 1e-4, name


def test_select_mask_matches_bruteforce_including_ties(make_packed):
    """tiles.select_mask (numpy partition + exact redo of tied rows) picks naive's blocks."""
    from sparsebalance.kernels.moba.gate import block_means, gate_scores, past_mask
    from sparsebalance.kernels.moba.tiles import select_mask

    p = make_packed(lens=(150,), heads=4, kv_heads=2)
    k = p.k.clone()
    k[32:64] = k[0:32]  # blocks 2,3 duplicate blocks 0,1 -> exactly equal gate scores
    means = block_means(k, B)
    scores = gate_scores(p.q, means)
    past = past_mask(0, 150, means.shape[0], B)
    for topk in (2, 3, 5, 9):
        got = select_mask(scores, past, topk - 1)
        assert torch.equal(got, naive_selection(p.q, k, B, topk)), topk
