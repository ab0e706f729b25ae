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
    RuntimeError when the orders deadlock (an action waits for one queued behind it).
    The default rule is applied with numpy to all actions at once (the policies build a graph for
    every new micro-batch count: thousands of actions); any other rule is called per action."""
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
    device = np.full(n, -1, dtype=np.int64)
    dev_orders = []
    for s, order in enumerate(orders):
        ids = np.zeros(0, dtype=np.int64)
        if order:
            ks, vs, js = zip(*order)
            ids = (np.fromiter(map(kind_idx.__getitem__, ks), np.int64, len(order)) * nv
                   + np.asarray(vs, dtype=np.int64)) * m + np.asarray(js, dtype=np.int64)
        if (device[ids] >= 0).any() or len(np.unique(ids)) != len(ids):
            raise ConfigError(f"{name}: an action is scheduled twice (stage {s})")
        device[ids] = s
        dev_orders.append(ids)
    if (device < 0).any():
        missing = int(np.flatnonzero(device < 0)[0])
        raise ConfigError(f"{name}: action node {missing} is never scheduled")
    zero = max(nv - 1, 0) * m
    if dependencies is pipeline_dependencies:
        deps, lags = _pipeline_deps(kinds, nv, m, device, name)
    else:
        deps, lags = _rule_deps(orders, kinds, nv, m, device, dependencies, name)
    width = deps.shape[1]
    prev = np.full(n, n, dtype=np.int64)
    for ids in dev_orders:
        prev[ids[1:]] = ids[:-1]
    by_level, bounds = _levels(dev_orders, prev, deps, n, name)
    # per level, views into level-sorted copies (one slice per array, no per-level gathers)
    used = ~((deps[by_level] == n) & (lags[by_level] == zero))  # a column of only "ends at 0 s, no lag"
    sorted_arrays = [by_level, prev[by_level]] + [a for c in range(width)
                                                  for a in (deps[by_level, c], lags[by_level, c])]
    for arr in (device, prev, deps, lags, fused, *dev_orders, *sorted_arrays):
        arr.setflags(write=False)
    pairs = list(itertools.pairwise(bounds.tolist()))
    levels = tuple(by_level[lo:hi] for lo, hi in pairs)
    # which dependency columns a level uses (adds nothing to the max where no node of it does)
    col_used = [np.add.reduceat(used[:, c], bounds[:-1]) > 0 for c in range(width)] if pairs else []
    col_used = np.array(col_used, dtype=bool).T.tolist() if pairs else []
    steps = []
    for (lo, hi), cols in zip(pairs, col_used):
        step = [sorted_arrays[0][lo:hi], sorted_arrays[1][lo:hi]]
        for c in range(width):
            if cols[c]:
                step += [sorted_arrays[2 + 2 * c][lo:hi], sorted_arrays[3 + 2 * c][lo:hi]]
        steps.append(tuple(step))
    return ActionGraph(kinds=kinds, pp=pp, nv=nv, m=m, orders=tuple(dev_orders), device=device,
                       prev=prev, deps=deps, lags=lags, levels=levels, steps=tuple(steps), fused=fused)


def _pipeline_deps(kinds: tuple[str, ...], nv: int, m: int, device: np.ndarray,
                   name: str) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pipeline_dependencies` of every node at once: ``deps``, ``lags`` [n, 1] (a
    dependency between two vstages on one device carries the zero lag, as in :func:`_rule_deps`)."""
    size = nv * m
    n = len(kinds) * size
    zero = max(nv - 1, 0) * m
    deps = np.full((n, 1), n, dtype=np.int64)
    lags = np.full((n, 1), zero, dtype=np.int64)
    vs, j = np.divmod(np.arange(size, dtype=np.int64), m)
    for ki, kind in enumerate(kinds):
        base = ki * size
        if kind == "F":
            has = vs > 0
            dep_kind, dep_vs, lag = "F", vs - 1, (vs - 1) * m + j
        elif kind == "W":
            has = np.ones(size, dtype=bool)
            dep_kind, dep_vs, lag = "I", vs, np.full(size, zero)
        else:  # B or I: from the next vstage, or from its own F on the last one (the loss is local)
            has = np.ones(size, dtype=bool)
            last = vs == nv - 1
            dep_kind, dep_vs, lag = kind, vs + 1, np.where(last, zero, vs * m + j)
        if not has.any():
            continue
        if kind in "BI" and (vs == nv - 1).any() and "F" not in kinds:
            raise ConfigError(f"{name}: ({kind!r}, {nv - 1}, 0) depends on ('F', {nv - 1}, 0), which no stage runs")
        if dep_kind not in kinds:
            first = int(np.flatnonzero(has)[0])
            raise ConfigError(f"{name}: ({kind!r}, {int(vs[first])}, {int(j[first])}) depends on "
                              f"({dep_kind!r}, {int(dep_vs[first])}, {int(j[first])}), which no stage runs")
        target = (kinds.index(dep_kind) * nv + dep_vs) * m + j
        if kind in "BI":
            target = np.where(vs == nv - 1, (kinds.index("F") * nv + vs) * m + j, target)
        local = device[np.where(has, target, 0)] == device[base:base + size]  # no transfer
        deps[base:base + size, 0] = np.where(has, target, n)
        lags[base:base + size, 0] = np.where(has & ~local, lag, zero)
    return deps, lags


