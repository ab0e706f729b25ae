"""MoBA attention on a context-parallel (CP) group: the token layout and the all-gather variant, in PyTorch.

Each rank of a CP group holds a layout's share of every packed sequence's tokens (Q, K and V of its
key blocks: :func:`cp_token_index`, the same layouts as ``simulator/cost/cp/shards.py``) and
computes the attention of its own queries.

:func:`moba_attention_cp` (all-gather, what the real run runs fast): K and V are all-gathered (gloo
or NCCL; one collective per layer, K and V together; the group's index comes with this rank's,
:func:`group_index`, so no collective learns it), placed at their packed positions, and the CPU path
(``chunked.py``) runs on this rank's query blocks only: their own blocks, their gate (the mean key
of every block, from the gathered K; the ``topk - 1`` best past blocks, the lower block on ties, as
``naive.py``) and tiles, and the rows of a causal prefix: per run of its blocks, causal among
themselves and merged by log-sum-exp with the keys before the run (the rank's share of the work).
The gathered K/V are not kept: the backward gathers them again (as Transformer Engine does, and as
the simulator prices it), then sums every rank's dK/dV and keeps the rank's own rows: the
reduce-scatter of the gradients, written as an all-reduce so that gloo runs it too.

:func:`moba_attention_cp_alone`: one rank's share of the same, computed in a process with no group
(the gather's result given up front, the gradients' sum left to the caller): what ``profile --cp``
times for the ``attn_*_cp`` rows, the CP path's work as the run executes it, collectives excluded.

:func:`~sparsebalance.kernels.moba.cp_ring.moba_attention_cp_ring` (``cp_ring.py``) is the P2P ring.

Every CP collective of both variants (the K/V gathers and the gradients' way back, each ring hop
both ways, the gate's pooled means) is timed into the sink :func:`recording` installs while it is active: the
real run's ``CP_COMM`` trace rows. Autograd runs a CPU graph's backward on the thread that calls it,
so an action's backward collectives land in that action's sink.

Both variants are checked forward and backward against the single-process float64 reference on 2
and 4 gloo ranks (tests/kernels/test_moba_cp.py).

Shapes: the packed batch has ``T`` tokens (``cu_seqlens`` int ``[N + 1]``); a rank holds ``T_r``
of them, ``index`` (int64 ``[T_r]``) their packed positions in its order; ``q`` ``[T_r, H, D]``,
``k``/``v`` ``[T_r, H_kv, D]``; ``topk`` an int or an int tensor ``[N]`` (own block included).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparsebalance.data.sequence import blocks

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["CPContext", "blocks_of", "cp_token_index", "group_index", "group_indices", "moba_attention_cp",
           "moba_attention_cp_alone", "recording"]


@dataclass(kw_only=True, slots=True)
class CPContext:
    """This rank's place in a context-parallel group, for the attention of one packed micro-batch
    (``MobaArgs.cp``): which of its tokens the rank holds, the group, and how K/V are exchanged."""

    index: torch.Tensor
    """int64 [T_r]: the packed positions of this rank's tokens (its rows of q/k/v, in order:
    :func:`group_index` of :func:`cp_token_index`); the micro-batch's ``cu_seqlens`` stays whole."""
    group: ProcessGroup | None
    """The context-parallel process group (None: the world)."""
    comm: str = "ring"
    """``ring`` (P2P, K/V passed around: ``cp_ring.py``) or ``allgather`` (K/V gathered: here);
    ``kernels/qwen2.py`` calls the variant."""


_SINK: tuple[Callable[[], float], Callable[[float, float], None]] | None = None
"""(clock, sink) while :func:`recording` is active."""


@contextmanager
def recording(clock: Callable[[], float], sink: Callable[[float, float], None]) -> Iterator[None]:
    """While active, every CP collective of this module calls ``sink(t0, t1)`` with ``clock()``
    read before and after it (seconds; the caller's clock)."""
    global _SINK
    before, _SINK = _SINK, (clock, sink)
    try:
        yield
    finally:
        _SINK = before


def _timed(call: Callable[[], Any]) -> Any:
    """``call()``, timed into the active :func:`recording` sink if any, as one row: collectives
    inside it record nothing of their own."""
    global _SINK
    if _SINK is None:
        return call()
    held = _SINK
    clock, sink = held
    _SINK = None
    try:
        t0 = clock()
        out = call()
        t1 = clock()
    finally:
        _SINK = held
    sink(t0, t1)
    return out


