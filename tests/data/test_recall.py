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


@pytest.mark.parametrize("length", [min_length(4), 64, 257, 1024])
def test_example_structure_and_answers(length):
    task = RecallTask(RecallConfig(pairs=4))
    e = task.example(TRAIN, 7, length)
    t = e.tokens
    assert len(t) == length and t.dtype == np.int64
    ctx = length - 1 - 2 * 4
    assert t[ctx] == SEPARATOR and np.all(e.positions == ctx + 1 + 2 * np.arange(4))
    keys, answers = t[e.positions], e.answers
    assert len(set(keys.tolist())) == 4 and np.all((keys >= KEY0) & (keys < VALUE0))
    assert len(set(answers.tolist())) == 4 and np.all(answers >= VALUE0)
    # the answer of each query is the token after the same key in the context (brute force)
    for k, v in zip(keys, answers):
        where = np.flatnonzero(t[:ctx] == k)
        assert len(where) == 1 and t[where[0] + 1] == v
    others = np.setdiff1d(np.arange(ctx), np.concatenate([np.flatnonzero(np.isin(t[:ctx], keys)) + d
                                                          for d in (0, 1)]))
    assert np.all(t[others] == FILLER)


def test_pairs_fall_in_different_blocks_when_there_is_room():
    task = RecallTask(RecallConfig(pairs=4))
    for i in range(20):
        e = task.example(TRAIN, i, 1024)
        keys = e.tokens[e.positions]
        blocks = {int(np.flatnonzero(e.tokens == k)[0]) // 32 for k in keys}
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
                                      ({"min_length": 10}, "min_length"),
                                      ({"max_length": 32}, "max_length"), ({"tail": -1}, "tail")])
def test_bad_config(kw, field):
    with pytest.raises(ConfigError, match=field):
        RecallConfig(**kw)
