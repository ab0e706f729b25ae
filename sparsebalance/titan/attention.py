"""MoBA as torchtitan's inner attention: a ``VarlenAttention`` that reads its budgets from the
attention metadata.

torchtitan's attention layers (``GQAttention``) call their inner attention with ``q, k, v`` of shape
``[B, L, heads, head_dim]`` and whatever the trainer built as ``attention_masks`` for the micro-batch.
Here that is a :class:`MobaMetadata`: the varlen boundaries of the micro-batch's real documents
(``cu_seq_q``), how many leading tokens they fill (``tokens``: the rest of the row is the slot's
pad document), and the budgets ``topk`` ``[layers, documents]`` (a per-layer budget is one row per
layer; a uniform one the same row repeated). Each layer reads its own row through its global layer
index, so under pipeline parallelism every stage applies the plan's budget of every micro-batch: the
metadata travels with the micro-batch's other keyword arguments to every stage.

Attention runs only on the real documents (the pad document is neither queried nor attended; its
output rows are zero and its labels are masked), which is what the latency model prices for a
padded micro-batch: the dense layers at the slot's tokens, the attention at the documents' budgets.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple

from sparsebalance.titan.compat import import_torchtitan

import_torchtitan()

import torch
from torchtitan.models.common.attention import VarlenAttention

from sparsebalance.errors import ConfigError


class MobaMetadata(NamedTuple):
    """One micro-batch's attention metadata (VarlenMetadata's fields, then MoBA's)."""

    cu_seq_q: torch.Tensor
    """int32 [documents + 1]: boundaries of the real documents (0 ... tokens)."""
    cu_seq_k: torch.Tensor
    """The same tensor (self-attention)."""
    max_q: int
    max_k: int
    cu_seq_q_host: tuple[int, ...] | None
    """``cu_seq_q`` on the host."""
    topk: torch.Tensor
    """int64 [layers, documents]: key blocks each query block of document d attends at layer l."""
    tokens: int
    """Tokens of the real documents; the row's remaining tokens are the pad document."""


def moba_metadata(cu_seqlens: torch.Tensor, topk: torch.Tensor) -> MobaMetadata:
    """:class:`MobaMetadata` from the loader's ``moba_cu_seqlens`` [documents + 1] and ``moba_topk``
    [layers, documents] (a leading batch dimension of 1 is dropped)."""
    cu = cu_seqlens.reshape(-1).to(torch.int32)
    tk = topk.reshape(topk.shape[-2], topk.shape[-1]).to(torch.int64)
    host = tuple(int(x) for x in cu.tolist())
    if tk.shape[1] != len(host) - 1:
        raise ValueError(f"moba metadata: {tk.shape[1]} budgets per layer for {len(host) - 1} documents")
    longest = max(b - a for a, b in itertools.pairwise(host))
    return MobaMetadata(cu_seq_q=cu, cu_seq_k=cu, max_q=longest, max_k=longest, cu_seq_q_host=host,
                        topk=tk, tokens=host[-1])


class BudgetLog:
    """What every MoBA layer ran at, when the trainer asks (``sparsebalance.record_budgets``): one
    row per layer call, tagged with the trainer's current (step, stage, micro-batch)."""

    def __init__(self) -> None:
        self.rows: list[dict] | None = None
        """None: not recording."""
        self.context: dict = {}


BUDGET_LOG = BudgetLog()


