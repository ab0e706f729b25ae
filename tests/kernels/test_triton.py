"""The MoBA Triton kernels checked against independent oracles: compiled on a CUDA machine, under the
Triton interpreter on a CPU-only one (``tests/kernels/conftest.py`` sets TRITON_INTERPRET before
triton is first imported, and never on a machine with CUDA).

Oracles: the float64 mask-based reference (``naive.py``) and dense causal SDPA; gradients of the
reference come from autograd in float64. Shapes are small so the whole module runs in under a
minute on the interpreter.
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

from sparsebalance.errors import ConfigError
from sparsebalance.kernels.moba import triton_impl
from sparsebalance.kernels.moba.naive import moba_attention_naive, naive_selection
from sparsebalance.kernels.moba.triton_impl import index_for, moba_attention_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# tiles of 8 rows (several per block) run under the interpreter; compiled, tl.dot needs 16
LOW = triton_impl.min_tile(DEV)


def _tiles(tiles):
    return (None, None) if tiles is None else tuple(max(t, LOW) for t in tiles)
B = 16
D = 16
# ragged: not multiples of the block, one shorter than a block, one exactly a block
LENS = [37, 70, 9, 16, 53]


def _inputs(seed: int, h: int, hkv: int, lens=LENS, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v, do = (torch.randn(t, n, D, generator=g) for n in (h, hkv, hkv, h))
    return q, k, v, do, cu


def _rel(a, b) -> float:
    """max |a - b| / max |b| (elementwise, not a norm ratio, so one wrong row cannot hide)."""
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max() / b.detach().abs().max())


def _run(fn, q, k, v, do, dtype):
    qs, ks, vs = (x.detach().to(device=DEV, dtype=dtype).clone().requires_grad_() for x in (q, k, v))
    out = fn(qs, ks, vs)
    out.backward(do.to(device=DEV, dtype=dtype))
    return out, qs.grad, ks.grad, vs.grad


def _reference(q, k, v, do, cu, topk, dtype=torch.float32):
    """float64 naive on the same (possibly rounded to ``dtype``) inputs."""
    rounded = [x.to(dtype).double() for x in (q, k, v, do)]
    return _run(lambda a, b, c: moba_attention_naive(a, b, c, cu, B, topk), *rounded, torch.float64)


CASES = {
    "mha-topk2": (4, 4, 2, None),
    "gqa2-topk3": (4, 2, 3, None),
    "mqa-topk-per-seq": (4, 1, torch.tensor([2, 4, 1, 3, 1]), None),
    "gqa2-tile8-per-seq": (4, 2, torch.tensor([3, 1, 2, 2, 4]), (8, 16)),
    "gqa2-keytile8-topk2": (2, 1, 2, (16, 8)),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_float64_reference_fp32(case):
    """The sparse key-block-major path, forced (the dispatcher prefers the masked dense path at these
    tiny sizes; that path is tested in test_triton_masked.py)."""
    h, hkv, topk, tiles = CASES[case]
    q, k, v, do, cu = _inputs(list(CASES).index(case), h, hkv)
    bm, bn = _tiles(tiles)
    got = _run(lambda a, b, c: moba_attention_triton(a, b, c, cu.to(DEV), B, topk, block_m=bm, block_n=bn,
                                                     path="sparse"), q, k, v, do, torch.float32)
    ref = _reference(q, k, v, do, cu, topk)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert _rel(a, r) <= 1e-4, f"{name}: rel err {_rel(a, r):.2e}"


def test_forward_chunks_and_split_backward_pieces(monkeypatch):
    """Chunked forward (partial buffer cap of ~2 blocks), gathered buckets split into pieces of 3
    entries and own-block rows split into one (row tile, head) pair a program -- the relaxed-atomic
    accumulation of dK/dV -- give the reference's result."""
    monkeypatch.setattr(triton_impl, "PARTIAL_BYTES", 4000)
    monkeypatch.setattr(triton_impl, "BWD_ENTRIES", 3)
    monkeypatch.setattr(triton_impl, "OWN_TILES", 1)
    q, k, v, do, cu = _inputs(21, 2, 1, lens=[70, 9, 53])
    topk = torch.tensor([3, 1, 2])
    bm = max(8, LOW)
    plan, _ = index_for(q, k, cu, B, topk, path="sparse", block_m=bm, block_n=bm)
    assert plan.nc >= 3 and plan.gathered_grid > plan.n_blocks
    own = plan.dev["own"].cpu()
    assert int(own[8].max()) > 1  # own rows split: several programs add to one key tile
    got = _run(lambda a, b, c: moba_attention_triton(a, b, c, cu.to(DEV), B, topk, block_m=bm, block_n=bm,
                                                     path="sparse"), q, k, v, do, torch.float32)
    ref = _reference(q, k, v, do, cu, topk)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert _rel(a, r) <= 1e-4, f"{name}: rel err {_rel(a, r):.2e}"


