"""Schedule orders against torch.distributed.pipelining (when installed) and hand-written orders."""

from __future__ import annotations

from collections import Counter

import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.schedule.schedules import stage_orders


def _parse(text: str, stage: int) -> list[tuple[str, int, int]]:
    return [(tok[0], stage, int(tok[1:])) for tok in text.split()]


def test_1f1b_matches_the_textbook_picture():
    # PipeDream-flush / Megatron 1F1B for p = 4, m = 6 (torch's Schedule1F1B executes the same order)
    expected = [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
    ]
    assert stage_orders("1f1b", 4, 6) == [_parse(t, s) for s, t in enumerate(expected)]


def test_1f1b_with_m_equal_p_has_no_steady_forward_on_stage_0():
    assert stage_orders("1f1b", 2, 2) == [_parse("F0 F1 B0 B1", 0), _parse("F0 B0 F1 B1", 1)]


def test_gpipe_is_all_forwards_then_all_backwards():
    assert stage_orders("gpipe", 2, 3)[1] == _parse("F0 F1 F2 B0 B1 B2", 1)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("pp,m", [(1, 1), (2, 4), (3, 6), (4, 8), (4, 12)])
def test_every_action_once_and_forward_before_backward(schedule, v, pp, m):
    orders = stage_orders(schedule, pp, m, v)
    for s, acts in enumerate(orders):
        want = Counter((op, c * pp + s, j) for op in "FB" for c in range(v) for j in range(m))
        assert Counter(acts) == want
        pos = {a: i for i, a in enumerate(acts)}
        assert all(pos[("F", vs, j)] < pos[("B", vs, j)] for _, vs, j in acts)


def _torch_action(a) -> tuple[str, int, int]:
    return ("F" if a.computation_type.name == "FORWARD" else "B", a.stage_index, a.microbatch_index)


def test_gpipe_matches_torch():
    torch_sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    for pp, m in [(1, 3), (2, 2), (4, 3), (4, 8)]:
        o = object.__new__(torch_sched.ScheduleGPipe)
        o._num_stages, o._n_microbatches = pp, m
        ref = o._get_pipeline_order()
        for s in range(pp):
            theirs = [_torch_action(a) for a in ref[s]
                      if a is not None and a.computation_type.name in ("FORWARD", "FULL_BACKWARD")]
            assert stage_orders("gpipe", pp, m)[s] == theirs


