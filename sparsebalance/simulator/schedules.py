"""Per-stage action orders of the pipeline schedules (GPipe, 1F1B, interleaved 1F1B).

An *action* is ``(op, vstage, microbatch)`` with ``op`` in ``"F"``/``"B"`` and ``vstage`` the
virtual-stage index ``chunk * pp + stage`` (the ``stage_index`` of torch.distributed.pipelining:
chunk ``c`` of physical stage ``s`` holds the ``c * pp + s``-th slice of layers). Orders are the
ones torch.distributed.pipelining executes; the idle slots (``None``) of its schedule IR are dropped,
because the engine derives waiting from data dependencies.

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
from sparsebalance.simulator.config import SCHEDULES

#: One scheduled action: (op "F" or "B", virtual stage index, micro-batch index).
Action = tuple[str, int, int]


def validate_schedule(schedule: str, pp: int, m: int, virtual_stages: int = 1) -> None:
    """Raise ConfigError unless ``schedule`` can run ``m`` micro-batches on ``pp`` stages."""
    check_choice(schedule, "schedule", SCHEDULES)
    check_positive(pp, "pp")
    check_positive(m, "microbatches")
    check_positive(virtual_stages, "virtual_stages")
    if schedule == "interleaved":
        if virtual_stages < 2:
            raise ConfigError(f"virtual_stages: the interleaved schedule needs >= 2, got {virtual_stages}")
        rounds = max(1, m // pp)
        if m % rounds:
            raise ConfigError(
                f"microbatches: interleaved 1F1B needs a multiple of rounds = max(1, m // pp) = {rounds} "
                f"micro-batches (pp = {pp}), got {m}; use e.g. {rounds * (m // rounds)} or "
                f"{rounds * (m // rounds + 1)}")
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
    """The action order of every physical stage: ``orders[s]`` is the list of stage ``s``.

    Each list holds every (F, B) x (chunk of the stage) x (micro-batch) exactly once, and every F of a
    (vstage, micro-batch) precedes its B on the same stage.
    """
    validate_schedule(schedule, pp, m, virtual_stages)
    if schedule == "gpipe":
        return [gpipe_order(pp, m, s) for s in range(pp)]
    if schedule == "1f1b":
        return [one_f_one_b_order(pp, m, s) for s in range(pp)]
    return [interleaved_order(pp, m, s, virtual_stages) for s in range(pp)]
