"""Tensor parallelism for realrun: torch's DTensor tensor-parallel API on a stage's decoder layers.

Plan (Megatron's, ``parallelize_module``): in every decoder layer the attention's q/k/v projections
are column-parallel (each TP rank computes its heads: ``heads / tp`` query heads and
``kv_heads / tp`` key/value heads, so grouped-query attention keeps its ratio and MoBA runs on the
local heads unchanged) and the output projection row-parallel (one all-reduce); the MLP's gate and
up projections column-parallel, the down projection row-parallel (one all-reduce). The backward
all-reduces the gradients of the column-parallel inputs. Norms, embedding, final norm and LM head
are replicated: their inputs are replicated, so every TP rank computes the same values and the
same gradients (no synchronisation needed). ``tp`` must divide ``heads`` and ``kv_heads`` (checked
on load, ``simulator.config.check_tp``); replicating KV heads (``cluster.replicate_kv_heads``) is
not supported here.

Gradients of sharded parameters are DTensors: :func:`local_grad` gives each rank's shard for the
DP all-reduce (replicas of one shard sum with each other), :func:`grad_sq_sum` the squared norm
share of a rank (sharded parameters counted once per shard, replicated ones once per TP group).
"""

from __future__ import annotations

from typing import Any

LAYER_PLAN = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
              "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col",
              "mlp.down_proj": "row"}
"""Sub-module of a Qwen2 decoder layer -> column- or row-parallel."""


def parallelize_layers(layers: Any, tp_mesh: Any) -> None:
    """Apply :data:`LAYER_PLAN` to every decoder layer of ``layers`` (in place)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {name: ColwiseParallel() if kind == "col" else RowwiseParallel() for name, kind in LAYER_PLAN.items()}
    for layer in layers:
        parallelize_module(layer, tp_mesh, plan)


def is_sharded(p: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def local_grad(p: Any) -> Any:
    """The gradient of ``p`` on this rank: its shard for a DTensor, the tensor otherwise."""
    g = p.grad
    return g.to_local() if is_sharded(g) else g


def grad_sq_sum(params: list, tp: int) -> Any:
    """This rank's share of the squared gradient norm of its TP group (float64 scalar): a shard's
    squares in full, a replicated parameter's divided by ``tp`` (every TP rank holds all of it)."""
    import torch

    out = torch.zeros((), dtype=torch.float64)
    for p in params:
        sq = local_grad(p).double().pow(2).sum()
        out = out + (sq if is_sharded(p) else sq / tp)
    return out