def _rule_deps(orders, kinds, nv: int, m: int, device: np.ndarray, dependencies,
               name: str) -> tuple[np.ndarray, np.ndarray]:
    """``deps``, ``lags`` [n, D] of any dependency rule, called action by action."""
    kind_idx = {k: i for i, k in enumerate(kinds)}
    n = len(kinds) * nv * m

    def node(a: Action) -> int:
        return (kind_idx[a[0]] * nv + a[1]) * m + a[2]

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
    width = max(1, max((len(x) for x in dep_lists), default=1))
    deps = np.full((n, width), n, dtype=np.int64)
    lags = np.full((n, width), zero, dtype=np.int64)
    for i, lst in enumerate(dep_lists):
        for c, (d, lag) in enumerate(lst):
            deps[i, c], lags[i, c] = d, lag
    return deps, lags


def _levels(dev_orders, prev, deps, n, name) -> tuple[np.ndarray, np.ndarray]:
    """Nodes sorted by topological level (ties by id) and the level bounds in that order, by
    walking the devices' orders (each device advances while its next action's inputs are done);
    raises RuntimeError on a deadlock."""
    level = [-1] * n + [0]  # -1: not done yet; the sentinel (node n) is done at level 0
    dep_rows = [[d for d in row if d < n] for row in deps.tolist()] if deps.shape[1] > 1 else None
    dep1 = deps[:, 0].tolist() if dep_rows is None else None
    rows: list[list[int]] = dep_rows if dep_rows is not None else []  # read only where dep1 is None
    prev_l = prev.tolist()
    ptr = [0] * len(dev_orders)
    orders = [o.tolist() for o in dev_orders]
    left = n
    while left:
        moved = False
        for s, order in enumerate(orders):
            p, end = ptr[s], len(order)
            while p < end:
                i = order[p]
                if dep1 is not None:
                    top = level[dep1[i]]
                    if top < 0:
                        break
                else:
                    top = 0
                    for d in rows[i]:
                        x = level[d]
                        if x < 0:
                            top = -1
                            break
                        if x > top:  # noqa: PLR1730 (hot loop: cheaper than max())
                            top = x
                    if top < 0:
                        break
                x = level[prev_l[i]]
                level[i] = (x if x > top else top) + 1  # noqa: FURB136 (hot loop)
                p += 1
            left -= p - ptr[s]
            moved = moved or p > ptr[s]
            ptr[s] = p
        if not moved:
            raise RuntimeError(f"{name} deadlocks: no device can start its next action")
    lv = np.asarray(level[:n], dtype=np.int64)
    order = np.argsort(lv, kind="stable")
    bounds = np.concatenate(([0], np.flatnonzero(np.diff(lv[order])) + 1, [n]))
    return order, bounds


@functools.lru_cache(maxsize=128)
def schedule_graph(schedule: str, pp: int, m: int, virtual_stages: int = 1) -> ActionGraph:
    """The (cached, read-only) graph of one of the simulator's schedules (see :mod:`.schedules`)."""
    from sparsebalance.simulator.schedule.schedules import stage_orders

    orders = stage_orders(schedule, pp, m, virtual_stages)
    return build_graph(orders, pp * virtual_stages, m, name=f"schedule {schedule!r}")
