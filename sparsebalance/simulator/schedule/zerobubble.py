"""Per-device action orders of the schedules that split the backward: ZB-H1, ZB-V and DualPipeV.

The backward of a (virtual stage, micro-batch) is split into ``I`` (gradient with respect to the
stage's input: what the previous stage waits for) and ``W`` (gradient with respect to the weights:
nobody waits for it, so it can fill bubbles); ``B`` is an unsplit backward (both at once). Orders are
the ones torch 2.13's ``torch.distributed.pipelining`` executes (``tests/simulator/schedule/test_schedules.py``
derives torch's orders and compares every (pp, m) torch accepts); the idle slots of its schedule IR
are dropped, the engine derives waiting from data dependencies. Written from the schedules' rules,
stated below, not from torch's code.

**ZB-H1** (``ScheduleInterleavedZeroBubble`` with one stage per device, the ZB1P / ZB-H1 schedule of
Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): device s runs ``w = min(pp - 1 - s, m)``
warm-up forwards, then ``m`` backward steps; step ``t`` (0-based) issues F (while forwards remain)
then I of the next micro-batch, and from step ``t = s`` on also the oldest pending W. Remaining Ws
close the iteration. Deferring W by ``s`` steps on device s fills the drain bubble of 1F1B with W.
Like interleaved 1F1B, torch requires m to be a multiple of ``max(1, m // pp)``.

**ZB-V** (``ScheduleZBVZeroBubble``, same paper, section 6): two virtual stages per device placed in
a V (device d holds vstages d and 2 pp - 1 - d). Built for ``n = max(2 pp - 1, m)`` micro-batches and
then every action of a micro-batch >= m is dropped. Device d (chunk 0 = vstage d, chunk 1 = vstage
2 pp - 1 - d): ``2 (pp - d) - 1`` F0; ``d`` times (F1, F0); ``pp - d`` times (F1, I1, W1); then while
chunk 1 has forwards left or chunk 0 has fewer than n: (F0 if any left), I0, W0, F1, I1, W1; then
``d`` times (I0, I1); ``pp - d`` times (I0, W0 of the oldest pending); then the pending W1, then W0.

**DualPipeV** (``ScheduleDualPipeV``, DeepSeek-V3's DualPipe folded into a V): V placement as ZB-V,
m >= 2 pp. Device d, with chunk 0 / 1 as above and a FIFO of pending weight gradients (each I queues
its W; ``W`` pops the oldest, a no-op when empty): (1) ``2 (pp - d - 1)`` F0; (2) ``d + 1`` times
(F0, F1); (3) ``pp - d - 1`` times (I1, W, F1); (4) ``m - 2 pp + d + 1`` times (F0, B1) then (F1,
B0) - torch's "overlapped" F+B pairs, which its runtime executes one after the other; (5) ``pp - d
- 1`` times (B1, F1, B0); (6) ``d + 1`` times (x1, x0) where x is B until the middle step ``(d + 1)
// 2`` switches it to I (for odd d before x1, for even d between x1 and x0); (7) ``pp - d - 1`` times
(W, x0); (8) ``d + 1`` times W. Micro-batch indices count per (vstage, kind), B and I sharing one.
"""

from __future__ import annotations

from collections import defaultdict, deque

from sparsebalance.simulator.layout import v_vstages

#: One scheduled action: (kind "F"/"B"/"I"/"W", virtual stage index, micro-batch index).
Action = tuple[str, int, int]


class _Counter:
    """Next micro-batch per (vstage, kind); ``B`` and ``I`` share one count (both are the
    backward that the previous vstage waits for)."""

    def __init__(self) -> None:
        self.next: dict[tuple[int, str], int] = defaultdict(int)

    def take(self, kind: str, vs: int) -> int:
        key = (vs, "I" if kind == "B" else kind)
        j = self.next[key]
        self.next[key] = j + 1
        return j


def zb_h1_order(pp: int, m: int, stage: int) -> list[Action]:
    warmup = min(pp - 1 - stage, m)
    out: list[Action] = [("F", stage, j) for j in range(warmup)]
    f, w = warmup, 0
    for t in range(m):
        if f < m:
            out.append(("F", stage, f))
            f += 1
        out.append(("I", stage, t))
        if t >= stage:
            out.append(("W", stage, w))
            w += 1
    out += [("W", stage, j) for j in range(w, m)]
    return out


def zbv_order(pp: int, m: int, device: int) -> list[Action]:
    n = max(2 * pp - 1, m)
    c0, c1 = v_vstages(pp, device)
    cnt = _Counter()
    out: list[Action] = []

    def act(kind: str, vs: int) -> None:
        out.append((kind, vs, cnt.take(kind, vs)))

    for _ in range(2 * (pp - device) - 1):
        act("F", c0)
    for _ in range(device):
        act("F", c1)
        act("F", c0)
    for _ in range(pp - device):
        act("F", c1)
        act("I", c1)
        act("W", c1)
    while cnt.next[(c1, "F")] < cnt.next[(c0, "F")] or cnt.next[(c0, "F")] < n:
        if cnt.next[(c0, "F")] < n:
            act("F", c0)
        for vs in (c0, c1):
            if vs == c1:
                act("F", c1)
            act("I", vs)
            act("W", vs)
    for _ in range(device):
        act("I", c0)
        act("I", c1)
    for _ in range(pp - device):
        act("I", c0)
        act("W", c0)
    for vs in (c1, c0):
        while cnt.next[(vs, "W")] < cnt.next[(vs, "I")]:
            act("W", vs)
    return [a for a in out if a[2] < m]


def dualpipev_order(pp: int, m: int, device: int) -> list[Action]:
    c0, c1 = v_vstages(pp, device)
    cnt = _Counter()
    pending: deque[tuple[int, int]] = deque()
    out: list[Action] = []

    def act(kind: str, vs: int) -> None:
        j = cnt.take(kind, vs)
        out.append((kind, vs, j))
        if kind == "I":
            pending.append((vs, j))

    def weight() -> None:
        if pending:
            vs, j = pending.popleft()
            out.append(("W", vs, j))

    d = device
    for _ in range(2 * (pp - d - 1)):
        act("F", c0)
    for _ in range(d + 1):
        act("F", c0)
        act("F", c1)
    for _ in range(pp - d - 1):
        act("I", c1)
        weight()
        act("F", c1)
    for _ in range(m - 2 * pp + d + 1):
        act("F", c0)
        act("B", c1)
        act("F", c1)
        act("B", c0)
    for _ in range(pp - d - 1):
        act("B", c1)
        act("F", c1)
        act("B", c0)
    split = False
    steps = d + 1
    for i in range(steps):
        if i == steps // 2 and d % 2 == 1:
            split = True
        act("I" if split else "B", c1)
        if i == steps // 2 and d % 2 == 0:
            split = True
        act("I" if split else "B", c0)
    for _ in range(pp - d - 1):
        weight()
        act("I" if split else "B", c0)
    for _ in range(d + 1):
        weight()
    return out
