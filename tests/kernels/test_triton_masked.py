"""The masked dense path of the MoBA Triton kernel (dense loops under each row's selected-block bits)
and the dispatcher that chooses it, against independent oracles: the float64 mask-based reference
(``naive.py``, gradients by autograd) on fresh seeded random inputs, and the cost model's rule.

Runs compiled on a CUDA machine and under the Triton interpreter on a CPU-only one
(``tests/kernels/conftest.py``); sizes are small so the module takes well under a minute there.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "never interpret on a CUDA machine"
elif os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)

from sparsebalance.kernels.moba import plan as moba_plan
from sparsebalance.kernels.moba import triton_impl
from sparsebalance.kernels.moba.naive import moba_attention_naive, naive_selection
from sparsebalance.kernels.moba.triton_impl import index_for, moba_attention_triton, sequence_kinds
from sparsebalance.simulator.cost import kernelcost as kc
from sparsebalance.simulator.cost.roofline import H100

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LOW = triton_impl.min_tile(DEV)  # 8-row tiles run under the interpreter; compiled, tl.dot needs 16
B, D = 16, 16


def _inputs(seed: int, lens, h: int, hkv: int):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    q, k, v, do = (torch.randn(t, n, D, generator=g) for n in (h, hkv, hkv, h))
    return q, k, v, do, cu


def _run(fn, q, k, v, do, dtype):
    qs, ks, vs = (x.detach().to(device=DEV, dtype=dtype).clone().requires_grad_() for x in (q, k, v))
    out = fn(qs, ks, vs)
    out.backward(do.to(device=DEV, dtype=dtype))
    return out, qs.grad, ks.grad, vs.grad


def _rel(a, b) -> float:
    """max |a - b| / max |b|, elementwise."""
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max() / b.detach().abs().max())


def _check(q, k, v, do, cu, topk, **kw):
    got = _run(lambda a, b, c: moba_attention_triton(a, b, c, cu.to(DEV), B, topk, **kw), q, k, v, do,
               torch.float32)
    ref = _run(lambda a, b, c: moba_attention_naive(a, b, c, cu, B, topk), q.double(), k.double(), v.double(),
               do.double(), torch.float64)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert _rel(a, r) <= 1e-4, f"{name}: rel err {_rel(a, r):.2e}"


# (lengths, heads, kv heads, topk, (block_m, block_n) or None)
CASES = {
    "mha-ragged-topk2": ((37, 70, 9, 53), 4, 4, 2, None),
    "gqa2-topk-per-seq": ((70, 16, 53, 41), 4, 2, torch.tensor([3, 1, 2, 4]), None),
    "mqa-tile8-keytile8": ((53, 37), 2, 1, torch.tensor([2, 3]), (8, 8)),
    # 34 blocks: two bit words per row (block 31 is the sign bit of word 0, block 32 starts word 1)
    "mha1-34-blocks-topk9": ((530,), 1, 1, 9, None),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_masked_path_matches_float64_reference_fp32(case):
    lens, h, hkv, topk, tiles = CASES[case]
    q, k, v, do, cu = _inputs(100 + list(CASES).index(case), lens, h, hkv)
    bm, bn = (None, None) if tiles is None else (max(t, LOW) for t in tiles)
    _check(q, k, v, do, cu, topk, block_m=bm, block_n=bn, path="masked")


def test_mixed_paths_in_one_varlen_call(monkeypatch):
    """Sequences on the masked path beside sparse and dense ones in one packed call: each runs its
    own path (the dispatcher's choice reaches the plan), all equal the reference."""
    lens, topk = (53, 70, 37, 41), torch.tensor([2, 3, 3, 2])  # blocks 4, 5, 3 (dense), 3
    kinds = [moba_plan.MASKED, moba_plan.SPARSE, moba_plan.DENSE, moba_plan.SPARSE]
    monkeypatch.setattr(triton_impl, "sequence_kinds", lambda *a, **kw: kinds)
    q, k, v, do, cu = _inputs(7, lens, 4, 2)
    _check(q, k, v, do, cu, topk)
    plan, _ = index_for(q, k, cu, B, topk)
    assert plan.kinds == kinds
    for c in plan.chunks:  # only the first sequence's tiles are masked, in their own tables
        assert set(c.q_tiles_masked[4].tolist()) <= {0} and set(c.q_tiles[4].tolist()) <= {-1}
    assert sum(c.q_tiles_masked.shape[1] for c in plan.chunks) == -(-53 // B) * -(-B // min(B, 64))
    assert set(plan.dev["own_masked"][9].tolist()) == {0} and set(plan.dev["own"][9].tolist()) == {-1}
    assert plan.entries == 4 * (70 - B) * 2 - 4 * B + 4 * (41 - B) * 1  # min(k - 1, c) per row, closed form


def test_selection_bits_hold_the_reference_selection_and_own_block():
    """bits (36 blocks, two words) = naive_selection plus each row's own block; nothing of a masked
    sequence is gathered."""
    q, k, _, _, cu = _inputs(5, (570,), 2, 1)
    plan, idx = index_for(q, k, cu, B, torch.tensor([9]), path="masked")
    n = 36
    assert plan.words == 2 and plan.entries == 0
    want = naive_selection(q.double(), k.double(), B, 9)
    rows = torch.arange(570)
    want[rows, :, rows // B] = True
    words = idx.bits.long() & 0xFFFFFFFF
    got = torch.stack([(words[:, :, j // 32] >> (j % 32)) & 1 == 1 for j in range(n)], dim=2)
    assert torch.equal(got, want)


# (L, k): long sequences at budgets where the model's choice changes, plus a dense one
POINTS = [(8448, 2), (8448, 32), (32768, 16), (32768, 100), (32768, 128), (4096, 14)]


def test_dispatcher_picks_the_path_the_cost_model_says():
    """sequence_kinds (per sequence of one packed call, what the plan fixes) = kernelcost.choose_path
    on the kernel's shape and dtype with the H100 model (a CPU device). The points cover the three
    kinds; a forced path keeps dense sequences dense."""
    lens, topk = [L for L, _ in POINTS], [k for _, k in POINTS]
    cpu = torch.device("cpu")
    got = sequence_kinds(lens, topk, 256, 8, 1, 128, 2, cpu)
    shape = kc.Shape(heads=8, kv_heads=1, head_dim=128, block=256, dtype_bytes=2)
    want = kc.choose_path(np.array(lens), np.array(topk), shape, H100)
    assert got == want.tolist()
    assert {kc.SPARSE, kc.MASKED, kc.DENSE} <= set(want.tolist())
    dense = [k >= -(-L // 256) for L, k in POINTS]
    assert sequence_kinds(lens, topk, 256, 8, 1, 128, 2, cpu, "sparse") == [
        kc.DENSE if d else kc.SPARSE for d in dense]
    assert sequence_kinds(lens, topk, 256, 8, 1, 128, 2, cpu, "masked") == [
        kc.DENSE if d else kc.MASKED for d in dense]
