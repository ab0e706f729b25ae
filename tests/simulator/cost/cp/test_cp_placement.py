"""A CP degree per sequence (``cluster.cp_split = "per-sequence"``): the placement against brute
force, its closed forms, the stage cost against the whole split, and the headline on a packed mix."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import h200_4x8, qwen25_3b
from sparsebalance.simulator.cost.cp.placement import place

ROOT = Path(__file__).resolve().parents[4]


def _brute(cost, degrees, cp):
    opts = [(j, g) for j, d in enumerate(degrees) for g in range(0, cp, d)]
    best = np.inf
    for combo in itertools.product(opts, repeat=len(cost)):
        load = np.zeros(cp)
        for i, (j, g) in enumerate(combo):
            if not np.isfinite(cost[i, j]):
                break
            load[g:g + degrees[j]] += cost[i, j]
        else:
            best = min(best, load.max())
    return best


def test_placement_is_near_the_optimum_and_never_worse_than_the_whole_split():
    """Oracle: every (degree, aligned group) of every sequence, enumerated (cp 4, up to 4
    sequences); rings cost their share plus an overhead that grows with the degree."""
    rng = np.random.default_rng(0)
    degrees, cp, ratios = (1, 2, 4), 4, []
    for _ in range(150):
        n = int(rng.integers(1, 5))
        work = rng.uniform(0.2, 4, n)
        cost = np.stack([work / d + rng.uniform(0, 0.3) * np.log2(d) for d in degrees], axis=1)
        cost[rng.random(n) < 0.2, 1:] = np.inf  # too short to split
        deg, start, load = place(cost, degrees, cp)
        again = np.zeros(cp)
        for i in range(n):
            assert start[i] % deg[i] == 0 and np.isfinite(cost[i, degrees.index(deg[i])])
            again[start[i]:start[i] + deg[i]] += cost[i, degrees.index(deg[i])]
        assert np.allclose(again, load)
        if np.isfinite(cost[:, -1]).all():
            assert load.max() <= cost[:, -1].sum() * (1 + 1e-12)
        ratios.append(load.max() / _brute(cost, degrees, cp))
    assert min(ratios) >= 1 - 1e-12 and max(ratios) <= 1.25 and np.mean(ratios) <= 1.06


def test_equal_short_sequences_each_take_one_rank():
    """Closed form: cp equal sequences whose rings cost more than their share (overhead h > 0)
    end in one sequence's time on one rank, not cp x the ring's."""
    cp, t, h = 8, 1.0, 0.05
    degrees = (1, 2, 4, 8)
    cost = np.array([[t / d + h * (d > 1) for d in degrees]] * cp)
    deg, start, load = place(cost, degrees, cp)
    assert deg.tolist() == [1] * cp and sorted(start.tolist()) == list(range(cp))
    assert np.allclose(load, t)


def _models(**cluster):
    from sparsebalance.simulator.cost.latency import load_latency_model

    model = qwen25_3b()
    base = replace(h200_4x8(), pp=2, dp=1, tp=1, cp=16, global_batch=8, cp_layout="stripe",
                         cp_comm="hierarchical", **cluster)
    return (load_latency_model("analytical-h200", model, base),
            load_latency_model("analytical-h200", model, replace(base, cp_split="per-sequence")))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_long_sequences_ring_over_the_whole_group_at_the_whole_split_cost():
    """Sequences long enough that the whole group is best: alone in its micro-batch, the same stage
    times as cp_split = "whole" (tokens divisible by cp, so every rank holds exactly 1/cp); two of
    them ring one after another here, so no faster than "whole", which runs them on one ring."""
    whole, per = _models()
    one = (262144,)
    assert per.cp_placement(one, 16).degree.tolist() == [16]
    a, b = whole.stage_times([one], [16]), per.stage_times([one], [16])
    for mode in ("F", "B"):
        assert np.allclose(a[mode], b[mode], rtol=1e-12)
    mb = (262144, 131072)
    assert per.cp_placement(mb, 16).degree.tolist() == [16, 16]
    a, b = whole.stage_times([mb], [16]), per.stage_times([mb], [16])
    for mode in ("F", "B"):
        assert (a[mode] <= b[mode] * (1 + 1e-12)).all()
    # the scalar view is the array form's element
    assert per.stage_time(mb, 16, 1, backward=True) == b["B"][1, 0]
    assert per.microbatch_latency(mb, 16) == pytest.approx(float(b["F"].sum() + b["B"].sum()), rel=1e-12)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_short_sequences_stop_paying_the_ring():
    """Sixteen 8K sequences on CP 16: one per rank beats sixteen 16-way rings, and the busiest
    rank's tokens (what P2P and memory see) are one sequence's."""
    whole, per = _models()
    mb = (8192,) * 16
    pl = per.cp_placement(mb, 8)
    assert pl.degree.tolist() == [1] * 16 and sorted(pl.start.tolist()) == list(range(16))
    assert per.cp_tokens(mb, 8) == 8192 * 16 and whole.cp_tokens(mb, 8) == 8192 * 16
    assert per.microbatch_latency(mb, 8) < 0.8 * whole.microbatch_latency(mb, 8)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_per_sequence_degrees_beat_the_whole_split_on_a_packed_mix():
    """Headline: the paper's bimodal mix packed to 256K tokens on CP 16 over two nodes, SAB + DST,
    seeded: a CP degree per sequence is faster than splitting every sequence 16 ways."""
    from sparsebalance.runconfig import load_run_config
    from sparsebalance.runner import run_simulation

    times = {}
    for split in ("whole", "per-sequence"):
        cfg = load_run_config(ROOT / "examples" / "cp16_per_sequence.toml",
                              {"iterations": 4, "cluster.cp_split": split})
        m = run_simulation(cfg, progress=False).metrics
        times[split] = float(m["iteration_time_s"].mean())
        assert (m["cp_worker_imbalance"] >= 1 - 1e-9).all()
    assert times["whole"] / times["per-sequence"] > 1.05


@pytest.mark.parametrize("overrides,match", [
    ({"cluster.cp": 1, "cluster.cp_comm": "ring"}, "needs cp > 1"),
    ({"policy.tuning": "dst-cp"}, "sab-order and dst-cp"),
    ({"policy.batching": "sab-order"}, "sab-order and dst-cp"),
    ({"policy.per_layer": True}, "per_layer"),
    ({"cluster.cp_split": "half"}, "whole, per-sequence"),
])
def test_bad_per_sequence_input_is_one_line(overrides, match):
    from sparsebalance.runconfig import load_run_config

    with pytest.raises(ConfigError, match=match):
        load_run_config(ROOT / "examples" / "cp16_per_sequence.toml", overrides)


def test_the_real_run_refuses_per_sequence_degrees():
    from sparsebalance.realrun.config import realrun_config
    from sparsebalance.runconfig import load_run_config

    cfg = load_run_config(ROOT / "examples" / "cpu_cp2.toml", {"cluster.cp_split": "per-sequence"})
    with pytest.raises(ConfigError, match="cluster.cp_split"):
        realrun_config(cfg)
