"""From a torchtitan job config to the SparseBalance run it carries out, and every check that the job
can run, made before any process starts.

A torchtitan job names a SparseBalance **run config** (``dataloader.run_config``: a shipped preset
under ``sparsebalance/data/presets/`` or a TOML path) for what torchtitan has no notion of: the
documents (``[data]``), the policies (``[policy]``), the latency profile, the seed, the documents per
step (``cluster.global_batch``) and the network constants. Everything torchtitan already says is
taken from the job and must not be contradicted: the model (dims of the torchtitan model, MoBA's
block size), the mesh (``pp`` = pipeline degree, ``dp`` = the rest of the world), the schedule, the
micro-batches per step and, under pipeline parallelism, the slot (``training.seq_len``).

Two modes, chosen by the pipeline degree:

* **PP** (``pipeline_parallel_degree > 1``): torch's pipelining allocates its receive buffers once,
  so every micro-batch of a step has one shape: **fixed slots** of ``training.seq_len`` tokens
  (``policy.slot_tokens``), one packed row each (``pipeline_parallel_microbatch_size = 1``), exactly
  ``local_batch_size`` (x gradient-accumulation steps) per DP rank.
* **FSDP** (no PP): each gradient-accumulation step is one micro-batch of any length
  (``local_batch_size = 1``, one packed row), so micro-batches stay variable; the plan holds
  ``global_batch / (dp x steps)`` documents in each. A run config that sets ``policy.slot_tokens``
  (= ``training.seq_len``) gets fixed slots here too (a single process replaying PP's plan).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from sparsebalance.errors import ConfigError
from sparsebalance.runconfig import RunConfig, load_run_config

SCHEDULES = {"GPipe": "gpipe", "1F1B": "1f1b"}
"""torchtitan schedule names the plugin runs -> ours (single-stage schedules: one model chunk per
rank, split as our Layout splits it)."""


@dataclass(kw_only=True, slots=True)
class TitanSetup:
    """The SparseBalance side of a torchtitan job."""

    run: RunConfig
    """The resolved run: model and mesh from the torchtitan job, the rest from its run config."""
    microbatches: int
    """Micro-batches per DP rank per step (what the trainer consumes, in order)."""
    pipeline: bool
    """Pipeline parallel (then always fixed slots)."""
    slots: bool
    """Fixed slots of ``training.seq_len`` tokens (under PP; without PP where the run config sets
    ``policy.slot_tokens``), else micro-batches of any length."""
    dp_rank: int = 0


def dp_mode_of(par: Any, dp: int, pipeline: bool) -> dict[str, Any]:
    """The cluster fields of how the torchtitan job holds its weights over its ``dp`` data-parallel
    ranks (``parallelism`` of the job): plain replicas (``ddp``) when it does not shard; else FSDP2,
    whose ``fsdp_reshard_after_forward`` policy ("default": reshard except under PP,
    ``torchtitan/distributed/fsdp.py``) makes it ``zero3`` (reshard) or ``zero2`` (keep), sharded
    over ``data_parallel_shard_degree`` ranks (fewer than dp: hybrid sharding), and under PP
    gathered once and reduced once per step (torch's pipeline stages sync gradients on the last
    backward only: ``fsdp_grad_sync = "last"``). Fields a run config set are overridden: the job
    decides."""
    rep = int(getattr(par, "data_parallel_replicate_degree", 1) or 1)
    shard = int(getattr(par, "data_parallel_shard_degree", -1))
    shard = dp // rep if shard == -1 else shard
    if dp == 1 or shard <= 1:
        return {"dp_mode": "ddp", "zero1": False, "fsdp_shard": None, "fsdp_grad_sync": None,
                "fsdp_backward_prefetch": None, "param_gather_bytes": None, "param_gather_overlap": False}
    policy = getattr(par, "fsdp_reshard_after_forward", "default")
    reshard = {"always": True, "never": False}.get(policy, not pipeline)
    return {"dp_mode": "zero3" if reshard else "zero2", "zero1": False,
            "fsdp_shard": shard if shard < dp else None, "fsdp_grad_sync": "last" if pipeline else None,
            "fsdp_backward_prefetch": None, "param_gather_overlap": False}


def preset_path(name_or_path: str) -> Path:
    """A run config: a shipped preset name (``titan-cpu``) or a path to a TOML file."""
    p = Path(name_or_path)
    if p.suffix or os.sep in name_or_path:
        return p
    shipped = Path(str(resources.files("sparsebalance.data") / "presets" / f"{name_or_path}.toml"))
    if not shipped.is_file():
        raise ConfigError(f"dataloader.run_config: {name_or_path!r} is neither a shipped preset "
                          "(sparsebalance/data/presets/) nor a .toml path")
    return shipped


def resolve(job: Any, world_size: int | None = None, *, check_data: bool = True) -> TitanSetup:
    """The :class:`TitanSetup` of torchtitan job config ``job`` on ``world_size`` processes
    (default: ``$WORLD_SIZE`` or 1). Every inconsistency is a :class:`ConfigError` naming the field."""
    from sparsebalance.titan.model import model_config_of

    if job.model_spec is None:
        raise ConfigError("model_spec: the torchtitan config has no model")
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    par, tr = job.parallelism, job.training
    run_cfg = getattr(job.dataloader, "run_config", None)
    if run_cfg is None:
        raise ConfigError("dataloader: the torchtitan config does not use SparseBalanceLoader "
                          "(sparsebalance.titan.loader); its plan cannot reach the trainer")
    base = load_run_config(preset_path(run_cfg))
    model = model_config_of(job.model_spec.model, dtype=tr.dtype, name=job.model_spec.flavor)
    for field in ("tp", "cp", "virtual_stages"):
        if getattr(base.cluster, field) != 1:
            raise ConfigError(f"cluster.{field}: the torchtitan plugin runs PP x DP; {field} must be 1")
    for name, deg in (("tensor_parallel_degree", par.tensor_parallel_degree),
                      ("context_parallel_degree", par.context_parallel_degree),
                      ("expert_parallel_degree", par.expert_parallel_degree)):
        if deg != 1:
            raise ConfigError(f"parallelism.{name}: must be 1 with sparsebalance.titan (PP x DP), got {deg}")
    pp = par.pipeline_parallel_degree
    if pp < 1 or world % pp:
        raise ConfigError(f"parallelism.pipeline_parallel_degree: {pp} does not divide the {world} processes")
    dp = world // pp
    steps = _accumulation(tr, dp)
    pipeline = pp > 1
    policy = base.policy
    slots = pipeline or policy.slot_tokens is not None
    if pipeline:
        sched = SCHEDULES.get(par.pipeline_parallel_schedule)
        if sched is None:
            raise ConfigError(f"parallelism.pipeline_parallel_schedule: must be one of {', '.join(SCHEDULES)} "
                              f"with sparsebalance.titan, got {par.pipeline_parallel_schedule!r}")
        if par.pipeline_parallel_microbatch_size != 1:
            raise ConfigError("parallelism.pipeline_parallel_microbatch_size: must be 1 (a micro-batch "
                              f"is one packed row), got {par.pipeline_parallel_microbatch_size}")
        want = stage_modules(model.layers, pp, base.cluster.end_stage_layers_fewer)
        if par.module_fqns_per_model_part != want:
            raise ConfigError(f"parallelism.module_fqns_per_model_part: must be {want} (the stages the "
                              "latency model prices: sparsebalance.titan.setup.stage_modules)")
        m = tr.local_batch_size * steps
    else:
        sched = "1f1b"
        if tr.local_batch_size != 1:
            raise ConfigError("training.local_batch_size: must be 1 without pipeline parallelism (a "
                              f"micro-batch is one packed row), got {tr.local_batch_size}")
        m = steps
    docs = base.cluster.global_batch
    if slots:
        if policy.slot_tokens not in (None, tr.seq_len):
            raise ConfigError(f"policy.slot_tokens: the slot is training.seq_len ({tr.seq_len}); leave it "
                              f"unset or equal, got {policy.slot_tokens}")
        if docs < dp * m:
            raise ConfigError(f"cluster.global_batch: {docs} documents cannot fill the {dp} x {m} slots of a step")
        # PolicyConfig checks that the policies can pack and tune fixed slots
        policy = replace(policy, slot_tokens=tr.seq_len, min_microbatches=m, token_cap=None)
        mbs = 1
    else:
        if policy.token_cap is not None:
            raise ConfigError("policy.token_cap: without pipeline parallelism each micro-batch holds "
                              "global_batch / (dp x micro-batches) documents; leave it unset")
        if docs % (dp * m):
            raise ConfigError(f"cluster.global_batch: {docs} documents do not split into dp x micro-batches "
                              f"= {dp} x {m} (every micro-batch holds the same number of documents)")
        mbs = docs // (dp * m)
    # torchtitan pipelines with torch.distributed.pipelining: its sends and FSDP reductions are priced so
    impl = "torch" if pipeline else base.cluster.pp_impl
    cluster = replace(base.cluster, pp=pp, dp=dp, schedule=sched, micro_batch_size=mbs, pp_impl=impl,
                      **dp_mode_of(par, dp, pipeline))
    run = replace(base, model=model, cluster=cluster, policy=policy)
    setup = TitanSetup(run=run, microbatches=m, pipeline=pipeline, slots=slots)
    if check_data:
        check_documents(setup)
    return setup


def stage_modules(layers: int, pp: int, end_fewer: int = 0) -> list[list[str]]:
    """torchtitan's ``module_fqns_per_model_part`` for our split (``simulator.layout.split_layers``:
    layers contiguous, the first ``layers % pp`` stages one longer, ``end_fewer`` =
    ``cluster.end_stage_layers_fewer`` fewer on the first and the last), the embedding on the first
    stage, final norm and LM head on the last: the stages the latency model prices."""
    from sparsebalance.simulator.layout import split_layers

    out = []
    for s, layer_range in enumerate(split_layers(layers, pp, end_fewer)):
        mods = ["tok_embeddings"] if s == 0 else []
        mods += [f"layers.{i}" for i in layer_range]
        if s == pp - 1:
            mods += ["norm", "lm_head"]
        out.append(mods)
    return out


def _accumulation(tr: Any, dp: int) -> int:
    gbs = tr.global_batch_size
    local = tr.local_batch_size
    if gbs < 0:
        return 1
    if gbs % (local * dp):
        raise ConfigError(f"training.global_batch_size: {gbs} is not a multiple of local_batch_size x dp "
                          f"= {local * dp}")
    return gbs // (local * dp)


def check_documents(setup: TitanSetup) -> None:
    """The documents must carry tokens and, under fixed slots, fit a slot each."""
    from sparsebalance.data import load_sequences

    run = setup.run
    seqs = load_sequences(run.data, base_dir=run.base_dir)
    if not seqs or seqs[0].tokens is None:
        raise ConfigError("data.source: the torchtitan plugin trains on token ids; use a token source "
                          "(text_dir, jsonl, parquet, hf_disk), not a length distribution")
    if len(seqs) < run.cluster.global_batch:
        raise ConfigError(f"data: {len(seqs)} documents cannot fill one step of cluster.global_batch = "
                          f"{run.cluster.global_batch}")
    longest = max(s.length for s in seqs)
    slot = run.policy.slot_tokens
    if slot is not None and slot < longest:
        raise ConfigError(f"training.seq_len: the slot ({slot} tokens) is smaller than the longest document "
                          f"({longest} tokens); raise seq_len or set data.max_length <= {slot}")
    vocab = run.model.vocab
    top = max(int(s.tokens.max()) for s in seqs)
    if top >= vocab:
        raise ConfigError(f"data: token id {top} is outside the model's vocabulary ({vocab})")
