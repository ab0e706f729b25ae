"""The run config: model x cluster x data x policy (+ profile), loaded from TOML and validated.

Example (``examples/qwen25-3b_h200_dp4pp4.toml``)::

    name = "qwen25-3b_h200_dp4pp4"
    iterations = 20
    profile = "analytical-h200"
    [model]
    preset = "qwen2.5-3b"
    [cluster]
    preset = "h200-4x8"
    [data]
    distribution = "chatqa2-like"
    [policy]
    batching = "sab"
    tuning = "dst"
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sparsebalance.configmap import from_mapping, to_dict
from sparsebalance.data.config import DataConfig
from sparsebalance.errors import ConfigError, check, check_choice, check_positive
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.readfile import load_config_file
from sparsebalance.simulator.config import (
    DEFAULT_ENGINE,
    ENGINE_NAMES,
    ClusterConfig,
    ModelConfig,
    check_tp,
    cluster_from_mapping,
    h200_4x8,
    qwen25_3b,
)
from sparsebalance.simulator.hfconfig import model_from_table

MAX_ITERATIONS = 10_000_000
"""Most iterations a run may ask for (a simulated iteration at global batch 16 takes ~1 ms)."""

@dataclass(kw_only=True, slots=True)
class RunConfig:
    """Everything one run needs. ``profile`` is a shipped profile name or a path (CSV + sidecar)."""

    name: str = "run"
    """Run label; results go to ``<output_dir>/<name>/``."""
    iterations: int = 10
    """Iterations (global batches) to run."""
    seed: int = 0
    """Seeds everything random in the run: the data draw and epoch shuffle (unless ``data.seed`` is
    set), the coverage model, the policies' RNG and (realrun) the model's initial weights. The same
    meaning in every verb; a sweep's ``seed`` axis and ablation's ``--seeds`` set this field."""
    profile: str = "analytical-h200"
    """Latency profile: a name under sparsebalance/data/profiles/ or a path to a profile CSV."""
    latency_extrapolate: str = "warn"
    """Latency queries outside the profiled grid: warn (once per op, then extrapolate linearly),
    error, or clamp to the nearest profiled value."""
    output_dir: str = "results"
    """Where ``<name>/`` is written."""
    engine: str = DEFAULT_ENGINE
    """What times each simulated iteration: ``core`` (the exact timing core, the default and fast)
    or ``simpy`` (the SimPy event model; the same times, for what needs events)."""
    model: ModelConfig = field(default_factory=qwen25_3b)
    cluster: ClusterConfig = field(default_factory=h200_4x8)
    data: DataConfig = field(default_factory=DataConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    realrun: dict[str, Any] = field(default_factory=dict)
    """Options of the real executor (``sparsebalance.realrun.config.RealrunConfig``: keys and values
    checked on load by every verb; empty for simulation)."""
    base_dir: str = "."
    """Directory relative paths are resolved against (the config file's directory)."""

    allow_nonmonotone: bool = False
    """Accept a profile whose latency falls as length or budget grows (a warning lists the points);
    by default such a profile is refused (``--allow-nonmonotone``)."""

    def __post_init__(self) -> None:
        check_positive(self.iterations, "iterations")
        check(self.iterations <= MAX_ITERATIONS, "iterations",
              f"must be <= {MAX_ITERATIONS:,}, got {self.iterations:,}")
        check_positive(self.seed, "seed", allow_zero=True)
        if self.data.seed is None:  # the data follow the run's seed unless given their own
            self.data = replace(self.data, seed=self.seed)
        check_tp(self.model, self.cluster)
        if self.cluster.cp_split == "per-sequence":  # the policies that price attention per sequence
            check(self.policy.batching != "sab-order" and self.policy.tuning != "dst-cp", "cluster.cp_split",
                  "'per-sequence' prices a micro-batch by its placement on the CP group; sab-order and dst-cp "
                  "need attention additive over sequences: use batching sab / lbb and tuning dst / fixed")
            check(not self.policy.per_layer, "cluster.cp_split",
                  "'per-sequence' places each micro-batch at one budget; set policy.per_layer = false")
        check_choice(self.latency_extrapolate, "latency_extrapolate", ("warn", "error", "clamp"))
        check_choice(self.engine, "engine", ENGINE_NAMES)
        check(bool(self.name.strip()) and "/" not in self.name and "\\" not in self.name and "\0" not in self.name
              and self.name.strip() not in (".", ".."), "name",
              f"must be a label naming a directory of its own (not '.', '..', no '/'), got {self.name!r}")

    def resolve(self, path: str | None) -> Path | None:
        """A path from the config, relative to the config file's directory."""
        if path is None:
            return None
        p = Path(path)
        return p if p.is_absolute() else Path(self.base_dir) / p

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


_SECTIONS = {"model", "cluster", "data", "policy", "realrun"}


def run_config_from_mapping(data: dict[str, Any], base_dir: str = ".") -> RunConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a table of settings, got {type(data).__name__}")
    data = dict(data)
    for section in _SECTIONS:
        if section in data and not isinstance(data[section], dict):
            raise ConfigError(f"{section}: expected a table ([{section}] or {section}.KEY = ...), "
                              f"got {type(data[section]).__name__} {data[section]!r}")
    kwargs: dict[str, Any] = {}
    if "model" in data:
        kwargs["model"] = model_from_table(data.pop("model"), base_dir=base_dir)
    if "cluster" in data:
        kwargs["cluster"] = cluster_from_mapping(data.pop("cluster"))
    if "data" in data:
        kwargs["data"] = from_mapping(DataConfig, data.pop("data"), "data")
    if "policy" in data:
        kwargs["policy"] = from_mapping(PolicyConfig, data.pop("policy"), "policy")
    if "realrun" in data:
        rr = data.pop("realrun")
        if not isinstance(rr, dict):
            raise ConfigError("realrun: expected a table")
        from sparsebalance.realrun.config import RealrunConfig

        # its keys and values checked on load whatever the verb (simulate ignores the table, but an
        # unknown key or backend = "mpi" is a mistake there too); the checks against the model, the
        # plan and this machine are realrun_config's, before a launch
        from_mapping(RealrunConfig, rr, "realrun")
        kwargs["realrun"] = rr
    data.pop("base_dir", None)
    cfg = from_mapping(RunConfig, data | kwargs | {"base_dir": base_dir})
    return cfg


def load_run_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load and validate a TOML (or JSON) run config. ``overrides`` are dotted keys
    (``{"policy.tuning": "dst"}``) applied before validation."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: no such file {str(path)!r}")
    data = load_config_file(path, "config")  # undecodable, invalid, too deep: one line naming it
    for key, value in (overrides or {}).items():
        apply_override(data, key, value)
    return run_config_from_mapping(data, base_dir=str(path.parent))


def apply_override(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``data["a"]["b"] = value`` for ``dotted = "a.b"``."""
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part} is not a table (it holds {node!r})")
    if isinstance(node.get(parts[-1]), dict) and not isinstance(value, dict) and parts[-1] in _SECTIONS:
        raise ConfigError(f"{dotted}: is a table; set one of its keys, e.g. {dotted}.KEY=VALUE")
    node[parts[-1]] = value


def dump_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML (written beside every result)."""
    d = cfg.to_dict()
    d.pop("base_dir", None)
    lines: list[str] = []
    tables: list[tuple[str, dict]] = []
    for k, v in d.items():
        if isinstance(v, dict):
            if v:  # TOML cannot tell an empty table from a missing one; skip it
                tables.append((k, v))
        else:
            lines.append(f"{k} = {_toml_value(v)}")
    for name, table in tables:
        lines.append(f"\n[{name}]")
        for k, v in table.items():
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")