class MobaAttention(VarlenAttention):
    """MoBA block-sparse attention (``sparsebalance.kernels.moba_attention``) in torchtitan."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        block_size: int = 64
        """MoBA key-block size in tokens."""
        layer: int = -1
        """This layer's global index (row of ``MobaMetadata.topk``); set by :func:`use_moba`."""
        backend: str = "auto"
        """moba_attention backend: auto (Triton on CUDA, the chunked PyTorch path elsewhere),
        torch, naive or triton."""

        def __post_init__(self) -> None:
            if self.block_size < 1:
                raise ConfigError(f"MobaAttention.block_size: must be >= 1, got {self.block_size}")
            if tuple(self.window_size) != (-1, 0):
                raise ConfigError(f"MobaAttention.window_size: MoBA is causal over whole documents: "
                                  f"(-1, 0), got {self.window_size}")

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.block_size = config.block_size
        self.layer = config.layer
        self.backend = config.backend

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks: Any, scale: float | None = None, out_transform: Any = None,
                **kwargs) -> torch.Tensor:
        from sparsebalance.kernels import moba_attention

        if not isinstance(attention_masks, MobaMetadata):
            raise TypeError("MobaAttention needs MobaMetadata as attention_masks (the "
                            "sparsebalance.titan trainer builds it from the loader's budgets), got "
                            f"{type(attention_masks).__name__}")
        if out_transform is not None:
            raise NotImplementedError("MobaAttention: out_transform (an LSE epilogue) is not supported")
        B, L, _, D = q_BLNH.shape
        if B != 1:
            raise ValueError(f"MobaAttention: expects one packed row per micro-batch, got batch {B}")
        if scale is not None and abs(scale - D ** -0.5) > 1e-6:
            raise ValueError(f"MobaAttention: scale {scale} != 1/sqrt(head_dim); MoBA assumes the latter")
        if self.layer < 0 or self.layer >= attention_masks.topk.shape[0]:
            raise ValueError(f"MobaAttention: layer index {self.layer} outside the budgets' "
                             f"{attention_masks.topk.shape[0]} layers")
        n = attention_masks.tokens
        q, k, v = q_BLNH[0, :n], k_BLNH[0, :n], v_BLNH[0, :n]
        out = moba_attention(q, k, v, attention_masks.cu_seq_q, block_size=self.block_size,
                             topk=attention_masks.topk[self.layer], backend=self.backend)
        if BUDGET_LOG.rows is not None:
            BUDGET_LOG.rows.append({**BUDGET_LOG.context, "layer": self.layer, "tokens": n,
                                    "topk": attention_masks.topk[self.layer].tolist()})
        if n < L:  # the pad document: no attention, zero output
            out = torch.cat([out, out.new_zeros((L - n,) + tuple(out.shape[1:]))])
        return out.unsqueeze(0)


def use_moba(model_config: Any, *, block_size: int, backend: str = "auto") -> int:
    """Put MoBA in every attention layer of a torchtitan decoder config, in place: each layer's
    ``inner_attention`` becomes a :class:`MobaAttention.Config` that knows its global layer index.
    Returns the number of MoBA layers. A config whose layers do not use varlen attention is refused:
    MoBA takes packed documents, which only the varlen path carries."""
    found = 0
    for fqn, cfg, parent, attr in list(model_config.traverse(VarlenAttention.Config)):
        layer = _layer_of(fqn)
        setattr(parent, attr, MobaAttention.Config(block_size=block_size, layer=layer, backend=backend))
        found += 1
    if not found:
        raise no_varlen(model_config)
    return found


def no_varlen(model_config: Any) -> ConfigError:
    """The error for a torchtitan model config without varlen attention (MoBA cannot replace it)."""
    from torchtitan.models.common.attention import FlexAttention

    flex = any(True for _ in model_config.traverse(FlexAttention.Config))
    return ConfigError("model: the torchtitan model config has no varlen attention "
                       f"({'it uses flex attention; ' if flex else ''}build it with attn_backend='varlen' "
                       "and sparsebalance.titan.use_moba): MoBA replaces the varlen inner attention, the "
                       "only one that takes packed documents")


def _layer_of(fqn: str) -> int:
    """Global layer index from a config path such as ``layers.3.attention.inner_attention``."""
    parts = fqn.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            return int(parts[i + 1])
    raise ConfigError(f"model: cannot tell the layer index of attention {fqn!r}")


def moba_layers(model_config: Any) -> list[int]:
    """Global layer indices of the MoBA layers of a torchtitan model config."""
    return sorted(cfg.layer for _, cfg, _, _ in model_config.traverse(MobaAttention.Config))