def cp_token_index(cu_seqlens: Any, block_size: int, cp: int, layout: str) -> list[Any]:
    """Per rank, the packed positions (int64 tensor) of the tokens it holds: each sequence's key
    blocks dealt by ``layout`` (``contiguous``, ``zigzag``, ``stripe``), in block order; a sequence
    with too few blocks for the layout (cp; 2 cp for zigzag) stays whole on rank ``i mod cp`` (its
    index in the batch)."""
    import numpy as np
    import torch

    from sparsebalance.simulator.cost.cp.shards import min_blocks, shards

    bounds = [int(x) for x in cu_seqlens.tolist()]
    per_rank: list[list[np.ndarray]] = [[] for _ in range(cp)]
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        L = b - a
        if L == 0:
            continue
        n = blocks(L, block_size)
        if n < min_blocks(layout, cp):
            per_rank[i % cp].append(np.arange(a, b))
            continue
        for r, part in enumerate(shards(n, cp, layout)):
            tok = [np.arange(a + j * block_size, min(a + (j + 1) * block_size, b)) for j in sorted(part)]
            per_rank[r].append(np.concatenate(tok) if tok else np.zeros(0, dtype=np.int64))
    return [torch.as_tensor(np.concatenate(p) if p else np.zeros(0, dtype=np.int64), dtype=torch.int64)
            for p in per_rank]


def blocks_of(index: Any, cu: list[int], block_size: int) -> list[tuple[int, ...]]:
    """Per sequence, the blocks whose tokens ``index`` (a rank's packed positions,
    ``cp.cp_token_index``) holds: its query blocks, and at a step the key blocks it passes on."""
    import torch

    idx = index.to(torch.int64)
    bounds = torch.as_tensor(cu, dtype=torch.int64)
    seq = torch.bucketize(idx, bounds[1:], right=True)
    blk = (idx - bounds[seq]) // block_size
    return [tuple(sorted(set(blk[seq == i].tolist()))) for i in range(len(cu) - 1)]


def group_index(per_rank: list[Any], rank: int) -> Any:
    """Rank ``rank``'s index (:func:`cp_token_index`'s entry) carrying the whole group's, so that
    :func:`moba_attention_cp` places the gathered K/V without a collective to learn it."""
    import torch

    idx = per_rank[rank]
    idx._cp_gathered = (torch.cat(per_rank), [len(x) for x in per_rank])
    return idx


def _gather_rows(x: Any, sizes: list[int], fill: Callable[[list, Any], None]) -> Any:
    """``x`` ``[T_r, ...]`` of every rank, concatenated in rank order; ``sizes``: every rank's row
    count (ranks may hold different counts: padded to the largest for the collective). ``fill(buf,
    pad)`` is the collective that fills ``buf`` (one padded tensor per rank) with every rank's
    ``pad``: :class:`_Group`'s is one timed all-gather, :class:`_Given`'s copies rows given up front."""
    import torch

    pad = x.new_zeros((max(sizes), *x.shape[1:]))
    pad[: x.shape[0]] = x
    buf = [torch.empty_like(pad) for _ in sizes]
    fill(buf, pad)
    return torch.cat([p[:s] for p, s in zip(buf, sizes)], dim=0)


