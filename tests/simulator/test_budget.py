"""The Budget value type: built and validated once, the same numbers wherever it is read."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.budget import Budget


def test_uniform_and_per_layer_read_alike_where_they_agree():
    rng = np.random.default_rng(11)
    for _ in range(20):
        layers = int(rng.integers(1, 40))
        ks = tuple(int(x) for x in rng.integers(1, 64, layers))
        b = Budget.per_layer(ks)
        assert b.layers == layers and not b.is_uniform
        assert b.expand(layers) == ks and b.ks == ks
        assert [b.at(i) for i in range(layers)] == list(ks)
        assert b.mean() == pytest.approx(sum(ks) / layers, rel=1e-15)
        k = int(rng.integers(1, 64))
        u = Budget.uniform(k)
        assert u.is_uniform and u.layers is None and u.expand(layers) == (k,) * layers
        assert u.at(int(rng.integers(0, 1000))) == k and u.mean() == float(k)


def test_forms_stay_distinct_and_hash_by_value():
    # a per-layer budget of one value is priced layer by layer, a uniform one as one look-up
    assert Budget.per_layer((4, 4)) != Budget.uniform(4)
    assert Budget.uniform(4) == Budget.uniform(4) and hash(Budget.uniform(4)) == hash(Budget.uniform(4))
    assert len({Budget.per_layer([1, 2]), Budget.per_layer((1, 2)), Budget.uniform(2)}) == 2


@pytest.mark.parametrize("b", [Budget.uniform(7), Budget.per_layer((3, 1, 9))])
def test_json_round_trip(b):
    assert Budget.from_json(json.loads(json.dumps(b.to_json()))) == b


def test_restrict_reindexes_one_stage():
    b = Budget.per_layer(range(1, 9))
    assert b.restrict(range(4, 8)) == Budget.per_layer((5, 6, 7, 8))
    assert Budget.uniform(3).restrict(range(4, 8)) == Budget.uniform(3)


def test_of_takes_ints_lists_and_numpy_ints():
    assert Budget.of(np.int64(5)) == Budget.uniform(5)
    assert Budget.of([2, 3]) == Budget.per_layer((2, 3))
    b = Budget.uniform(2)
    assert Budget.of(b) is b


@pytest.mark.parametrize("bad,match", [
    (0, "budget: must be >= 1"), (-3, "budget: must be >= 1"), (2.5, "budget: expected an int"),
    (True, "budget: expected an int"), ((), "at least one layer"), ((2, 0, 1), r"budget layer 1: must be >= 1"),
    ((2, "x"), r"budget layer 1: expected an int"),
])
def test_bad_values_are_one_line_naming_the_layer(bad, match):
    with pytest.raises(ConfigError, match=match):
        Budget(bad)


def test_bad_json_and_wrong_depth_name_where():
    with pytest.raises(ConfigError, match=r"plans.json: iteration 3 budget\[1\]"):
        Budget.from_json([1, 0], "plans.json: iteration 3 budget")
    with pytest.raises(ConfigError, match=r"one int per layer \(4\), got 3"):
        Budget.per_layer((1, 2, 3)).check_layers(4)
    with pytest.raises(ConfigError, match="outside this per-layer budget's 3 layers"):
        Budget.per_layer((1, 2, 3)).at(3)
    with pytest.raises(ConfigError, match="expected a Budget"):
        Budget.of("8")
