"""Blocking P2P: every transfer a rendezvous of its sender and its receiver (``cluster.pp_impl``).

The timing core (:mod:`.timing`) lets a sender go on as soon as its action ends; only the receiver
waits for the data. Megatron-LM does not: each P2P call is one ``batch_isend_irecv`` whose requests
are all waited on, then ``torch.cuda.synchronize()`` (May 2022, ``megatron/p2p_communication.py``
L130-139; Megatron-Core, ``core/pipeline_parallel/p2p_communication.py`` L416-424, whenever
``overlap_p2p_comm`` is off, which it is outside the interleaved schedule). An NCCL send completes
only once the receiver has posted its receive, so a transfer is a rendezvous::

    done = max(post by the sender, post by the receiver) + hop

and every call of a device completes when all its transfers are done; the device's next action
starts then (docs/costmodel.md, "Blocking sends").

**Which transfers share a call** is read off each device's order, following Megatron's 1F1B
(``schedules.py``): after an action ``u`` whose next action ``x`` is of the other kind (F then B in
the steady state, B then F) the sends of ``u`` and the receive of ``x`` are one call
(``send_forward_recv_backward``, ``send_backward_recv_forward``); after ``u`` followed by an action
of its own kind (warm-up F, F; cool-down B, B) the sends are one call and the receive of ``x`` a
second call posted when the first completes (``send_forward`` then ``recv_forward``). Interleaved
1F1B follows Megatron 2022's loop (:func:`_interleaved`: one call after each warm-up F, steady (F, B)
pair and cool-down B, receiving the next inputs one unit early); Megatron-Core overlaps its P2P
there (``overlap_p2p_comm``), so ``megatron`` does not block it (``cost.comm.p2p_blocking``).

The host's relaunch after ``synchronize`` (a few microseconds a call, no published figure) is not
added. Event by event in plain Python, replica by replica: O(actions) work a column.
"""

from __future__ import annotations

import numpy as np

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.schedule.graph import ActionGraph


