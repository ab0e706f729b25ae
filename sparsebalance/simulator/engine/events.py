"""The SimPy model of one training iteration on a PP x DP cluster: the ``"simpy"`` engine
(``engine.ENGINES``), the independent check of the timing core that runs by default.

Each (replica, physical stage) is a :class:`StageEntity`: it owns its device and starts one SimPy
process that walks the stage's actions in schedule order (an :class:`~.graph.ActionGraph`). An action
starts when its device is free and every input has arrived: a data predecessor's end plus, when the
dependency crosses a stage boundary, one P2P transfer. Sends are asynchronous (the sender is not
blocked). When every replica's copy of a physical stage has finished its last action, the stage's
gradient all-reduce runs on all of them, then the optimizer step.

Events are what this model is for: device contention, faults, stragglers and other what-if
extensions hook in here. Without them its times equal the timing core's (:mod:`.timing`), which
every run uses unless its config says ``engine = "simpy"``; tests check the two agree on random
cases and on whole runs of every schedule.

Speed: one event per action when its inputs have already arrived (the wait and the compute are one
timeout), more otherwise; state lives in flat lists indexed by ``replica * (n + 1) + node``.
"""

from __future__ import annotations

import numpy as np
import simpy

from sparsebalance.simulator.schedule.graph import ActionGraph


class _Sim:
    """State shared by the stage entities of one iteration (flat lists, see module docstring)."""

    def __init__(self, graph: ActionGraph, duration: np.ndarray, lag: np.ndarray,
                 allreduce: np.ndarray, optimizer: np.ndarray) -> None:
        n, dp = duration.shape
        self.env = simpy.Environment()
        self.graph, self.n, self.dp = graph, n, dp
        stride = n + 1
        self.dur = np.vstack([duration, np.zeros((1, dp))]).T.ravel().tolist()
        self.lag = lag.T.tolist()  # [dp][lag id]
        self.end: list = [None] * (dp * stride)
        for r in range(dp):
            self.end[r * stride + n] = 0.0  # the sentinel ends at 0
        self.start = [0.0] * (dp * stride)
        self.waiting: dict[int, simpy.Event] = {}
        self.allreduce = allreduce.tolist()
        self.optimizer = optimizer.tolist()
        self.pending = [dp] * graph.pp
        self.barrier = [self.env.event() for _ in range(graph.pp)]
        self.ar_start = [0.0] * graph.pp
        self.finished = 0


class StageEntity:
    """Physical stage ``stage`` of replica ``replica``: one device, one process over its actions."""

    __slots__ = ("actions", "process", "replica", "sim", "stage")

    def __init__(self, sim: _Sim, replica: int, stage: int) -> None:
        self.sim = sim
        self.replica = replica
        self.stage = stage
        g = sim.graph
        base = replica * (sim.n + 1)
        # (flat index, [(flat index of a data predecessor, lag id), ...]) resolved once
        deps, lags = g.deps.tolist(), g.lags.tolist()
        self.actions = [(base + i, [(base + d, lg) for d, lg in zip(deps[i], lags[i]) if d != sim.n])
                        for i in g.orders[stage].tolist()]
        self.process = sim.env.process(self._run())

    def _run(self):
        sim = self.sim
        env = sim.env
        end, start, dur, waiting = sim.end, sim.start, sim.dur, sim.waiting
        lag = sim.lag[self.replica]
        timeout = env.timeout
        for i, deps in self.actions:
            for d, _ in deps:
                if end[d] is None:  # not finished yet: wait for it
                    ev = waiting.get(d)
                    if ev is None:
                        ev = waiting[d] = env.event()
                    yield ev
            now = env.now
            ready = now
            for d, lg in deps:
                t = end[d] + lag[lg]
                if t > ready:  # noqa: PLR1730 (hot loop: cheaper than max())
                    ready = t
            e = ready + dur[i]
            yield timeout(e - now)
            start[i] = ready
            end[i] = e
            ev = waiting.pop(i, None)
            if ev is not None:
                ev.succeed()
        s = self.stage
        sim.pending[s] -= 1
        if sim.pending[s] == 0:
            sim.ar_start[s] = env.now
            sim.barrier[s].succeed()
        yield sim.barrier[s]
        yield timeout(sim.allreduce[s])
        yield timeout(sim.optimizer[s])
        sim.finished += 1


def simulate_events(graph: ActionGraph, duration: np.ndarray, lag: np.ndarray, allreduce: np.ndarray,
                    optimizer: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run one iteration through SimPy. ``duration`` [n, dp], ``lag`` [(V-1) m + 1, dp] (as for
    :func:`.timing.time_graph`), ``allreduce``/``optimizer`` [pp] seconds. Returns (start [n, dp],
    end [n, dp], all-reduce start [pp])."""
    sim = _Sim(graph, duration, lag, allreduce, optimizer)
    dp = sim.dp
    for r in range(dp):
        for s in range(graph.pp):
            StageEntity(sim, r, s)
    sim.env.run()
    if sim.finished != dp * graph.pp:
        raise RuntimeError(f"deadlock: {dp * graph.pp - sim.finished} devices stuck")
    n = sim.n
    start = np.asarray(sim.start, dtype=float).reshape(dp, n + 1)[:, :n].T
    end = np.asarray(sim.end, dtype=float).reshape(dp, n + 1)[:, :n].T
    return start, end, np.asarray(sim.ar_start, dtype=float)
