"""Shared fixtures of the kernel tests: seeded, ragged, packed MoBA inputs (never zeros).

Helpers are handed out as fixtures (``make_packed``, ``dense_causal``, ``rel_err``) because test
directories are not packages here.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

import pytest

# Triton kernels run compiled where CUDA is present and under the interpreter only where it is not.
# The choice must be made before triton is first imported (pytest loads this file first).
try:
    import torch as _torch

    _CUDA = _torch.cuda.is_available()
except ImportError:
    _CUDA = False
if _CUDA:
    os.environ["TRITON_INTERPRET"] = "0"
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: Ragged lengths: not multiples of the block (16), one shorter than a block, one exactly two blocks.
RAGGED = (37, 70, 5, 32, 131)


@dataclass(kw_only=True, slots=True)
class Packed:
    """One packed batch: q [T, H, D], k/v [T, H_kv, D] (float64), cu_seqlens int32 [N + 1]."""

    q: Any
    """Queries [T, H, D]."""
    k: Any
    """Keys [T, H_kv, D]."""
    v: Any
    """Values [T, H_kv, D]."""
    cu: Any
    """Sequence boundaries, int32 [N + 1]."""
    lens: tuple[int, ...]
    """Sequence lengths in tokens."""

    def cast(self, dtype: Any, grad: bool = False) -> tuple[Any, Any, Any]:
        return tuple(x.detach().to(dtype).clone().requires_grad_(grad) for x in (self.q, self.k, self.v))


def make_packed(lens: tuple[int, ...] = RAGGED, heads: int = 4, kv_heads: int = 2, dim: int = 8,
                seed: int = 0) -> Packed:
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(T, kv_heads, dim, generator=g, dtype=torch.float64)
    v = torch.randn(T, kv_heads, dim, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    return Packed(q=q, k=k, v=v, cu=cu, lens=tuple(lens))


@pytest.fixture
def packed() -> Packed:
    """GQA batch (4 query heads on 2 kv heads), head dim 8, ragged lengths."""
    return make_packed()


@pytest.fixture(name="make_packed")
def make_packed_fixture() -> Any:
    """The :func:`make_packed` factory (lengths, heads, kv_heads, dim, seed)."""
    return make_packed


@pytest.fixture(name="dense_causal")
def dense_causal_fixture() -> Any:
    """The :func:`dense_causal` SDPA oracle."""
    return dense_causal


@pytest.fixture(name="forward_backward")
def forward_backward_fixture() -> Any:
    """The :func:`forward_backward` runner (output and dq, dk, dv of one attention call)."""
    return forward_backward


@pytest.fixture(name="rel_err")
def rel_err_fixture() -> Any:
    """The :func:`rel_err` metric."""
    return rel_err


def dense_causal(q: Any, k: Any, v: Any, cu: Any) -> Any:
    """Dense causal attention per sequence with torch SDPA (GQA by repeating kv heads)."""
    import torch

    g = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs = q[a:b].transpose(0, 1)
        ks = k[a:b].repeat_interleave(g, dim=1).transpose(0, 1)
        vs = v[a:b].repeat_interleave(g, dim=1).transpose(0, 1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
                    .transpose(0, 1))
    return torch.cat(outs)


def forward_backward(fn: Any, p: Packed, dtype: Any, block_size: int, topk: Any, seed: int = 1) -> tuple:
    """``fn(q, k, v, cu, block_size, topk)`` on ``p`` cast to ``dtype``, then backward of a seeded
    random upstream gradient (float64 draw, cast, so every dtype sees the same one). Returns
    (out, dq, dk, dv)."""
    import torch

    q, k, v = p.cast(dtype, grad=True)
    out = fn(q, k, v, p.cu, block_size, topk)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out.backward(dout.to(dtype))
    return out, q.grad, k.grad, v.grad


def rel_err(a: Any, b: Any) -> float:
    """Relative Frobenius error of ``a`` against the reference ``b`` (both cast to float64)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())
