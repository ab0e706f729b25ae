"""Memory per device: weights, gradients and optimizer states plus the activations of the
micro-batches in flight under the schedule. Bytes throughout; no torch.

**Static** (per device = one TP shard of one pipeline stage, all its chunks): ``P`` parameters of
the stage (``Layout.device_params``, the split and counting the latency model uses too) over ``tp``,
times ``PARAM_BYTES`` (bf16 weights) + ``GRAD_BYTES`` (bf16 gradients) + ``MASTER_BYTES`` (fp32
master copy) + ``ADAM_BYTES`` (fp32 first and second moments) = 16 bytes per parameter; with
``cluster.zero1`` the master copy and the moments are sharded over the gradient group (ZeRO-1;
``Layout.grad_group``: dp x cp): ``4 + 12 / (dp cp)``; under ``dp_mode`` zero2 / zero3 every state
is sharded and the gathered units are added (:func:`sharded_bytes`).

**Activations** kept for the backward, per token per decoder layer (bf16, FlashAttention-style
attention: no L x L matrices; MoBA's gate scores are per block, negligible), from the model dims
with ``q = heads x head_dim``, ``kv = kv_heads x head_dim``, ``f = ffn``, ``h = hidden``:
``2 (4 h + 2 q + 2 kv + 3 f) + 4 heads`` bytes: the inputs of the two RMSNorms and of the QKV and
MLP projections (4 h), Q, K, V (q + 2 kv), the attention output (q), the gate, up and gated
products of the SwiGLU MLP (3 f), and the fp32 softmax log-sum-exp per head; all divided by ``tp``,
the norms' inputs (4 h) only with ``cluster.sequence_parallel`` (else each TP rank holds them whole,
as in Korthikanti et al. 2022). Virtual stage 0 also keeps the embedding output (2 h). With full activation
recomputation (``cluster.recompute = "full"``) a layer keeps only its input (2 h / tp) and the
backward re-materialises one layer of one micro-batch at a time (a transient of one layer's full
bytes); with selective recomputation (the attention core) a layer drops the attention output and
the log-sum-exp (2 q + 4 heads), which the backward re-materialises one layer at a time.
The last stage's LM head logits (``2 vocab / tp`` bytes per token, bf16) are live for one
micro-batch at a time (transient).

**In flight**: a micro-batch's activations on virtual stage ``vs`` live from its F there until its
last backward action there (B, or W when the backward is split). The peak of a device is read off
its actual action order (``schedule/graph.py``): walking the order, adding the bytes at each F and
releasing them after the backward, so every schedule, present or future, is covered. 1F1B stage
``s`` thus peaks at ``min(m, pp - s)`` micro-batches, GPipe at ``m``. With CP a rank holds 1/cp of
every micro-batch's tokens (``Layout.rank_tokens``) and the K/V its ring or all-gather holds beside
its own.

Not modelled: the allocator's fragmentation and caching, CUDA context and NCCL buffers, optimizer
temporaries; :func:`compare_measured` compares with ``torch.cuda.max_memory_allocated`` (unrun
here: no GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import FSDP_MODES, ClusterConfig, ModelConfig
from sparsebalance.simulator.cost.fsdp import FsdpPricing
from sparsebalance.simulator.layout import layout_of
from sparsebalance.simulator.schedule.graph import ActionGraph

PARAM_BYTES = 2
"""bf16 weights."""
GRAD_BYTES = 2
"""bf16 gradients."""
MASTER_BYTES = 4
"""fp32 master weights."""
ADAM_BYTES = 8
"""fp32 Adam first and second moments."""
GB = 1e9


def static_bytes(model: ModelConfig, cluster: ClusterConfig) -> np.ndarray:
    """[pp] weights + gradients + optimizer states of one device of each stage (under zero2 / zero3:
    :func:`sharded_bytes`)."""
    lay = layout_of(model, cluster)  # with zero1 the master copy and moments are sharded over the gradient group
    if cluster.dp_mode in FSDP_MODES:
        return sharded_bytes(model, cluster)
    per_param = PARAM_BYTES + GRAD_BYTES + (MASTER_BYTES + ADAM_BYTES) / (lay.grad_group if cluster.zero1 else 1)
    return np.array([lay.device_params(s) / cluster.tp * per_param for s in range(cluster.pp)])


def sharded_bytes(model: ModelConfig, cluster: ClusterConfig) -> np.ndarray:
    """[pp] a zero2 / zero3 device's states and gathered units (``cost/fsdp.py``): its 1/n shard of
    the fp32 parameters (FSDP keeps the sharded parameter in fp32 and casts on gather), of the fp32
    gradients and of Adam's two moments, ``P / (tp n) x (MASTER_BYTES + 4 + ADAM_BYTES)``; plus the
    gathered parameters: zero3 at most two layer units at once (``limit_all_gathers`` / implicit
    prefetch) + the root unit (kept from forward to backward), zero2 every unit of the device (kept
    between a micro-batch's forward and backward), at ``param_gather_bytes``; plus one layer unit's
    unsharded gradient before its reduce-scatter, at ``grad_reduce_bytes``. With ``fsdp_grad_sync =
    "last"`` every unit stays gathered and the device's whole gradient accumulates unsharded."""
    lay = layout_of(model, cluster)
    pricing = FsdpPricing(model, cluster, lay)
    out = np.zeros(cluster.pp)
    for s in range(cluster.pp):
        states = lay.device_params(s) / cluster.tp / pricing.n * (MASTER_BYTES + 4 + ADAM_BYTES)
        units = [pricing.units[vs] for vs in lay.vstages_of(s)]
        per_layer = units[0].per_layer
        root = sum(u.root for u in units)
        if cluster.dp_mode == "zero3" and not pricing.once:
            gathered = (root + min(2, sum(u.layers for u in units)) * per_layer) * pricing.gather_bytes
        else:
            gathered = sum(u.params for u in units) * pricing.gather_bytes
        # the unsharded gradient: one layer's before its reduce-scatter, or the device's whole
        # accumulated gradient when the step reduces once
        grads = sum(u.params for u in units) if pricing.once else per_layer
        out[s] = states + gathered + grads * pricing.reduce_bytes
    return out


def layer_bytes_per_token(model: ModelConfig, tp: int = 1, sequence_parallel: bool = True) -> float:
    """Activation bytes one decoder layer keeps per token without recomputation (module docstring);
    without ``sequence_parallel`` the norms' inputs (4 h) are whole on every TP rank."""
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    if sequence_parallel or tp == 1:
        return (2 * (4 * model.hidden + 2 * q + 2 * kv + 3 * model.ffn) + 4 * model.heads) / tp
    return 2 * 4 * model.hidden + (2 * (2 * q + 2 * kv + 3 * model.ffn) + 4 * model.heads) / tp


def input_bytes_per_token(model: ModelConfig, cluster: ClusterConfig) -> float:
    """Bytes per token of a layer's input (bf16 hidden state) on one TP rank: 1/tp with sequence
    parallelism, whole on every rank without it."""
    split = cluster.sequence_parallel or cluster.tp == 1
    return 2 * model.hidden / cluster.tp if split else 2.0 * model.hidden


def recomputed_bytes_per_token(model: ModelConfig, cluster: ClusterConfig) -> float:
    """Bytes per token of one layer that recomputation drops and its backward re-materialises:
    all but the layer's input (full), the attention output and log-sum-exp (selective), none."""
    if cluster.recompute == "full":
        return layer_bytes_per_token(model, cluster.tp, cluster.sequence_parallel) - input_bytes_per_token(model, cluster)
    if cluster.recompute == "selective":
        return (2 * model.heads * model.head_dim + 4 * model.heads) / cluster.tp
    return 0.0


def kept_bytes_per_token(model: ModelConfig, cluster: ClusterConfig) -> np.ndarray:
    """[V] bytes a micro-batch leaves on each virtual stage per token until its backward there."""
    if cluster.recompute == "full":
        per_layer = input_bytes_per_token(model, cluster)
    else:
        per_layer = (layer_bytes_per_token(model, cluster.tp, cluster.sequence_parallel)
                     - recomputed_bytes_per_token(model, cluster))
    lay = layout_of(model, cluster)
    out = lay.layer_counts * per_layer
    out[0] += input_bytes_per_token(model, cluster)  # embedding output
    return lay.rank_tokens(out)  # a CP rank keeps its 1/cp of the tokens


def transient_bytes_per_token(model: ModelConfig, cluster: ClusterConfig) -> np.ndarray:
    """[pp] bytes per token of the one micro-batch being worked on: the recomputed layer (with
    recomputation) and, on the last stage, the LM head logits."""
    out = np.zeros(cluster.pp)
    if cluster.recompute == "full":
        out += layer_bytes_per_token(model, cluster.tp, cluster.sequence_parallel)
    elif cluster.recompute == "selective":
        out += recomputed_bytes_per_token(model, cluster)
    lay = layout_of(model, cluster)
    out[lay.devices[-1]] += 2 * model.vocab / cluster.tp
    if cluster.cp > 1:  # 1/cp of the tokens per rank, + the K/V a CP layer holds beside its own
        kv = 2 * -(-model.kv_heads // cluster.tp) * model.head_dim * model.dtype_bytes  # K and V, bf16
        extra = {"ring": 2 * kv + 2 * 2 * kv,  # two shards in flight, + dK/dV (fp32) travelling in the backward
                 "hierarchical": 3 * kv + 2 * 2 * kv,  # + the next node's shard arriving
                 "allgather": cluster.cp * kv + 2 * cluster.cp * kv}[cluster.cp_comm]  # all K/V, dK/dV
        out = lay.rank_tokens(out) + lay.rank_tokens(extra)
    return out


def peak_activation_bytes(graph: ActionGraph, tokens: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """[dp, pp] peak bytes of activations held per device: walking each device's action order,
    ``tokens[r, j] x kept[vs]`` is added at F(vs, j) and released after the last backward action
    of (vs, j). ``tokens``: [dp, m]."""
    tokens = np.asarray(tokens, dtype=float)
    dp = tokens.shape[0]
    nv, m = graph.nv, graph.m
    release_kind = graph.kinds.index("W") if "W" in graph.kinds else graph.kinds.index(
        "B" if "B" in graph.kinds else "I")
    out = np.zeros((dp, graph.pp))
    for s, order in enumerate(graph.orders):
        kind, rest = np.divmod(order, nv * m)
        vs, j = np.divmod(rest, m)
        sign = np.where(kind == 0, 1.0, np.where(kind == release_kind, -1.0, 0.0))
        delta = sign[None, :] * tokens[:, j] * kept[vs][None, :]  # [dp, actions]
        out[:, s] = np.maximum(np.cumsum(delta, axis=1).max(axis=1), 0.0)
    return out


@dataclass(kw_only=True, slots=True)
class MemoryReport:
    """Peak memory of one iteration, bytes."""

    static: np.ndarray
    """[pp] weights + gradients + optimizer states per device of each stage."""
    activations: np.ndarray
    """[dp, pp] peak activation bytes kept for the backward."""
    transient: np.ndarray
    """[dp, pp] the working set of one micro-batch (largest on the device)."""
    limit: float | None
    """Device memory (bytes) or None when the cluster does not say."""

    @property
    def peak(self) -> np.ndarray:
        """[dp, pp] peak bytes per device."""
        return self.static[None, :] + self.activations + self.transient

    @property
    def exceeded(self) -> int:
        """Devices whose peak exceeds the limit (0 when unknown)."""
        return 0 if self.limit is None else int((self.peak > self.limit).sum())


def memory_report(model: ModelConfig, cluster: ClusterConfig, graph: ActionGraph,
                  tokens: np.ndarray | list[list[int]]) -> MemoryReport:
    """Peak memory per device of an iteration whose micro-batch j of DP rank r has ``tokens[r, j]``
    tokens, under ``graph`` (the schedule of ``cluster``)."""
    tokens = np.asarray(tokens, dtype=float)
    kept = kept_bytes_per_token(model, cluster)
    act = peak_activation_bytes(graph, tokens, kept)
    trans = tokens.max(axis=1)[:, None] * transient_bytes_per_token(model, cluster)[None, :]
    return MemoryReport(static=static_bytes(model, cluster), activations=act, transient=trans,
                        limit=cluster.device_memory)


def token_cap_for_memory(model: ModelConfig, cluster: ClusterConfig, graph: ActionGraph) -> int:
    """The most tokens a micro-batch may hold so that every device fits when every micro-batch
    in flight holds that many (``cluster.device_memory`` must be set). ConfigError when not even
    one token fits (the weights and optimizer states alone exceed the device)."""
    limit = cluster.device_memory
    if limit is None:
        raise ConfigError("cluster.device_memory: needed for memory-aware packing (bytes, e.g. 141e9)")
    per_token = (peak_activation_bytes(graph, np.ones((1, graph.m)), kept_bytes_per_token(model, cluster))[0]
                 + transient_bytes_per_token(model, cluster))
    room = limit - static_bytes(model, cluster)
    cap = int(np.floor(np.min(room / per_token)))
    if cap < 1:
        worst = int(np.argmin(room / per_token))
        raise ConfigError(f"cluster.device_memory: {limit / GB:.1f} GB cannot hold one micro-batch on "
                          f"stage {worst} (weights, gradients and optimizer states alone take "
                          f"{static_bytes(model, cluster)[worst] / GB:.1f} GB); use more pp/tp, dp_mode zero1 / zero3 "
                          "or recompute")
    return cap


def check_fits(model: ModelConfig, cluster: ClusterConfig) -> None:
    """ConfigError (one line) when ``cluster.device_memory`` cannot hold the weights, gradients and
    optimizer states of some stage plus one token of activations: no micro-batch could run."""
    if cluster.device_memory is None:
        return
    dev = layout_of(model, cluster).devices
    kept = np.bincount(dev, weights=kept_bytes_per_token(model, cluster), minlength=cluster.pp)
    need = static_bytes(model, cluster) + kept + transient_bytes_per_token(model, cluster)
    worst = int(np.argmax(need))
    if need[worst] > cluster.device_memory:
        raise ConfigError(f"cluster.device_memory: {cluster.device_memory / GB:.1f} GB cannot hold one "
                          f"micro-batch on stage {worst} (weights, gradients and optimizer states take "
                          f"{static_bytes(model, cluster)[worst] / GB:.1f} GB); use more pp or tp, "
                          "dp_mode zero1 / zero3, or a device with more memory")


def compare_measured(predicted_bytes: float, measured_bytes: float) -> dict[str, float]:
    """Predicted vs measured peak (``torch.cuda.max_memory_allocated`` of one device over an
    iteration) for ``gpu-check``: both in GB and the relative error. Unrun here (no GPU)."""
    if measured_bytes <= 0:
        raise ValueError(f"measured_bytes: must be > 0, got {measured_bytes}")
    return {"predicted_gb": predicted_bytes / GB, "measured_gb": measured_bytes / GB,
            "relative_error": (predicted_bytes - measured_bytes) / measured_bytes}
