"""A whole measured profile, as the ``profile`` verb and ``gpu-check`` write it: the table of
:func:`sparsebalance.kernels.profiler.run_profile` and its sidecar (``profile.json``, docs/formats.md),
from one function, so that both producers record the same device, versions, method and command.
"""

from __future__ import annotations

import platform
from datetime import UTC, datetime

from sparsebalance.kernels import profiler
from sparsebalance.kernels.profiler import ProfileGrid
from sparsebalance.simulator.config import ModelConfig
from sparsebalance.simulator.cost.profile import Profile
from sparsebalance.simulator.cost.profilemeta import FORMAT_VERSION, MODEL_DIMS, ProfileMeta

LAYER_HOW = {
    "eager": "layer_* = one HF Qwen2DecoderLayer (eager) with a zero-cost attention core; head_* = final "
             "norm + LM head + cross entropy of the whole logits",
    "compiled": "layer_impl compiled (kernels/fastlayer.py): layer_* = one Qwen2 decoder layer as two "
                "torch.compile regions (norm + QKV + RoPE; O + norm + SwiGLU MLP) around a zero-cost "
                "attention core; head_* = compiled final norm + linear cross-entropy chunked over the "
                "vocabulary (kernels/lmhead.py); the *_bwd_input / *_bwd_weight rows of the eager layer "
                "and head (a compiled region's backward does not split; realrun runs zb-h1 eager)",
}
"""What the sidecar's ``how`` says of the layer and head rows, per layer implementation."""


def measure_profile(model: ModelConfig, grid: ProfileGrid, *, command: str, tp: int = 1, concurrency: int = 1,
                    progress: bool = False) -> Profile:
    """Measure ``model`` (one TP rank's shard when ``tp`` > 1) on ``grid``: the whole profile, table
    and sidecar (save it with :meth:`Profile.save`).

    ``command`` is recorded in the sidecar as what produced the profile."""
    import torch
    import transformers

    from sparsebalance.kernels.calibrate import machine_fingerprint

    table = profiler.run_profile(tp_shard(model, tp), grid, progress=progress, concurrency=concurrency)
    dev_name = (torch.cuda.get_device_name() if grid.device == "cuda"
                else f"cpu {platform.processor() or platform.machine()}, {grid.threads} thread(s)")
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "python": platform.python_version()}
    if grid.device == "cuda":
        import triton

        # the driver is in the machine fingerprint (``machine.gpu_driver``)
        versions |= {"triton": triton.__version__, "cuda": torch.version.cuda}
    meta = ProfileMeta(
        machine=machine_fingerprint(grid.device, threads=grid.threads),
        format_version=FORMAT_VERSION, device=dev_name, dtype=grid.dtype, analytical=False,
        model={**{d: getattr(model, d) for d in MODEL_DIMS}, **model.arch},  # arch: where not Qwen2
        block_size=model.block_size, tp=tp, concurrency=concurrency,
        tp_comm_included=False,
        cp=grid.cp if grid.cp > 1 else None, cp_layout=grid.cp_layout if grid.cp > 1 else None,
        bench=grid.bench or None,
        how=(f"sparsebalance.kernels.profiler: {grid.statistic} of {grid.repeats} after {grid.warmup} "
             "warm-up "
             f"calls ({'CUDA events' if grid.device == 'cuda' else 'perf_counter'}) in {grid.repeats} "
             "interleaved rounds (every op timed once per round, seeded order), "
             f"{concurrency} concurrent cop{'y' if concurrency == 1 else 'ies'} "
             f"({grid.statistic} over copies, one core each, glibc allocator kept steady and "
             "Python's collector run between rounds, as in realrun); "
             + (f"layer_* = {profiler.bench_class(grid).LAYER}" if grid.bench  # another trainer's model
                else LAYER_HOW[grid.resolved_layer_impl()]) + "; attn_* = moba_attention (auto backend)"
             + (f"; tp {tp}: one rank's shard (heads, kv heads, MLP width / {tp}; embedding "
                "and head whole, as realrun replicates them), the layer under realrun's DTensor plan "
                "on a one-rank mesh (tp_plan), TP all-reduces not included"
                if tp > 1 else "")
             + (f"; attn_*_cp = one sequence dealt {grid.cp_layout} over cp {grid.cp} ranks, every rank's "
                "share computed in turn on realrun's all-gather CP path (moba_attention_cp_alone), "
                "collectives excluded: the group's attention work" if grid.cp > 1 else "")
             + ("; attn_*_cp_step = rank 0's ring steps on the same sequences (kernels/moba/ring_step.py), "
                "seq_len = the pairs each step attends per head, forward with its merge (step 0 with the "
                "gate), backward with its accumulation" if grid.cp > 1 and grid.device == "cpu" and grid.cp_steps
                else "")),
        command=command,
        date=datetime.now(UTC).date().isoformat(),  # UTC day the measurement ended
        versions=versions,
    )
    return Profile(table=table, meta=meta, source=f"measured on {dev_name}")


def tp_shard(model, tp: int):
    """The layer one TP rank computes: heads, kv heads and MLP width divided by ``tp`` (the same
    hidden size, vocabulary and head dim). ConfigError (one line) when ``tp`` does not divide them."""
    from dataclasses import replace

    from sparsebalance.errors import ConfigError

    for dim in ("heads", "kv_heads", "ffn"):
        if getattr(model, dim) % tp:
            raise ConfigError(f"--tp: must divide model.{dim} ({getattr(model, dim)}) to measure one "
                              f"rank's shard, got {tp}")
    if tp == 1:
        return model
    return replace(model, heads=model.heads // tp, kv_heads=model.kv_heads // tp, ffn=model.ffn // tp)
