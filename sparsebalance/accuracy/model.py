"""The accuracy experiment's model: the tiny Qwen2 with MoBA, its checkpoint file and its checks.

The model is ``kernels/qwen2.py``'s Qwen2 at the ``tiny`` preset's dimensions (hidden 64, 4 layers,
4 query / 2 kv heads of 16, MoBA block 32, byte vocabulary). Two departures from Hugging Face's
defaults, both needed for the recall task to be learnt on this CPU: weights initialised with standard
deviation 0.1 (0.02 plateaus at the copy baseline) and RoPE base 10,000 (Qwen2's 10^6 barely rotates
16-dimensional heads over a thousand positions, which starves the previous-token heads that
associative recall is built from).

A **checkpoint** is a directory with ``model.pt`` (float32 state dict, ~0.7 MB) and
``checkpoint.json``: format version, the model and task configs, the seed and command that made it,
the pretraining record (steps, CPU and wall time, held-out accuracy) and the coverage fit. Loading
checks everything a later run relies on and fails with one ``ConfigError`` line naming the field.
"""

from __future__ import annotations

import errno
import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from sparsebalance.configmap import from_mapping
from sparsebalance.data.recall import RecallConfig
from sparsebalance.errors import ConfigError, check, check_positive
from sparsebalance.readfile import load_json, os_error
from sparsebalance.simulator.config import ModelConfig, tiny

FORMAT_VERSION = 1
SHIPPED = "recall-tiny"
"""Name of the shipped checkpoint (``sparsebalance/data/checkpoints/recall-tiny/``)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class NetConfig:
    """What the tiny recall model is besides ``ModelConfig``'s dimensions."""

    preset: str = "tiny"
    """Model dimensions: a ``simulator.config`` preset name (only ``tiny`` is supported)."""
    rope_theta: float = 10_000.0
    """RoPE base (Qwen2's default 1e6 is too slow a rotation for 16-dim heads at these lengths)."""
    init_std: float = 0.1
    """Initial weight standard deviation (Hugging Face's 0.02 plateaus at the copy baseline)."""
    max_positions: int = 2048
    """Longest sequence the model takes (``max_position_embeddings``); longer tasks are refused."""
    seed: int = 0
    """Seed of the initial weights."""

    def __post_init__(self) -> None:
        check(self.preset == "tiny", "model.preset", f"only 'tiny' is supported, got {self.preset!r}")
        check_positive(self.rope_theta, "rope_theta")
        check_positive(self.init_std, "init_std")
        check_positive(self.max_positions, "max_positions")

    @property
    def dims(self) -> ModelConfig:
        return tiny()


def build(net: NetConfig) -> Any:
    """A freshly initialised model (same seed -> same weights)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from sparsebalance.kernels.qwen2 import qwen2_config

    cfg = qwen2_config(net.dims, max_position_embeddings=net.max_positions, rope_theta=net.rope_theta)
    cfg.initializer_range = net.init_std
    torch.manual_seed(net.seed)
    model = Qwen2ForCausalLM(cfg)
    model.train()
    return model


def shipped_path(name: str = SHIPPED) -> Path:
    return Path(str(resources.files("sparsebalance.data") / "checkpoints" / name))


@dataclass(slots=True)
class Checkpoint:
    """A loaded checkpoint: configs, record and the path of its weights."""

    path: Path
    net: NetConfig
    task: RecallConfig
    meta: dict[str, Any]
    """Everything else of checkpoint.json (seed, command, pretraining record, coverage fit)."""

    def load_model(self) -> Any:
        import torch

        model = build(self.net)
        weights = self.path / "model.pt"
        try:
            state = torch.load(weights, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001  (garbage or a truncated zip: pickle, zip, Runtime errors)
            if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EIO, errno.ENOMEM):
                raise os_error(e, "checkpoint", f"cannot read {weights}") from None
            # any other OSError is the file's: mmap of an empty or cut file fails with EINVAL
            first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0][:160]
            raise ConfigError(f"checkpoint: {weights} is not a readable weights file (truncated or not "
                              f"saved by torch.save?): {first}") from None
        if not isinstance(state, dict):
            raise ConfigError(f"checkpoint: {weights} holds a {type(state).__name__}, not a state dict")
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            first = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
            raise ConfigError(f"checkpoint: {self.path}/model.pt does not fit the model: {first}") from None
        return model


def save(path: Path, model: Any, net: NetConfig, task: RecallConfig, meta: dict[str, Any]) -> None:
    import torch

    path.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().float().contiguous() for k, v in model.state_dict().items()},
               path / "model.pt")
    doc = {"format_version": FORMAT_VERSION, "model": asdict(net), "task": asdict(task), **meta}
    (path / "checkpoint.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")


def export_hf(ckpt: Checkpoint, directory: Path) -> Path:
    """The checkpoint as a Hugging Face directory (``config.json`` with its RoPE base and positions,
    ``model.safetensors``): what the real run's stages load (``realrun.checkpoint``)."""
    from transformers.utils import logging as hf_logging

    directory = Path(directory)
    hf_logging.disable_progress_bar()  # a bar for one 0.7 MB shard is noise on the console
    ckpt.load_model().save_pretrained(str(directory), safe_serialization=True)
    return directory


def load(path: str | Path | None, default: str = SHIPPED) -> Checkpoint:
    """Read and check a checkpoint directory (None = the shipped one named ``default``)."""
    p = shipped_path(default) if path is None else Path(path)
    if p.is_file():
        p = p.parent
    meta_file = p / "checkpoint.json"
    check(meta_file.is_file(), "checkpoint", f"no checkpoint at {str(p)!r} (expected checkpoint.json "
          f"and model.pt; make one with `sparsebalance accuracy pretrain`)")
    check((p / "model.pt").is_file(), "checkpoint", f"{str(p)!r} has no model.pt")
    doc = load_json(meta_file, "checkpoint")  # undecodable, invalid, nested too deep: one line
    check(isinstance(doc, dict), "checkpoint", f"{meta_file} must hold a JSON object")
    check(doc.get("format_version") == FORMAT_VERSION, "checkpoint.format_version",
          f"expected {FORMAT_VERSION}, got {doc.get('format_version')!r}")
    for key in ("model", "task"):
        check(isinstance(doc.get(key), dict), f"checkpoint.{key}", "missing table")
    net = from_mapping(NetConfig, doc.pop("model"), "checkpoint.model")
    task = from_mapping(RecallConfig, doc.pop("task"), "checkpoint.task")
    doc.pop("format_version")
    return Checkpoint(path=p, net=net, task=task, meta=doc)


def check_task_fits(ckpt: Checkpoint, buckets: list[int]) -> None:
    """The checkpoint's task and the held-out buckets must fit the model's positions."""
    check(ckpt.task.max_length <= ckpt.net.max_positions, "task.max_length",
          f"the checkpoint's task ({ckpt.task.max_length} tokens) exceeds its model's positions "
          f"({ckpt.net.max_positions}): mismatched checkpoint")
    for b in buckets:
        check(b <= ckpt.net.max_positions, "buckets",
              f"bucket {b} is longer than the model's positions ({ckpt.net.max_positions})")
