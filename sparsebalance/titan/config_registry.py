"""Presets: ``--module sparsebalance.titan --config NAME`` (torchtitan's config registry).

Each returns a :class:`SparseBalanceTrainer.Config`: a Qwen3 decoder with MoBA in every layer at our
``tiny`` model's dimensions (so the shipped ``cpu-tiny`` profile prices it), the SparseBalance loader
on the ``titan-cpu`` run config (SAB + DST over the Python standard library's sources), plain DTensor
SPMD (``partial_dtensor``), fp32, no activation checkpointing, no compile. What a torchtitan user
changes in a config of their own is the same four things: the model's inner attention
(:func:`~sparsebalance.titan.attention.use_moba`), ``dataloader`` (``SparseBalanceLoader.Config``),
the trainer class (``SparseBalanceTrainer.Config``) and, under PP, ``training.seq_len`` as the slot.

* ``sparsebalance_tiny_pp2``: PP 2 (1F1B), 4 fixed slots of 2,048 tokens per step.
* ``sparsebalance_tiny_fsdp2``: FSDP 2, 4 gradient-accumulation micro-batches of any length per rank.
* ``sparsebalance_tiny_single``: one process, the same 8 micro-batches per step (the reference of
  both: 4 slots of 2,048 tokens as in PP 2).
"""

from __future__ import annotations

from sparsebalance.titan.compat import import_torchtitan

import_torchtitan()

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

from sparsebalance.simulator.config import tiny
from sparsebalance.titan.loader import SparseBalanceLoader
from sparsebalance.titan.model import qwen3_spec
from sparsebalance.titan.setup import stage_modules
from sparsebalance.titan.tokenizer import ByteTokenizer
from sparsebalance.titan.trainer import SparseBalanceTrainer

SLOT = 2048
SLOTS = 4


def _base(*, pp: int, dp_shard: int, local_batch: int, global_batch: int, seq_len: int, steps: int):
    model = tiny()
    return SparseBalanceTrainer.Config(
        model_spec=qwen3_spec(model, rope_max_seq_len=max(seq_len, 4096)),
        hf_assets_path="",
        tokenizer=ByteTokenizer.Config(),
        loss=CrossEntropyLoss.Config(),
        metrics=MetricsProcessor.Config(log_freq=1),
        dataloader=SparseBalanceLoader.Config(run_config="titan-cpu"),
        optimizer=default_adamw(lr=1e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1, total_steps=100),  # steps-independent
        training=TrainingConfig(local_batch_size=local_batch, global_batch_size=global_batch,
                                seq_len=seq_len, steps=steps, dtype="float32",
                                mixed_precision_param="float32", disable_cuda_graphs=True, gc_freq=1000),
        parallelism=ParallelismConfig(
            pipeline_parallel_degree=pp, pipeline_parallel_schedule="1F1B",
            pipeline_parallel_microbatch_size=1, data_parallel_shard_degree=dp_shard,
            module_fqns_per_model_part=stage_modules(model.layers, pp) if pp > 1 else None,
            spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(enable=False, interval=500, last_save_model_only=False),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
    )


def sparsebalance_tiny_pp2() -> SparseBalanceTrainer.Config:
    """PP 2, 1F1B, 4 slots of 2,048 tokens per step (SAB packs the step's 8 documents into them)."""
    return _base(pp=2, dp_shard=1, local_batch=SLOTS, global_batch=-1, seq_len=SLOT, steps=6)


def sparsebalance_tiny_fsdp2() -> SparseBalanceTrainer.Config:
    """FSDP 2: each rank 4 gradient-accumulation micro-batches of one document each (any length)."""
    return _base(pp=1, dp_shard=2, local_batch=1, global_batch=8, seq_len=SLOT, steps=6)


def sparsebalance_tiny_single() -> SparseBalanceTrainer.Config:
    """One process, one micro-batch per gradient-accumulation step, 8 per step (FSDP 2's plan on one
    rank)."""
    return _base(pp=1, dp_shard=1, local_batch=1, global_batch=8, seq_len=SLOT, steps=6)
