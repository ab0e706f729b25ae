"""The SimPy model of one training iteration on a PP x DP cluster.

Each (replica, physical stage) is a :class:`StageEntity`: it owns its device and starts one SimPy
process in ``__init__`` that walks the stage's action list (see :mod:`.schedules`). An action starts
when its input has arrived and the device is free:

* F of virtual stage ``vs > 0`` needs F of ``vs - 1`` (same replica, same micro-batch) finished plus
  one P2P transfer; F of virtual stage 0 has its input at time 0;
* B of ``vs < V - 1`` needs B of ``vs + 1`` finished plus one P2P transfer; B of the last virtual
  stage needs its own F (local, no transfer).

Sends are asynchronous: the sender is not blocked, the receiver sees the data ``p2p`` seconds after
the sender's action ended. When every replica's copy of a physical stage has finished its last
action, the stage's gradient all-reduce runs on all of them (``allreduce[s]`` seconds, the ring cost
is computed by the caller), then the optimizer step (``optimizer[s]`` seconds).

Speed: one event per action when the input has already arrived (the wait and the compute are folded
into one timeout), two otherwise; state lives in flat Python lists indexed by
``(replica * V + vstage) * m + microbatch``; the trace is built from arrays after the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import simpy
from simpy.core import NORMAL

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.schedules import stage_orders
from sparsebalance.simulator.trace import TRACE_COLUMNS


def _per(name: str, value, shape: tuple[int, ...]) -> np.ndarray:
    """``value`` (scalar or array) broadcast to ``shape`` as float64 seconds, checked >= 0 and finite."""
    arr = np.asarray(value, dtype=float)
    try:
        arr = np.broadcast_to(arr, shape)
    except ValueError:
        raise ConfigError(f"{name}: shape {arr.shape} does not fit {shape}") from None
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ConfigError(f"{name}: every value must be a finite number >= 0 seconds")
    return arr


@dataclass(kw_only=True, slots=True)
class PipelineInput:
    """Durations of one iteration. ``V = pp * virtual_stages`` virtual stages, ``m`` micro-batches."""

    schedule: str
    """gpipe, 1f1b or interleaved."""
    pp: int
    """Physical pipeline stages."""
    forward: np.ndarray
    """[dp, V, m] seconds of F of micro-batch j on virtual stage vs (vs = chunk * pp + stage)."""
    backward: np.ndarray
    """[dp, V, m] seconds of B, same indexing."""
    virtual_stages: int = 1
    """Chunks per physical stage (interleaved only)."""
    p2p: float | np.ndarray = 0.0
    """Seconds of one transfer across boundary vs -> vs + 1: scalar or broadcastable to [dp, V - 1, m]
    (the same for the activation forward and the gradient backward)."""
    allreduce: float | np.ndarray = 0.0
    """Seconds of the gradient all-reduce of each physical stage: scalar or [pp]."""
    optimizer: float | np.ndarray = 0.0
    """Seconds of the optimizer step of each physical stage: scalar or [pp]."""
    tokens: np.ndarray | None = None
    """Optional [dp, m] tokens per micro-batch (trace only)."""
    budget: np.ndarray | None = None
    """Optional [dp, m] (mean) budget per micro-batch (trace only)."""
    iteration: int = 0
    """Iteration index written to the trace."""

    def __post_init__(self) -> None:
        fwd = np.asarray(self.forward, dtype=float)
        if fwd.ndim != 3:
            raise ConfigError("forward: expected [replicas][virtual stages][micro-batches], "
                              f"got ndim {fwd.ndim}")
        dp, nv, m = fwd.shape
        if self.pp < 1 or self.virtual_stages < 1 or nv != self.pp * self.virtual_stages:
            raise ConfigError(f"forward: has {nv} virtual stages, expected pp x virtual_stages = "
                              f"{self.pp} x {self.virtual_stages}")
        if dp < 1 or m < 1:
            raise ConfigError("forward: needs at least one replica and one micro-batch")
        self.forward = _per("forward", fwd, (dp, nv, m))
        self.backward = _per("backward", self.backward, (dp, nv, m))
        self.p2p = _per("p2p", self.p2p, (dp, max(nv - 1, 0), m))
        self.allreduce = _per("allreduce", self.allreduce, (self.pp,))
        self.optimizer = _per("optimizer", self.optimizer, (self.pp,))
        for name in ("tokens", "budget"):
            val = getattr(self, name)
            setattr(self, name, np.full((dp, m), -1.0) if val is None else
                    np.broadcast_to(np.asarray(val, dtype=float), (dp, m)))

    @property
    def shape(self) -> tuple[int, int, int]:
        """(dp, V, m)."""
        return self.forward.shape  # type: ignore[return-value]


@dataclass(kw_only=True, slots=True)
class PipelineResult:
    """What one simulated iteration gives (seconds from the iteration's start)."""

    iteration_time: float
    """End of the last optimizer step."""
    device_busy: np.ndarray
    """[dp, pp] compute (F + B) seconds of each device."""
    stage_busy: np.ndarray
    """[pp] busy seconds of a physical stage = max over replicas of ``device_busy``."""
    bubble_fraction: float
    """idle / (dp x pp x iteration_time), idle = everything that is not F/B compute (P2P waits,
    pipeline fill and drain, all-reduce, optimizer)."""
    microbatch_latency: np.ndarray
    """[dp, m] F + B compute of each micro-batch summed over all virtual stages."""
    forward_start: np.ndarray
    """[dp, V, m] start of each F (and below: its end, and B's start and end)."""
    forward_end: np.ndarray
    backward_start: np.ndarray
    backward_end: np.ndarray
    allreduce_start: np.ndarray
    """[pp] when the stage's all-reduce began (after its last action on every replica)."""
    trace: pd.DataFrame = field(repr=False)
    """Rows in the TRACE_COLUMNS schema: F, B, P2P (stage = sender), ALLREDUCE and OPTIM
    (microbatch = -1), sorted by dp_rank, stage, start."""

    @property
    def imbalance(self) -> float:
        """max / mean micro-batch latency over all replicas (1.0 = perfectly balanced)."""
        lat = self.microbatch_latency
        return float(lat.max() / lat.mean()) if lat.size and lat.mean() > 0 else 1.0

    @property
    def stage_imbalance(self) -> float:
        """max / mean of ``stage_busy`` (pipeline-stage balance)."""
        sb = self.stage_busy
        return float(sb.max() / sb.mean()) if sb.size and sb.mean() > 0 else 1.0

    @property
    def replica_imbalance(self) -> float:
        """max / mean of total compute per replica (DP balance)."""
        per = self.device_busy.sum(axis=1)
        return float(per.max() / per.mean()) if per.size and per.mean() > 0 else 1.0


class _Arrival(simpy.Event):
    """An input a stage waits for; the sender fires it ``delay`` seconds from now (the P2P)."""

    __slots__ = ()

    def arrive(self, delay: float) -> None:
        self._ok = True
        self._value = None
        self.env.schedule(self, NORMAL, delay)


class _Sim:
    """State shared by the stage entities of one iteration (flat lists, see module docstring)."""

    def __init__(self, inp: PipelineInput) -> None:
        dp, nv, m = inp.shape
        n = dp * nv * m
        self.env = simpy.Environment()
        self.dp, self.nv, self.m, self.pp = dp, nv, m, inp.pp
        self.fdur = inp.forward.ravel().tolist()
        self.bdur = inp.backward.ravel().tolist()
        # p2p out of (r, vs, j) toward vs + 1 (forward) or, looked up at vs - 1, toward vs - 1.
        p2p = np.zeros((dp, nv, m))
        p2p[:, : nv - 1, :] = inp.p2p
        self.p2p = p2p.ravel().tolist()
        self.f_arr: list = [None] * n
        self.b_arr: list = [None] * n
        for r in range(dp):
            self.f_arr[r * nv * m: r * nv * m + m] = [0.0] * m
        self.f_wait: list = [None] * n
        self.b_wait: list = [None] * n
        self.fs = [0.0] * n
        self.fe = [0.0] * n
        self.bs = [0.0] * n
        self.be = [0.0] * n
        self.allreduce = inp.allreduce.tolist()
        self.optimizer = inp.optimizer.tolist()
        self.pending = [dp] * inp.pp
        self.barrier = [self.env.event() for _ in range(inp.pp)]
        self.ar_start = [0.0] * inp.pp
        self.finished = 0


class StageEntity:
    """Physical stage ``stage`` of replica ``replica``: one device, one process over its actions."""

    __slots__ = ("sim", "replica", "stage", "actions", "process")

    def __init__(self, sim: _Sim, replica: int, stage: int, actions: list[tuple[str, int, int]]) -> None:
        self.sim = sim
        self.replica = replica
        self.stage = stage
        # (is_forward, flat index of (replica, vstage, microbatch)) - resolved once, outside the loop.
        base = replica * sim.nv * sim.m
        self.actions = [(op == "F", base + vs * sim.m + j, vs) for op, vs, j in actions]
        self.process = sim.env.process(self._run())

    def _run(self):
        sim = self.sim
        env = sim.env
        m, last = sim.m, sim.nv - 1
        fdur, bdur, p2p = sim.fdur, sim.bdur, sim.p2p
        f_arr, b_arr, f_wait, b_wait = sim.f_arr, sim.b_arr, sim.f_wait, sim.b_wait
        fs, fe, bs, be = sim.fs, sim.fe, sim.bs, sim.be
        timeout = env.timeout
        for forward, i, vs in self.actions:
            arr = f_arr[i] if forward else b_arr[i]
            now = env.now
            if arr is None:
                ev = _Arrival(env)
                if forward:
                    f_wait[i] = ev
                else:
                    b_wait[i] = ev
                yield ev
                now = start = env.now
            else:
                start = arr if arr > now else now
            if forward:
                end = start + fdur[i]
                yield timeout(end - now)
                fs[i] = start
                fe[i] = end
                if vs < last:  # activation to vs + 1
                    d = p2p[i]
                    f_arr[i + m] = end + d
                    w = f_wait[i + m]
                    if w is not None:
                        w.arrive(d)
                else:  # the loss is local: B of the last virtual stage may start
                    b_arr[i] = end
            else:
                end = start + bdur[i]
                yield timeout(end - now)
                bs[i] = start
                be[i] = end
                if vs > 0:  # gradient to vs - 1
                    d = p2p[i - m]
                    b_arr[i - m] = end + d
                    w = b_wait[i - m]
                    if w is not None:
                        w.arrive(d)
        s = self.stage
        sim.pending[s] -= 1
        if sim.pending[s] == 0:
            sim.ar_start[s] = env.now
            sim.barrier[s].succeed()
        yield sim.barrier[s]
        yield timeout(sim.allreduce[s])
        yield timeout(sim.optimizer[s])
        sim.finished += 1


def simulate(inp: PipelineInput) -> PipelineResult:
    """Run one iteration of ``inp`` through its schedule; see the module docstring for the model."""
    dp, nv, m = inp.shape
    pp = inp.pp
    orders = stage_orders(inp.schedule, pp, m, inp.virtual_stages)
    sim = _Sim(inp)
    for r in range(dp):
        for s in range(pp):
            StageEntity(sim, r, s, orders[s])
    sim.env.run()
    if sim.finished != dp * pp:  # cannot happen for the shipped schedules: every input gets sent
        raise RuntimeError(f"schedule {inp.schedule!r} deadlocked: {dp * pp - sim.finished} devices stuck")
    return _result(inp, sim)


def _result(inp: PipelineInput, sim: _Sim) -> PipelineResult:
    dp, nv, m = inp.shape
    pp, v = inp.pp, inp.virtual_stages
    shape = (dp, nv, m)
    fs, fe = np.reshape(sim.fs, shape), np.reshape(sim.fe, shape)
    bs, be = np.reshape(sim.bs, shape), np.reshape(sim.be, shape)
    ar_start = np.asarray(sim.ar_start)
    ar_end = ar_start + inp.allreduce
    opt_end = ar_end + inp.optimizer
    iteration_time = float(opt_end.max())
    work = inp.forward + inp.backward  # [dp, V, m]
    # vstage c * pp + s lives on physical stage s
    device_busy = work.sum(axis=2).reshape(dp, v, pp).sum(axis=1)
    total = dp * pp * iteration_time
    bubble = float(1.0 - device_busy.sum() / total) if total > 0 else 0.0
    trace = _trace(inp, fs, fe, bs, be, ar_start, ar_end, opt_end)
    return PipelineResult(iteration_time=iteration_time, device_busy=device_busy,
                          stage_busy=device_busy.max(axis=0), bubble_fraction=bubble,
                          microbatch_latency=work.sum(axis=1), forward_start=fs, forward_end=fe,
                          backward_start=bs, backward_end=be, allreduce_start=ar_start, trace=trace)


def _trace(inp: PipelineInput, fs, fe, bs, be, ar_start, ar_end, opt_end) -> pd.DataFrame:
    dp, nv, m = inp.shape
    pp = inp.pp
    r_idx, vs_idx, j_idx = (a.ravel() for a in np.indices((dp, nv, m)))
    stage = vs_idx % pp
    tok = inp.tokens[r_idx, j_idx]
    bud = inp.budget[r_idx, j_idx]
    parts = [
        (r_idx, stage, j_idx, "F", fs.ravel(), fe.ravel(), tok, bud),
        (r_idx, stage, j_idx, "B", bs.ravel(), be.ravel(), tok, bud),
    ]
    if nv > 1:
        send_f = vs_idx < nv - 1  # activation out of vs toward vs + 1
        d = np.zeros((dp, nv, m))
        d[:, : nv - 1] = inp.p2p
        d = d.ravel()
        parts.append((r_idx[send_f], stage[send_f], j_idx[send_f], "P2P", fe.ravel()[send_f],
                      fe.ravel()[send_f] + d[send_f], tok[send_f], bud[send_f]))
        send_b = vs_idx > 0  # gradient out of vs toward vs - 1 over boundary vs - 1
        d_b = np.zeros((dp, nv, m))
        d_b[:, 1:] = inp.p2p
        d_b = d_b.ravel()
        parts.append((r_idx[send_b], stage[send_b], j_idx[send_b], "P2P", be.ravel()[send_b],
                      be.ravel()[send_b] + d_b[send_b], tok[send_b], bud[send_b]))
    rr, ss = (a.ravel() for a in np.indices((dp, pp)))
    minus = np.full(rr.shape, -1)
    nan = np.full(rr.shape, -1.0)
    parts.append((rr, ss, minus, "ALLREDUCE", ar_start[ss], ar_end[ss], nan, nan))
    parts.append((rr, ss, minus, "OPTIM", ar_end[ss], opt_end[ss], nan, nan))
    cols = list(zip(*parts))
    df = pd.DataFrame({
        "iteration": inp.iteration,
        "dp_rank": np.concatenate(cols[0]).astype(np.int64),
        "stage": np.concatenate(cols[1]).astype(np.int64),
        "microbatch": np.concatenate(cols[2]).astype(np.int64),
        "op": np.concatenate([np.full(len(a), op, dtype=object) for a, op in zip(cols[0], cols[3])]),
        "start_s": np.concatenate(cols[4]),
        "end_s": np.concatenate(cols[5]),
        "tokens": np.concatenate(cols[6]).astype(np.int64),
        "budget": np.concatenate(cols[7]),
    }, columns=list(TRACE_COLUMNS))
    return df.sort_values(["dp_rank", "stage", "start_s", "end_s"], kind="stable", ignore_index=True)