class _Group:
    """The all-gather variant's two collectives on a process group, each timed (CP_COMM rows)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def fill(self, buf: list, pad: Any) -> None:
        import torch.distributed as dist

        _timed(lambda: dist.all_gather(buf, pad, group=self.group))

    def reduce(self, x: Any) -> None:
        import torch.distributed as dist

        _timed(lambda: dist.all_reduce(x, group=self.group))


class _Given:
    """Stand-in collectives for one rank computed alone (:func:`moba_attention_cp_alone`): the
    gather copies every rank's K/V rows, given up front, into its buffers (the receive's copy); the
    gradients' sum keeps this rank's own contributions (the other ranks' are the collective's)."""

    def __init__(self, rows: list) -> None:
        self.rows = rows

    def fill(self, buf: list, pad: Any) -> None:
        for b, r in zip(buf, self.rows):
            b[: r.shape[0]].copy_(r)

    def reduce(self, x: Any) -> None:
        pass


def moba_attention_cp(q: Any, k: Any, v: Any, index: Any, cu_seqlens: Any, block_size: int, topk: Any,
                      group: Any = None) -> Any:
    """MoBA attention of this rank's queries (``[T_r, H, D]``, in ``index``'s order) on the CP group
    ``group`` (default: the world), all-gather variant (module docstring): K and V gathered to their
    packed positions, then the CPU path (``chunked.py``) on this rank's query blocks only -- its own
    blocks, gate tiles and rows of a sequence's causal prefix (its first ``topk`` blocks). The
    gathered K/V are not kept for the backward, which gathers them again (as Transformer Engine's
    all-gather CP does, and as the simulator prices it) and then reduce-scatters dK/dV."""

    # every layer of a micro-batch passes the same index tensor: the group's index is kept on it
    # (group_index, or gathered once here), so a layer costs one collective forward (K and V
    # together) and two backward
    group_indices(index, group)
    return _run(q, k, v, index, cu_seqlens, block_size, topk, _Group(group))


def group_indices(index: Any, group: Any = None) -> list[Any]:
    """Every rank's index of the group (rank order), from the group's index kept on this rank's
    ``index`` (:func:`group_index`), or gathered once (one timed collective) and kept there: every
    layer of a micro-batch passes the same index tensor."""
    import torch
    import torch.distributed as dist

    if getattr(index, "_cp_gathered", None) is None:
        idx = index.to(torch.int64)
        got = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(got, torch.tensor([idx.shape[0]], dtype=torch.int64), group=group)
        sizes = [int(x) for x in got]
        index._cp_gathered = (_gather_rows(idx, sizes, _Group(group).fill), sizes)
    cat, sizes = index._cp_gathered
    return list(torch.split(cat, sizes))


def moba_attention_cp_alone(q: Any, k: Any, v: Any, index: Any, cu_seqlens: Any, block_size: int, topk: Any,
                            kv_rows: list) -> Any:
    """One rank's share of :func:`moba_attention_cp` computed in a process of its own, with no
    collective: what the profiler times for the ``attn_*_cp`` rows (the rank's compute as the real
    run executes it, the collectives left to the latency model). ``index`` carries the group's
    (:func:`group_index`); ``kv_rows``: every rank's K and V rows (``[T_s, H_kv, 2 D]``, K then V on
    the last axis, in rank order, the compute dtype), what the gather would deliver. The returned
    output and every gradient of this rank's queries are those of :func:`moba_attention_cp`; dK/dV
    hold this rank's own contributions only (the collective adds the others')."""
    if getattr(index, "_cp_gathered", None) is None:
        from sparsebalance.errors import ConfigError

        raise ConfigError("index: moba_attention_cp_alone needs the group's index on it: pass "
                          "group_index(cp_token_index(...), rank)")
    return _run(q, k, v, index, cu_seqlens, block_size, topk, _Given(kv_rows))


def _run(q: Any, k: Any, v: Any, held: Any, cu_seqlens: Any, block_size: int, topk: Any, exchange: Any) -> Any:
    import torch

    index = held.to(torch.int64)
    bounds = tuple(int(x) for x in cu_seqlens.tolist())
    wanted = getattr(held, "_cp_wanted", {}).get((bounds, block_size))  # the same for every layer
    if wanted is None:
        wanted = tuple(blocks_of(index, list(bounds), block_size))
        held._cp_wanted = {(bounds, block_size): wanted}
    n = len(bounds) - 1
    topks = ([int(x) for x in topk.reshape(-1).tolist()] if isinstance(topk, torch.Tensor) else [int(topk)] * n)
    global _ALLGATHER
    if _ALLGATHER is None:
        _ALLGATHER = _allgather_function()
    return _ALLGATHER.apply(q, k, v, (index, *held._cp_gathered, list(bounds), block_size, topks, wanted, exchange))


_ALLGATHER: Any = None


def _allgather_function() -> Any:
    import torch

    from sparsebalance.kernels.moba.chunked import backward_parts, forward_parts
    from sparsebalance.kernels.moba.gate import gate_dtype

    def packed(q, k, v, index, index_all, sizes, total, exchange):
        """Q (this rank's rows) and K, V (everybody's, gathered: one collective) at packed positions."""
        kv_all = _gather_rows(torch.cat([k, v], dim=-1), sizes, exchange.fill)
        full = kv_all.new_zeros((total, *kv_all.shape[1:])).index_copy_(0, index_all, kv_all)
        D = k.shape[-1]
        Q = q.new_zeros((total, *q.shape[1:])).index_copy_(0, index, q)
        return Q, full[..., :D], full[..., D:]

    class _AllGatherMoba(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, args):
            index, index_all, sizes, bounds, block_size, topks, wanted, exchange = args
            cdt = gate_dtype(q.dtype)
            Q, K, V = packed(q.detach().to(cdt), k.detach().to(cdt), v.detach().to(cdt), index, index_all,
                             sizes, bounds[-1], exchange)
            out, lse, saved = forward_parts(Q, K, V, bounds, block_size, topks, wanted)
            ctx.args, ctx.saved, ctx.dtypes = args, saved, (q.dtype, k.dtype, v.dtype)
            ctx.save_for_backward(q, k, v, out, lse)
            return out[index].to(q.dtype)

        @staticmethod
        def backward(ctx, dout):
            index, index_all, sizes, bounds, block_size, _, _, exchange = ctx.args
            q, k, v, out, lse = ctx.saved_tensors
            cdt = out.dtype
            Q, K, V = packed(q.to(cdt), k.to(cdt), v.to(cdt), index, index_all, sizes, bounds[-1], exchange)
            dO = out.new_zeros(out.shape).index_copy_(0, index, dout.to(cdt))
            dq, dk, dv = backward_parts(ctx.saved, Q, K, V, out, lse, dO, block_size)
            dkv = torch.cat([dk, dv], dim=-1)
            # every rank's contribution to every key (the reduce-scatter of dK/dV; an all-reduce so
            # that gloo runs it too), this rank's rows kept
            exchange.reduce(dkv)
            D = k.shape[-1]
            ctx.saved = None
            qd, kd, vd = ctx.dtypes
            mine = dkv[index]
            return dq[index].to(qd), mine[..., :D].to(kd), mine[..., D:].to(vd), None

    return _AllGatherMoba
