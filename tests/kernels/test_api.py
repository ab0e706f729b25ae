"""Public API: backend dispatch and input validation (each bad input names its argument)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sparsebalance.errors import ConfigError
from sparsebalance.kernels import moba_attention, moba_coverage
from sparsebalance.kernels.moba.naive import moba_attention_naive


def test_backends_agree_on_cpu(packed, rel_err):
    q, k, v = packed.cast(torch.float32)
    ref = moba_attention_naive(*packed.cast(torch.float64), packed.cu, 16, 3)
    for backend in ("auto", "torch", "naive"):
        out = moba_attention(q, k, v, packed.cu, block_size=16, topk=3, backend=backend)
        assert out.shape == q.shape and rel_err(out, ref) <= 1e-5, backend


def test_topk_tensor_equals_scalar_when_uniform(packed):
    q, k, v = packed.cast(torch.float32)
    a = moba_attention(q, k, v, packed.cu, block_size=16, topk=3)
    b = moba_attention(q, k, v, packed.cu, block_size=16, topk=torch.full((5,), 3, dtype=torch.int32))
    assert torch.equal(a, b)


def _args(packed):
    q, k, v = packed.cast(torch.float32)
    return dict(q=q, k=k, v=v, cu_seqlens=packed.cu, block_size=16, topk=3)


BAD = [  # (id, argument named in the error, change)
    ("k-wrong-T", "k", lambda a: a.update(k=a["k"][:-1], v=a["v"][:-1])),
    ("k-wrong-D", "k", lambda a: a.update(k=a["k"][..., :4], v=a["v"][..., :4])),
    ("k-heads-not-dividing", "k", lambda a: a.update(k=torch.randn(275, 3, 8), v=torch.randn(275, 3, 8))),
    ("k-dtype", "k", lambda a: a.update(k=a["k"].double())),
    ("q-not-3d", "q", lambda a: a.update(q=a["q"].reshape(275, -1))),
    ("v-shape", "v", lambda a: a.update(v=a["v"][:, :1])),
    ("v-dtype", "v", lambda a: a.update(v=a["v"].double())),
    ("cu-int64", "cu_seqlens", lambda a: a.update(cu_seqlens=a["cu_seqlens"].long())),
    ("cu-not-from-0", "cu_seqlens", lambda a: a.update(cu_seqlens=a["cu_seqlens"] + 1)),
    ("cu-not-increasing", "cu_seqlens",
     lambda a: a.update(cu_seqlens=torch.tensor([0, 40, 30, 275], dtype=torch.int32))),
    ("cu-not-ending-at-T", "cu_seqlens",
     lambda a: a.update(cu_seqlens=torch.tensor([0, 40, 270], dtype=torch.int32))),
    ("head-dim-zero", "q", lambda a: a.update(q=a["q"][:, :, :0], k=a["k"][:, :, :0], v=a["v"][:, :, :0])),
    ("topk-zero", "topk", lambda a: a.update(topk=0)),
    ("topk-tensor-below-1", "topk", lambda a: a.update(topk=torch.tensor([1, 2, 0, 3, 3]))),
    ("topk-tensor-wrong-length", "topk", lambda a: a.update(topk=torch.tensor([2, 2]))),
    ("topk-float", "topk", lambda a: a.update(topk=2.5)),
    ("block-size-zero", "block_size", lambda a: a.update(block_size=0)),
    ("backend-unknown", "backend", lambda a: a.update(backend="cuda")),
]


@pytest.mark.parametrize("argname,change", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_value_error_naming_argument(argname, change, packed):
    args = _args(packed)
    change(args)
    with pytest.raises(ValueError, match=rf"^{argname}:") as e:
        moba_attention(**args)
    assert isinstance(e.value, ConfigError)


def test_coverage_validates_topks(packed):
    with pytest.raises(ValueError, match="^topks:"):
        moba_coverage(packed.q, packed.k, packed.cu, 16, [0, 2])
    with pytest.raises(ValueError, match="^block_size:"):
        moba_coverage(packed.q, packed.k, packed.cu, -1, [2])
