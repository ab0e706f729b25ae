"""A profile's sidecar (``profile.json``) as a typed, validated value: :class:`ProfileMeta`.

The sidecar is read through ``configmap`` (wrong types name the field) and written by
:meth:`ProfileMeta.to_json` only, so every producer (the roofline, a measurement, a calibration)
records the same keys the same way. Keys this version does not know are kept in ``extra`` and
written back unchanged: a sidecar from a newer or older tool loads and survives a rescale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sparsebalance.configmap import from_mapping
from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import CP_LAYOUTS as _RUN_LAYOUTS
from sparsebalance.simulator.config import TP_OVERLAP_IMPLS

CP_LAYOUTS = tuple(x for x in _RUN_LAYOUTS if x != "best")
"""Layouts a CP profile can be measured on (a run's, less ``best``, which picks among them)."""

FORMAT_VERSION = 2
"""Written by this version. 2 added the split backward (``*_bwd_input``, ``*_bwd_weight``)."""
READ_VERSIONS = (1, 2)
"""Read by this version: a format-1 profile loads; the latency model derives its split backward
(I = W = half of the whole, B = I + W) and says so once."""
#: Model dimensions a sidecar's ``model`` dict records (names of ``ModelConfig`` fields).
MODEL_DIMS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab")


@dataclass(kw_only=True, slots=True, frozen=True)
class ProfileMeta:
    """The sidecar of a profile: what was measured (or modelled), where, and how."""

    format_version: int
    """Profile format the table follows (see :data:`READ_VERSIONS`)."""
    device: str
    """Device label: a short name (``h100``) for analytical profiles, the full name for measured ones
    (``NVIDIA H100 80GB HBM3``, ``cpu x86_64, 1 thread(s)``)."""
    dtype: str
    """Compute dtype of the measurement (``bfloat16``, ``float32``; ``bf16`` for analytical)."""
    analytical: bool
    """True when the table is a model (``simulator/cost/roofline.py``), not a measurement."""
    model: dict[str, Any]
    """The model measured: :data:`MODEL_DIMS` (positive integers) and optionally ``name``,
    ``dtype_bytes`` (analytical profiles, which re-derive from it)."""
    block_size: int
    """MoBA block size, tokens."""
    tp: int
    """Tensor-parallel degree: latencies are of one TP rank."""
    how: str
    """The method in words (statistic, repeats, timer; read by the calibration probe)."""
    command: str
    """The command that produced the profile."""
    versions: dict[str, Any]
    """Package versions of the producer (name -> version string)."""
    memory_bandwidth: float | None = None
    """Effective HBM bandwidth, bytes/s: prices the optimizer step when there are no ``optim`` rows."""
    roofline: dict[str, Any] | None = None
    """Analytical profiles: the ``Hardware`` parameters they re-derive from for another model."""
    concurrency: int | None = None
    """Copies measured at once (CPU; absent = 1)."""
    tp_comm_included: bool | None = None
    """Whether the dense ops include the TP all-reduces (absent = ``analytical``)."""
    attention_call_s: dict[str, float] | None = None
    """Seconds of one attention call that the attention rows leave out, ``{"fwd": s, "bwd": s}``:
    paid once per layer and packed micro-batch, not per sequence (analytical profiles); absent = 0
    (a measured table times each sequence as a call of its own, so its rows include it)."""
    sequence_parallel: bool | None = None
    """Megatron sequence parallelism at ``tp`` (norms and residuals on 1/tp of the tokens); absent = no."""
    tp_overlap: bool | None = None
    """The backward's TP collectives overlapped with its GEMMs, as Megatron-LM runs them (analytical
    profiles; ``cluster.tp_overlap``); absent = no."""
    tp_overlap_impl: str | None = None
    """Whose TP overlap the dense rows price (``cluster.tp_overlap_impl``): ``te`` = Transformer
    Engine's comm-GEMM overlap, forward included; absent = ``megatron``."""
    cp: int | None = None
    """Context-parallel degree of the ``attn_*_cp`` rows (``profile --cp``); absent = no such rows."""
    cp_layout: str | None = None
    """Layout of the ``attn_*_cp`` rows' group (``contiguous``, ``zigzag``, ``stripe``)."""
    bench: str | None = None
    """``module:Class`` of the bench that built the timed pieces (``ProfileGrid.bench``:
    ``sparsebalance.titan.profile:TitanBench`` for torchtitan's Qwen3); absent = realrun's HF Qwen2.
    The calibration probe times its points with the same bench."""
    machine: dict[str, Any] | None = None
    """Fingerprint of the machine measured on (``kernels/calibrate.machine_fingerprint``)."""
    calibration: dict[str, Any] | None = None
    """In a copy rescaled by a probe: per-op ``scales``, ``spreads``, the probing machine, the source."""
    nonmonotone: str | None = None
    """Why points where latency falls as work grows are acceptable (runs then only warn)."""
    date: str | None = None
    """UTC day the measurement ended (ISO 8601)."""
    host: dict[str, Any] | None = None
    """CPU measurements: the host's load while measuring and the verdict on it (``disturbed``,
    ``disturbed_reasons``; ``analysis/disturbance.py``), so a disturbed table says so where it is kept."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Sidecar keys this version does not know, kept so that writing gives them back."""

    def __post_init__(self) -> None:
        if self.format_version not in READ_VERSIONS:
            raise ConfigError(f"format_version: {self.format_version} is not supported "
                              f"(this version reads {', '.join(map(str, READ_VERSIONS))})")
        for name in ("block_size", "tp", "concurrency", "cp"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name}: must be > 0, got {value}")
        bad = [k for k, v in self.model.items()
               if k in MODEL_DIMS and (isinstance(v, bool) or not isinstance(v, int) or v <= 0)]
        if bad:
            raise ConfigError(f"model: dims {', '.join(bad)} must be positive integers")
        call = self.attention_call_s
        if call is not None and (set(call) != {"fwd", "bwd"} or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 for v in call.values())):
            raise ConfigError(f"attention_call_s: must be {{\"fwd\": seconds, \"bwd\": seconds}} (>= 0), got {call!r}")
        if self.tp_overlap_impl is not None and self.tp_overlap_impl not in TP_OVERLAP_IMPLS:
            raise ConfigError(f"tp_overlap_impl: must be one of {', '.join(TP_OVERLAP_IMPLS)}, "
                              f"got {self.tp_overlap_impl!r}")
        if self.cp_layout is not None and self.cp_layout not in CP_LAYOUTS:
            raise ConfigError(f"cp_layout: must be one of {', '.join(CP_LAYOUTS)}, got {self.cp_layout!r}")
        bw = self.memory_bandwidth
        if bw is not None and bw <= 0:  # configmap already refused a non-number and inf
            raise ConfigError(f"memory_bandwidth: must be a positive number of bytes/s, got {bw!r}")

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str) -> ProfileMeta:
        """The sidecar ``data`` (a parsed ``profile.json``) validated; errors are one line naming
        ``where`` and the field. Unknown keys go to ``extra``."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"profile: {where} must hold a JSON object")
        missing = [k for k in REQUIRED_KEYS if k not in data]
        if missing:
            raise ConfigError(f"profile: {where}: sidecar is missing key(s) {', '.join(missing)} "
                              f"(required: {', '.join(REQUIRED_KEYS)})")
        known = {k: v for k, v in data.items() if k in SIDECAR_FIELDS}
        extra = {k: v for k, v in data.items() if k not in SIDECAR_FIELDS}
        try:
            return from_mapping(cls, {**known, "extra": extra})
        except ConfigError as e:
            raise ConfigError(f"profile: {where}: sidecar key {e}") from None

    def to_json(self) -> dict[str, Any]:
        """The sidecar as a JSON object: every set field and the ``extra`` keys (absent stays absent)."""
        out = {name: getattr(self, name) for name in SIDECAR_FIELDS if getattr(self, name) is not None}
        return {**self.extra, **out}

    def check_consistent(self, where: str) -> None:
        """A measured sidecar's records say the same device: the label, the machine fingerprint (which
        the measurement itself writes) and the concurrency (copies at once: CPU measurements only).
        A contradiction means the sidecar was edited or belongs to another table, and nothing says
        which record describes the table: one line, ConfigError. Analytical sidecars have no
        fingerprint and are left alone."""
        kind = (self.machine or {}).get("device_kind")
        if self.analytical or kind is None:
            return
        fix = "restore the sidecar written with the table, or re-measure (sparsebalance profile)"
        if kind not in ("cpu", "cuda"):
            raise ConfigError(f"profile: {where}: machine.device_kind must be cpu or cuda, got {kind!r}")
        label_cpu = self.device.lower().startswith("cpu")
        if label_cpu != (kind == "cpu"):
            raise ConfigError(f"profile: {where}: device {self.device!r} names a {'CPU' if label_cpu else 'GPU'} "
                              f"but machine.device_kind, written by the measurement, is {kind}; {fix}")
        gpu = (self.machine or {}).get("gpu_name")
        if kind == "cuda" and gpu and self.device != gpu:
            raise ConfigError(f"profile: {where}: device {self.device!r} but the table was measured on "
                              f"machine.gpu_name {gpu!r}; {fix}")
        if kind == "cuda" and (self.concurrency or 1) > 1:
            raise ConfigError(f"profile: {where}: concurrency {self.concurrency} (copies measured at once) "
                              f"is how CPU tables are measured, but machine.device_kind is cuda; {fix}")

    @property
    def device_kind(self) -> str:
        """``cpu`` or ``cuda``: the fingerprint's record, else read from the device label."""
        recorded = (self.machine or {}).get("device_kind")
        return recorded or ("cpu" if self.device.lower().startswith("cpu") else "cuda")


#: Sidecar keys with a field of their own (``extra`` holds the rest).
SIDECAR_FIELDS = tuple(f.name for f in dataclasses.fields(ProfileMeta) if f.name != "extra")
#: Keys every sidecar has (fields without a default).
REQUIRED_KEYS = tuple(f.name for f in dataclasses.fields(ProfileMeta)
                      if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
