"""A :class:`ModelConfig` from a Hugging Face ``config.json``: any Llama-, Qwen2-, Mistral-, GPT-2- or
GPT-NeoX-style decoder, so a published run's model is a file, not a hand-typed preset.

Only what the cost model and the memory model read is taken: dimensions, the MLP kind (SwiGLU for
Llama/Qwen2/Mistral, a 4h GELU MLP for GPT-2/GPT-NeoX unless the file states another width), biases,
the norm, positions (rotary, or GPT-2's learned table) and whether the LM head is tied. Each
architecture's defaults are those of its ``transformers`` config class, so a ``config.json`` that
omits a key (as saved files often do for defaults) reads as ``transformers`` would read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from sparsebalance.configmap import from_mapping, to_dict
from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import ModelConfig, model_from_mapping

#: ``model_type`` values understood, and the architecture each implies.
ARCHITECTURES = {
    "llama": {"mlp": "swiglu", "qkv_bias": False, "bias": False, "norm": "rmsnorm", "positions": "rotary"},
    "mistral": {"mlp": "swiglu", "qkv_bias": False, "bias": False, "norm": "rmsnorm", "positions": "rotary"},
    "qwen2": {"mlp": "swiglu", "qkv_bias": True, "bias": False, "norm": "rmsnorm", "positions": "rotary"},
    "gpt2": {"mlp": "gelu", "qkv_bias": True, "bias": True, "norm": "layernorm", "positions": "learned"},
    "gpt_neox": {"mlp": "gelu", "qkv_bias": True, "bias": True, "norm": "layernorm", "positions": "rotary"},
}
#: Key names per family: (hidden, layers, heads, ffn, vocab) in ``config.json``.
_GPT2_KEYS = ("n_embd", "n_layer", "n_head", "n_inner", "vocab_size")
_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
#: ``transformers``' defaults of ``tie_word_embeddings`` per architecture (GPT-2 ties its head).
_TIED = {"llama": False, "mistral": False, "qwen2": False, "gpt2": True, "gpt_neox": False}


def model_from_table(data: dict[str, Any], where: str = "model", base_dir: str = ".") -> ModelConfig:
    """A run config's ``[model]`` table: ``hf_config = "path/config.json"`` (relative to ``base_dir``,
    the run config's folder) plus optional overrides of any field; else as ``model_from_mapping``
    (a ``preset`` or every field)."""
    if "hf_config" not in data:
        return model_from_mapping(data, where)
    data = dict(data)
    path = data.pop("hf_config")
    if "preset" in data:
        raise ConfigError(f"{where}: give preset or hf_config, not both")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}.hf_config: expected the path of a config.json, got {path!r}")
    p = Path(path) if Path(path).is_absolute() else Path(base_dir) / path
    return from_mapping(ModelConfig, to_dict(model_from_hf(p, where=f"{where}.hf_config")) | data, where)


def model_from_hf(source: str | Path | Mapping[str, Any], *, where: str = "model.hf_config",
                  **overrides: Any) -> ModelConfig:
    """The decoder described by ``source`` (a ``config.json`` path, or its parsed dict), with
    ``overrides`` (other ``ModelConfig`` fields: ``block_size``, ``name``, ...) applied last.
    Errors are one line naming ``where`` and the key."""
    if isinstance(source, Mapping):
        data, label = dict(source), where
    else:
        from sparsebalance.readfile import load_json

        data, label = load_json(Path(source), where), f"{where} ({source})"
        if not isinstance(data, dict):
            raise ConfigError(f"{label}: expected a JSON object, got {type(data).__name__}")
    kind = data.get("model_type")
    if kind not in ARCHITECTURES:
        raise ConfigError(f"{label}: model_type {kind!r} is not supported; choose one of "
                          f"{', '.join(ARCHITECTURES)} (or give the dimensions in [model] directly)")
    arch: dict[str, Any] = dict(ARCHITECTURES[kind])

    def get(key: str, default: Any = None) -> Any:
        value = data.get(key, default)
        if value is None:
            raise ConfigError(f"{label}: {key} is missing (model_type {kind})")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{label}: {key} must be a positive integer, got {value!r}")
        return value

    names = _GPT2_KEYS if kind == "gpt2" else _KEYS
    hidden, layers, heads = get(names[0]), get(names[1]), get(names[2])
    kv_heads = get("num_key_value_heads", heads) if kind in ("llama", "mistral", "qwen2") else heads
    head_dim = data.get("head_dim") or hidden // heads
    ffn = get(names[3], 4 * hidden) if kind == "gpt2" else get(names[3])
    if kind == "llama":  # its O-projection bias (also under attention_bias) is not counted: h weights
        arch["qkv_bias"] = bool(data.get("attention_bias", False))
    if kind == "gpt_neox":
        arch["qkv_bias"] = arch["bias"] = bool(data.get("attention_bias", True))
    if kind == "gpt2":
        arch["max_positions"] = get("n_positions", 1024)
    tied = data.get("tie_word_embeddings", _TIED[kind])
    if not isinstance(tied, bool):
        raise ConfigError(f"{label}: tie_word_embeddings must be true or false, got {tied!r}")
    name = str(data.get("_name_or_path") or (data.get("architectures") or [kind])[0])
    try:
        model = ModelConfig(name=name, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                            head_dim=int(head_dim), ffn=ffn, vocab=get(names[4]), tie_embeddings=tied,
                            **arch)
        return replace(model, **overrides)
    except ConfigError as e:
        raise ConfigError(f"{label}: {e}") from None
    except TypeError as e:  # an override that is no ModelConfig field
        raise ConfigError(f"{label}: {e}") from None
