"""Tensor parallelism for realrun: torch's DTensor tensor-parallel API on a stage's decoder layers.

Plan (Megatron's, ``parallelize_module``; ``kernels/tp_plan.py``, which the profiler times too): in
every decoder layer the attention's q/k/v projections
are column-parallel (each TP rank computes its heads: ``heads / tp`` query heads and
``kv_heads / tp`` key/value heads, so grouped-query attention keeps its ratio and MoBA runs on the
local heads unchanged: it takes the query/key head ratio from the shapes) and the output projection
row-parallel (one all-reduce); the MLP's gate and up projections column-parallel, the down
projection row-parallel (one all-reduce). The backward all-reduces the gradients of the
column-parallel inputs. Norms, embedding, final norm and LM head are replicated: their inputs are
replicated, so every TP rank computes the same values and the same gradients (no synchronisation
needed). ``tp`` must divide ``heads``, and divide ``kv_heads`` or, with
``cluster.replicate_kv_heads``, be a multiple of it (``simulator.config.check_tp``).

**Replicated KV heads** (``tp = r x kv_heads``, r > 1; Megatron's rule for tp > kv_heads): rank t's
query heads all use KV head ``t // r``, so before sharding :func:`replicate_kv` widens ``k_proj`` and
``v_proj`` to ``tp`` heads, head t a copy of KV head ``t // r``; the column-parallel plan then gives
rank t exactly its KV head. The r copies of a head get different gradients (from different query
heads) whose sum is the true one: :func:`sum_replicated_kv` all-reduces them over the r ranks that
share the head (``kv_group``), so the copies take the same step and stay equal; a whole tensor
collapses back to the model's shape by keeping one copy (:func:`collapse_kv`).

Gradients of sharded parameters are DTensors: :func:`local_grad` gives each rank's shard for the
DP all-reduce (replicas of one shard sum with each other), :func:`grad_sq_sum` the squared norm
share of a rank (a shard counted once, or once per copy set for replicated KV heads; a replicated
tensor once per TP group).
"""

from __future__ import annotations

from typing import Any

from sparsebalance.kernels.tp_plan import LAYER_PLAN, parallelize_layers

__all__ = ["LAYER_PLAN", "parallelize_layers"]  # the plan lives in kernels/ (the profiler times it)
KV_PROJ = ("self_attn.k_proj", "self_attn.v_proj")


def kv_copies(kv_heads: int, tp: int) -> int:
    """Ranks sharing one KV head: ``tp / kv_heads`` when tp exceeds kv_heads, else 1 (split)."""
    return tp // kv_heads if tp > kv_heads else 1


def replicate_kv(layers: Any, kv_heads: int, head_dim: int, tp: int) -> None:
    """Widen every layer's k_proj/v_proj to ``tp`` heads, head t = KV head ``t // r`` (in place)."""
    import torch

    r = kv_copies(kv_heads, tp)
    for layer in layers:
        for name in KV_PROJ:
            lin = layer.get_submodule(name)
            w = lin.weight.detach().view(kv_heads, head_dim, -1).repeat_interleave(r, dim=0)
            lin.weight = torch.nn.Parameter(w.reshape(tp * head_dim, -1).contiguous())
            if lin.bias is not None:
                b = lin.bias.detach().view(kv_heads, head_dim).repeat_interleave(r, dim=0)
                lin.bias = torch.nn.Parameter(b.reshape(-1).contiguous())
            lin.out_features = tp * head_dim


def collapse_kv(name: str, t: Any, kv_heads: int, head_dim: int, tp: int) -> Any:
    """A whole k_proj/v_proj tensor widened by :func:`replicate_kv` back to ``kv_heads`` heads (one
    copy of each); any other tensor unchanged."""
    r = kv_copies(kv_heads, tp)
    if r == 1 or not any(f"{p}." in name for p in KV_PROJ):
        return t
    return t.reshape(tp, head_dim, *t.shape[1:])[::r].reshape(kv_heads * head_dim, *t.shape[1:]).clone()


def replicated_kv_params(layers: Any) -> list:
    """The k_proj/v_proj parameters of ``layers`` (their gradients need :func:`sum_replicated_kv`)."""
    return [p for layer in layers for name in KV_PROJ for p in layer.get_submodule(name).parameters()]


def sum_replicated_kv(params: list, group: Any) -> None:
    """Sum the local gradients of replicated KV-head shards over the ranks sharing the head."""
    import torch
    import torch.distributed as dist

    grads = [local_grad(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


def is_sharded(p: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def local_grad(p: Any) -> Any:
    """The gradient of ``p`` on this rank: its shard for a DTensor, the tensor otherwise."""
    g = p.grad
    return g.to_local() if is_sharded(g) else g


def grad_sq_sum(params: list, tp: int, copies: dict[int, int] | None = None) -> Any:
    """This rank's share of the squared gradient norm of its TP group (float64 scalar): a shard's
    squares in full (divided by its copies for a replicated KV head, ``copies``: id(param) -> r), a
    replicated parameter's divided by ``tp`` (every TP rank holds all of it)."""
    import torch

    copies = copies or {}
    out = torch.zeros((), dtype=torch.float64)
    for p in params:
        sq = local_grad(p).double().pow(2).sum()
        out = out + (sq / copies.get(id(p), 1) if is_sharded(p) else sq / tp)
    return out