def _programs(graph: ActionGraph) -> list[list[tuple]]:
    """Per device its program: ``("run", node)`` and ``("call", ops)`` items, an op being
    ``((sender node, receiver node), side)`` (the transfer over the receiver's dependency; side 0
    on the sender's device, 1 on the receiver's)."""
    n = graph.n
    dev = graph.device
    recv_of: dict[int, int] = {}  # receiver node -> its cross-device sender
    sends: dict[int, list[int]] = {}  # sender node -> receivers on other devices
    for x in range(n):
        for u in graph.deps[x]:
            if u < n and dev[u] != dev[x]:
                recv_of[x] = int(u)
                sends.setdefault(int(u), []).append(x)
    if graph.nv > graph.pp and not graph.split:  # interleaved (the V schedules split their backward)
        return [_interleaved(graph, [int(a) for a in order], recv_of, sends) for order in graph.orders]
    progs = []
    for device_order in graph.orders:
        prog: list[tuple] = []
        order = [int(a) for a in device_order]
        if order and order[0] in recv_of:
            prog.append(("call", (((recv_of[order[0]], order[0]), 1),)))
        for i, u in enumerate(order):
            prog.append(("run", u))
            out = tuple(((u, d), 0) for d in sends.get(u, ()))
            nxt: int | None = order[i + 1] if i + 1 < len(order) else None
            rx = (((recv_of[nxt], nxt), 1),) if nxt is not None and nxt in recv_of else ()
            paired = nxt is not None and graph.kinds[u // (graph.nv * graph.m)] != graph.kinds[nxt // (graph.nv * graph.m)]
            if paired and (out or rx):
                prog.append(("call", out + rx))
                continue
            if out:
                prog.append(("call", out))
            if rx:
                prog.append(("call", rx))
        progs.append(prog)
    return progs


def _interleaved(graph: ActionGraph, order: list[int], recv_of: dict, sends: dict) -> list[tuple]:
    """One device's program under Megatron's interleaved 1F1B (2022,
    ``forward_backward_pipelining_with_interleaving``): the order is cut into units, a warm-up F,
    a steady (F, B) pair, a cool-down B; after each unit one call sends the unit's outputs and
    receives the input of the next F and, once the next unit runs a B, the gradient of the next B
    (``send_forward_recv_forward``, ``send_forward_backward_recv_forward_backward``,
    ``send_backward_recv_backward``), each receive only where the data comes from another device."""
    size = graph.nv * graph.m
    is_f = [graph.kinds[u // size] == "F" for u in order]
    units, i = [], 0
    while i < len(order):
        step = 2 if is_f[i] and i + 1 < len(order) and not is_f[i + 1] else 1
        units.append(order[i:i + step])
        i += step
    fs = [u for u, f in zip(order, is_f, strict=True) if f]
    bs = [u for u, f in zip(order, is_f, strict=True) if not f]
    nf = nb = 0  # forwards / backwards run so far
    prog: list[tuple] = []
    if fs and fs[0] in recv_of:
        prog.append(("call", (((recv_of[fs[0]], fs[0]), 1),)))
    for k, unit in enumerate(units):
        ops = []
        for u in unit:
            prog.append(("run", u))
            ops += [((u, d), 0) for d in sends.get(u, ())]
            nf, nb = (nf + 1, nb) if graph.kinds[u // size] == "F" else (nf, nb + 1)
        if nf < len(fs) and fs[nf] in recv_of:
            ops.append(((recv_of[fs[nf]], fs[nf]), 1))
        b_next = k + 1 < len(units) and any(graph.kinds[u // size] != "F" for u in units[k + 1])
        if b_next and nb < len(bs) and bs[nb] in recv_of:
            ops.append(((recv_of[bs[nb]], bs[nb]), 1))
        if ops:
            prog.append(("call", tuple(ops)))
    return prog


def time_blocking(graph: ActionGraph, duration: np.ndarray,
                  lag: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Start and end ``[n, C]`` of every node and ``[pp, C]`` when each device is done (its last
    action and its last call), with every transfer a rendezvous (module docstring). ``duration``
    ``[n, C]`` and ``lag`` ``[(V - 1) m + 1, C]`` as :func:`.timing.time_graph` takes them; the
    transfer ``u -> x`` takes the lag of ``x``'s dependency on ``u``."""
    n, c = duration.shape
    progs = _programs(graph)
    lag_id = {}
    for x in range(n):
        for u, lid in zip(graph.deps[x], graph.lags[x], strict=True):
            if u < n:
                lag_id[(int(u), x)] = int(lid)
    start = np.empty((n, c))
    end = np.empty((n, c))
    finish = np.empty((graph.pp, c))
    for col in range(c):
        dur = duration[:, col].tolist()
        hop = lag[:, col].tolist()
        st, en, finish[:, col] = _solve(progs, dur, {k: hop[v] for k, v in lag_id.items()})
        start[:, col], end[:, col] = st, en
    return start, end, finish


def _solve(progs: list[list[tuple]], dur: list[float], hop: dict) -> tuple[list, list, list]:
    """One column: advance every device as far as its calls' partners have posted, until done."""
    n = len(dur)
    start, end = [0.0] * n, [0.0] * n
    posted: dict[tuple[tuple[int, int], int], float] = {}  # (op, side 0 sender / 1 receiver) -> post
    pc = [0] * len(progs)
    now = [0.0] * len(progs)
    posting = [False] * len(progs)
    done = [False] * len(progs)
    while not all(done):
        moved = False
        for d, prog in enumerate(progs):
            while pc[d] < len(prog):
                what, arg = prog[pc[d]]
                if what == "run":
                    start[arg] = now[d]
                    now[d] += dur[arg]
                    end[arg] = now[d]
                    pc[d] += 1
                    moved = True
                    continue
                if not posting[d]:
                    for key in arg:
                        posted[key] = now[d]
                    posting[d] = moved = True
                if any((op, 1 - side) not in posted for op, side in arg):
                    break
                now[d] = max(max(posted[(op, 0)], posted[(op, 1)]) + hop[op] for op, _ in arg)
                posting[d] = False
                pc[d] += 1
                moved = True
            if pc[d] == len(prog) and not done[d]:
                done[d] = moved = True
        if not all(done) and not moved:
            raise ConfigError("p2p_blocking: the schedule's P2P calls deadlock as Megatron would group them "
                              "(interleaved 1F1B blocks only with micro-batches a multiple of pp and more than pp)")
    return start, end, now

