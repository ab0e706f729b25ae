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
second call posted when the first completes (``send_forward`` then ``recv_forward``). The interleaved
schedule is not priced this way (Megatron-Core overlaps its P2P there; see ``docs/costmodel.md``).

The host's relaunch after ``synchronize`` (a few microseconds a call, no published figure) is not
added. Event by event in plain Python, replica by replica: O(actions) work a column.
"""

from __future__ import annotations

import numpy as np

from sparsebalance.simulator.schedule.graph import ActionGraph


def _programs(graph: ActionGraph) -> list[list[tuple]]:
    """Per device its program: ``("run", node)`` and ``("call", ops)`` items, an op being
    ``((sender node, receiver node), side)`` (the transfer over the receiver's dependency; side 0
    on the sender's device, 1 on the receiver's)."""
    n = graph.n
    dev = graph.device
    recv_of = {}  # receiver node -> its cross-device sender
    sends = {}  # sender node -> receivers on other devices
    for x in range(n):
        for u in graph.deps[x]:
            if u < n and dev[u] != dev[x]:
                recv_of[x] = int(u)
                sends.setdefault(int(u), []).append(x)
    progs = []
    for order in graph.orders:
        prog: list[tuple] = []
        order = [int(a) for a in order]
        if order and order[0] in recv_of:
            prog.append(("call", (((recv_of[order[0]], order[0]), 1),)))
        for i, u in enumerate(order):
            prog.append(("run", u))
            out = tuple(((u, d), 0) for d in sends.get(u, ()))
            x = order[i + 1] if i + 1 < len(order) else None
            rx = (((recv_of[x], x), 1),) if x is not None and x in recv_of else ()
            paired = x is not None and graph.kinds[u // (graph.nv * graph.m)] != graph.kinds[x // (graph.nv * graph.m)]
            if paired and (out or rx):
                prog.append(("call", out + rx))
                continue
            if out:
                prog.append(("call", out))
            if rx:
                prog.append(("call", rx))
        progs.append(prog)
    return progs


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
            raise RuntimeError("blocking P2P: the schedule's calls deadlock (no call can complete)")
    return start, end, now

