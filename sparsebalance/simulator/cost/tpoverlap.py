"""Transformer Engine's TP comm-GEMM overlap (``cluster.tp_overlap_impl = "te"``, Megatron-LM's
``--tp-comm-overlap``): each TP collective of a sequence-parallel layer split into chunks that run
beside chunks of the GEMM that produces or consumes it, so only what a chunk's GEMM cannot cover
costs time.

Which collective runs beside which GEMM, and how, is TE's default (``transformer_engine/pytorch/
module/base.py: initialize_ub``; NVIDIA NeMo's H100 configs ``tp_overlap_configs/userbuffers.py`` use
the same methods):

* ring exchange (``qkv_fprop``, ``fc1_fprop``; ``proj_dgrad``, ``fc2_dgrad``): the all-gather before
  a GEMM in tp - 1 point-to-point steps, each beside the GEMM of the chunk already here (the rank's
  own chunk first): :func:`ring_exchange_exposed`;
* pipeline (``proj_fprop``, ``fc2_fprop``): the GEMM in ``TE_PIPELINE_SPLITS`` chunks, each chunk's
  reduce-scatter beside the next chunk's GEMM, the last one after it: :func:`pipeline_exposed`;
* bulk (``qkv_dgrad``/``fc1_dgrad``: the input's re-gather for the weight gradient beside the
  input-gradient GEMM; ``qkv_wgrad``/``fc1_wgrad``: the input gradient's reduce-scatter beside the
  weight-gradient GEMM): the whole collective beside the whole GEMM, :func:`bulk_exposed`.

An all-gather or a reduce-scatter of a [tokens, hidden] activation moves (tp - 1) / tp of it, half an
all-reduce's bytes, at the same bus bandwidth. Not priced: the SMs the communication kernels take
from the GEMMs (TE gives the pipeline's reduce-scatter 16-24 of 132 SMs), so this is a lower bound
on the layer's time.
"""

from __future__ import annotations

import numpy as np

TE_PIPELINE_SPLITS = 4
"""Chunks of a pipelined GEMM + reduce-scatter (TE's default ``num_splits`` for the pipeline method;
NeMo's H100 configs set 4)."""


def ring_exchange_exposed(comm, gemm, tp: int):
    """Seconds of an all-gather of ``comm`` seconds not hidden by a GEMM of ``gemm`` seconds split
    into ``tp`` chunks: step i sends the next chunk while the GEMM runs on chunk i (the first chunk is
    the rank's own), so ``(tp - 1) / tp`` of the GEMM covers the transfer."""
    return np.maximum(0.0, np.asarray(comm, dtype=float) - (tp - 1) / tp * np.asarray(gemm, dtype=float))


def pipeline_exposed(comm, gemm, splits: int = TE_PIPELINE_SPLITS):
    """Seconds of a reduce-scatter of ``comm`` seconds after a GEMM of ``gemm`` seconds, both in
    ``splits`` chunks, chunk i's reduce-scatter beside chunk i + 1's GEMM: the last chunk's transfer
    is always exposed, and whatever the other transfers outlast their GEMM chunks."""
    comm, gemm = np.asarray(comm, dtype=float), np.asarray(gemm, dtype=float)
    return np.maximum(comm / splits, comm - (splits - 1) / splits * gemm)


def bulk_exposed(comm, gemm):
    """Seconds of a collective run beside a whole GEMM that it outlasts."""
    return np.maximum(0.0, np.asarray(comm, dtype=float) - np.asarray(gemm, dtype=float))


def te_layer_comm(half, gemm: dict, tp: int, *, backward: bool):
    """Exposed seconds of one sequence-parallel layer's TP collectives under TE's overlap.

    ``half``: seconds of one all-gather or reduce-scatter of the layer's [tokens, hidden] activation;
    ``gemm``: seconds of each projection's GEMM (``qkv``, ``o``, ``up``, ``down``; the backward's
    input- and weight-gradient GEMMs take as long each). Forward: the all-gathers before QKV and the
    MLP's up projection by ring exchange, the reduce-scatters after the attention output and the down
    projection pipelined. Backward: the output gradients' all-gathers before the O and down
    projections' input-gradient GEMMs by ring exchange; for QKV and up, the input's re-gather beside
    the input-gradient GEMM and the input gradient's reduce-scatter beside the weight-gradient GEMM,
    in bulk."""
    if backward:
        return (ring_exchange_exposed(half, gemm["o"], tp) + ring_exchange_exposed(half, gemm["down"], tp)
                + 2 * bulk_exposed(half, gemm["qkv"]) + 2 * bulk_exposed(half, gemm["up"]))
    return (ring_exchange_exposed(half, gemm["qkv"], tp) + ring_exchange_exposed(half, gemm["up"], tp)
            + pipeline_exposed(half, gemm["o"]) + pipeline_exposed(half, gemm["down"]))
