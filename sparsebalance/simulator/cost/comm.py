"""Communication and the optimizer step: what moves between devices, and the update, priced.

* **P2P** (:meth:`Communication.p2p_time`): one micro-batch's activations (tokens x hidden x dtype
  bytes) to the next stage, ``p2p_latency + bytes / p2p_bandwidth``; each CP rank sends its own share.
  Under Megatron and Llama 3's pipeline (``cluster.pp_impl``) the TP ranks split it: ``bytes / tp`` each, + (2022, without
  sequence parallelism) the receiver's TP all-gather; whether a send blocks its sender is the
  engine's (:func:`p2p_blocking`, ``schedule/rendezvous.py``).
* **End of the iteration** (Megatron, tied embeddings, pp > 1): the word embedding's gradient
  all-reduced between the first and last stage (:func:`embedding_allreduce_time`);
  with ``cluster.grad_clip`` the global norm's all-reduce (:func:`grad_norm_time`),
  a barrier before any stage steps.
* **TP all-reduce** (:meth:`Communication.tp_allreduce_time`): a profile's numbers are one TP rank's.
  An analytical profile includes the TP all-reduces of a Megatron layer (the roofline's); a profile
  measured on one shard (``profile --tp N``, sidecar ``tp_comm_included`` false or absent) does not,
  and they are added from the cluster (:attr:`Communication.tp_added`): 2 all-reduces of the layer's
  activation (tokens x hidden x dtype bytes) per layer forward (after the row-parallel attention
  output and MLP down projections) and 2 in the input-gradient part of its backward (the
  column-parallel inputs' gradients), + the forward's 2 again under full recomputation, each
  ``tp_latency + 2 (tp - 1) / tp x bytes / tp_bandwidth``. Where they enter a stage's time:
  ``StageCost.dense``.
* **DP gradient synchronisation** (:meth:`Communication.allreduce_time`,
  :meth:`Communication.grad_sync_exposed`): bucketed and, with ``dp_overlap``, overlapped with the
  device's last backward action; with ``zero1`` a reduce-scatter. The group is ``Layout.grad_group``
  (DP x CP: the CP ranks of a stage hold the same weights), on its link (:func:`.link.group_link`:
  NVLink inside a node, one NIC per rank of the group in each node across nodes).
* **Optimizer** (:meth:`Communication.optimizer_time`): the profile's ``optim`` op, else HBM bytes of
  one AdamW step (:func:`adamw_bytes`) over the sidecar's memory bandwidth; with ``zero1`` on 1/n of
  the parameters, then their all-gather; under ``zero2`` / ``zero3`` on 1/n of them, no gather
  after (the next forward's unit gathers do it: :mod:`.fsdp`, whose reduce-scatters replace the
  gradient synchronisation).
"""

from __future__ import annotations

import warnings

from sparsebalance.errors import MeaningWarning
from sparsebalance.simulator.config import BLOCKING_SCHEDULES, FSDP_MODES, ClusterConfig, ModelConfig
from sparsebalance.simulator.cost.fsdp import FsdpPricing
from sparsebalance.simulator.cost.link import group_link, ring_latency
from sparsebalance.simulator.cost.tables import OpTables
from sparsebalance.simulator.layout import Layout, mesh_rank

ADAMW_BYTES_PER_PARAM = 32
"""HBM bytes one mixed-precision AdamW step moves per parameter with bf16 gradients (the optimizer
estimate of a profile without ``optim`` rows): read the fp32 master weight, Adam's two fp32 moments
(12) and the gradient (2); write the master and the moments (12) and the bf16 weight the next forward
uses (2); read the gradient once more for the global norm of gradient clipping (2) and zero it (2).
The gradient's three passes follow its buffer's dtype (:func:`adamw_bytes`)."""
ADAMW_GRAD_PASSES = 3
"""Passes over the gradient buffer in one step: the clipping norm's read, the step's read, the zeroing."""


def adamw_bytes(grad_bytes: int) -> int:
    """HBM bytes per parameter of one AdamW step whose gradient buffer holds ``grad_bytes`` per
    element (``cluster.grad_reduce_bytes``: Megatron-LM keeps a bf16 model's gradients in an fp32
    ``main_grad`` buffer, 4): ``ADAMW_BYTES_PER_PARAM`` with the three gradient passes at that width."""
    return ADAMW_BYTES_PER_PARAM + ADAMW_GRAD_PASSES * (grad_bytes - 2)


