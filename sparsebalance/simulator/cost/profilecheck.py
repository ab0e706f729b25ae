"""A profile against the run: what a latency model may be built on.

A measured profile must match the run's ``model.block_size``, ``cluster.tp`` and the per-layer dims
(hidden, heads, kv_heads, head_dim, ffn, vocab) or loading fails with ConfigError, since its numbers
cannot be rescaled faithfully; ``layers`` may differ (the table is per layer). An analytical profile
is instead re-derived for the run's dims, TP and block size from the hardware parameters in its
sidecar (``sparsebalance.simulator.cost.roofline``), after checking that its table is what that
sidecar derives. ``analytical-<gpu>`` without a shipped profile of that name is built for the run
on the fly. A profile whose latency falls as length or budget grows is refused unless allowed.
"""

from __future__ import annotations

import warnings

import numpy as np

from sparsebalance.errors import ConfigError, MeaningWarning, NoteWarning
from sparsebalance.simulator.config import QWEN2_ARCH, ClusterConfig, ModelConfig
from sparsebalance.simulator.cost.catalog import load_profile
from sparsebalance.simulator.cost.profile import Profile, monotone_violations
from sparsebalance.simulator.cost.profilemeta import ProfileMeta

_CHECKED_DIMS = ("hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab")


def _mismatches(meta: ProfileMeta, model: ModelConfig, cluster: ClusterConfig) -> list[str]:
    out = []
    if meta.block_size != model.block_size:
        out.append(f"block_size {meta.block_size} (run: model.block_size = {model.block_size})")
    if meta.tp != cluster.tp:
        out.append(f"tp {meta.tp} (run: cluster.tp = {cluster.tp})")
    for dim in _CHECKED_DIMS:
        if dim in meta.model and meta.model[dim] != getattr(model, dim):
            out.append(f"model.{dim} {meta.model[dim]} (run: {getattr(model, dim)})")
    # a sidecar records only the architecture fields that differ from Qwen2's (ModelConfig.arch)
    for key, default in QWEN2_ARCH.items():
        if key == "layer_ops" and not meta.analytical:  # a measured table holds its layer as it ran
            continue
        have = meta.model.get(key, default)
        if have != getattr(model, key):
            out.append(f"model.{key} {have!r} (run: {getattr(model, key)!r})")
    return out


def check_tp_overlap(prof: Profile, cluster: ClusterConfig) -> None:
    """``cluster.tp_overlap`` is priced by analytical profiles only: a measured one refuses it in one
    line (checked before a calibration probe spends time on it, and when the model is built)."""
    if cluster.tp_overlap and cluster.tp > 1 and not prof.meta.analytical:
        raise ConfigError(f"cluster.tp_overlap: priced by analytical profiles only (profile = \"analytical-<gpu>\"); "
                          f"{prof.source} is measured, its TP collectives are added whole: set tp_overlap = false")


def load_checked(profile: str | Profile, model: ModelConfig, cluster: ClusterConfig, *,
                 base_dir: str = ".", allow_nonmonotone: bool = False) -> Profile:
    """Load ``profile`` (shipped name, directory or CSV path, or a Profile) and check it against
    ``model`` on ``cluster`` (module docstring): the profile the latency model is built on.

    A profile whose latency falls as length or budget grows is refused (ConfigError listing the
    points) unless ``allow_nonmonotone`` or its sidecar carries a ``nonmonotone`` note saying why the
    points are acceptable; then a warning lists them."""
    if isinstance(profile, Profile):
        prof = profile
    else:
        prof = _built(profile, model, cluster, base_dir) or load_profile(profile, base_dir)
    bad = _mismatches(prof.meta, model, cluster)
    sp = cluster.sequence_parallel and cluster.tp > 1
    overlap = cluster.tp_overlap and cluster.tp > 1
    if prof.meta.analytical and bool(prof.meta.sequence_parallel) != sp:  # a measured table is as measured
        bad.append(f"sequence_parallel {bool(prof.meta.sequence_parallel)} (run: {sp})")
    if prof.meta.analytical and bool(prof.meta.tp_overlap) != overlap:
        bad.append(f"tp_overlap {bool(prof.meta.tp_overlap)} (run: {overlap})")
    impl = cluster.tp_overlap_impl if overlap and sp else "megatron"
    if prof.meta.analytical and (prof.meta.tp_overlap_impl or "megatron") != impl:
        bad.append(f"tp_overlap_impl {prof.meta.tp_overlap_impl or 'megatron'} (run: {impl})")
    check_tp_overlap(prof, cluster)
    if bad and prof.meta.analytical and prof.meta.roofline is not None:
        from sparsebalance.simulator.cost.roofline import Hardware, build_profile

        hw = Hardware(**prof.meta.roofline)
        _check_derivable(prof, hw, build_profile)
        derived = build_profile(hw, model, cluster.tp, sequence_parallel=sp, tp_overlap=overlap,
                                tp_overlap_impl=impl)
        derived.source = f"{prof.source} (analytical, re-derived for {model.name}, tp {cluster.tp})"
        prof = derived
    elif bad:
        raise ConfigError(f"profile: {prof.source} does not match the run: " + "; ".join(bad)
                          + ". Measure a profile for this model and plan (sparsebalance profile)")
    _check_monotone(prof, model.block_size, allow_nonmonotone)
    device = prof.meta.device
    # A measured profile names the device in full ("cpu x86_64, 1 thread(s)", "NVIDIA H200"): the
    # cluster's short label matches when it is a word of that name.
    words = device.lower().replace(",", " ").split()
    if device and cluster.device and cluster.device.lower() not in words + [device.lower()]:
        warnings.warn(f"profile {prof.source} is for device {device!r} but cluster.device is "
                      f"{cluster.device!r}; predictions follow the profile", MeaningWarning, stacklevel=3)
    return prof


