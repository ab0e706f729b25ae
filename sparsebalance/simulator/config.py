"""Typed configs for the model and the cluster, with presets as plain functions.

Units: bandwidth in bytes/s, latency in seconds. Every field is validated in ``__post_init__``;
errors name the field and what is allowed (see ``sparsebalance.errors``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from sparsebalance.configmap import from_mapping
from sparsebalance.errors import ConfigError, check, check_choice, check_positive

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
SPLIT_SCHEDULES = ("zb-h1", "zbv", "dualpipev")
"""Schedules that split (some) backwards into an input-gradient I and a deferred weight-gradient W."""
V_SCHEDULES = ("zbv", "dualpipev")
RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation: ``cluster.recompute`` (docs/costmodel.md, 'Recomputation')."""
DP_MODES = ("ddp", "zero1", "zero2", "zero3")
TP_OVERLAP_IMPLS = ("megatron", "te")
"""Whose TP comm-GEMM overlap a run follows (``cluster.tp_overlap_impl``)."""
FSDP_MODES = ("zero2", "zero3")
"""``dp_mode`` values priced unit by unit (``simulator/cost/fsdp.py``)."""
FSDP_PREFETCH = ("pre", "post")
FSDP_GRAD_SYNC = ("every", "last")
CP_LAYOUTS = ("contiguous", "zigzag", "stripe", "best")
"""How a sequence's blocks are dealt to the ranks of a CP group (``cluster.cp_layout``)."""
CP_COMMS = ("ring", "hierarchical", "allgather")
"""How the ranks of a CP group exchange K/V (``cluster.cp_comm``)."""
CP_SELECTIONS = ("uniform", "local")
"""Where a query block's chosen past blocks lie (``cluster.cp_selection``)."""
CP_SPLITS = ("whole", "per-sequence")
"""How far each sequence is split over its CP group (``cluster.cp_split``)."""
CP_MERGES = ("unfused", "fused")
"""How a ring step's partial output and LSE are merged (``cluster.cp_merge``)."""
PP_IMPLS = ("ideal", "megatron-2022", "megatron", "torch", "meta")
"""Pipeline implementations whose P2P behaviour a run may follow (``ClusterConfig.pp_impl``)."""
BLOCKING_SCHEDULES = ("gpipe", "1f1b")
"""Schedules whose sends wait for their transfer under a blocking ``pp_impl`` (cost/comm.py)."""
#: The engines that time an iteration (``engine.ENGINES``, in this order) and the one runs use by
#: default: the exact timing core; "simpy" is the SimPy event model (same times, for events).
ENGINE_NAMES = ("core", "simpy")
DEFAULT_ENGINE = "core"
"""Schedules with two virtual stages per device placed in a V (device d: vstages d, 2 pp - 1 - d)."""


