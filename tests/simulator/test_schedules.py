"""Schedule orders against torch.distributed.pipelining (when installed) and hand-written orders."""

from __future__ import annotations

from collections import Counter

import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.schedules import stage_orders


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
    (("gpipe", 0, 4, 1), "pp"),
    (("gpipe", 2, 0, 1), "microbatches"),
])
def test_bad_schedule_parameters_raise_config_error(args, needle):
    with pytest.raises(ConfigError, match=needle):
        stage_orders(*args)