def megatron(cluster: ClusterConfig) -> bool:
    """Whether the run follows one of Megatron-LM's pipelines (``cluster.pp_impl``)."""
    return cluster.pp_impl in ("megatron-2022", "megatron")


def p2p_blocking(cluster: ClusterConfig) -> bool:
    """Whether every transfer is a rendezvous that also holds its sender (``schedule/rendezvous.py``):
    a blocking ``pp_impl`` (all but ``ideal`` and ``meta``, whose sends are asynchronous) with a
    schedule of ``BLOCKING_SCHEDULES``, and Megatron 2022's interleaved 1F1B (Megatron-Core overlaps
    its P2P there, ``overlap_p2p_comm``)."""
    if cluster.pp_impl == "megatron-2022" and cluster.schedule == "interleaved":
        return True
    return cluster.pp_impl not in ("ideal", "meta") and cluster.schedule in BLOCKING_SCHEDULES


def end_stages_share_node(cluster: ClusterConfig) -> bool:
    """Whether every first-stage rank sits on the same node as its last-stage partner (the same dp,
    cp and tp coordinates in the (dp, pp, cp, tp) mesh: :func:`.layout.mesh_rank`; nodes of
    ``gpus_per_node`` consecutive ranks). One pair across nodes puts the whole all-reduce there:
    every stage waits for it before the optimizer."""
    c, inner = cluster, (cluster.pp, cluster.cp, cluster.tp)
    ends = ((mesh_rank((d, 0, k, t), inner), mesh_rank((d, c.pp - 1, k, t), inner))
            for d in range(c.dp) for k in range(c.cp) for t in range(c.tp))
    return all(a // c.gpus_per_node == b // c.gpus_per_node for a, b in ends)


def embedding_allreduce_time(model: ModelConfig, cluster: ClusterConfig, stage: int) -> float:
    """Seconds of the tied word embedding's gradient all-reduce between the first and last stage
    (Megatron: ``_allreduce_word_embedding_grads``, after the DP reduction, before the optimizer)
    on stage ``stage``: a two-rank ring, its latency from :func:`.link.ring_latency` (2 steps) +
    ``(vocab / tp) x hidden x grad_reduce_bytes / bandwidth`` (a 2-rank all-reduce's bus bytes are
    its bytes), on the node's NVLink (``tp_bandwidth``) where both end stages share a node
    (:func:`end_stages_share_node`), else on the network (``allreduce_bandwidth``: one NIC each); on
    both end stages; 0 elsewhere, for untied embeddings, at pp = 1 and outside Megatron."""
    c = cluster
    if not (megatron(c) and model.tie_embeddings and c.pp > 1 and stage in (0, c.pp - 1)):
        return 0.0
    nbytes = model.vocab / c.tp * model.hidden * (c.grad_reduce_bytes or model.dtype_bytes)
    if end_stages_share_node(c):
        return ring_latency(c, 2, 1, "allreduce") + nbytes / c.tp_bandwidth
    return ring_latency(c, 2, 2, "allreduce") + nbytes / c.allreduce_bandwidth


def grad_norm_time(cluster: ClusterConfig) -> float | None:
    """Seconds of the gradient-norm all-reduce of one fp32 scalar over the model-parallel group
    (n = tp x pp ranks) with ``cluster.grad_clip``, latency-bound: a ring's 2 (n - 1) steps of
    ``p2p_latency`` (Megatron's ``get_grad_norm_fp32``); None without clipping (no barrier)."""
    if not cluster.grad_clip:
        return None
    return 2 * (cluster.tp * cluster.pp - 1) * cluster.p2p_latency


class Communication:
    """P2P, TP and DP collectives and the optimizer step of one (model, cluster) (module docstring)."""

    def __init__(self, tables: OpTables, model: ModelConfig, cluster: ClusterConfig, layout: Layout) -> None:
        self.tables, self.model, self.cluster, self.layout = tables, model, cluster, layout
        meta = tables.profile.meta
        included = meta.analytical if meta.tp_comm_included is None else meta.tp_comm_included
        self.tp_added = cluster.tp > 1 and not included
        """Whether the profile's dense ops lack the TP all-reduces (added from the cluster)."""
        self.fsdp = FsdpPricing(model, cluster, layout) if cluster.dp_mode in FSDP_MODES else None
        """The unit gathers and reduce-scatters under ``dp_mode`` zero2 / zero3 (``fsdp.py``), else None."""
        self.tp_backward = 4 if cluster.recompute == "full" else 2
        """TP all-reduces in a layer's backward (input part): its own 2, + the forward's 2 again
        under full recomputation."""

    def p2p_time(self, tokens: int) -> float:
        """Seconds to send one micro-batch's activations (tokens x hidden x dtype bytes) to the next
        stage; each CP rank sends its own share, all at once (``Layout.rank_tokens``). Under
        Megatron each TP rank sends 1/tp of them when they are split: always in 2022
        (``split_tensor_into_1d_equal_chunks``), with sequence parallelism (already 1/tp a rank)
        in both, and in Llama 3's pipeline (``meta``); 2022 without sequence parallelism adds the receiver's TP all-gather of the whole
        activation (``gather_split_1d_tensor``), ``tp_latency + (tp - 1) / tp x bytes / tp_bandwidth``."""
        c = self.cluster
        tokens = self.layout.rank_tokens(tokens)
        nbytes = tokens * self.model.hidden * self.model.dtype_bytes
        split = c.tp > 1 and (megatron(c) or c.pp_impl == "meta") and (
            c.sequence_parallel or c.pp_impl == "megatron-2022")
        if not split:
            return c.p2p_latency + nbytes / c.p2p_bandwidth
        gather = 0.0
        if not c.sequence_parallel:
            gather = c.tp_latency + (c.tp - 1) / c.tp * nbytes / c.tp_bandwidth
        return c.p2p_latency + nbytes / (c.tp * c.p2p_bandwidth) + gather

    def tp_allreduce_time(self, tokens):
        """Seconds of one ring all-reduce of a [tokens, hidden] activation across the TP group
        (0 at tp = 1); numpy-broadcastable in ``tokens``."""
        c = self.cluster
        if c.tp == 1:
            return 0.0 * tokens
        nbytes = self.layout.rank_tokens(tokens) * self.model.hidden * self.model.dtype_bytes
        return c.tp_latency + 2 * (c.tp - 1) / c.tp * nbytes / c.tp_bandwidth

    def _grad_buckets(self, stage: int) -> list[tuple[float, float]]:
        """(share of the device's parameters up to and including the bucket, seconds of its
        collective) per gradient bucket, in the order the backward fills them: one bucket without
        ``dp_overlap``; each a ring all-reduce ``2 (n-1)/n x bytes / bw + latency``, or with
        ``zero1`` a reduce-scatter ``(n-1)/n x bytes / bw + latency`` (bytes = params / tp x
        ``cluster.grad_reduce_bytes``, default the model's dtype bytes). Empty at n = 1."""
        c = self.cluster
        n = self.layout.grad_group
        if n == 1 or self.fsdp is not None:  # FSDP reduces unit by unit inside the backward (fsdp.py)
            return []
        params = self.layout.device_params(stage) / c.tp
        size = params
        if c.dp_overlap:
            size = c.grad_bucket_params or max(40_000_000, 1_000_000 * n)
        steps = (n - 1) / n if c.zero1 else 2 * (n - 1) / n
        db = c.grad_reduce_bytes or self.model.dtype_bytes
        bw, latency = group_link(c, n, "reducescatter" if c.zero1 else "allreduce")
        out, done = [], 0.0
        while done < params:
            p = min(size, params - done)
            done += p
            out.append((done / params, steps * (p * db) / bw + latency))
        return out

    def allreduce_time(self, stage: int) -> float:
        """Seconds of the DP gradient synchronisation of stage ``stage`` when nothing overlaps it:
        its buckets' collectives one after another (without ``dp_overlap`` one ring all-reduce
        ``2 (n-1)/n x bytes / bandwidth + latency``); 0 when n = 1. Under zero2 / zero3 the units'
        reduce-scatters run inside the backward (``fsdp.py``); what is left is hybrid sharding's
        all-reduce across replicas."""
        if self.fsdp is not None:
            return self.fsdp.replica_allreduce(stage)
        return float(sum(sec for _, sec in self._grad_buckets(stage)))

    def grad_sync_exposed(self, stage: int, window: float) -> float:
        """Seconds of stage ``stage``'s gradient synchronisation left after its last backward action
        (``window`` seconds long) with ``dp_overlap``: bucket i is ready when the action has run
        its share of the parameters (gradients come out evenly over it), and the collectives run
        one at a time, ``end_i = max(ready_i, end_(i-1)) + seconds_i``; exposed = end - window.
        Equal buckets (n_b of them, T seconds in all): ``max(T / n_b, T - window (n_b - 1) / n_b)``."""
        if self.fsdp is not None:  # the replicas' all-reduce waits for every unit's reduce-scatter
            return self.fsdp.replica_allreduce(stage)
        end = 0.0
        for share, sec in self._grad_buckets(stage):
            end = max(end, window * share) + sec
        return max(0.0, end - window)

    def param_gather_exposed(self, stage: int, window: float) -> float:
        """Seconds of ZeRO-1's parameter all-gather of stage ``stage`` left exposed with
        ``param_gather_overlap``: the gathers run one bucket after another from the end of the
        optimizer step ((n-1)/n x bytes / bw + latency each, the gradient buckets' sizes, bf16),
        and the device's first forward action (``window`` seconds; its share of each bucket's
        layers) waits for each bucket, ``f_i = max(f_(i-1), g_i) + window x share_i``; exposed =
        f_last - window. 0 without ZeRO-1, the overlap or replicas."""
        c = self.cluster
        n = self.layout.grad_group
        if not (c.zero1 and c.param_gather_overlap and n > 1):
            return 0.0
        bw, latency = group_link(c, n, "allgather")
        params = self.layout.device_params(stage) / c.tp
        size = c.grad_bucket_params or max(40_000_000, 1_000_000 * n)
        gathered = forward = done = 0.0
        while done < params:
            p = min(size, params - done)
            done += p
            gathered += (n - 1) / n * p * self.model.dtype_bytes / bw + latency
            forward = max(forward, gathered) + window * p / params
        return max(0.0, forward - window)

    def optimizer_time(self, stage: int) -> float:
        """Seconds of one AdamW step over stage ``stage``'s parameters (its TP shard; with ``zero1``
        its 1/n share, then the ring all-gather of the updated bf16 parameters, ``(n-1)/n x bytes
        / bandwidth + latency``): the profile's ``optim`` op at that parameter count, else params x
        :func:`adamw_bytes` (gradient buffer of ``grad_reduce_bytes``) / the sidecar's memory_bandwidth."""
        c = self.cluster
        params = round(self.layout.device_params(stage) / c.tp)
        n = self.layout.grad_group  # the data-parallel group of a stage's weights: DP x CP
        if c.zero1 and n > 1:
            if c.param_gather_overlap:  # the gather runs under the next forward: param_gather_exposed
                return self._optimizer_step(round(params / n))
            bw, latency = group_link(c, n, "allgather")
            gather = (n - 1) / n * params * self.model.dtype_bytes / bw + latency
            return self._optimizer_step(round(params / n)) + gather
        if self.fsdp is not None:  # each rank steps its shard; the next forward gathers (fsdp.py)
            return self._optimizer_step(round(params / self.fsdp.n))
        return self._optimizer_step(params)

    def _optimizer_step(self, params: int) -> float:
        t = self.tables
        if "optim" in t.curves:
            return t.op("optim", params)
        bw = t.profile.meta.memory_bandwidth
        if bw:
            return params * adamw_bytes(self.cluster.grad_reduce_bytes or self.model.dtype_bytes) / bw
        if "optim" not in t.warned:
            t.warned.add("optim")
            warnings.warn(f"profile {t.profile.source} has neither optim rows nor memory_bandwidth; "
                          "the optimizer step costs 0 s", MeaningWarning, stacklevel=4)
        return 0.0
