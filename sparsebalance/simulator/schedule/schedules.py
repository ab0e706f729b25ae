"""Per-device action orders of the pipeline schedules, their stage placement and their rules.

An *action* is ``(op, vstage, microbatch)`` with ``op`` in ``"F"``/``"B"`` (and ``"I"``/``"W"``
for the split backward of the zero-bubble schedules, :mod:`.zerobubble`) and ``vstage`` the
virtual-stage index (the ``stage_index`` of torch.distributed.pipelining: virtual stage ``vs`` holds
the ``vs``-th slice of layers). **Placement** (:func:`placement`): under the loop placement of GPipe,
1F1B, interleaved 1F1B and ZB-H1, vstage ``c * pp + s`` (chunk ``c``) lives on device ``s``; under
the V placement of ZB-V and DualPipeV, device ``d`` holds vstages ``d`` and ``2 pp - 1 - d``, so the
first and the last vstage share device 0 and the two middle ones share device pp - 1 (their
transfer is local: no P2P). Orders are the ones torch.distributed.pipelining executes; the idle
slots (``None``) of its schedule IR are dropped, because the engine derives waiting from data
dependencies. ``orders[d]`` is the list of device ``d``.

GPipe (``ScheduleGPipe``): every stage runs F0 .. F(m-1), then B0 .. B(m-1). Any m >= 1.

1F1B (``Schedule1F1B._step_microbatches``): stage s runs ``w = min(m, pp - s)`` warm-up forwards,
then alternates B, F (B0, Fw, B1, Fw+1, ...) until every forward is issued, then the remaining
backwards. (Same order as Megatron's ``pp - s - 1`` warm-ups followed by F, B pairs.) torch refuses
m < pp; so do we.

Interleaved 1F1B (``ScheduleInterleaved1F1B``, depth first): with ``rounds = max(1, m // pp)`` and
``mpr = m // rounds`` micro-batches per round (m must be a multiple of ``rounds``), stage s has
``warmup = min((v - 1) * mpr + 2 * (pp - 1 - s), v * m)`` forward-only steps; step ``k`` forwards on
chunk ``(k // mpr) % v``, and backward step ``k`` works on chunk ``v - 1 - ((k - warmup) // mpr) % v``;
each chunk takes its micro-batches in order 0, 1, .... Steady steps issue F then B; cool-down steps
issue only B.
"""

from __future__ import annotations

from sparsebalance.errors import ConfigError, check_choice, check_positive
from sparsebalance.simulator.config import SCHEDULES, SPLIT_SCHEDULES, V_SCHEDULES
from sparsebalance.simulator.schedule.zerobubble import dualpipev_order, zb_h1_order, zbv_order

#: One scheduled action: (op "F", "B", "I" or "W", virtual stage index, micro-batch index).
Action = tuple[str, int, int]


def splits_backward(schedule: str) -> bool:
    """Whether ``schedule`` runs (some of) its backwards as I + W (zb-h1, zbv, dualpipev)."""
    return schedule in SPLIT_SCHEDULES


def fewest_microbatches(schedule: str, pp: int) -> int:
    """Micro-batches per replica a packing policy aims for at least: pp (every stage busy in the
    steady state), 2 pp for dualpipev (its minimum)."""
    return 2 * pp if schedule == "dualpipev" else pp


def validate_schedule(schedule: str, pp: int, m: int, virtual_stages: int = 1) -> None:
    """Raise ConfigError unless ``schedule`` can run ``m`` micro-batches on ``pp`` stages."""
    check_choice(schedule, "schedule", SCHEDULES)
    check_positive(pp, "pp")
    check_positive(m, "microbatches")
    check_positive(virtual_stages, "virtual_stages")
    if schedule in V_SCHEDULES:
        if virtual_stages != 2:
            raise ConfigError(f"virtual_stages: {schedule} places exactly 2 stages per device in a V "
                              f"(2 x pp = {2 * pp} stages, an even count); got {virtual_stages}")
        if schedule == "dualpipev" and m < 2 * pp:
            raise ConfigError(f"microbatches: dualpipev needs at least 2 x pp = {2 * pp} micro-batches "
                              f"per replica (torch's rule), got {m}")
        return
    if schedule in ("interleaved", "zb-h1"):
        rounds = max(1, m // pp)
        if m % rounds:
            raise ConfigError(
                f"microbatches: {schedule} needs a multiple of rounds = max(1, m // pp) = {rounds} "
                f"micro-batches (pp = {pp}), got {m}; use e.g. {rounds * (m // rounds)} or "
                f"{rounds * (m // rounds + 1)}")
    if schedule == "interleaved":
        if virtual_stages < 2:
            raise ConfigError(f"virtual_stages: the interleaved schedule needs >= 2, got {virtual_stages}")
    else:
        if virtual_stages != 1:
            raise ConfigError(f"virtual_stages: must be 1 for schedule {schedule!r}, got {virtual_stages} "
                              "(use schedule 'interleaved')")
        if schedule == "1f1b" and m < pp:
            raise ConfigError(f"microbatches: 1f1b needs at least pp = {pp} micro-batches per replica, "
                              f"got {m}; use more micro-batches or schedule 'gpipe'")


def gpipe_order(pp: int, m: int, stage: int) -> list[Action]:
    return [("F", stage, j) for j in range(m)] + [("B", stage, j) for j in range(m)]


def one_f_one_b_order(pp: int, m: int, stage: int) -> list[Action]:
    warmup = min(m, pp - stage)
    out: list[Action] = [("F", stage, j) for j in range(warmup)]
    fwd, bwd = warmup, 0
    while bwd < m:
        out.append(("B", stage, bwd))
        bwd += 1
        if fwd < m:
            out.append(("F", stage, fwd))
            fwd += 1
    return out


def interleaved_order(pp: int, m: int, stage: int, virtual_stages: int) -> list[Action]:
    v = virtual_stages
    rounds = max(1, m // pp)
    mpr = m // rounds
    total = v * m
    warmup = min((v - 1) * mpr + 2 * (pp - 1 - stage), total)
    next_f = [0] * v
    next_b = [0] * v
    out: list[Action] = []

    def fwd(k: int) -> None:
        c = (k // mpr) % v
        out.append(("F", c * pp + stage, next_f[c]))
        next_f[c] += 1

    def bwd(k: int) -> None:
        c = v - 1 - ((k - warmup) // mpr) % v
        out.append(("B", c * pp + stage, next_b[c]))
        next_b[c] += 1

    steady = total - warmup
    for k in range(warmup):
        fwd(k)
    for k in range(warmup, warmup + steady):
        fwd(k)
        bwd(k)
    for k in range(warmup + steady, warmup + steady + warmup):
        bwd(k)
    return out


def stage_orders(schedule: str, pp: int, m: int, virtual_stages: int = 1) -> list[list[Action]]:
    """The action order of every device: ``orders[d]`` is the list of device ``d``.

    Each list holds, for every vstage of the device (``layout.placement``) and micro-batch, its F and
    either its B or its I and W, exactly once; F precedes the backward, I precedes W.
    """
    validate_schedule(schedule, pp, m, virtual_stages)
    make = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order, "zb-h1": zb_h1_order,
            "zbv": zbv_order, "dualpipev": dualpipev_order}.get(schedule)
    if make is None:
        return [interleaved_order(pp, m, s, virtual_stages) for s in range(pp)]
    return [make(pp, m, s) for s in range(pp)]
