"""MoBA as torchtitan's inner attention: the kernel on the real documents at each layer's budgets,
zeros on the pad document, against a float64 reference per document."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")


def _qkv(T: int, H: int = 4, Hkv: int = 2, D: int = 16, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(1, T, h, D, generator=g, dtype=torch.float64, requires_grad=True)
    return mk(H), mk(Hkv), mk(Hkv)


def test_moba_attention_runs_the_documents_at_their_layers_budgets_and_zeros_the_pad():
    import torch

    from sparsebalance.kernels.moba.naive import moba_attention_naive
    from sparsebalance.titan.attention import MobaAttention, moba_metadata

    lens, pad, block = (40, 70, 25), 17, 8
    T = sum(lens) + pad
    cu = torch.tensor([0, 40, 110, 135], dtype=torch.int32)
    topk = torch.tensor([[1, 2, 3], [4, 1, 2]])  # layer 0, layer 1; per document
    meta = moba_metadata(cu[None], topk[None])
    assert meta.tokens == 135 and meta.max_q == 70
    q, k, v = _qkv(T)
    for layer in (0, 1):
        attn = MobaAttention(MobaAttention.Config(block_size=block, layer=layer, backend="torch"))
        out = attn(q, k, v, attention_masks=meta, scale=16 ** -0.5)
        assert out.shape == q.shape
        assert torch.count_nonzero(out[0, 135:]) == 0
        ref = moba_attention_naive(q[0, :135], k[0, :135], v[0, :135], cu, block, topk[layer])
        torch.testing.assert_close(out[0, :135], ref, rtol=1e-9, atol=1e-9)
        # gradients flow to the documents' q, k, v only, and equal the reference's
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(layer), dtype=torch.float64)
        g = torch.autograd.grad(out, (q, k, v), dout)
        gr = torch.autograd.grad(ref, (q, k, v), dout[0, :135])
        for a, b in zip(g, gr):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
            assert torch.count_nonzero(a[0, 135:]) == 0


def test_moba_attention_refuses_what_it_cannot_run():
    import torch

    from sparsebalance.titan.attention import MobaAttention, moba_metadata

    attn = MobaAttention(MobaAttention.Config(block_size=8, layer=3))
    q, k, v = _qkv(16)
    meta = moba_metadata(torch.tensor([[0, 16]], dtype=torch.int32), torch.ones(1, 2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="layer index 3"):
        attn(q, k, v, attention_masks=meta)
    with pytest.raises(TypeError, match="MobaMetadata"):
        attn(q, k, v, attention_masks=None)
    with pytest.raises(ValueError, match="scale"):
        MobaAttention(MobaAttention.Config(block_size=8, layer=0))(q, k, v, attention_masks=meta, scale=0.5)