def _built(name: str, model: ModelConfig, cluster: ClusterConfig, base_dir: str) -> Profile | None:
    """``analytical-<gpu>`` with no shipped profile or directory of that name: the roofline's profile
    for this model and TP on that GPU, built now (None: load ``name`` as a file)."""
    from sparsebalance.simulator.cost.catalog import built_gpu

    gpu = built_gpu(name, base_dir)
    if gpu is None:
        return None
    from sparsebalance.simulator.cost.roofline import HARDWARE, build_profile

    prof = build_profile(HARDWARE[gpu], model, cluster.tp, sequence_parallel=cluster.sequence_parallel,
                         tp_overlap=cluster.tp_overlap, tp_overlap_impl=cluster.tp_overlap_impl)
    prof.source = f"{name} (analytical, built for {model.name}, tp {cluster.tp})"
    return prof


def _check_derivable(prof: Profile, hw, build_profile) -> None:
    """An analytical profile is re-derived for another model from its sidecar; that is only the same
    profile if its table is what the sidecar derives for the sidecar's own model. An edited table
    (every latency x10, say) would be silently replaced: refuse it in one line instead."""
    meta = prof.meta
    try:
        own = ModelConfig(**meta.model, block_size=meta.block_size)
        want = build_profile(hw, own, meta.tp, sequence_parallel=bool(meta.sequence_parallel),
                             tp_overlap=bool(meta.tp_overlap),
                             tp_overlap_impl=meta.tp_overlap_impl or "megatron").table
    except (TypeError, KeyError, ValueError, ConfigError) as e:
        raise ConfigError(f"profile: {prof.source}: its sidecar cannot re-derive it ({e}); "
                          "regenerate it with python -m sparsebalance.simulator.cost.roofline") from None
    keys = ["op", "seq_len", "budget"]
    a = prof.table.sort_values(keys, kind="stable").reset_index(drop=True)
    b = want.sort_values(keys, kind="stable").reset_index(drop=True)
    same = len(a) == len(b) and (a[keys].to_numpy() == b[keys].to_numpy()).all()
    off = 0 if not same else int((~np.isclose(a["latency_s"], b["latency_s"], rtol=1e-9, atol=0)).sum())
    if not same or off:
        what = f"{off} of {len(a)} latencies differ" if same else "its rows differ"
        raise ConfigError(f"profile: {prof.source} is analytical, so it is re-derived for this run from its "
                          f"sidecar, but its table is not what that sidecar derives ({what}: edited?). "
                          "To use the table as it is, set \"analytical\": false in profile.json and match "
                          "the run's model and plan; or regenerate it (python -m sparsebalance.simulator.cost.roofline)")


def _check_monotone(prof: Profile, block_size: int, allow: bool) -> None:
    bad = monotone_violations(prof, block_size)
    if not bad:
        return
    shown = "; ".join(bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "")
    note = prof.meta.nonmonotone
    if allow or note:
        why = f" (accepted: {note})" if note else " (accepted: --allow-nonmonotone)"
        warnings.warn(f"profile {prof.source}: latency falls as work grows at {len(bad)} point(s)"
                      f"{why}: {shown}", NoteWarning, stacklevel=4)
        return
    raise ConfigError(f"profile: {prof.source}: latency falls as work grows at {len(bad)} point(s): "
                      f"{shown}. Re-measure, or pass --allow-nonmonotone (allow_nonmonotone = true) "
                      "to use it anyway")
