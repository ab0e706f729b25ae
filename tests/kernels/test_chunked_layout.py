"""The CPU MoBA path's layout and tiles (``tiles.py``): causal prefix, sparse rows, tile tables, and
the layout cache of ``chunked.py``; oracles: ``naive_selection`` and the float64 mask reference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sparsebalance.kernels.moba import chunked, tiles
from sparsebalance.kernels.moba.chunked import moba_attention_chunked
from sparsebalance.kernels.moba.naive import moba_attention_naive, naive_selection

B = 16


def _entries(p, topk, tile=None):
    """Every (row, head, block) the tiles hold, checked lane by lane against ``pos``/``tab``/``kv``."""
    q, k, _ = p.cast(torch.float32)
    cu = [int(x) for x in p.cu]
    lay = tiles.layout(cu, B, [topk] * len(p.lens), q.shape[1], q.shape[2], q.device, 1 << 23)
    H, hk = q.shape[1], k.shape[1]
    key_rows = lay.key_idx.view(lay.n_keys, B)[:, 0]            # first row of each key block
    got = set()
    for pieces in lay.chunks:
        t = tiles.chunk_tiles(q, k, pieces, B, lay.n_keys, lay.memo)
        TILE = t.lane.shape[-1]
        if tile is not None:
            assert TILE == tile
        lane = t.lane.view(-1)
        assert int(lane.sum()) == t.pos.numel() == len(set(t.pos.tolist()))  # one lane per entry
        for a, t0, t1, n, e0 in t.pieces:
            pos = t.pos[e0:e0 + H * (t1 - t0) * n].view(H, t1 - t0, n)
            for h in range(H):
                for r in range(t1 - t0):
                    for s in pos[h, r].tolist():
                        assert bool(lane[s]) and int(t.tab[s]) == (a + t0 + r) * H + h
                        kv = int(t.kv[s // TILE])
                        assert kv // lay.n_keys == h // (H // hk)      # the row's kv head
                        start = int(key_rows[kv % lay.n_keys])
                        assert (start - a) % B == 0 and a <= start < a + t0 + r
                        got.add((a + t0 + r, h, (start - a) // B))
    return lay, got


@pytest.mark.parametrize("heads,kv_heads,topk,tile", [(4, 2, 3, None), (4, 1, 4, 4), (2, 2, 2, 8)])
def test_tiles_hold_exactly_the_gate_choice_of_the_sparse_rows(make_packed, heads, kv_heads, topk, tile,
                                                               monkeypatch):
    """Rows of blocks >= topk: tile entries = naive_selection minus the own block; rows of the first
    topk blocks are causal prefixes (every past block chosen) and hold no entry."""
    if tile is not None:
        monkeypatch.setattr(tiles, "TILE_MIN", tile)
        monkeypatch.setattr(tiles, "TILE_MAX", tile)
    p = make_packed(lens=(150, 37, 70, 5), heads=heads, kv_heads=kv_heads, seed=11)
    lay, got = _entries(p, topk)
    want = set()
    for i, L in enumerate(p.lens):
        a = int(p.cu[i])
        sel = naive_selection(p.q[a:a + L], p.k[a:a + L], B, topk)          # [L, H, nb]
        nb = sel.shape[-1]
        if topk >= nb:
            assert (a, a + L) in lay.dense
            continue
        assert (a, a + topk * B) in lay.dense
        assert bool(sel[:topk * B].sum(-1).eq(torch.arange(topk * B)[:, None] // B).all())
        for t in range(topk * B, L):
            for h in range(heads):
                want |= {(a + t, h, j) for j in sel[t, h].nonzero().squeeze(1).tolist() if j != t // B}
    assert got == want


def test_many_selected_blocks_merge_path_matches_reference(make_packed, rel_err, forward_backward):
    """topk - 1 > 8 past blocks per row takes the bmm merge (fewer take the fused multiply-sum)."""
    p = make_packed(lens=(300, 211), heads=4, kv_heads=2, seed=5)
    ref = forward_backward(moba_attention_naive, p, torch.float64, B, 12, seed=3)
    got = forward_backward(moba_attention_chunked, p, torch.float32, B, 12, seed=3)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert rel_err(a, b) <= 1e-4, name


def test_cached_layout_is_reused_and_stays_exact(make_packed, rel_err, forward_backward):
    """The same packing with other data, then with other kv heads: the cached layout (and its memo)
    must serve the first and not the second."""
    chunked._LAYOUTS.clear()
    for seed, kv_heads in ((1, 2), (2, 2), (3, 4)):
        p = make_packed(lens=(130, 64), heads=4, kv_heads=kv_heads, seed=seed)
        ref = forward_backward(moba_attention_naive, p, torch.float64, B, 3, seed=3)
        got = forward_backward(moba_attention_chunked, p, torch.float32, B, 3, seed=3)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            assert rel_err(a, b) <= 1e-4, (seed, name)
    assert len(chunked._LAYOUTS) == 2


def test_tile_size_minimises_padded_cost():
    """group() picks the size with the least (padded rows x per-row cost) and pads only within groups."""
    counts = [3, 700, 0, 129]
    keys = torch.cat([torch.full((c,), g, dtype=torch.int64) for g, c in enumerate(counts)])
    keys = keys[torch.randperm(keys.numel(), generator=torch.Generator().manual_seed(0))]
    rowheads = torch.arange(keys.numel()) * 7
    tab, lane, kv, pos = tiles.group(keys, rowheads, len(counts))
    T = lane.shape[-1]
    cost = {t: sum(-(-c // t) * t for c in counts) * w for t, w in tiles.TILE_COST.items()}
    assert T == min(cost, key=cost.get)
    assert kv.tolist() == [g for g, c in enumerate(counts) for _ in range(-(-c // T))]
    assert torch.equal(tab[pos], rowheads) and bool(lane.view(-1)[pos].all())
    assert torch.equal(kv[pos // T], keys)
