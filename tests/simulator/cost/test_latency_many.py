"""The vectorised latency look-ups give the scalar look-ups' values bit for bit, in and out of range."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from sparsebalance.simulator.config import h200_4x8, qwen25_3b
from sparsebalance.simulator.cost.latency import load_latency_model


@pytest.mark.parametrize("extrapolate", ["clamp", "warn"])
def test_many_equals_scalar(extrapolate):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = load_latency_model("analytical-h200", qwen25_3b(), h200_4x8(), extrapolate=extrapolate)
        rng = np.random.default_rng(0)
        L = np.concatenate([rng.integers(1, 300_000, 500), [1, 64, 128 * 1024]])  # beyond the grid too
        k = rng.integers(1, 200, len(L))
        for bw in (False, True):
            got = lm.attention_many(L, k, backward=bw)
            assert [float(x) for x in got] == [lm.attention(int(a), int(b), backward=bw) for a, b in zip(L, k)]
        tokens = np.concatenate([rng.integers(0, 2_000_000, 300), [0, 1]])
        for op, scalar in (("layer", lm.dense), ("embed", lm.embed), ("head", lm.head)):
            for bw in (False, True):
                got = lm.op_many(f"{op}_{'bwd' if bw else 'fwd'}", tokens)
                assert [float(x) for x in got] == [scalar(int(t), backward=bw) for t in tokens]
