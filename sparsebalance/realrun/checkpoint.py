"""A local Hugging Face checkpoint, read tensor by tensor: each rank loads only its stage's weights.

Formats: ``model.safetensors``, sharded safetensors (``model.safetensors.index.json``),
``pytorch_model.bin`` and sharded bin (``pytorch_model.bin.index.json``). safetensors files are opened
lazily (``safe_open`` reads one tensor at a time); ``.bin`` files are memory-mapped
(``torch.load(mmap=True, weights_only=True)``), so neither reads the whole model into memory.
Never downloads: the directory must exist locally. Before launch every weight file is opened (its
header or zip index only), so a garbage or truncated file is one line naming it, not N workers failing.
"""

from __future__ import annotations

import errno
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
            return kind, {name: p for name in _open(p, kind, keys=True)}
    raise ConfigError(f"{FIELD}: {directory} holds no weights (expected model.safetensors, "
                      "pytorch_model.bin or their .index.json for sharded checkpoints)")


def _open(path: Path, kind: str, *, keys: bool = False) -> Any:
    """The opened weight file (``keys``: its tensor names); one line naming the file when it cannot be
    read: ConfigError for the file's own fault (garbage, cut short), HostError for the machine's."""
    try:
        if kind == "safetensors":
            from safetensors import safe_open

            f = safe_open(str(path), framework="pt")  # parses the header, checks the file covers it
        else:
            f = _load_bin(path)  # reads the zip index: a truncated or foreign file fails here
        return list(f.keys()) if keys else f
    except Exception as e:  # noqa: BLE001  (SafetensorError, pickle, zip and Runtime errors)
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EIO, errno.ENOMEM):
            from sparsebalance.readfile import os_error

            raise os_error(e, FIELD, f"cannot read {path}") from None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0][:160]
        raise ConfigError(f"{FIELD}: {path} is not a readable {kind} weights file (garbage or "
                          f"truncated?): {first}") from None


def check_weight_files(directory: Path) -> None:
    """Open every file the checkpoint's weights live in, and check each holds the tensors its index
    names (a shard replaced by another model's is found here, not inside a worker)."""
    kind, files = weight_map(directory)
    by_file: dict[Path, set[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, set()).add(name)
    for f, names in sorted(by_file.items()):
        if not f.is_file():
            raise ConfigError(f"{FIELD}: {f} is named by the weight index but is not a file")
        missing = sorted(names - set(_open(f, kind, keys=True)))
        if missing:
            raise ConfigError(f"{FIELD}: {f} does not hold {missing[0]!r}, which the weight index "
                              f"places there ({len(missing)} tensor(s) missing)")


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
    check_weight_files(directory)


class CheckpointReader:
    """``fill(name, tensor)`` for :func:`sparsebalance.kernels.qwen2_init.materialize`: copies one
    named tensor from the checkpoint into ``tensor`` (shapes must agree)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.kind, self.files = weight_map(directory)
        self._open: dict[Path, Any] = {}

    def _source(self, path: Path) -> Any:
        if path not in self._open:
            self._open[path] = _open(path, self.kind)
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