#: ModelConfig's architecture fields (their defaults are Qwen2's) and the values they take.
ARCH_FIELDS = ("mlp", "qkv_bias", "bias", "norm", "positions", "max_positions", "attention_kernel", "layer_ops")
MLP_KINDS = ("swiglu", "gelu")
NORM_KINDS = ("rmsnorm", "layernorm")
POSITION_KINDS = ("rotary", "learned")
ATTENTION_KERNELS = ("moba", "unfused")
LAYER_OPS = ("fused", "eager", "eager-unpad")


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    """Decoder dimensions plus the MoBA block size. The defaults of the architecture fields are
    Qwen2's (SwiGLU MLP, QKV biases only, RMSNorm, rotary positions); Llama, Mistral, GPT-2 and
    GPT-NeoX differ in them (``simulator/hfconfig.py`` reads them from an HF ``config.json``)."""

    name: str = "custom"
    """Preset name or a label for a custom model."""
    hidden: int
    """Hidden size (d_model)."""
    layers: int
    """Number of decoder layers."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention); must divide ``heads``."""
    head_dim: int
    """Dimension of one head."""
    ffn: int
    """Intermediate size of the MLP."""
    vocab: int
    """Vocabulary size (embedding and LM head rows)."""
    tie_embeddings: bool = False
    """Whether the LM head shares the embedding matrix (gradient bytes counted once)."""
    block_size: int = 256
    """MoBA key-block size in tokens (the paper uses 256)."""
    dtype_bytes: int = 2
    """Bytes per activation/gradient element (2 for bf16)."""
    mlp: str = "swiglu"
    """MLP kind: ``swiglu`` (gate, up and down projections: 3 x hidden x ffn weights; Llama, Qwen2,
    Mistral) or ``gelu`` (up and down: 2 x hidden x ffn; GPT-2, GPT-NeoX)."""
    qkv_bias: bool = True
    """Biases on the Q, K and V projections (Qwen2 and GPT-style models have them, Llama and Mistral
    do not)."""
    bias: bool = False
    """Biases on the output projection, the MLP and the norms too (GPT-2, GPT-NeoX)."""
    norm: str = "rmsnorm"
    """``rmsnorm`` (a weight per channel) or ``layernorm`` (a weight and a bias per channel)."""
    positions: str = "rotary"
    """``rotary`` (no weights) or ``learned`` (a ``max_positions`` x ``hidden`` table beside the token
    embedding, GPT-2)."""
    max_positions: int = 0
    """Rows of a learned position table (``positions = "learned"``); unused with rotary positions."""
    attention_kernel: str = "moba"
    """How attention is computed, for the cost model: ``moba`` (our MoBA kernels: block-sparse at
    the budget, FlashAttention-style dense at a full budget) or ``unfused`` (dense attention as
    Megatron-LM ran it before FlashAttention, e.g. Korthikanti et al. 2022: Q K^T and the product
    with V as batched GEMMs and the L x L scores written to memory by softmax and dropout; the
    budget is ignored). Only ``moba`` runs in the real run."""
    layer_ops: str = "fused"
    """How the layer's elementwise ops run, for an analytical profile (a measured one holds its own):
    ``fused`` (a fused training stack, Megatron-LM / Transformer Engine: fused norms, bias-GELU,
    bias-dropout-add; the backward moves twice the forward's bytes), ``eager`` (each op a PyTorch
    kernel of its own, as eager autograd runs a block such as LLM Foundry's MPT block: two kernels
    per norm's backward, the residual gradients' accumulation, the activation's backward reading
    its input, one reduction per bias, a fused QKV projection's split backward) or ``eager-unpad``
    (``eager`` plus flash-attn's unpad of Q, K, V and pad of the output, forward and backward, as
    LLM Foundry's ``flash_attn_fn`` runs them even with no padding). ``roofline.elementwise``."""

    def __post_init__(self) -> None:
        for f in ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab", "block_size"):
            check_positive(getattr(self, f), f)
        check(self.heads % self.kv_heads == 0, "kv_heads",
              f"must divide heads ({self.heads}), got {self.kv_heads}")
        check_choice(self.dtype_bytes, "dtype_bytes", (1, 2, 4, 8))
        check_choice(self.mlp, "mlp", MLP_KINDS)
        check_choice(self.norm, "norm", NORM_KINDS)
        check_choice(self.positions, "positions", POSITION_KINDS)
        check_choice(self.attention_kernel, "attention_kernel", ATTENTION_KERNELS)
        check_choice(self.layer_ops, "layer_ops", LAYER_OPS)
        check_positive(self.max_positions, "max_positions", allow_zero=True)
        check(self.positions != "learned" or self.max_positions > 0, "max_positions",
              "must be > 0 with learned positions (the rows of the position table)")

    @property
    def arch(self) -> dict[str, Any]:
        """The architecture fields that differ from Qwen2's defaults (empty for a Qwen2 decoder):
        what a profile's sidecar records and what the real run refuses."""
        return {k: getattr(self, k) for k, v in QWEN2_ARCH.items() if getattr(self, k) != v}

    @property
    def norm_params(self) -> int:
        """Weights of one norm (RMSNorm: a scale per channel; LayerNorm: a scale and a bias)."""
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    @property
    def params_per_layer(self) -> int:
        """Weights of one decoder layer: QKV (with their biases where ``qkv_bias``), O, the MLP, two
        norms (and the other biases where ``bias``)."""
        h, q_out, kv_out = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        q = h * q_out + (q_out if self.qkv_bias else 0)
        kv = 2 * (h * kv_out + (kv_out if self.qkv_bias else 0))
        o = q_out * h + (h if self.bias else 0)
        inner = 2 if self.mlp == "swiglu" else 1  # gate and up, or up alone
        mlp = (inner + 1) * h * self.ffn + ((inner * self.ffn + h) if self.bias else 0)
        return q + kv + o + mlp + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        """The token embedding (and a learned position table); the LM head has ``vocab x hidden``."""
        return (self.vocab + (self.max_positions if self.positions == "learned" else 0)) * self.hidden

    @property
    def head_params(self) -> int:
        """The LM head's weights (``vocab x hidden``; the same matrix as the embedding when tied)."""
        return self.vocab * self.hidden


#: The architecture fields' defaults: a Qwen2 decoder's (and that of every profile that records none).
QWEN2_ARCH = {f.name: f.default for f in fields(ModelConfig) if f.name in ARCH_FIELDS}


def qwen25_05b() -> ModelConfig:
    return ModelConfig(name="qwen2.5-0.5b", hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64,
                       ffn=4864, vocab=151936, tie_embeddings=True)


def qwen25_3b() -> ModelConfig:
    return ModelConfig(name="qwen2.5-3b", hidden=2048, layers=36, heads=16, kv_heads=2, head_dim=128,
                       ffn=11008, vocab=151936, tie_embeddings=True)


def qwen25_7b() -> ModelConfig:
    return ModelConfig(name="qwen2.5-7b", hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128,
                       ffn=18944, vocab=152064, tie_embeddings=False)


