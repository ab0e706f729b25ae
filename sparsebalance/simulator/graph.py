"""The dependency graph of one replica's pipeline schedule: what the timing core and the SimPy engine run.

A schedule is given by two things only, so new ones (zero-bubble ZB-H1 / ZB-V, DualPipeV with the
backward split into I and W, V-shaped stage placement) plug in without touching either engine:

* **orders**: per physical stage (device) the list of actions it runs, in order; an action is
  ``(kind, vstage, microbatch)`` with ``kind`` one of :data:`KINDS` (``F``, ``B``; or ``F``, ``I``,
  ``W`` when the backward is split into input- and weight-gradient parts);
* **dependencies**: per action the actions whose end it waits for, each with or without one P2P
  transfer (a ``lag`` on vstage boundary ``b`` = the transfer between vstage ``b`` and ``b + 1``).

:func:`pipeline_dependencies` is the rule of every schedule so far: F(vs, j) waits for F(vs-1, j) plus
P2P over boundary vs-1; the backward (B, or I) of vs waits for that of vs+1 plus P2P over boundary
vs; the backward of the last vstage waits for its own F (the loss is local); W(vs, j) waits for
I(vs, j). Which device a vstage lives on is read off the orders, so V-shaped placement needs no rule;
a dependency between two vstages on the same device (the bend of a V) carries no P2P lag.

**Mixed backwards** (DualPipeV runs some backwards whole and splits others): when orders hold both
B and I/W actions, a B(vs, j) becomes the node I(vs, j) marked in :attr:`ActionGraph.fused`
(it carries the whole backward's duration) followed on its device by W(vs, j) as an empty
placeholder (0 s). The previous vstage waits for I, so it waits for the whole backward, as it does
in torch's runtime; the graph keeps one node per (kind, vstage, micro-batch).

Nodes are numbered ``kind_index * V * m + vstage * m + microbatch``; node ``n`` (one past the last)
is the sentinel "ends at 0 s". Lags are numbered ``boundary * m + microbatch``; lag ``(V - 1) * m``
is the zero lag. Every replica of a PP x DP iteration runs the same graph, so engines carry replicas
(and candidate duration sets) as a trailing axis.

**Levels**: ``level(i) = 1 + max(level of its device predecessor and data predecessors)``. All nodes
of a level are independent, so the timing core handles a level with a handful of numpy operations;
there are about 2 (m + V) levels for GPipe and 1F1B, whatever the number of replicas.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sparsebalance.errors import ConfigError

#: Action kinds: forward, full backward, and the split backward (input gradient, weight gradient).
KINDS = ("F", "B", "I", "W")

#: One scheduled action: (kind, virtual stage, micro-batch).
Action = tuple[str, int, int]
#: One dependency of an action: (action it waits for, P2P boundary crossed or None).
Dependency = tuple[Action, int | None]


def pipeline_dependencies(action: Action, nv: int) -> list[Dependency]:
    """Data dependencies of ``action`` under the usual pipeline rule (see the module docstring)."""
    kind, vs, j = action
    if kind == "F":
        return [(("F", vs - 1, j), vs - 1)] if vs > 0 else []
    if kind == "W":
        return [(("I", vs, j), None)]
    if vs == nv - 1:  # B or I of the last vstage: the loss is computed where the F ended
        return [(("F", vs, j), None)]
    return [((kind, vs + 1, j), vs)]


@dataclass(frozen=True, slots=True, eq=False)
class ActionGraph:
    """The DAG of one replica (see the module docstring). Arrays are read-only."""

    kinds: tuple[str, ...]
    """Kinds present, in node-numbering order (("F", "B") for GPipe / 1F1B / interleaved,
    ("F", "I", "W") for the zero-bubble schedules)."""
    pp: int
    """Physical stages (devices per replica)."""
    nv: int
    """Virtual stages."""
    m: int
    """Micro-batches."""
    orders: tuple[np.ndarray, ...]
    """Per device the node ids in execution order."""
    device: np.ndarray
    """[n] device of each node."""
    prev: np.ndarray
    """[n] the node run before it on its device (sentinel for the first)."""
    deps: np.ndarray
    """[n, D] data predecessors (sentinel-padded)."""
    lags: np.ndarray
    """[n, D] lag id of each data dependency (the zero lag when none)."""
    levels: tuple[np.ndarray, ...]
    """Node ids of each topological level, in level order."""
    steps: tuple[tuple[np.ndarray, ...], ...]
    """Per level what the timing core gathers: (nodes, device predecessors, then per dependency
    column that is used at this level its predecessors and lag ids)."""
    fused: np.ndarray
    """[V, m] True where a split graph runs the backward whole (node I = B, node W = empty)."""

    @property
    def split(self) -> bool:
        """Whether the backward is split into I and W nodes."""
        return "I" in self.kinds

    @property
    def vstage_device(self) -> np.ndarray:
        """[V] the device of each virtual stage (read off the orders)."""
        return self.device[: self.nv * self.m: self.m]

    @property
    def n(self) -> int:
        """Nodes (= the sentinel's id)."""
        return len(self.device)

    @property
    def zero_lag(self) -> int:
        return max(self.nv - 1, 0) * self.m

    @property
    def last(self) -> np.ndarray:
        """[pp] the last node of every device."""
        return np.array([o[-1] for o in self.orders], dtype=np.int64)

    def node(self, kind: str, vs: int, j: int) -> int:
        return (self.kinds.index(kind) * self.nv + vs) * self.m + j

    def block(self, kind_index: int) -> slice:
        """Node ids of one kind as a slice (its [V, m] block)."""
        size = self.nv * self.m
        return slice(kind_index * size, (kind_index + 1) * size)


def build_graph(orders: Sequence[Sequence[Action]], nv: int, m: int,
                dependencies: Callable[[Action, int], list[Dependency]] = pipeline_dependencies,
                name: str = "schedule") -> ActionGraph:
    """The ActionGraph of per-device ``orders`` (every action exactly once) under ``dependencies``.

    Raises ConfigError when an action is missing, repeated or depends on an absent action, and
    RuntimeError when the orders deadlock (an action waits for one queued behind it)."""
    pp = len(orders)
    present = {a[0] for o in orders for a in o}
    mixed = "B" in present and bool(present & {"I", "W"})
    fused = np.zeros((nv, m), dtype=bool)
    if mixed:  # see "Mixed backwards" in the module docstring
        expanded = []
        for order in orders:
            out: list[Action] = []
            for a in order:
                if a[0] == "B":
                    fused[a[1], a[2]] = True
                    out += [("I", a[1], a[2]), ("W", a[1], a[2])]
                else:
                    out.append(a)
            expanded.append(out)
        orders = expanded
        present = (present - {"B"}) | {"I", "W"}
    kinds = tuple(k for k in KINDS if k in present)
    size = nv * m
    n = len(kinds) * size
    kind_idx = {k: i for i, k in enumerate(kinds)}

    def node(a: Action) -> int:
        return (kind_idx[a[0]] * nv + a[1]) * m + a[2]

    device = np.full(n, -1, dtype=np.int64)
    dev_orders = []
    for s, order in enumerate(orders):
        ids = np.fromiter((node(a) for a in order), dtype=np.int64, count=len(order))
        if (device[ids] >= 0).any() or len(np.unique(ids)) != len(ids):
            raise ConfigError(f"{name}: an action is scheduled twice (stage {s})")
        device[ids] = s
        dev_orders.append(ids)
    if (device < 0).any():
        missing = int(np.flatnonzero(device < 0)[0])
        raise ConfigError(f"{name}: action node {missing} is never scheduled")
    dep_lists: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    zero = max(nv - 1, 0) * m
    for order in orders:
        for a in order:
            i = node(a)
            for d, boundary in dependencies(a, nv):
                if d[0] not in kind_idx:
                    raise ConfigError(f"{name}: {a} depends on {d}, which no stage runs")
                k = node(d)
                local = boundary is None or device[k] == device[i]  # same device: no transfer
                dep_lists[i].append((k, zero if local else boundary * m + a[2]))
    width = max(1, max(len(x) for x in dep_lists))
    deps = np.full((n, width), n, dtype=np.int64)
    lags = np.full((n, width), zero, dtype=np.int64)
    for i, lst in enumerate(dep_lists):
        for c, (d, lag) in enumerate(lst):
            deps[i, c], lags[i, c] = d, lag
    prev = np.full(n, n, dtype=np.int64)
    for ids in dev_orders:
        prev[ids[1:]] = ids[:-1]
    levels = _levels(dev_orders, prev, deps, n, name)
    # per level, views into level-sorted copies (one slice per array, no per-level gathers)
    order = np.concatenate(levels)
    bounds = np.cumsum([0] + [len(x) for x in levels])
    used = ~((deps[order] == n) & (lags[order] == zero))  # a column of only "ends at 0 s, no lag"
    sorted_arrays = [order, prev[order]] + [a for c in range(width) for a in (deps[order, c], lags[order, c])]
    for arr in (device, prev, deps, lags, fused, *dev_orders, *sorted_arrays):
        arr.setflags(write=False)
    levels = tuple(order[lo:hi] for lo, hi in itertools.pairwise(bounds.tolist()))
    steps = []
    for lo, hi in itertools.pairwise(bounds.tolist()):
        step = [sorted_arrays[0][lo:hi], sorted_arrays[1][lo:hi]]
        for c in range(width):  # adds nothing to the max where no node of the level uses it
            if used[lo:hi, c].any():
                step += [sorted_arrays[2 + 2 * c][lo:hi], sorted_arrays[3 + 2 * c][lo:hi]]
        steps.append(tuple(step))
    return ActionGraph(kinds=kinds, pp=pp, nv=nv, m=m, orders=tuple(dev_orders), device=device,
                       prev=prev, deps=deps, lags=lags, levels=levels, steps=tuple(steps), fused=fused)


def _levels(dev_orders, prev, deps, n, name) -> tuple[np.ndarray, ...]:
    """Topological levels by walking the devices' orders (each device advances while its next
    action's inputs are done); raises RuntimeError on a deadlock."""
    level = [0] * (n + 1)
    done = [False] * n + [True]
    dep_rows = deps.tolist()
    ptr = [0] * len(dev_orders)
    orders = [o.tolist() for o in dev_orders]
    prev_l = prev.tolist()
    left = n
    while left:
        moved = False
        for s, order in enumerate(orders):
            p = ptr[s]
            while p < len(order):
                i = order[p]
                row = dep_rows[i]
                if not all(done[d] for d in row):
                    break
                level[i] = 1 + max(level[prev_l[i]], max(level[d] for d in row))
                done[i] = True
                p += 1
                left -= 1
                moved = True
            ptr[s] = p
        if not moved:
            raise RuntimeError(f"{name} deadlocks: no device can start its next action")
    lv = np.asarray(level[:n], dtype=np.int64)
    order = np.argsort(lv, kind="stable")
    bounds = np.flatnonzero(np.diff(lv[order])) + 1
    return tuple(np.split(order, bounds))


@functools.lru_cache(maxsize=128)
def schedule_graph(schedule: str, pp: int, m: int, virtual_stages: int = 1) -> ActionGraph:
    """The (cached, read-only) graph of one of the simulator's schedules (see :mod:`.schedules`)."""
    from sparsebalance.simulator.schedules import stage_orders

    orders = stage_orders(schedule, pp, m, virtual_stages)
    return build_graph(orders, pp * virtual_stages, m, name=f"schedule {schedule!r}")
