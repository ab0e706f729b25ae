"""A CP ring's steps on the CPU path (kernels/moba/ring_step.py) against the single-process float64
reference (kernels/moba/naive.py): for every layout and group size, each rank's steps merged by
log-sum-exp give the reference output of its rows, and the steps' gradients summed over ranks give
every reference gradient (fresh random inputs, no zeros; packed ragged sequences, GQA, per-sequence
budgets, a partial last block, a sequence left whole on one rank)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

LENGTHS = [130, 40, 257, 64]
BLOCK, H, H_KV, D = 16, 4, 2, 8
TOPK = [3, 2, 4, 1]


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS)
    q, k, v, up = (torch.randn(T, h, D, generator=g, dtype=torch.float64) + 0.1 for h in (H, H_KV, H_KV, H))
    cu = [0] + torch.tensor(LENGTHS).cumsum(0).tolist()
    return q, k, v, up, cu


def _ring(q, k, v, up, cu, world: int, layout: str):
    """Every rank's merged output rows and the summed step gradients, plus each step's pairs."""
    from sparsebalance.kernels.moba.cp import blocks_of, cp_token_index
    from sparsebalance.kernels.moba.ring_step import merge, plan, step_backward, step_forward

    index = cp_token_index(torch.tensor(cu), BLOCK, world, layout)
    held = [blocks_of(ix, cu, BLOCK) for ix in index]
    out = torch.zeros_like(q)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    pairs = []
    for r in range(world):
        p = plan(q, k, cu, BLOCK, TOPK, held[r])
        acc, lse = q.new_zeros(q.shape), q.new_full(q.shape[:2], float("-inf"))
        steps = []
        for s in range(world):
            o, lo, saved = step_forward(p, q, k, v, held[(r - s) % world])
            acc, lse = merge(acc, lse, o, lo)
            steps.append(saved)
            pairs.append(saved.pairs)
        rows = index[r]
        out[rows] = acc[rows]
        do = torch.zeros_like(up)
        do[rows] = up[rows]
        for saved in steps:
            gq, gk, gv = step_backward(p, saved, q, k, v, acc, lse, do)
            dq[rows] += gq[rows]
            dk += gk
            dv += gv
    return out, dq, dk, dv, pairs


@pytest.mark.parametrize("layout,world", [("zigzag", 2), ("zigzag", 3), ("stripe", 2), ("stripe", 4),
                                          ("contiguous", 3)])
def test_ring_steps_match_the_float64_reference(layout, world):
    from sparsebalance.kernels.moba.naive import moba_attention_naive

    q, k, v, up, cu = _inputs(11 + world)
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    ref = moba_attention_naive(qr, kr, vr, torch.tensor(cu), BLOCK, torch.tensor(TOPK))
    (ref * up).sum().backward()
    out, dq, dk, dv, _ = _ring(q, k, v, up, cu, world, layout)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-9, atol=1e-10)
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-9)


def test_dense_ring_step_pairs_sum_to_the_causal_total():
    """At a budget covering every block, the steps attend every causal pair once: per head
    sum L (L + 1) / 2 over the sequences, whatever the layout; the zigzag's steps after the first
    are full calls of (L / 2W)^2 x 2 pairs each, by hand (L = 256, W = 2: 8,192)."""
    from sparsebalance.kernels.moba.cp import blocks_of, cp_token_index
    from sparsebalance.kernels.moba.ring_step import plan, step_forward

    g = torch.Generator().manual_seed(5)
    L, W = 256, 2
    q, k, v = (torch.randn(L, h, D, generator=g, dtype=torch.float64) for h in (H, H_KV, H_KV))
    cu = [0, L]
    held = [blocks_of(ix, cu, BLOCK) for ix in cp_token_index(torch.tensor(cu), BLOCK, W, "zigzag")]
    got = {}
    for r in range(W):
        p = plan(q, k, cu, BLOCK, [L // BLOCK], held[r])
        for s in range(W):
            got[(r, s)] = step_forward(p, q, k, v, held[(r - s) % W])[2].pairs
    assert sum(got.values()) == L * (L + 1) / 2
    assert got[(0, 1)] == got[(1, 1)] == 2 * (L // (2 * W)) ** 2
