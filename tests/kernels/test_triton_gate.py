"""The fused Triton gate (block means, scores, exact top-k) against ``gate.select_blocks``, exactly.

Oracle: ``gate.py`` (PyTorch scores, ``torch.topk`` + the exact lower-index tie rule). Exactness is
tested where both sides compute bitwise-equal scores: small integer q and k make every block mean
and dot product exact in float32, so ties are real ties (duplicated key blocks, zero rows of q, and
-0.0 against +0.0 scores) and the tie rule alone decides. On random float data the two sides sum in
different orders; the selections still agree (no score pair there is within rounding of a tie).
Interpreter on the CPU, compiled on a GPU (``conftest.py``).
"""

from __future__ import annotations

import itertools
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "never interpret on a CUDA machine"
elif os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)

from sparsebalance.kernels.moba import gate
from sparsebalance.kernels.moba import plan as moba_plan
from sparsebalance.kernels.moba.triton_impl import index_for

DEV = "cuda" if torch.cuda.is_available() else "cpu"
B = 16


def _want(q, k, cu, topk):
    """gate.select_blocks per sequence as a [T, H, n] table of ids (-1 unused; dense rows all -1)."""
    out = []
    for (a, b), kk in zip(itertools.pairwise(cu.tolist()), topk):
        idx, valid = gate.select_blocks(q[a:b], k[a:b], B, kk)
        n = -(-(b - a) // B)
        out.append(torch.where(valid, idx, -1).int() if kk < n else torch.full((b - a, q.shape[1], kk - 1), -1,
                                                                              dtype=torch.int32))
    return out


def _check(q, k, cu, topk):
    _, idx = index_for(q.to(DEV), k.to(DEV), cu, B, torch.tensor(topk), path="sparse")
    sel = idx.sel.cpu()
    for (a, b), want in zip(itertools.pairwise(cu.tolist()), _want(q, k, cu, topk)):
        w = want.shape[2]
        assert torch.equal(sel[a:b, :, :w], want), (a, b)
        assert bool((sel[a:b, :, w:] == -1).all())


def _integer_inputs(seed, lens, h, hkv, d=16):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randint(-2, 3, (T, h, d), generator=g).float()
    k = torch.randint(-2, 3, (T, hkv, d), generator=g).float()
    return q, k, torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def test_ties_go_to_the_lower_block_exactly():
    """Integer data: exact scores with many ties; duplicated key blocks (identical means) and q rows
    of zeros (every score 0, some -0.0) make the tie rule decide whole rows."""
    lens = (150, 70, 97)
    q, k, cu = _integer_inputs(3, lens, 4, 2)
    k[16:32] = k[48:64]            # sequence 0: blocks 1 and 3 identical
    k[80:96] = k[0:16]             # sequence 0: blocks 5 and 0 identical
    q[100:110] = 0.0               # rows of zeros: every past block scores 0
    q[110:116, :, :] = -0.0 * q[110:116].abs()  # -0.0 rows: -0.0 . mean is -0.0 or +0.0
    k[150 + 32:150 + 48] = 0.0     # sequence 1: a zero block (scores 0 for every query)
    _check(q, k, cu, [4, 3, 5])


def test_random_float_data_mha_gqa_mqa():
    g = torch.Generator().manual_seed(7)
    for h, hkv, lens, topk in ((4, 4, (70, 37), [3, 2]), (4, 2, (131, 53, 9), [5, 2, 1]), (2, 1, (100,), [4])):
        T = sum(lens)
        q, k = torch.randn(T, h, 16, generator=g), torch.randn(T, hkv, 16, generator=g)
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
        _check(q, k, cu, topk)


def test_wide_budgets_take_the_topk_in_pytorch(monkeypatch):
    """Above the kernel's slot width the top-k runs in PyTorch on the same packed keys
    (``select_torch``) and the kernel only emits entries: same selection, ties included."""
    monkeypatch.setattr(moba_plan, "GATE_MAX_KW", 2)
    q, k, cu = _integer_inputs(5, (150, 70), 4, 2)
    k[16:32] = k[48:64]
    plan, _ = index_for(q.to(DEV), k.to(DEV), cu, B, torch.tensor([6, 4]), path="sparse")
    assert plan.from_sel
    _check(q, k, cu, [6, 4])


def test_entries_are_written_at_their_closed_form_positions():
    """Every chosen slot becomes exactly one entry whose code names its (row, head, slot): the
    gate's positions (plan.py) tile [0, E) without gaps or overlaps."""
    q, k, cu = _integer_inputs(9, (90, 45), 4, 2)
    plan, idx = index_for(q.to(DEV), k.to(DEV), cu, B, torch.tensor([3, 4]), path="sparse")
    codes = idx.codes.long().cpu()
    want = torch.nonzero(idx.sel.cpu().reshape(-1) >= 0).squeeze(1)
    assert codes.numel() == plan.entries == want.numel()
    assert torch.equal(codes.sort().values, want)