def test_index_gathers_every_selection_once_by_key_block(monkeypatch):
    """The sorted codes hold each chosen (row, head, slot) once; every (bucket, chunk) run of ``ptr``
    holds exactly the rows of that chunk that chose the bucket's key block, codes ascending; the
    running item counts are those of the runs."""
    monkeypatch.setattr(triton_impl, "PARTIAL_BYTES", 6000)
    monkeypatch.setattr(triton_impl, "BWD_ENTRIES", 5)
    q, k, _, _, cu = _inputs(22, 4, 2)
    topk = torch.tensor([3, 2, 1, 2, 4])
    plan, idx = index_for(q, k, cu, B, topk, path="sparse", block_m=8)
    H, K1P, HKV, NC = 4, plan.k1p, 2, plan.nc
    assert NC >= 2
    sel = idx.sel.long()
    codes = idx.codes.long()
    assert codes.numel() == plan.entries
    assert torch.equal(codes.sort().values, torch.nonzero(sel.reshape(-1) >= 0).squeeze(1))
    t, h, s = codes // (H * K1P), (codes // K1P) % H, codes % K1P
    starts = torch.tensor(cu[:-1].tolist())
    seq = torch.bucketize(t, starts, right=True) - 1
    nbs = [-(-int(L) // B) for L in (cu[1:] - cu[:-1]).tolist()]
    base = torch.tensor([sum(nbs[:i]) for i in range(len(nbs))])
    bucket = (base[seq] + sel[t, h, s]) * HKV + h // 2
    ptr = idx.ptr.long()
    rows0 = [c.row0 for c in plan.chunks]
    for c, ch in enumerate(plan.chunks):
        for b in range(plan.n_blocks * HKV):
            run = slice(int(ptr[b * NC + c]), int(ptr[b * NC + c + 1]))
            assert bool((bucket[run] == b).all()) and bool((codes[run].diff() > 0).all())
            assert bool(((t[run] >= ch.row0) & (t[run] < ch.row1)).all()), (b, c, rows0)
    cnt = (ptr[1:] - ptr[:-1]).view(-1, NC)
    assert torch.equal(idx.cum_fwd.long(), ((cnt + 7) // 8).cumsum(0))
    assert torch.equal(idx.cum_bwd.long(), ((cnt.sum(1) + 4) // 5).cumsum(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_error_at_most_twice_the_pytorch_implementation(dtype):
    """The rule of attention-kernel suites (kernels/moba/check.py), small case: packed ragged, GQA,
    per-sequence budgets. On CUDA the larger cases run in test_triton_gpu.py."""
    from sparsebalance.kernels.moba.check import Case, accuracy

    case = Case(lens=(37, 70, 9, 53), heads=4, kv_heads=2, dim=16, block=16, topk=(3, 4, 1, 2), seed=3)
    rows = accuracy(case, dtype, DEV)
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad


@pytest.mark.parametrize("dtype,bound", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)], ids=["fp16", "bf16"])
def test_half_precision(dtype, bound):
    q, k, v, do, cu = _inputs(7, 4, 2, lens=[37, 70])
    got = _run(lambda a, b, c: moba_attention_triton(a, b, c, cu.to(DEV), B, 3), q, k, v, do, dtype)
    assert got[0].dtype == dtype
    ref = _reference(q, k, v, do, cu, 3, dtype)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert _rel(a, r) <= bound, f"{name}: rel err {_rel(a, r):.2e}"


def _dense_causal(q, k, v, cu):
    """Per-sequence causal SDPA (float64), kv heads repeated for GQA."""
    g = q.shape[1] // k.shape[1]
    outs = []
    bounds = cu.tolist()
    for a, b in itertools.pairwise(bounds):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)))
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    return torch.cat(outs)


def test_full_budget_equals_dense_causal_sdpa():
    q, k, v, do, cu = _inputs(11, 4, 2)
    topk = -(-max(LENS) // B)  # >= number of blocks of every sequence
    got = _run(lambda a, b, c: moba_attention_triton(a, b, c, cu.to(DEV), B, topk), q, k, v, do, torch.float32)
    ref = _run(lambda a, b, c: _dense_causal(a, b, c, cu), q.double(), k.double(), v.double(), do.double(),
               torch.float64)
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert _rel(a, r) <= 1e-4, f"{name}: rel err {_rel(a, r):.2e}"


def test_small_budget_differs_from_dense():
    q, k, v, _, cu = _inputs(12, 2, 2, lens=[80])
    out = moba_attention_triton(q.to(DEV), k.to(DEV), v.to(DEV), cu.to(DEV), B, 2).cpu()
    dense = _dense_causal(q.double(), k.double(), v.double(), cu)
    # rows in blocks 0 and 1 see every earlier key either way; later rows drop blocks
    assert _rel(out[:2 * B], dense[:2 * B]) <= 1e-4
    assert _rel(out[2 * B:], dense[2 * B:]) > 1e-2


def test_selection_matches_naive_selection():
    """Sparse sequences select what the reference selects; dense ones (topk >= blocks: 2 and 3 here)
    select nothing: they run dense causal attention."""
    q, k, _, _, cu = _inputs(13, 4, 2)
    topk = torch.tensor([2, 3, 1, 1, 3])  # blocks: 3, 5, 1, 1, 4
    _, idx = index_for(q, k, cu, B, topk, path="sparse")
    bounds = cu.tolist()
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        want = naive_selection(q[a:b].double(), k[a:b].double(), B, int(topk[s]))  # [L, H, nb]
        sel = idx.sel[a:b].long()
        nb = want.shape[2]
        if int(topk[s]) >= nb:
            assert bool((sel == -1).all()), f"dense sequence {s} has a selection"
            continue
        got = torch.zeros(*want.shape[:2], nb + 1, dtype=torch.bool)  # column nb absorbs the -1 padding
        got.scatter_(2, torch.where(sel >= 0, sel, nb), True)
        got = got[..., :nb]
        assert torch.equal(got, want), f"sequence {s}"


@pytest.mark.parametrize("bad,field", [
    ({"k_shape": (5, 2, 16)}, "k"),
    ({"hkv": 3}, "k"),
    ({"cu": [0, 20, 10, 100]}, "cu_seqlens"),
    ({"cu": [0, 50, 99]}, "cu_seqlens"),
    ({"topk": 0}, "topk"),
    ({"topk": torch.tensor([1, 2, 3])}, "topk"),
    ({"block_size": 24}, "block_size"),
], ids=["k-rows", "heads-not-divisible", "cu-decreasing", "cu-not-ending-at-T", "topk-zero",
        "topk-wrong-length", "block-not-pow2"])
def test_bad_input_names_the_argument(bad, field):
    g = torch.Generator().manual_seed(3)
    hkv = bad.get("hkv", 2)
    q = torch.randn(100, 4, 16, generator=g)
    k = torch.randn(*bad.get("k_shape", (100, hkv, 16)), generator=g)
    v = torch.randn_like(k)
    cu = torch.tensor(bad.get("cu", [0, 40, 100]), dtype=torch.int32)
    with pytest.raises(ConfigError, match=f"^{field}:"):
        moba_attention_triton(q, k, v, cu, bad.get("block_size", 16), bad.get("topk", 2))


def test_compiled_kernels_refuse_tiles_under_16_rows(monkeypatch):
    """tl.dot compiled for a GPU needs 16-row tiles (an 8-row tile failed to compile on an H100): the
    tile bound is 16 for CUDA unless interpreting, 1 otherwise, and a smaller tile is a named error."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_impl.min_tile("cuda") == 16 and triton_impl.min_tile("cpu") == 1
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_impl.min_tile("cuda") == 1


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                    reason="compiled kernels only")
def test_gpu_tile_of_8_rows_is_a_named_error():
    q, k, v, _, cu = _inputs(5, 2, 1)
    with pytest.raises(ConfigError, match="^block_n: must be >= 16"):
        moba_attention_triton(q.to(DEV), k.to(DEV), v.to(DEV), cu.to(DEV), B, 2, block_n=8)
