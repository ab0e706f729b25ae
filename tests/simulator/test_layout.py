"""simulator/layout.py, the one home of the model's geometry, against closed forms and brute force:
the layer split, the placement of virtual stages, the parameters per device, the mesh order and the
block count."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest

from sparsebalance.data.sequence import blocks
from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import ClusterConfig, qwen25_3b, tiny
from sparsebalance.simulator.layout import Layout, layout_of, mesh_coords, mesh_rank, split_layers


@pytest.mark.parametrize("layers,chunks", [(4, 2), (4, 3), (7, 4), (24, 8), (5, 5), (36, 8), (1, 1)])
def test_split_covers_every_layer_once_contiguous_and_even(layers, chunks):
    ranges = split_layers(layers, chunks)
    assert [i for r in ranges for i in r] == list(range(layers))
    sizes = [len(r) for r in ranges]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    assert sizes.count(math.ceil(layers / chunks)) == (layers % chunks or chunks)


def test_split_refuses_more_chunks_than_layers():
    with pytest.raises(ConfigError, match="exceeds model.layers = 3"):
        split_layers(3, 4)


@pytest.mark.parametrize(("layers", "chunks", "fewer", "sizes"), [
    (126, 32, 1, [3] + [4] * 30 + [3]),  # Llama 3 405B on 16 x 2 virtual stages (section 3.3.2)
    (10, 4, 1, [2, 3, 3, 2]), (11, 4, 1, [3, 3, 3, 2]), (8, 2, 0, [4, 4]), (8, 2, 2, [4, 4]),
    (12, 3, 2, [4, 5, 3])])
def test_split_with_lighter_end_stages_by_hand(layers, chunks, fewer, sizes):
    ranges = split_layers(layers, chunks, fewer)
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(layers))


@pytest.mark.parametrize("seed", range(6))
def test_split_with_lighter_end_stages_brute_force(seed):
    """The first and the last stage hold ``fewer`` layers less than an even split of the layers plus
    2 x fewer gives them; the stages between hold what that split gives them."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        chunks = int(rng.integers(2, 12))
        fewer = int(rng.integers(0, 3))
        layers = int(rng.integers(chunks * (fewer + 1), 6 * chunks))
        sizes = [len(r) for r in split_layers(layers, chunks, fewer)]
        even = [len(r) for r in split_layers(layers + 2 * fewer, chunks)]
        if min(even[0], even[-1]) - fewer < 1:
            continue
        assert sizes == [even[0] - fewer, *even[1:-1], even[-1] - fewer] and sum(sizes) == layers


def test_split_with_lighter_end_stages_refuses_an_empty_stage():
    with pytest.raises(ConfigError, match=r"^cluster.end_stage_layers_fewer: 1 fewer layers .* \[1, 2, 0\]"):
        split_layers(3, 3, 1)
    with pytest.raises(ConfigError, match="pp x virtual_stages >= 2"):
        split_layers(4, 1, 1)
    with pytest.raises(ConfigError, match="^cluster.end_stage_layers_fewer"):
        Layout(replace(tiny(), layers=4), ClusterConfig(pp=4, global_batch=4, end_stage_layers_fewer=1))


def test_layout_places_lighter_end_stages_across_virtual_stages():
    """Interleaved: the lighter ends are virtual stages 0 (device 0, the embedding) and the last
    (device pp - 1, the LM head); every device but the two end ones holds the even count."""
    lay = Layout(replace(tiny(), layers=14), ClusterConfig(pp=2, schedule="interleaved", virtual_stages=2,
                                                            global_batch=4, end_stage_layers_fewer=1))
    assert [len(r) for r in lay.vstage_ranges] == [3, 4, 4, 3]
    assert lay.stage_layers(0, 0) == range(3) and lay.stage_layers(1, 1) == range(11, 14)


def test_loop_placement_numbers_chunks_as_interleaving_does():
    lay = Layout(replace(tiny(), layers=8), ClusterConfig(pp=2, schedule="interleaved", virtual_stages=2,
                                                           global_batch=4))
    assert lay.devices == (0, 1, 0, 1) and lay.vstages_of(0) == (0, 2) and lay.vstages_of(1) == (1, 3)
    assert lay.stage_layers(0, 0) == range(2) and lay.stage_layers(1, 0) == range(2, 4)
    assert lay.stage_layers(0, 1) == range(4, 6) and lay.stage_layers(1, 1) == range(6, 8)
    np.testing.assert_array_equal(lay.layer_counts, [2.0, 2.0, 2.0, 2.0])
    with pytest.raises(ConfigError, match="chunk in 0..1"):
        lay.stage_layers(0, 2)


def test_v_placement_puts_first_and_last_vstage_on_device_0():
    lay = Layout(qwen25_3b(), ClusterConfig(pp=4, schedule="zbv", virtual_stages=2, global_batch=8))
    assert lay.devices == (0, 1, 2, 3, 3, 2, 1, 0)
    assert [lay.vstages_of(d) for d in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


@pytest.mark.parametrize("cluster", [ClusterConfig(pp=4, dp=2), ClusterConfig(pp=3, schedule="interleaved",
                                                                              virtual_stages=2, global_batch=6),
                                     ClusterConfig(pp=4, schedule="zbv", virtual_stages=2, global_batch=8)])
@pytest.mark.parametrize("tied", [True, False])
def test_device_params_add_up_to_the_model_with_a_tied_head_counted_where_it_lives(cluster, tied):
    m = replace(qwen25_3b(), tie_embeddings=tied)
    lay = Layout(m, cluster)
    total = sum(lay.device_params(d) for d in range(cluster.pp))
    same_device = lay.devices[0] == lay.devices[-1]
    # layers + embedding + final norm, plus the head unless it is tied and on the embedding's device
    want = m.layers * m.params_per_layer + m.embedding_params + m.hidden
    want += 0 if (tied and same_device) else m.embedding_params
    assert total == want


def test_mesh_order_is_dp_pp_tp_outside_in_and_round_trips():
    dp, pp, tp = 3, 4, 2
    ranks = [mesh_rank((d, s, t), (pp, tp)) for d, s, t in itertools.product(range(dp), range(pp), range(tp))]
    assert ranks == list(range(dp * pp * tp))  # t fastest, then s, then d: (d pp + s) tp + t
    assert all(mesh_coords(r, (pp, tp)) == (r // (pp * tp), r // tp % pp, r % tp) for r in ranks)
    assert all(mesh_rank(mesh_coords(r, (pp, tp)), (pp, tp)) == r for r in ranks)
    # a fourth dimension is one more size: (d, s, c, t) with c of 2 between pp and tp
    four = [mesh_rank(x, (pp, 2, tp)) for x in itertools.product(range(dp), range(pp), range(2), range(tp))]
    assert four == list(range(dp * pp * 2 * tp)) and mesh_coords(four[-1], (pp, 2, tp)) == (dp - 1, pp - 1, 1, tp - 1)


def test_blocks_is_the_ceiling_against_brute_force():
    for length, block in itertools.product(range(1, 300, 7), (16, 64, 128)):
        assert blocks(length, block) == len(range(0, length, block))
    np.testing.assert_array_equal(blocks(np.array([1, 128, 129, 4096]), 128), [1, 1, 2, 32])


def test_layout_of_is_cached_per_model_and_cluster():
    cl = ClusterConfig(pp=2, global_batch=4)
    assert layout_of(tiny(), cl) is layout_of(tiny(), cl)
    assert layout_of(tiny(), cl) is not layout_of(tiny(), replace(cl, pp=1))