def test_interleaved_matches_torch():
    torch_sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    cases = 0
    for pp in range(1, 5):
        for v in range(2, 4):
            for m in range(1, 11):
                rounds = max(1, m // pp)
                if m % rounds:
                    continue
                o = object.__new__(torch_sched.ScheduleInterleaved1F1B)
                o.n_local_stages, o.pp_group_size, o._n_microbatches = v, pp, m
                o.microbatches_per_round = m // rounds
                ours = stage_orders("interleaved", pp, m, v)
                for s in range(pp):
                    theirs = [_torch_action(a) for a in o._calculate_single_rank_operations(s)
                              if a is not None]
                    assert ours[s] == theirs, (pp, v, m, s)
                cases += 1
    assert cases > 50


@pytest.mark.parametrize("args,needle", [
    (("1f1b", 4, 3, 1), "1f1b needs at least pp = 4"),
    (("interleaved", 2, 5, 2), "multiple of rounds"),
    (("interleaved", 2, 4, 1), "virtual_stages"),
    (("gpipe", 2, 4, 2), "virtual_stages"),
    (("zb", 2, 4, 1), "schedule"),
    (("zbv", 4, 8, 3), "even count"),
    (("zbv", 4, 8, 1), "virtual_stages"),
    (("dualpipev", 4, 7, 2), "at least 2 x pp = 8"),
    (("zb-h1", 4, 9, 1), "multiple of rounds"),
    (("zb-h1", 4, 8, 2), "virtual_stages"),
    (("gpipe", 0, 4, 1), "pp"),
    (("gpipe", 2, 0, 1), "microbatches"),
])
def test_bad_schedule_parameters_raise_config_error(args, needle):
    with pytest.raises(ConfigError, match=needle):
        stage_orders(*args)


# -- zero-bubble schedules against torch 2.13 -------------------------------------------------------
_KIND = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
_TORCH_SCHEDULES = {"zb-h1": ("ScheduleInterleavedZeroBubble", 1), "zbv": ("ScheduleZBVZeroBubble", 2),
                    "dualpipev": ("ScheduleDualPipeV", 2)}


def _torch_orders(cls, pp: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """torch's per-rank compute orders, built by the schedule's own constructor (which validates the
    (pp, m) and lowers the orders to send/recv, raising on a schedule it cannot run). The stages are
    stand-ins: the constructor reads only their group size, rank, stage count and module."""
    from types import SimpleNamespace

    stages = [SimpleNamespace(group_size=pp, group_rank=0, num_stages=pp * v, submod=None,
                              stage_index=i, stage_index_to_group_rank=None) for i in range(v)]
    sched = cls(stages, m)
    out = []
    for rank in range(pp):
        acts = []
        for a in sched.pipeline_order[rank]:
            if a is None:
                continue
            for sub in (a.sub_actions or (a,)):  # OVERLAP_F_B: its F and B, run one after the other
                acts.append((_KIND[sub.computation_type.name], sub.stage_index, sub.microbatch_index))
        out.append(acts)
    return out


@pytest.mark.parametrize("schedule", list(_TORCH_SCHEDULES))
def test_zero_bubble_orders_equal_torch_for_every_accepted_pp_and_m(schedule):
    import logging

    torch_sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls_name, v = _TORCH_SCHEDULES[schedule]
    cls = getattr(torch_sched, cls_name)
    compared = refused = 0
    logging.disable(logging.WARNING)
    try:
        for pp in range(1, 9):
            for m in range(1, 25):
                try:
                    theirs = _torch_orders(cls, pp, m, v)
                except ValueError:
                    with pytest.raises(ConfigError):  # what torch refuses, we refuse
                        stage_orders(schedule, pp, m, v)
                    refused += 1
                    continue
                assert stage_orders(schedule, pp, m, v) == theirs, (schedule, pp, m)
                compared += 1
    finally:
        logging.disable(logging.NOTSET)
    assert compared >= 100 and compared + refused == 8 * 24


@pytest.mark.parametrize("schedule,v", [("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)])
@pytest.mark.parametrize("pp,m", [(1, 2), (2, 4), (3, 6), (4, 8), (4, 12)])
def test_split_schedules_run_each_backward_once_f_before_i_before_w(schedule, v, pp, m):
    from sparsebalance.simulator.layout import placement

    orders = stage_orders(schedule, pp, m, v)
    dev = placement(schedule, pp, v)
    for d, acts in enumerate(orders):
        pos = {a: i for i, a in enumerate(acts)}
        assert len(pos) == len(acts)
        for vs in (x for x in range(pp * v) if dev[x] == d):
            for j in range(m):
                assert ("F", vs, j) in pos
                if ("B", vs, j) in pos:  # a whole backward, or I then W
                    assert ("I", vs, j) not in pos and pos[("F", vs, j)] < pos[("B", vs, j)]
                else:
                    assert pos[("F", vs, j)] < pos[("I", vs, j)] < pos[("W", vs, j)]
        assert all(dev[a[1]] == d for a in acts)


def test_v_placement_pairs_first_and_last_stage():
    from sparsebalance.simulator.config import ClusterConfig, qwen25_3b
    from sparsebalance.simulator.layout import layout_of, placement

    assert placement("zbv", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert placement("interleaved", 4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    dual = ClusterConfig(pp=3, dp=1, global_batch=6, schedule="dualpipev", virtual_stages=2)
    assert layout_of(qwen25_3b(), dual).vstages_of(0) == (0, 5)
    zb = ClusterConfig(pp=3, dp=1, global_batch=3, schedule="zb-h1")
    assert layout_of(qwen25_3b(), zb).vstages_of(2) == (2,)


def test_zb_h1_defers_weight_gradients_on_later_stages():
    # pp = 3, m = 4: stage s starts its Ws s steps late, filling the drain bubble of 1F1B
    orders = stage_orders("zb-h1", 3, 4)
    text = [" ".join(f"{k}{j}" for k, _, j in o) for o in orders]
    assert text == ["F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3",
                    "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
                    "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3"]
