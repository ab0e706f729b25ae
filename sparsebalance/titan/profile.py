"""A profile of the torchtitan model: ``sparsebalance profile --trainer torchtitan`` times torchtitan's
own Qwen3 pieces (a decoder block with a zero-cost attention core, the embedding, the final norm and
LM head with the summed cross entropy) with the profiler of ``sparsebalance.kernels.profiler``
(interleaved rounds, concurrent copies, the same hygiene). The attention rows are the MoBA kernel's,
as in every profile: the very call :class:`~sparsebalance.titan.attention.MobaAttention` makes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sparsebalance.errors import check
from sparsebalance.kernels.profiler import Bench, ProfileGrid, _null_core_fn
from sparsebalance.simulator.config import ModelConfig
from sparsebalance.titan.compat import import_torchtitan

BENCH = "sparsebalance.titan.profile:TitanBench"
"""``ProfileGrid.bench`` of this module's bench."""


class TitanBench(Bench):
    """:class:`Bench` over torchtitan's Qwen3 pieces (``titan.model.qwen3_spec``)."""

    LAYER = ("one torchtitan Qwen3TransformerBlock (fused QKV, QK norm, SwiGLU) with a zero-cost "
             "attention core")

    def __init__(self, model: ModelConfig, grid: ProfileGrid) -> None:
        import_torchtitan()
        import torch

        from sparsebalance.titan.model import qwen3_spec

        self._common(model, grid)
        check(grid.resolved_layer_impl() == "eager", "layer_impl",
              "eager (torchtitan's own block is timed; layer_impl compiled is realrun's Qwen2)")
        torch.manual_seed(grid.seed)
        with torch.device("meta"):
            net = qwen3_spec(replace(model, layers=1), rope_max_seq_len=max(max(grid.tokens), 4096)).model.build()
        net.to_empty(device=self.dev)
        with torch.no_grad():
            net.init_weights(buffer_device=None)
        self.net = net.to(self.dtype)
        self.layer = net.layers["0"]
        self.layer.attention.inner_attention = _NullInner()

    def _layer(self, tokens: int, _: int) -> list:
        torch = self.torch
        pos = torch.arange(tokens, device=self.dev)[None]
        x = self._randn(1, tokens, self.model.hidden, grad=True)
        dy = self._randn(1, tokens, self.model.hidden)

        def fwd(_: Any = None) -> Any:
            return self.layer(x, None, pos)

        return [(fwd, None), (lambda y: y.backward(dy), fwd),
                *self._split(fwd, [dy], [x], list(self.layer.parameters()))]

    def pieces(self) -> tuple[Any, Any, Any]:
        return self.net.tok_embeddings, self.net.norm, self.net.lm_head


class _NullInner:
    """A zero-cost inner attention for torchtitan's GQAttention (q, k, v as [B, L, N, H])."""

    def __new__(cls):
        import torch

        core = _null_core_fn()

        class NullInner(torch.nn.Module):
            def forward(self, q, k, v, **kwargs):
                # the HF-shaped core takes [B, H, T, D] and returns [B, T, H, D]
                return core(None, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None)[0]

        return NullInner()
