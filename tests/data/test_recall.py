"""The recall task generator: determinism, structure, answers, streams, length mix, errors."""

import numpy as np
import pytest

from sparsebalance.data.recall import (
    FILLER,
    HELDOUT,
    KEY0,
    SEPARATOR,
    TRAIN,
    VALUE0,
    RecallConfig,
    RecallTask,
    min_length,
)
from sparsebalance.errors import ConfigError


@pytest.mark.parametrize("pairs_as,queries", [("one", "sample"), ("two", "each"), ("two", "sample")])
@pytest.mark.parametrize("length", [min_length(4), 64, 257, 1024])
def test_example_structure_and_answers(length, pairs_as, queries):
    cfg = RecallConfig(pairs=4, pairs_as=pairs_as, queries=queries, n_keys=10, n_values=10)
    e = RecallTask(cfg).example(TRAIN, 7, length)
    t = e.tokens
    assert len(t) == length and t.dtype == np.int64
    ctx = length - 1 - 2 * 4
    assert t[ctx] == SEPARATOR and np.all(e.positions == ctx + 1 + 2 * np.arange(4))
    keys, answers = t[e.positions], e.answers
    assert np.all((keys >= KEY0) & (keys < KEY0 + 10)) and np.all((answers >= VALUE0) & (answers < VALUE0 + 10))
    if queries == "each":
        assert len(set(keys.tolist())) == 4
    # brute force: decode every pair of the context, then each query's answer is its key's value
    if pairs_as == "two":
        spots = np.flatnonzero((t[:ctx] >= KEY0) & (t[:ctx] < KEY0 + 10))
        table = {int(t[i]): int(t[i + 1]) for i in spots}
        used = np.concatenate([spots, spots + 1])
    else:
        spots = np.flatnonzero(t[:ctx] != FILLER)
        code = t[spots] - KEY0 - 10
        table = {KEY0 + int(c // 10): VALUE0 + int(c % 10) for c in code}
        used = spots
    assert len(table) == 4 and len(set(table.values())) == 4
    for k, v in zip(keys, answers):
        assert table[int(k)] == v
    assert np.all(t[np.setdiff1d(np.arange(ctx), used)] == FILLER)


def test_pairs_fall_in_different_blocks_when_there_is_room():
    task = RecallTask(RecallConfig(pairs=4))
    for i in range(20):
        e = task.example(TRAIN, i, 1024)
        ctx = 1024 - 9
        blocks = {int(p) // 32 for p in np.flatnonzero(e.tokens[:ctx] != FILLER)}
        assert len(blocks) == 4


def test_deterministic_and_streams_are_separate():
    a, b = RecallTask(RecallConfig(seed=3)), RecallTask(RecallConfig(seed=3))
    np.testing.assert_array_equal(a.example(TRAIN, 5, 300).tokens, b.example(TRAIN, 5, 300).tokens)
    assert not np.array_equal(a.example(TRAIN, 5, 300).tokens, a.example(HELDOUT, 5, 300).tokens)
    assert not np.array_equal(a.example(TRAIN, 5, 300).tokens,
                              RecallTask(RecallConfig(seed=4)).example(TRAIN, 5, 300).tokens)
    held = a.heldout(256, 3)
    assert [len(e.tokens) for e in held] == [256] * 3


def test_length_mix_is_a_truncated_pareto():
    """Inverse-transform draws: within bounds; the share below the median of the law ~ 1/2."""
    cfg = RecallConfig(min_length=64, max_length=1024, tail=0.5)
    task = RecallTask(cfg)
    lens = np.array([task.train_length(i) for i in range(4000)])
    assert lens.min() >= 64 and lens.max() <= 1024
    lo, hi = 64 ** -0.5, 1024 ** -0.5
    median = (lo - 0.5 * (lo - hi)) ** -2.0
    assert abs(np.mean(lens <= median) - 0.5) < 0.03
    seqs = task.train_sequences(5)
    assert [s.length for s in seqs] == [task.train_length(i) for i in range(5)]


@pytest.mark.parametrize("kw,field", [({"pairs": 0}, "pairs"), ({"n_keys": 200}, "n_keys"),
                                      ({"n_keys": 20, "n_values": 20}, "n_values"),
                                      ({"queries": "all"}, "queries"), ({"pairs_as": "three"}, "pairs_as"),
                                      ({"min_length": 10}, "min_length"),
                                      ({"max_length": 32}, "max_length"), ({"tail": -1}, "tail")])
def test_bad_config(kw, field):
    with pytest.raises(ConfigError, match=field):
        RecallConfig(**kw)


@pytest.mark.parametrize("length", [1024, 4096, 8192])
def test_long_examples_spread_pairs_over_the_blocks_and_label_only_the_answers(length):
    """The measured experiment's lengths: pair i lies in the i-th quarter of the context (so the first
    lies thousands of tokens back, in one of the first n / 4 MoBA blocks of 32), and the labels are the
    answers at the queried keys' positions, IGNORE_INDEX everywhere else."""
    from sparsebalance.data.sequence import IGNORE_INDEX

    task = RecallTask(RecallConfig(min_length=1024, max_length=8192, tail=1.0))
    for i in range(5):
        e = task.example(TRAIN, i, length)
        ctx = length - 9
        spots = np.flatnonzero(e.tokens[:ctx] != FILLER)
        assert len(spots) == 4
        quarter = ctx / 4
        assert all(q * quarter - 1 <= s < (q + 1) * quarter for q, s in enumerate(spots))
        assert spots[0] // 32 < (ctx // 32) // 4 + 1 and len({int(s) // 32 for s in spots}) == 4
        lab = e.labels
        assert lab.dtype == np.int64 and len(lab) == length
        assert np.all(lab[e.positions] == e.answers)
        assert np.all(np.delete(lab, e.positions) == IGNORE_INDEX)


def test_heavy_tailed_long_mix():
    """tail 1 on [1024, 8192] (density ~ L^-2): in bounds, the median of the law at 2 x 1024 x 8192 /
    (1024 + 8192) tokens, about an eighth of the examples above 4,096 tokens."""
    task = RecallTask(RecallConfig(min_length=1024, max_length=8192, tail=1.0))
    lens = np.array([task.train_length(i) for i in range(4000)])
    assert lens.min() >= 1024 and lens.max() <= 8192
    median = 2 * 1024 * 8192 / (1024 + 8192)
    assert abs(np.mean(lens <= median) - 0.5) < 0.03
    above = (1 / 4096 - 1 / 8192) / (1 / 1024 - 1 / 8192)  # the law's share above 4,096
    assert abs(np.mean(lens > 4096) - above) < 0.02
