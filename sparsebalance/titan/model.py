"""The model side: a torchtitan Qwen3 decoder with MoBA in every layer, and our ``ModelConfig`` of any
torchtitan decoder config (what the latency model and the policies need to know of it).

:func:`qwen3_spec` builds torchtitan's own ``Qwen3Model`` (no fork: its public config builders, with
:class:`~sparsebalance.titan.attention.MobaAttention` as every layer's inner attention) at the dimensions of
one of our model presets, so a profile measured for that preset prices it. :func:`model_config_of`
goes the other way, for a user's own torchtitan config.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import ModelConfig
from sparsebalance.titan.attention import MobaAttention, VarlenAttention, no_varlen

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def _init(std: float) -> dict:
    from torch import nn

    return {"weight": partial(nn.init.normal_, std=std), "bias": nn.init.zeros_}


def qwen3_spec(model: ModelConfig, *, backend: str = "auto", rope_max_seq_len: int = 65536) -> Any:
    """torchtitan ``ModelSpec`` of a Qwen3 decoder (QK norm, grouped-query attention, SwiGLU) with
    ``model``'s dimensions and MoBA attention (block ``model.block_size``) in every layer, built from
    torchtitan's public config builders; initialised as torchtitan's Qwen3 (normal, std 0.02)."""
    from torch import nn
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

    def norm(dim: int):
        return RMSNorm.Config(normalized_shape=dim, eps=1e-6, param_init={"weight": nn.init.ones_})

    lin = _init(0.02)
    rope = CosSinRoPE.Config(dim=model.head_dim, max_seq_len=rope_max_seq_len, theta=1000000.0)
    layers = [Qwen3TransformerBlock.Config(
        attention_norm=norm(model.hidden), ffn_norm=norm(model.hidden),
        attention=make_gqa_config(dim=model.hidden, n_heads=model.heads, n_kv_heads=model.kv_heads,
                                  head_dim=model.head_dim, wqkv_param_init=lin, wo_param_init=lin,
                                  inner_attention=MobaAttention.Config(block_size=model.block_size,
                                                                       layer=i, backend=backend),
                                  fuse_qkv=True, rope=rope, qk_norm=norm(model.head_dim)),
        feed_forward=make_ffn_config(dim=model.hidden, hidden_dim=model.ffn, w1_param_init=lin,
                                     w2w3_param_init=lin))
        for i in range(model.layers)]
    spec = model_registry("debugmodel", attn_backend="varlen")  # Qwen3's parallelize/pipeline fns
    spec.flavor = f"sparsebalance-{model.name}"
    spec.model = Qwen3Model.Config(
        vocab_size=model.vocab, dim=model.hidden, norm=norm(model.hidden),
        enable_weight_tying=model.tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=model.vocab, embedding_dim=model.hidden,
                                        param_init={"weight": partial(nn.init.normal_, std=0.02)}),
        lm_head=Linear.Config(in_features=model.hidden, out_features=model.vocab, param_init=lin),
        layers=layers)
    return spec


def model_config_of(titan_model: Any, *, dtype: str, name: str = "titan") -> ModelConfig:
    """Our ``ModelConfig`` of a torchtitan decoder config whose attention is MoBA (the dims the
    latency model and the policies read). Refuses a model without MoBA layers, or with MoBA on only
    some of them (a budget is per layer of the whole model)."""
    layers = list(titan_model.layers)
    moba = [cfg for _, cfg, _, _ in titan_model.traverse(MobaAttention.Config)]
    if not moba:
        if not any(True for _ in titan_model.traverse(VarlenAttention.Config)):
            raise no_varlen(titan_model)
        raise ConfigError("model: the torchtitan model has no MoBA layers (inner attention "
                          "MobaAttention); a budget needs them: build the model with "
                          "sparsebalance.titan.use_moba or a sparsebalance.titan preset")
    if len(moba) != len(layers) or sorted(c.layer for c in moba) != list(range(len(layers))):
        raise ConfigError(f"model: MoBA must be the attention of every layer ({len(layers)}), found it "
                          f"in layers {sorted(c.layer for c in moba)}")
    if len({c.block_size for c in moba}) != 1:
        raise ConfigError("model: every MoBA layer needs the same block_size")
    attn = titan_model.first_attention
    ffn = layers[0].feed_forward
    if ffn is None:
        raise ConfigError("model: mixture-of-experts layers are not modelled by the latency model; "
                          "use a dense decoder")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"training.dtype: must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    heads = attn.n_heads
    return ModelConfig(
        name=name, hidden=titan_model.dim, layers=len(layers), heads=heads,
        kv_heads=attn.n_kv_heads or heads, head_dim=attn.head_dim or titan_model.dim // heads,
        ffn=ffn.w1.out_features, vocab=titan_model.vocab_size,
        tie_embeddings=bool(titan_model.enable_weight_tying), block_size=moba[0].block_size,
        dtype_bytes=DTYPE_BYTES[dtype], qkv_bias=False)
