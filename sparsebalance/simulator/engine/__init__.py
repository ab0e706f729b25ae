"""One simulated iteration: inputs, results, and ``simulate`` (the timing core or the SimPy model).

:class:`PipelineInput` holds the durations of one iteration (F/B seconds per replica, virtual stage
and micro-batch, P2P, per-stage all-reduce and optimizer). :func:`simulate` runs them through the
schedule's dependency graph (:mod:`.graph`) with one of the registered :data:`ENGINES`: the exact
timing core (:mod:`.timing`, ``"core"``, :data:`DEFAULT_ENGINE`: what every run uses unless its
config says ``engine = "simpy"``) or the SimPy event model (:mod:`.events`, ``"simpy"``: the
independent check of the core, and the place for what needs events). Both give the same start and
end of every action (tests run both on every schedule). The model, in short:

* F of virtual stage ``vs > 0`` needs F of ``vs - 1`` (same replica, same micro-batch) finished plus
  one P2P transfer; F of virtual stage 0 has its input at time 0;
* B of ``vs < V - 1`` needs B of ``vs + 1`` finished plus one P2P transfer; B of the last virtual
  stage needs its own F (local, no transfer); a transfer between two vstages on one device (the
  bend of a V) is local too;
* the zero-bubble schedules (zb-h1, zbv, dualpipev) split a backward into I (input gradient: what
  the previous vstage waits for) and W (weight gradient, after I on the same device, waited for by
  nobody); their durations are ``backward_input`` and ``backward_weight``, and a backward they run
  whole takes ``backward``;
* a device runs its actions one at a time in schedule order; sends do not block the sender, unless
  ``p2p_blocking``: then every transfer is a rendezvous that holds sender and receiver until it is
  done (:mod:`..schedule.rendezvous`, Megatron's P2P; it replaces either engine);
* when every replica's copy of a physical stage has finished its last action, the stage's gradient
  all-reduce runs (``allreduce[s]`` seconds, the ring cost is computed by the caller), then the
  optimizer step (``optimizer[s]`` seconds); with ``grad_norm`` (gradient clipping) every stage's
  optimizer waits for all stages' all-reduces and then the norm's ``grad_norm`` seconds.

The trace table is built on first access of :attr:`PipelineResult.trace` (a 65,536-action iteration
has ~120,000 rows; callers that want only times never pay for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pandas as pd

from sparsebalance.errors import ConfigError, check_choice
from sparsebalance.simulator.config import DEFAULT_ENGINE, ENGINE_NAMES
from sparsebalance.simulator.engine.trace import TRACE_COLUMNS
from sparsebalance.simulator.schedule.graph import ActionGraph, schedule_graph


class Engine(Protocol):
    """Times one iteration's action graph: ``(graph, durations [n + 1], lags, allreduce [pp],
    optimizer [pp]) -> (start, end, allreduce start [pp])``, seconds, start/end of node i of replica r
    at ``[i, r]``."""

    def __call__(self, graph: ActionGraph, duration: np.ndarray, lag: np.ndarray, allreduce: np.ndarray,
                 optimizer: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


def _core(graph, duration, lag, allreduce, optimizer):
    from sparsebalance.simulator.schedule.timing import time_graph

    start, end = time_graph(graph, duration, lag)
    return start, end, end[graph.last].max(axis=1)  # a stage's all-reduce waits for all its replicas


def _simpy(graph, duration, lag, allreduce, optimizer):
    from sparsebalance.simulator.engine.events import simulate_events

    return simulate_events(graph, duration, lag, allreduce, optimizer)


#: The engines by name (a run config's ``engine``; ``simulate(..., method=)``). The default,
#: ``config.DEFAULT_ENGINE``, is the timing core: 0.0037 s vs SimPy's 1.22 s on a 65,536-action
#: replay (docs/results.md, "Simulator speed").
ENGINES: dict[str, Engine] = dict(zip(ENGINE_NAMES, (_core, _simpy), strict=True))
METHODS = ENGINE_NAMES


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
    """A schedule of ``sparsebalance.simulator.config.SCHEDULES``."""
    pp: int
    """Physical pipeline stages."""
    forward: np.ndarray
    """[dp, V, m] seconds of F of micro-batch j on virtual stage vs (vs = chunk * pp + stage)."""
    backward: np.ndarray
    """[dp, V, m] seconds of B, same indexing."""
    virtual_stages: int = 1
    """Chunks per device (interleaved: >= 2; zbv, dualpipev: 2)."""
    backward_input: np.ndarray | None = None
    """[dp, V, m] seconds of the input-gradient part I of each backward (split schedules only)."""
    backward_weight: np.ndarray | None = None
    """[dp, V, m] seconds of the weight-gradient part W (split schedules only)."""
    p2p: float | np.ndarray = 0.0
    """Seconds of one transfer across boundary vs -> vs + 1: scalar or broadcastable to [dp, V - 1, m]
    (the same for the activation forward and the gradient backward)."""
    allreduce: float | np.ndarray = 0.0
    """Seconds of the gradient all-reduce of each physical stage: scalar or [pp]."""
    optimizer: float | np.ndarray = 0.0
    """Seconds of the optimizer step of each physical stage: scalar or [pp]."""
    p2p_blocking: bool = False
    """Every transfer a rendezvous of sender and receiver (``cost.comm.p2p_blocking``); False: only
    the receiver waits."""
    grad_norm: float | None = None
    """Seconds of the gradient-norm all-reduce, a barrier over all stages before their optimizer
    steps (``cost.comm.grad_norm_time``); None: no barrier (no clipping)."""
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
        from sparsebalance.simulator.schedule.schedules import splits_backward

        if splits_backward(self.schedule):
            for name in ("backward_input", "backward_weight"):
                if getattr(self, name) is None:
                    raise ConfigError(f"{name}: schedule {self.schedule!r} splits the backward into "
                                      "input- and weight-gradient parts; give both [dp, V, m] arrays")
                setattr(self, name, _per(name, getattr(self, name), (dp, nv, m)))
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
        return self.forward.shape


@dataclass(kw_only=True, slots=True)
class PipelineResult:
    """What one simulated iteration gives (seconds from the iteration's start)."""

    iteration_time: float
    """End of the last optimizer step."""
    device_busy: np.ndarray
    """[dp, pp] compute (F + B, or F + I + W) seconds of each device."""
    stage_busy: np.ndarray
    """[pp] busy seconds of a physical stage = max over replicas of ``device_busy``."""
    bubble_fraction: float
    """idle / (dp x pp x iteration_time), idle = everything that is not F/B compute (P2P waits,
    pipeline fill and drain, all-reduce, optimizer)."""
    microbatch_latency: np.ndarray
    """[dp, m] compute of each micro-batch's actions summed over all virtual stages."""
    kinds: tuple[str, ...]
    """Action kinds of the schedule (("F", "B"), or ("F", "I", "W") when the backward is split),
    the second axis of ``start``/``end``."""
    start: np.ndarray
    """[dp, kinds, V, m] start of each action."""
    end: np.ndarray
    """[dp, kinds, V, m] end of each action."""
    allreduce_start: np.ndarray
    """[pp] when the stage's all-reduce began (after its last action on every replica)."""
    stage_finish: np.ndarray
    """[dp, pp] end of each device's last action."""
    inp: PipelineInput = field(repr=False)
    graph: ActionGraph = field(repr=False)
    _trace: pd.DataFrame | None = field(default=None, repr=False)

    def _kind(self, kind: str) -> int:
        return self.kinds.index(kind)

    @property
    def forward_start(self) -> np.ndarray:
        """[dp, V, m] start of each F (and below: its end, and B's start and end)."""
        return self.start[:, self._kind("F")]

    @property
    def forward_end(self) -> np.ndarray:
        return self.end[:, self._kind("F")]

    @property
    def backward_start(self) -> np.ndarray:
        """[dp, V, m] start of each backward (its I when split)."""
        return self.start[:, self._kind("I" if "I" in self.kinds else "B")]

    @property
    def backward_end(self) -> np.ndarray:
        """[dp, V, m] end of each backward's last part (W when split, else B)."""
        return self.end[:, self._kind("W" if "W" in self.kinds else "B")]

    @property
    def trace(self) -> pd.DataFrame:
        """Rows in the TRACE_COLUMNS schema: F, B, P2P (stage = sender), ALLREDUCE and OPTIM
        (microbatch = -1), sorted by dp_rank, stage, start (built on first access)."""
        if self._trace is None:
            self._trace = _trace(self)
        return self._trace

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


def graph_of(inp: PipelineInput) -> ActionGraph:
    """The (cached) dependency graph of ``inp``'s schedule."""
    return schedule_graph(inp.schedule, inp.pp, inp.shape[2], inp.virtual_stages)


def simulate(inp: PipelineInput, *, method: str = DEFAULT_ENGINE) -> PipelineResult:
    """Run one iteration of ``inp`` through its schedule (see the module docstring) with the engine
    named ``method`` (:data:`ENGINES`)."""
    from sparsebalance.simulator.schedule.timing import kind_durations, pack_durations, pack_lags

    check_choice(method, "method", METHODS)
    dp, nv, m = inp.shape
    g = graph_of(inp)
    dur = pack_durations(g, kind_durations(g, inp.forward, inp.backward, inp.backward_input,
                                           inp.backward_weight))
    lag = pack_lags(g, np.asarray(inp.p2p, dtype=float), dp)
    if inp.p2p_blocking and nv > 1:
        from sparsebalance.simulator.schedule.rendezvous import time_blocking

        start, end, finish = time_blocking(g, dur, lag)  # finish: a device's last call included
        ar_start = finish.max(axis=1)
    else:
        start, end, ar_start = ENGINES[method](g, dur, lag, np.asarray(inp.allreduce), np.asarray(inp.optimizer))
        finish = end[g.last]  # [pp, dp]
    k = len(g.kinds)
    shape = (k, nv, m, dp)
    start = start.reshape(shape).transpose(3, 0, 1, 2)
    end = end.reshape(shape).transpose(3, 0, 1, 2)
    opt_start = _optimizer_start(np.asarray(ar_start, dtype=float) + inp.allreduce, inp.grad_norm)
    iteration_time = float((opt_start + inp.optimizer).max())
    work = dur.T.reshape(dp, k, nv, m).sum(axis=1)  # [dp, V, m] compute of the actions run
    pp = inp.pp
    device_busy = np.zeros((dp, pp))
    np.add.at(device_busy.T, g.vstage_device, work.sum(axis=2).T)
    total = dp * pp * iteration_time
    bubble = float(1.0 - device_busy.sum() / total) if total > 0 else 0.0
    return PipelineResult(iteration_time=iteration_time, device_busy=device_busy,
                          stage_busy=device_busy.max(axis=0), bubble_fraction=bubble,
                          microbatch_latency=work.sum(axis=1), kinds=g.kinds, start=start, end=end,
                          allreduce_start=np.asarray(ar_start, dtype=float), stage_finish=finish.T,
                          inp=inp, graph=g)


def _optimizer_start(ready: np.ndarray, grad_norm: float | None) -> np.ndarray:
    """[pp] when each stage's optimizer step starts: when its gradients are ready (``ready``), or
    with clipping when every stage's are and the norm's all-reduce is done (a barrier)."""
    if grad_norm is None:
        return ready
    return np.full_like(ready, ready.max() + grad_norm)


def _trace(res: PipelineResult) -> pd.DataFrame:
    """The trace table of ``res``: F/B (or F/I/W, and B for a backward a split schedule runs
    whole) rows, one P2P row per data dependency that crosses devices (stage = the sending device,
    from the sender's end for the transfer's seconds; with ``p2p_blocking`` the transfer's seconds
    up to the receiver's start, when the rendezvous completed), ALLREDUCE, OPTIM.

    Built without a general sort: rows are laid out device by device (F/B in execution order,
    then the device's sends in the same order, then its all-reduce and optimizer step), so within
    a device each part is already sorted by start; one stable sort on the key (device, start)
    merges the parts (timsort over a few sorted runs, about 1 ms for 120,000 rows)."""
    inp, g = res.inp, res.graph
    dp, nv, m = inp.shape
    pp, n = inp.pp, g.n
    start = res.start.reshape(dp, n)  # [dp, n] in node order
    end = res.end.reshape(dp, n)
    seq = np.concatenate(g.orders)  # node ids device by device, each in execution order
    kinds = list(g.kinds)
    code = seq // (nv * m)
    if g.fused.any():  # a whole backward of a split graph: its I node is the B, its W is empty
        fused = g.fused.ravel()[seq % (nv * m)]
        keep = ~(fused & (code == kinds.index("W")))
        seq, code, fused = seq[keep], code[keep], fused[keep]
        kinds.append("B")
        code = np.where(fused, len(kinds) - 1, code)
    dev = g.device[seq]
    rows = len(seq)
    rr = np.repeat(np.arange(dp), rows)
    parts = [(rr, np.tile(dev, dp), np.tile(seq % m, dp), np.tile(code, dp),
              start[:, seq].ravel(), end[:, seq].ravel())]
    recv, col = np.nonzero(g.lags != g.zero_lag)  # data dependencies that cross a boundary
    if recv.size:
        pos = np.zeros(n, dtype=np.int64)
        pos[seq] = np.arange(len(seq))
        sender, lag_id = g.deps[recv, col], g.lags[recv, col]
        o = np.argsort(pos[sender], kind="stable")
        sender, lag_id, recv = sender[o], lag_id[o], recv[o]
        p2p = np.zeros((dp, g.zero_lag + 1))
        p2p[:, :-1] = np.broadcast_to(inp.p2p, (dp, nv - 1, m)).reshape(dp, -1)
        t0 = end[:, sender]
        if inp.p2p_blocking:  # a rendezvous: done when the receiver's call completes, its start
            t0 = start[:, recv] - p2p[:, lag_id]
        kinds.append("P2P")
        k = len(sender)
        parts.append((np.repeat(np.arange(dp), k), np.tile(g.device[sender], dp),
                      np.tile(sender % m, dp), np.full(dp * k, len(kinds) - 1),
                      t0.ravel(), (t0 + p2p[:, lag_id]).ravel()))
    ar_start = res.allreduce_start
    ar_end = ar_start + inp.allreduce
    opt_start = _optimizer_start(ar_end, inp.grad_norm)
    opt_end = opt_start + inp.optimizer
    r2, s2 = (a.ravel() for a in np.indices((dp, pp)))
    for op, a, b in (("ALLREDUCE", ar_start, ar_end), ("OPTIM", opt_start, opt_end)):
        kinds.append(op)
        parts.append((r2, s2, np.full(len(r2), -1), np.full(len(r2), len(kinds) - 1), a[s2], b[s2]))
    r, st, j, code, t_a, t_b = (np.concatenate(c) for c in zip(*parts))
    order = np.argsort((r * pp + st) + 1j * t_a, kind="stable")  # complex: by device, then start
    r, st, j, code = r[order], st[order], j[order], code[order]
    fb = j >= 0
    tok = np.full(len(r), -1, dtype=np.int64)
    bud = np.full(len(r), -1.0)
    assert inp.tokens is not None and inp.budget is not None  # filled in by PipelineInput
    tok[fb] = inp.tokens[r[fb], j[fb]]
    bud[fb] = inp.budget[r[fb], j[fb]]
    return pd.DataFrame({
        "iteration": np.full(len(r), inp.iteration, dtype=np.int64),
        "dp_rank": r.astype(np.int64), "stage": st.astype(np.int64), "microbatch": j.astype(np.int64),
        "op": _op_column(code, kinds), "start_s": t_a[order], "end_s": t_b[order],
        "tokens": tok, "budget": bud,
    }, columns=list(TRACE_COLUMNS))


def _op_column(code: np.ndarray, names: list[str]):
    """The op column from integer codes: decoded by pyarrow when pandas stores strings in arrow
    (5x faster than converting Python strings), else an object array."""
    obj = np.array(names, dtype=object)[code]
    dtype = pd.Series(names[:1]).dtype
    if getattr(dtype, "storage", None) == "pyarrow":
        try:
            import pyarrow as pa

            arr = pa.DictionaryArray.from_arrays(pa.array(code.astype(np.int32)), pa.array(names))
            return pd.array(arr.cast(pa.large_string()), dtype=dtype)
        except (ImportError, TypeError, ValueError):
            pass
    return obj
