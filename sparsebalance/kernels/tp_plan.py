"""The tensor-parallel plan of a Qwen2 decoder layer (torch's DTensor API), in kernels/ so that the
profiler times the very layer realrun's TP ranks run (``realrun/tp.py`` applies it; kernels/ may not
import realrun/).

Megatron's plan: q/k/v projections and the MLP's gate/up projections column-parallel (each rank
computes its heads and its slice of the MLP width), the attention output and MLP down projections
row-parallel (one all-reduce each in the forward; the backward all-reduces the column-parallel
inputs' gradients).
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
