"""A local Hugging Face checkpoint, read tensor by tensor: each rank loads only its stage's weights.

Formats: ``model.safetensors``, sharded safetensors (``model.safetensors.index.json``),
``pytorch_model.bin`` and sharded bin (``pytorch_model.bin.index.json``). safetensors files are opened
lazily (``safe_open`` reads one tensor at a time); ``.bin`` files are memory-mapped
(``torch.load(mmap=True, weights_only=True)``), so neither reads the whole model into memory.
Never downloads: the directory must exist locally.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparsebalance.errors import ConfigError

FIELD = "realrun.checkpoint"
#: (Qwen2Config attribute, ModelConfig field) pairs that must agree between checkpoint and run.
DIMS = (("hidden_size", "hidden"), ("num_hidden_layers", "layers"), ("num_attention_heads", "heads"),
        ("num_key_value_heads", "kv_heads"), ("intermediate_size", "ffn"), ("vocab_size", "vocab"))
_INDEXES = (("model.safetensors.index.json", "safetensors"), ("pytorch_model.bin.index.json", "bin"))
_SINGLE = (("model.safetensors", "safetensors"), ("pytorch_model.bin", "bin"))


def weight_map(directory: Path) -> tuple[str, dict[str, Path]]:
    """(format, {tensor name: file}) of a checkpoint directory; ConfigError when it holds none."""
    for index, kind in _INDEXES:
        p = directory / index
        if p.is_file():
            try:
                wm = json.loads(p.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ConfigError(f"{FIELD}: {p} is not a valid weight index ({e})") from None
            return kind, {name: directory / f for name, f in wm.items()}
    for single, kind in _SINGLE:
        p = directory / single
        if p.is_file():
            return kind, {name: p for name in _names(p, kind)}
    raise ConfigError(f"{FIELD}: {directory} holds no weights (expected model.safetensors, "
                      "pytorch_model.bin or their .index.json for sharded checkpoints)")


def _names(path: Path, kind: str) -> list[str]:
    if kind == "safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    return list(_load_bin(path))


def _load_bin(path: Path) -> dict:
    import torch

    return torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)


def hf_config(directory: Path) -> Any:
    """The checkpoint's ``Qwen2Config`` with MoBA attention and no KV cache."""
    from transformers import Qwen2Config

    from sparsebalance.kernels.qwen2 import ATTN_NAME, register_moba_attention

    register_moba_attention()
    cfg = Qwen2Config.from_pretrained(str(directory), local_files_only=True)
    cfg.use_cache = False
    cfg._attn_implementation = ATTN_NAME
    return cfg


def check_checkpoint(directory: Path, model: Any) -> None:
    """Before launch: the directory exists, holds a Qwen2 config.json whose dims equal the run's
    ``[model]`` (the latency model and the plan use those), and weights in a known format."""
    if not directory.is_dir():
        raise ConfigError(f"{FIELD}: {str(directory)!r} is not a local directory")
    cj = directory / "config.json"
    try:
        meta = json.loads(cj.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{FIELD}: cannot read {cj} ({e})") from None
    if meta.get("model_type") != "qwen2":
        raise ConfigError(f"{FIELD}: {cj} has model_type {meta.get('model_type')!r}; realrun "
                          "builds Qwen2 models (model_type \"qwen2\")")
    have = dict(meta)
    have.setdefault("head_dim", (meta.get("hidden_size") or 0) // max(meta.get("num_attention_heads") or 1, 1))
    bad = [f"model.{field} = {getattr(model, field)} but the checkpoint has {key} = {have.get(key)}"
           for key, field in (*DIMS, ("head_dim", "head_dim")) if have.get(key) != getattr(model, field)]
    if bad:
        raise ConfigError(f"{FIELD}: does not match the run's [model]: " + "; ".join(bad)
                          + " (set model.preset to the checkpoint's model)")
    weight_map(directory)


class CheckpointReader:
    """``fill(name, tensor)`` for :func:`sparsebalance.kernels.qwen2_init.materialize`: copies one
    named tensor from the checkpoint into ``tensor`` (shapes must agree)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.kind, self.files = weight_map(directory)
        self._open: dict[Path, Any] = {}

    def _source(self, path: Path) -> Any:
        if path not in self._open:
            if self.kind == "safetensors":
                from safetensors import safe_open

                self._open[path] = safe_open(str(path), framework="pt")
            else:
                self._open[path] = _load_bin(path)
        return self._open[path]

    def tensor(self, name: str) -> Any:
        path = self.files.get(name)
        if path is None:
            raise ConfigError(f"{FIELD}: tensor {name!r} is not in {self.directory}")
        src = self._source(path)
        return src.get_tensor(name) if self.kind == "safetensors" else src[name]

    def __call__(self, name: str, out: Any) -> None:
        t = self.tensor(name)
        if tuple(t.shape) != tuple(out.shape):
            raise ConfigError(f"{FIELD}: tensor {name!r} has shape {tuple(t.shape)}, the model "
                              f"expects {tuple(out.shape)}")
        out.copy_(t)

    def close(self) -> None:
        self._open.clear()
