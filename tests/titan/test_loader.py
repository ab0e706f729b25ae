"""The loader: packed documents, positions, labels, budgets; the same plan on every DP rank; the exact
next micro-batch after a restart (in process, no distributed job)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torchtitan")


def _setup(nproc: int = 2, preset: str = "sparsebalance_tiny_pp2", extra=()):
    from sparsebalance.titan.launch import check_job

    return check_job(preset, nproc, list(extra))


def test_microbatch_tensors_pack_documents_then_the_pad():
    import torch

    from sparsebalance.data.sequence import Sequence
    from sparsebalance.kernels.qwen2 import IGNORE_INDEX
    from sparsebalance.simulator.budget import Budget
    from sparsebalance.simulator.plan import MicroBatch
    from sparsebalance.titan.loader import microbatch_tensors

    rng = np.random.default_rng(3)
    docs = [Sequence(id=i, length=n, tokens=rng.integers(1, 256, n)) for i, n in enumerate((5, 3, 7))]
    mb = MicroBatch(tuple(docs), pad=9)
    inp, labels = microbatch_tensors(mb, Budget.per_layer((1, 2, 3, 4)), layers=4)
    ids, pos = inp["input"][0], inp["positions"][0]
    assert ids.shape == labels.shape[1:] == pos.shape == (24,)
    want_ids = np.concatenate([d.tokens for d in docs] + [np.zeros(9)])
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    np.testing.assert_array_equal(pos.numpy(), np.concatenate([np.arange(n) for n in (5, 3, 7, 9)]))
    lab = labels[0].numpy()
    start = 0
    for d in docs:  # next token inside the document, ignored at its last token
        np.testing.assert_array_equal(lab[start:start + d.length - 1], d.tokens[1:])
        assert lab[start + d.length - 1] == IGNORE_INDEX
        start += d.length
    assert (lab[15:] == IGNORE_INDEX).all()  # the pad carries no label
    assert inp["moba_cu_seqlens"][0].tolist() == [0, 5, 8, 15]
    assert inp["moba_cu_seqlens"].dtype == torch.int32
    assert inp["moba_topk"][0].tolist() == [[1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4]]


def test_every_dp_rank_plans_the_same_step_without_a_collective():
    """FSDP 2: two loaders (ranks 0 and 1) built apart; their plans are equal, their micro-batches
    the plan's own rank rows, and together they hold the global batch once."""
    from sparsebalance.titan.loader import SparseBalanceLoader, StepPlanner

    setup = _setup(2, "sparsebalance_tiny_fsdp2")
    cfg = SparseBalanceLoader.Config(setup=setup)
    loaders = [SparseBalanceLoader(cfg, dp_world_size=2, dp_rank=r) for r in (0, 1)]
    its = [iter(ld) for ld in loaders]
    m = setup.microbatches
    for _ in range(2):
        got = [[next(it) for _ in range(m)] for it in its]
        plan0, plan1 = loaders[0].plans[-1][0], loaders[1].plans[-1][0]
        assert plan0 == plan1
        ids = []
        for r, rows in enumerate(got):
            for j, (inp, _) in enumerate(rows):
                mb = plan0.ranks[r][j]
                assert inp["input"].shape[1] == mb.tokens
                ids += [s.id for s in mb.sequences]
        assert len(ids) == len(set(ids)) == setup.run.cluster.global_batch
    ref = StepPlanner(setup)
    assert [ref.next()[0] for _ in range(2)] == [p for p, _ in loaders[0].plans]


def test_pp_slots_have_one_shape_and_at_least_one_document():
    from sparsebalance.titan.loader import SparseBalanceLoader

    setup = _setup()
    loader = SparseBalanceLoader(SparseBalanceLoader.Config(setup=setup), dp_world_size=1, dp_rank=0)
    it = iter(loader)
    for _ in range(3 * setup.microbatches):
        inp, labels = next(it)
        assert inp["input"].shape == (1, 2048) == labels.shape
        assert inp["moba_cu_seqlens"].shape[1] >= 2


@pytest.mark.parametrize("stop_after", [8, 9, 11])  # a step boundary, one past it, mid-step
def test_state_dict_restores_the_exact_next_microbatch(stop_after):
    import torch

    from sparsebalance.titan.loader import SparseBalanceLoader

    setup = _setup()
    cfg = SparseBalanceLoader.Config(setup=setup)
    a = SparseBalanceLoader(cfg, dp_world_size=1, dp_rank=0)
    it = iter(a)
    for _ in range(stop_after):
        next(it)
    state = a.state_dict()
    rest = [next(it) for _ in range(6)]
    b = SparseBalanceLoader(cfg, dp_world_size=1, dp_rank=0)
    b.load_state_dict(state)
    again = [x for x, _ in zip(iter(b), range(6))]
    for (x, lx), (y, ly) in zip(rest, again):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k
        assert torch.equal(lx, ly)
    # the policies' state moved on identically (SAB's EMA)
    assert a.planner.prepared.batching.ema == b.planner.prepared.batching.ema