def tiny() -> ModelConfig:
    """A tiny Qwen2-shaped model for tests and CPU runs (byte-level vocabulary)."""
    return ModelConfig(name="tiny", hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, ffn=128,
                       vocab=256, tie_embeddings=False, block_size=32, dtype_bytes=4)


MODEL_PRESETS = {"qwen2.5-0.5b": qwen25_05b, "qwen2.5-3b": qwen25_3b, "qwen2.5-7b": qwen25_7b,
                 "tiny": tiny}


@dataclass(kw_only=True, slots=True, frozen=True)
class ClusterConfig:
    """Parallel plan and network of a PP x DP (x TP) cluster."""

    name: str = "custom"
    """Preset name or a label."""
    device: str = "h200"
    """Accelerator label; selects nothing by itself (the run config names the profile)."""
    pp: int = 1
    """Pipeline stages."""
    dp: int = 1
    """Data-parallel replicas."""
    tp: int = 1
    """Tensor-parallel degree inside a stage (the profile must be measured at this TP)."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved (interleaved 1F1B with virtual stages), zb-h1
    (zero bubble, split backward), zbv or dualpipev (split backward, 2 stages per device in a V)."""
    virtual_stages: int = 1
    """Model chunks per device: >= 2 for interleaved, exactly 2 for zbv and dualpipev, 1 otherwise."""
    micro_batch_size: int = 1
    """Sequences per micro-batch for policies that do not pack by a token cap."""
    global_batch: int = 16
    """Sequences per iteration across all DP ranks."""
    cp: int = 1
    """Context-parallel degree: every sequence of a micro-batch split over ``cp`` GPUs of a stage
    (mesh order dp x pp x cp x tp, TP innermost; docs/costmodel.md section 11)."""
    cp_layout: str = "zigzag"
    """How a sequence's key blocks are dealt to the CP ranks: ``contiguous``, ``zigzag`` (runs r and
    2 cp - 1 - r), ``stripe`` (block j on rank j mod cp), or ``best``: per sequence and budget the
    fastest by simulated layer time of zigzag and stripe on ``cp_comm`` and all-gather (the choice
    a planner makes from this model). A sequence with too few blocks for the layout (cp; 2 cp for
    zigzag) stays whole on one rank."""
    cp_comm: str = "ring"
    """How the CP ranks exchange K/V: ``ring`` (P2P, next step's transfer overlapped with this
    step's compute), ``hierarchical`` (a ring inside each node, one inter-node transfer hidden behind
    each inner ring; needs the group to span nodes) or ``allgather`` (K/V gathered, dK/dV
    reduce-scattered)."""
    cp_selection: str = "uniform"
    """Where a query block's chosen past key blocks lie, for the work per ring step: ``uniform`` over
    its past blocks or ``local`` (the most recent)."""
    cp_split: str = "whole"
    """How far each sequence is split: ``whole`` (every sequence with enough blocks over all ``cp``
    ranks) or ``per-sequence`` (each sequence of a micro-batch gets a CP degree -- 1, a power of two
    dividing cp, or cp -- and an aligned group of that many ranks, placed to balance the CP ranks'
    predicted time: short sequences stay whole on one rank while long ones ring; docs/costmodel.md
    section 11, 'CP degree per sequence')."""
    cp_merge: str = "unfused"
    """How the forward merges each ring step's partial output and LSE into its fp32 accumulator:
    ``unfused`` (separate elementwise ops, 38 bytes per q x head x dim element, as our ring
    ``kernels/moba/cp_ring.py`` and ring-flash-attention do) or ``fused`` (one correction kernel, 10
    bytes); priced at the memory bandwidth (docs/costmodel.md, 'A ring step is a kernel call')."""
    p2p_bandwidth: float = 50e9
    """Bytes/s between adjacent pipeline stages."""
    p2p_latency: float = 10e-6
    """Seconds of fixed cost per P2P transfer."""
    pp_impl: str = "ideal"
    """The pipeline implementation whose P2P and end-of-iteration work a run follows
    (docs/costmodel.md, "Pipeline costs that grow with depth"). ``ideal`` (default: today's model,
    so existing studies and frozen decisions keep their numbers): a sender goes on once its action
    ends, only the receiver waits for the data, every TP rank sends the whole activation, no
    embedding-gradient all-reduce. ``megatron-2022`` (Megatron-LM of May 2022, Korthikanti et al.):
    blocking sends (each transfer a rendezvous of sender and receiver) in GPipe and 1F1B; P2P split
    across the TP ranks (each sends 1/tp, the receiver all-gathers it over NVLink unless
    ``sequence_parallel``); the tied word embedding's gradient all-reduced between the first and
    last stage. ``megatron`` (Megatron-Core): the same, except that without sequence parallelism the
    whole activation is sent by every TP rank (no scatter/gather). ``torch``
    (torch.distributed.pipelining): blocking sends only. ``meta`` (Llama 3's pipeline, Grattafiori
    et al. 2024, section 3.3.2): asynchronous sends (only the receiver waits, as ``ideal``), and
    with ``sequence_parallel`` each TP rank sends the 1/tp of the activation it holds."""
    end_stage_layers_fewer: int = 0
    """Decoder layers fewer on the first and on the last (virtual) stage than an even split gives
    them, for the embedding and the LM head they also run (``layout.split_layers``): 0 (default)
    the even split; Llama 3 ran 1 (Grattafiori et al. 2024, section 3.3.2), torchtitan's
    ``pipeline_parallel_first/last_stage_less_layers`` (default 1 there) do the same."""
    grad_clip: bool = False
    """Gradient clipping by the global norm: each rank's norm all-reduced over the model-parallel
    group (tp x pp ranks) before any stage steps, a barrier: iteration = max over stages of the
    gradients' ready time + that all-reduce + max over stages of the optimizer step. False
    (default, today's model): each stage steps as soon as its own gradients are ready."""
    allreduce_bandwidth: float = 50e9
    """Bytes/s of the ring all-reduce (bus bandwidth per link)."""
    allreduce_latency: float = 20e-6
    """Seconds of fixed cost per all-reduce step sequence."""
    tp_bandwidth: float = 450e9
    """Bytes/s of the tensor-parallel all-reduce (ring bus bandwidth; NVLink 4: 450 GB/s per
    direction). Used with profiles measured without TP communication (one shard, ``profile --tp``);
    an analytical profile carries its own (the roofline's)."""
    tp_latency: float = 5e-6
    """Seconds of fixed cost per tensor-parallel all-reduce."""
    nvlink_step_latency: float = 0.0
    """Seconds each step of a data-parallel ring collective adds when it stays inside a node, on top
    of the collective's fixed latency: a ring all-gather or reduce-scatter over n ranks takes n - 1
    steps, an all-reduce 2 (n - 1) (``simulator/cost/link.py: ring_latency``). 0 (default): the fixed
    latency alone. The GPU presets set NCCL's own model of its ring with the Simple protocol over
    NVLink, 3.4 us (``src/graph/tuning.cc``: ``hwLat``)."""
    net_step_latency: float = 0.0
    """Seconds each step of a data-parallel ring collective adds when it crosses nodes (a ring over
    N nodes crosses N - 1 boundaries in an all-gather or reduce-scatter, 2 N in an all-reduce, as
    NCCL's model counts them). 0 (default): the fixed latency alone. The GPU presets set NCCL's ring /
    Simple value over the network, 14 us (``src/graph/tuning.cc``)."""
    gpus_per_node: int = 8
    """GPUs per node: tensor parallelism stays inside a node (tp <= gpus_per_node)."""
    nodes: int | None = None
    """Nodes in the cluster; when set, pp x dp x tp must fit in nodes x gpus_per_node. None = as
    many as the plan needs."""
    replicate_kv_heads: bool = False
    """Allow tp > kv_heads by replicating each KV head on tp / kv_heads ranks (Megatron-style);
    without it tp must divide kv_heads."""
    device_memory: float | None = None
    """Bytes of memory per device (the presets carry it: H200 141 GB, H20 96 GB, H100 80 GB);
    None = unknown, plans are not checked against it."""
    zero1: bool = False
    """Older configs' switch for ``dp_mode = "zero1"`` (kept so they load; true sets it, and it reads
    true whenever ``dp_mode`` is ``zero1``)."""
    dp_mode: str = "ddp"
    """How the data-parallel group (DP x CP ranks of a stage, ``Layout.grad_group``) holds the
    weights: ``ddp`` (replicated, gradients all-reduced); ``zero1`` (Megatron's distributed
    optimizer: fp32 master weights and Adam moments sharded, gradients reduce-scattered, each rank
    steps its 1/n shard, then the updated bf16 parameters are all-gathered); ``zero3`` (FSDP
    FULL_SHARD / FSDP2 ``fully_shard``, DeepSpeed ZeRO-3: every state sharded; each decoder layer
    (one unit) gathered before its forward and again before its backward, its gradient
    reduce-scattered after its backward, at every micro-batch); ``zero2`` (FSDP SHARD_GRAD_OP, or
    FSDP2 without resharding after forward as Llama 3 ran it: no gather in the backward). zero2 and
    zero3 are priced unit by unit (docs/costmodel.md, 'FSDP / ZeRO-3'): a gather overlapped with the
    previous unit's compute, exposed where it does not fit."""
    param_gather_overlap: bool = False
    """With ``dp_mode = "zero1"``: the all-gather of the updated parameters overlapped with the next
    forward, bucket by bucket (Megatron-Core's ``--overlap-param-gather``: each bucket's gather is
    waited for in the forward pre-hook of its first module); only what the device's first forward
    action cannot hide is exposed (docs/costmodel.md, 'ZeRO-1'). False: the gather follows the
    optimizer step, all exposed."""
    fsdp_shard: int | None = None
    """Ranks a zero2 / zero3 unit is sharded over; None = all of the DP group (dp x cp, as torchtitan
    flattens ``dp_shard`` and ``cp``). Fewer (it must divide dp x cp) is hybrid sharding (HSDP): the
    shards' gradients are then all-reduced across the dp x cp / fsdp_shard replicas after the
    backward."""
    fsdp_grad_sync: str | None = None
    """How often a zero2 / zero3 step gathers and reduces: ``every`` micro-batch (FSDP's default
    under gradient accumulation: each micro-batch gathers as ``dp_mode`` says and reduce-scatters
    its gradients) or once per step, ``last`` (parameters gathered by the first micro-batch's
    forward and kept for the step, gradients accumulated unsharded and reduce-scattered by the last
    micro-batch's backward: torch.distributed.pipelining's stages with FSDP2 --
    ``reshard_after_backward`` off, gradient sync on the last backward only -- and Llama 3's FSDP
    with PP). None = ``every``."""
    fsdp_backward_prefetch: str | None = None
    """When a zero3 backward gathers the next unit: ``pre`` (FSDP's BACKWARD_PRE, FSDP2's implicit
    prefetch: issued as the current unit's gradient computation starts, ahead of its
    reduce-scatter) or ``post`` (BACKWARD_POST: after that computation, behind its reduce-scatter
    on the link). None = ``pre``; only with zero3."""
    param_gather_bytes: int | None = None
    """Bytes per element a zero2 / zero3 gather moves (the mixed-precision parameter dtype:
    2 for bf16); None = ``model.dtype_bytes``. The reduce-scatter moves ``grad_reduce_bytes``."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism with TP (Korthikanti et al. 2022): the norms, dropouts and
    residual adds run on 1/tp of the tokens per rank, and their activations are kept 1/tp per rank;
    each TP all-reduce becomes an all-gather + reduce-scatter (the same bytes per rank on a ring).
    Without it those parts are replicated on every TP rank."""
    tp_overlap: bool = False
    """The backward's TP collectives overlapped with its GEMMs, as Megatron-LM runs them by default
    (``LinearWithGradAccumulationAndAsyncCommunication``; off with
    ``--no-async-tensor-model-parallel-allreduce``): a column-parallel linear's input-gradient
    all-reduce (with SP: reduce-scatter) runs beside its weight-gradient GEMM, SP's re-gather beside
    the input-gradient GEMM; only what outlasts the GEMM costs time. Priced by the analytical
    profiles (``roofline.tp_backward_comm``); false keeps every collective exposed."""
    tp_overlap_impl: str = "megatron"
    """Whose TP overlap runs with ``tp_overlap``: ``megatron`` (the backward's asynchronous
    collectives above; the forward's exposed) or ``te`` (Transformer Engine's comm-GEMM overlap,
    Megatron-LM's ``--tp-comm-overlap``: every collective of the forward and backward split into
    chunks beside the GEMM that makes or reads it; needs ``sequence_parallel``;
    ``simulator/cost/tpoverlap.py``). Priced by the analytical profiles."""
    dp_overlap: bool = False
    """Bucketed DP gradient reduction overlapped with each device's last backward action
    (Megatron's ``overlap_grad_reduce``): only what is left after that action is exposed
    (docs/costmodel.md, 'Gradient synchronisation'). False: one collective after the backward."""
    grad_reduce_bytes: int | None = None
    """Bytes per element of the gradient buffer, which the DP reduction moves and the optimizer step
    reads twice and zeroes (``cost.comm.adamw_bytes``); None = ``model.dtype_bytes``. Megatron-LM
    accumulates and all-reduces a bf16 model's gradients in fp32 (4): "bfloat16 requires gradient
    accumulation and all-reduce to be done in fp32" (megatron/training/arguments.py)."""
    grad_bucket_params: int | None = None
    """Parameters per gradient bucket with ``dp_overlap``; None = Megatron-Core's default
    max(40,000,000, 1,000,000 x dp) (megatron/core/distributed/distributed_data_parallel.py)."""
    recompute: str | bool = "none"
    """Activation recomputation, priced in time and memory: ``none``; ``selective`` (the attention
    core, Megatron's selective recomputation: a layer drops the attention output and its softmax
    statistics, and each layer's backward runs its attention forward again); ``full`` (a layer
    keeps only its input, and each layer's backward runs the whole layer's forward again, TP
    all-reduces included). ``true`` / ``false`` (older configs) read as ``full`` / ``none``."""

    def __post_init__(self) -> None:
        for f in ("pp", "dp", "tp", "cp", "virtual_stages", "micro_batch_size", "global_batch",
                  "p2p_bandwidth", "allreduce_bandwidth", "gpus_per_node"):
            check_positive(getattr(self, f), f)
        for f in ("p2p_bandwidth", "p2p_latency", "allreduce_bandwidth", "allreduce_latency",
                  "tp_bandwidth", "tp_latency"):
            check(math.isfinite(getattr(self, f)), f, f"must be finite, got {getattr(self, f)!r}")
        check_positive(self.tp_bandwidth, "tp_bandwidth")
        check(self.tp <= self.gpus_per_node, "tp",
              f"tensor parallelism stays inside a node: must be <= gpus_per_node ({self.gpus_per_node}), "
              f"got {self.tp}")
        if self.nodes is not None:
            check_positive(self.nodes, "nodes")
            need = self.gpus
            check(need <= self.nodes * self.gpus_per_node, "cp" if self.cp > 1 else "tp",
                  f"pp x dp x cp x tp = {self.pp} x {self.dp} x {self.cp} x {self.tp} = {need} GPUs exceeds the cluster's "
                  f"nodes x gpus_per_node = {self.nodes} x {self.gpus_per_node} = "
                  f"{self.nodes * self.gpus_per_node}")
        for f in ("p2p_latency", "allreduce_latency", "tp_latency", "nvlink_step_latency", "net_step_latency"):
            check_positive(getattr(self, f), f, allow_zero=True)
        check_choice(self.schedule, "schedule", SCHEDULES)
        if self.device_memory is not None:
            check(isinstance(self.device_memory, (int, float)) and not isinstance(self.device_memory, bool)
                  and self.device_memory > 0, "device_memory",
                  f"must be a number of bytes > 0 (e.g. 141e9), got {self.device_memory!r}")
        check_choice(self.cp_layout, "cp_layout", CP_LAYOUTS)
        check_choice(self.cp_comm, "cp_comm", CP_COMMS)
        check_choice(self.cp_selection, "cp_selection", CP_SELECTIONS)
        check_choice(self.cp_split, "cp_split", CP_SPLITS)
        check_choice(self.cp_merge, "cp_merge", CP_MERGES)
        check_choice(self.pp_impl, "pp_impl", PP_IMPLS)
        check(isinstance(self.end_stage_layers_fewer, int) and not isinstance(self.end_stage_layers_fewer, bool)
              and self.end_stage_layers_fewer >= 0, "end_stage_layers_fewer",
              f"must be a whole number of layers >= 0, got {self.end_stage_layers_fewer!r}")
        check(self.cp_split == "whole" or self.cp > 1, "cp_split",
              f"'per-sequence' chooses a CP degree per sequence: needs cp > 1, got cp = {self.cp}")
        if self.cp > 1 and self.cp_comm == "hierarchical":
            inner = self.cp_ranks_per_node
            check(self.cp > inner and self.cp % inner == 0, "cp_comm",
                  f"'hierarchical' rings over nodes: cp ({self.cp}) must be a multiple > 1 of the CP ranks a node "
                  f"holds (gpus_per_node / tp = {inner}); use 'ring' inside one node")
        for f in ("zero1", "dp_overlap", "sequence_parallel", "tp_overlap", "grad_clip"):
            check(isinstance(getattr(self, f), bool), f, f"must be true or false, got {getattr(self, f)!r}")
        check_choice(self.tp_overlap_impl, "tp_overlap_impl", TP_OVERLAP_IMPLS)
        if self.tp_overlap_impl == "te" and self.tp > 1:
            check(self.tp_overlap and self.sequence_parallel, "tp_overlap_impl",
                  "'te' (Transformer Engine's comm-GEMM overlap) needs tp_overlap = true and "
                  f"sequence_parallel = true, got tp_overlap = {str(self.tp_overlap).lower()}, "
                  f"sequence_parallel = {str(self.sequence_parallel).lower()}")
        self._check_dp_mode()
        if self.grad_reduce_bytes is not None:
            check_choice(self.grad_reduce_bytes, "grad_reduce_bytes", (1, 2, 4, 8))
        if self.grad_bucket_params is not None:
            check(isinstance(self.grad_bucket_params, int) and not isinstance(self.grad_bucket_params, bool)
                  and self.grad_bucket_params > 0, "grad_bucket_params",
                  f"must be a whole number of parameters > 0 (or absent), got {self.grad_bucket_params!r}")
        if isinstance(self.recompute, bool):  # older configs: a memory switch
            object.__setattr__(self, "recompute", "full" if self.recompute else "none")
        check_choice(self.recompute, "recompute", RECOMPUTE)
        if self.schedule == "interleaved":
            check(self.virtual_stages >= 2, "virtual_stages",
                  f"the interleaved schedule needs >= 2, got {self.virtual_stages}")
        elif self.schedule in V_SCHEDULES:
            check(self.virtual_stages == 2, "virtual_stages",
                  f"{self.schedule} places exactly 2 stages per device in a V (2 x pp = {2 * self.pp} "
                  f"stages, an even count); must be 2, got {self.virtual_stages}")
        else:
            check(self.virtual_stages == 1, "virtual_stages",
                  f"must be 1 for schedule {self.schedule!r} (use schedule = \"interleaved\")")
        check(self.global_batch % (self.dp * self.micro_batch_size) == 0, "global_batch",
              f"must be a multiple of dp x micro_batch_size = {self.dp * self.micro_batch_size}, "
              f"got {self.global_batch}")

    def _check_dp_mode(self) -> None:
        check_choice(self.dp_mode, "dp_mode", DP_MODES)
        if self.zero1:  # an older config's switch: the same as dp_mode = "zero1"
            check(self.dp_mode in ("ddp", "zero1"), "zero1",
                  f"true means dp_mode = \"zero1\"; it contradicts dp_mode = {self.dp_mode!r} (drop zero1)")
            object.__setattr__(self, "dp_mode", "zero1")
        object.__setattr__(self, "zero1", self.dp_mode == "zero1")
        check(isinstance(self.param_gather_overlap, bool), "param_gather_overlap",
              f"must be true or false, got {self.param_gather_overlap!r}")
        if self.param_gather_overlap:
            check(self.dp_mode == "zero1", "param_gather_overlap",
                  f"overlaps ZeRO-1's parameter all-gather; dp_mode is {self.dp_mode!r} (set dp_mode = \"zero1\" "
                  "or drop it; zero2 / zero3 gathers overlap by design)")
        fsdp = self.dp_mode in FSDP_MODES
        group = self.dp * self.cp
        if self.fsdp_shard is not None:
            check(fsdp, "fsdp_shard", f"shards a zero2 / zero3 unit; dp_mode is {self.dp_mode!r} (drop it, or set "
                  f"dp_mode to one of {', '.join(FSDP_MODES)})")
            check(isinstance(self.fsdp_shard, int) and not isinstance(self.fsdp_shard, bool) and self.fsdp_shard >= 1
                  and group % self.fsdp_shard == 0, "fsdp_shard",
                  f"must be a whole number dividing dp x cp = {group} (or absent: all of them), got {self.fsdp_shard!r}")
        if self.fsdp_grad_sync is not None:
            check(fsdp, "fsdp_grad_sync", f"chooses how often zero2 / zero3 gathers and reduces; dp_mode is "
                  f"{self.dp_mode!r} (drop it)")
            check_choice(self.fsdp_grad_sync, "fsdp_grad_sync", FSDP_GRAD_SYNC)
        if self.fsdp_backward_prefetch is not None:
            check(self.dp_mode == "zero3", "fsdp_backward_prefetch",
                  f"chooses when a zero3 backward gathers; dp_mode is {self.dp_mode!r} (drop it)")
            check_choice(self.fsdp_backward_prefetch, "fsdp_backward_prefetch", FSDP_PREFETCH)
        if self.param_gather_bytes is not None:
            check(fsdp, "param_gather_bytes", f"sizes a zero2 / zero3 gather; dp_mode is {self.dp_mode!r} (drop it)")
            check_choice(self.param_gather_bytes, "param_gather_bytes", (1, 2, 4))
        if fsdp:
            check(self.schedule not in SPLIT_SCHEDULES, "dp_mode",
                  f"{self.dp_mode} with the split backward of schedule {self.schedule!r} is not modelled; use "
                  f"one of {', '.join(s for s in SCHEDULES if s not in SPLIT_SCHEDULES)}, or dp_mode ddp / zero1")

    @property
    def fsdp_group(self) -> int:
        """Ranks a zero2 / zero3 unit is sharded over (``fsdp_shard``, default dp x cp); 1 otherwise."""
        if self.dp_mode not in FSDP_MODES:
            return 1
        return self.fsdp_shard or self.dp * self.cp

    @property
    def microbatches_per_rank(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch_size)

    @property
    def cp_ranks_per_node(self) -> int:
        """CP ranks of one group inside a node (TP innermost, then CP): gpus_per_node / tp, at most cp."""
        return max(1, min(self.cp, self.gpus_per_node // self.tp))

    @property
    def cp_degrees(self) -> tuple[int, ...]:
        """CP degrees a sequence may take under ``cp_split = "per-sequence"`` (ascending): the powers
        of two dividing cp, and cp; their aligned rank groups nest (docs/costmodel.md section 11)."""
        return tuple(sorted({d for d in (2 ** j for j in range(self.cp.bit_length())) if self.cp % d == 0}
                            | {self.cp}))

    @property
    def gpus(self) -> int:
        return self.pp * self.dp * self.cp * self.tp


def check_tp(model: ModelConfig, cluster: ClusterConfig) -> None:
    """Tensor parallelism must split the heads evenly: tp divides heads, and kv_heads too unless
    ``cluster.replicate_kv_heads`` (then tp must be a multiple of kv_heads)."""
    tp = cluster.tp
    check(model.heads % tp == 0, "cluster.tp",
          f"must divide model.heads ({model.heads}) so every rank holds whole heads, got {tp}")
    if model.kv_heads % tp == 0:
        return
    if not cluster.replicate_kv_heads:
        raise ConfigError(f"cluster.tp: must divide model.kv_heads ({model.kv_heads}), got {tp}; set "
                          "cluster.replicate_kv_heads = true to replicate KV heads across TP ranks")
    check(tp % model.kv_heads == 0, "cluster.tp",
          f"with replicated KV heads must be a multiple of model.kv_heads ({model.kv_heads}), got {tp}")


#: NCCL's model of one step of its ring with the Simple protocol (the one large collectives use):
#: 3.4 us over NVLink, 14 us over the network (``src/graph/tuning.cc``, ``hwLat``, NCCL 2.19-2.21).
NCCL_NVLINK_STEP, NCCL_NET_STEP = 3.4e-6, 14e-6
NCCL_RING_STEPS = {"nvlink_step_latency": NCCL_NVLINK_STEP, "net_step_latency": NCCL_NET_STEP}


def h200_4x8() -> ClusterConfig:
    """4 nodes x 8 H200 (the paper's main setting DP4 x PP4 x TP2). Network: NDR InfiniBand
    400 Gb/s per GPU (50 GB/s) between nodes, which P2P and DP all-reduce cross."""
    return ClusterConfig(name="h200-4x8", device="h200", pp=4, dp=4, tp=2, global_batch=16, nodes=4,
                         p2p_bandwidth=50e9, p2p_latency=10e-6, allreduce_bandwidth=50e9,
                         allreduce_latency=20e-6, device_memory=141e9,
                         nvlink_step_latency=NCCL_NVLINK_STEP, net_step_latency=NCCL_NET_STEP)


def h20_4x8() -> ClusterConfig:
    """4 nodes x 8 H20, same parallel plan and network assumptions as ``h200_4x8``."""
    return replace(h200_4x8(), name="h20-4x8", device="h20", device_memory=96e9)


def h100_4x8() -> ClusterConfig:
    """4 nodes x 8 H100 SXM 80 GB, same parallel plan and network assumptions as ``h200_4x8`` (NVLink 4
    inside a node, NDR InfiniBand 400 Gb/s per GPU between nodes, as on DGX H100)."""
    return replace(h200_4x8(), name="h100-4x8", device="h100", device_memory=80e9)


def dgx_a100_80gb() -> ClusterConfig:
    """DGX A100 80 GB nodes (Selene, as in Narayanan et al. 2021 and Korthikanti et al. 2022): 8 GPUs on
    NVLink 3 (12 links x 50 GB/s = 600 GB/s bidirectional; NCCL's all-reduce reaches a bus bandwidth of
    230 GB/s on one node: ``roofline.A100_80GB``) and 8 HDR InfiniBand 200 Gb/s HCAs per node, one per
    GPU, which P2P and DP rings cross: 24 GB/s each ("we usually consider 24GB/s is the peak
    performance per 200G NIC", NVIDIA's NCCL maintainer, NVIDIA/nccl-tests issue #119). Set pp, dp,
    tp, schedule and batch for the run."""
    return ClusterConfig(name="dgx-a100-80gb", device="a100-80gb", pp=1, dp=1, tp=8, gpus_per_node=8,
                         p2p_bandwidth=24e9, allreduce_bandwidth=24e9, tp_bandwidth=230e9, device_memory=80e9,
                         nvlink_step_latency=NCCL_NVLINK_STEP, net_step_latency=NCCL_NET_STEP)


def dgx_a100_40gb() -> ClusterConfig:
    """DGX A100 40 GB nodes: as :func:`dgx_a100_80gb` with 40 GB per GPU."""
    return replace(dgx_a100_80gb(), name="dgx-a100-40gb", device="a100-40gb", device_memory=40e9)


CLUSTER_PRESETS = {"h200-4x8": h200_4x8, "h20-4x8": h20_4x8, "h100-4x8": h100_4x8,
                   "dgx-a100-80gb": dgx_a100_80gb, "dgx-a100-40gb": dgx_a100_40gb}


def _with_preset(kind: str, presets: dict, cls: type, data: dict[str, Any], where: str):
    data = dict(data)
    preset = data.pop("preset", None)
    if preset is None:
        return from_mapping(cls, data, where)
    if preset not in presets:
        raise ConfigError(f"{where}.preset: unknown {kind} preset {preset!r}; "
                          f"choose one of {', '.join(presets)}")
    base = presets[preset]()
    from sparsebalance.configmap import to_dict
    merged = to_dict(base) | data
    return from_mapping(cls, merged, where)


def model_from_mapping(data: dict[str, Any], where: str = "model") -> ModelConfig:
    """A ``[model]`` table: ``preset = "qwen2.5-3b"`` plus optional overrides, or every field (a
    Hugging Face ``config.json``: ``simulator/hfconfig.model_from_table``)."""
    return _with_preset("model", MODEL_PRESETS, ModelConfig, data, where)


def cluster_from_mapping(data: dict[str, Any], where: str = "cluster") -> ClusterConfig:
    """A ``[cluster]`` table: ``preset = "h200-4x8"`` plus optional overrides, or every field."""
    return _with_preset("cluster", CLUSTER_PRESETS, ClusterConfig, data, where)
