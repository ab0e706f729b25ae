"""Options of the real executor (the ``[realrun]`` table of a run config), validated before launch.

Everything that can be checked without starting a process is checked here, so a bad config fails in
``sparsebalance train`` / ``validate`` with one clear line instead of N crashing workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsebalance.configmap import from_mapping
from sparsebalance.errors import ConfigError, check, check_choice, check_positive
from sparsebalance.simulator.layout import mesh_coords, mesh_rank

BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "naive", "triton")
DTYPES = ("float32", "bfloat16", "float64")
REALRUN_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
"""What the real run executes (the V-placed zbv and dualpipev are simulated only)."""
MAX_THREADS = 1024
"""More torch threads per process than any node has cores: a typo (100000 makes thread creation fail
inside a worker, after torchrun started)."""
TIMEOUT_RANGE_S = (1.0, 7 * 86400.0)
"""``timeout_s`` bounds: under a second the rendezvous itself times out (0 ms sockets); past a week
the value overflows torch's millisecond timer (an OverflowError in a worker) and bounds no hang."""


@dataclass(kw_only=True, slots=True, frozen=True)
class RealrunConfig:
    """How the PP x DP executor runs (``[realrun]`` in the run config)."""

    backend: str = "gloo"
    """torch.distributed backend: gloo (CPU) or nccl (CUDA)."""
    device: str = "cpu"
    """Where each rank computes: cpu or cuda (rank's local GPU = LOCAL_RANK)."""
    threads: int = 1
    """torch intra-op threads per process (1 on the CPU, so N processes do not oversubscribe cores)."""
    pin_cores: bool = True
    """CPU: pin each worker process to one core (local rank -> core; os.sched_setaffinity), so two
    workers never share a core and are not migrated; ignored on CUDA and where unsupported."""
    manual_gc: bool = True
    """Python's cyclic garbage collector runs between iterations, not inside timed actions: after
    setup the model's objects are frozen (gc.freeze) and automatic collection is off during an
    iteration; the profiler times its ops the same way. Without it, collections land in random
    actions (tens of ms each, up to ~0.3 s for a full one on this VM), docs/validation.md."""
    steady_allocator: bool = True
    """CPU: keep freed memory in the process (glibc mallopt: no mmap of large blocks, no heap trim),
    as the profiler does and as CUDA's caching allocator does; without it a stage holding several
    micro-batches page-faults every new large tensor in (kernels/cpuclock.py, docs/validation.md)."""
    timeout_s: float = 120.0
    """Seconds any collective or P2P may wait before the rank gives up (bounds a hang after a fault)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float | None = None
    """Clip the global gradient norm to this value (None = no clipping)."""
    attention_backend: str = "auto"
    """moba_attention backend: auto, torch (chunked PyTorch, CPU), naive (reference), triton (GPU)."""
    dtype: str = "float32"
    """Parameter and activation dtype: float32, bfloat16 or float64."""
    layer_impl: str = "auto"
    """How the decoder layers and the head run (``kernels/fastlayer.py``): eager (the Hugging Face
    modules), compiled (torch.compile'd norms, projections, RoPE and MLP around the eager attention;
    the loss chunked over the vocabulary), or auto: compiled on CUDA unless tp > 1 or the schedule
    splits the backward (zb-h1), else eager (the CPU default)."""
    coverage_layer: int = 0
    """Layer whose real gate scores give each sequence's coverage curve (-1 = do not measure)."""
    score_labels: bool = False
    """The last stage also counts the labels each forward predicts exactly (argmax), reported as
    ``answer_accuracy`` per iteration: the accuracy experiment's answers at the budgets chosen."""
    checkpoint: str | None = None
    """Local Hugging Face checkpoint directory to start from (None = random init from the run seed)."""
    fail_rank: int | None = None
    """Fault injection for tests: this global rank raises RuntimeError at ``fail_iteration``."""
    fail_iteration: int = 0
    """Iteration at which ``fail_rank`` raises."""

    def __post_init__(self) -> None:
        check_choice(self.backend, "backend", BACKENDS)
        check_choice(self.device, "device", DEVICES)
        check_choice(self.attention_backend, "attention_backend", ATTENTION_BACKENDS)
        check_choice(self.dtype, "dtype", DTYPES)
        from sparsebalance.kernels.fastlayer import LAYER_IMPLS

        check_choice(self.layer_impl, "layer_impl", LAYER_IMPLS)
        check(1 <= self.threads <= MAX_THREADS, "threads",
              f"must lie in [1, {MAX_THREADS}] (torch threads per process), got {self.threads}")
        lo, hi = TIMEOUT_RANGE_S
        check(lo <= self.timeout_s <= hi, "timeout_s",
              f"must lie in [{lo:g}, {hi:g}] seconds (1 s to a week), got {self.timeout_s!r}")
        check_positive(self.lr, "lr")
        check_positive(self.weight_decay, "weight_decay", allow_zero=True)
        if self.grad_clip is not None:
            check_positive(self.grad_clip, "grad_clip")
        check(not (self.backend == "nccl" and self.device == "cpu"), "backend",
              "nccl needs device = \"cuda\"; use backend = \"gloo\" on the CPU")
        check_positive(self.fail_iteration, "fail_iteration", allow_zero=True)


def realrun_config(cfg) -> RealrunConfig:
    """Parse and cross-check ``cfg.realrun`` (a RunConfig) against the model and cluster."""
    rr = from_mapping(RealrunConfig, cfg.realrun, "realrun")
    m, c = cfg.model, cfg.cluster
    check(-1 <= rr.coverage_layer < m.layers, "realrun.coverage_layer",
          f"must lie in [0, {m.layers - 1}] (model.layers = {m.layers}) or be -1 (off), "
          f"got {rr.coverage_layer}")
    check_choice(c.schedule, "cluster.schedule", REALRUN_SCHEDULES)
    if c.cp > 1:  # what the real run's context parallelism covers (kernels/moba/cp.py)
        check(c.tp == 1, "cluster.tp", f"context parallelism in the real run needs tp = 1, got {c.tp}")
        check_choice(c.cp_layout, "cluster.cp_layout", ("contiguous", "zigzag", "stripe"))
        check_choice(c.cp_comm, "cluster.cp_comm", ("ring", "allgather"))
        check_choice(c.schedule, "cluster.schedule", ("gpipe", "1f1b", "interleaved"))
        check_choice(c.cp_split, "cluster.cp_split", ("whole",))  # a degree per sequence: simulated only
        # both exchanges run the CPU MoBA path (chunked.py, ring_step.py: PyTorch's CPU flash-attention parts)
        check(rr.device == "cpu", "realrun.device",
              f"context parallelism in the real run computes on the CPU path; must be cpu, got {rr.device!r}")
    check_mesh(m, c)
    layer_impl(cfg, rr)  # compiled where it cannot run: refused here, before launch
    if rr.fail_rank is not None:
        check(0 <= rr.fail_rank < world_size(cfg), "realrun.fail_rank",
              f"must lie in [0, {world_size(cfg) - 1}], got {rr.fail_rank}")
        # an injection past the last iteration never fires: the test that asked for it passes unfailed
        check(rr.fail_iteration < cfg.iterations, "realrun.fail_iteration",
              f"must lie in [0, {cfg.iterations - 1}] (iterations = {cfg.iterations}) with "
              f"realrun.fail_rank set, got {rr.fail_iteration}")
    check(cfg.data.source != "distribution", "data.source",
          "realrun trains on real tokens; use text_dir, jsonl, parquet or hf_disk "
          "(e.g. source = \"text_dir\", path = \"stdlib\")")
    if rr.checkpoint is not None:
        from sparsebalance.realrun.checkpoint import check_checkpoint

        check_checkpoint(cfg.resolve(rr.checkpoint), m)
    if rr.device == "cuda":
        try:
            import torch
        except ImportError:
            raise ConfigError("realrun.device: cuda needs torch installed") from None
        check(torch.cuda.is_available(), "realrun.device", "cuda requested but no CUDA device is visible")
    return rr


def layer_impl(cfg, rr: RealrunConfig) -> str:
    """eager or compiled: ``rr.layer_impl`` resolved for the run's device, tp and schedule
    (ConfigError naming ``realrun.layer_impl`` for compiled where it cannot run)."""
    from sparsebalance.kernels.fastlayer import resolve_layer_impl
    from sparsebalance.simulator.schedule.schedules import splits_backward

    c = cfg.cluster
    return resolve_layer_impl(rr.layer_impl, rr.device, tp=c.tp, split_backward=splits_backward(c.schedule),
                              field="realrun.layer_impl")


def check_mesh(m, c) -> None:
    """What the real model can run (one line each, ConfigError): every (virtual) stage needs layers,
    and with virtual stages the layers split evenly over pp x virtual_stages chunks (Megatron's rule:
    each chunk is one model piece); tp divides the query heads and divides the key/value heads or, with
    ``cluster.replicate_kv_heads``, is a multiple of them (``realrun/tp.py``)."""
    from sparsebalance.simulator.config import check_tp

    chunks = c.pp * c.virtual_stages
    check(c.pp <= m.layers, "cluster.pp",
          f"cannot exceed model.layers ({m.layers}): every stage needs a layer, got {c.pp}")
    if c.virtual_stages > 1:
        check(m.layers % chunks == 0, "cluster.virtual_stages",
              f"pp x virtual_stages = {c.pp} x {c.virtual_stages} = {chunks} must divide model.layers "
              f"({m.layers}) in the real run (equal model chunks)")
    check_tp(m, c)  # tp divides the heads, and the KV heads or (replicate_kv_heads) is a multiple


def world_size(cfg) -> int:
    """Processes a run needs: one per (dp replica, stage, CP rank, TP rank)."""
    return cfg.cluster.pp * cfg.cluster.dp * cfg.cluster.cp * cfg.cluster.tp


def rank_layout(rank: int, pp: int, tp: int = 1) -> tuple[int, int, int]:
    """Global rank -> (dp_rank, stage, tp_rank). TP ranks of a stage are consecutive, then the stages
    of one replica, so TP (the most traffic) and P2P stay inside a node when ``pp x tp <=
    gpus_per_node``, and only the DP all-reduce crosses nodes (``simulator/layout.py``'s mesh)."""
    return mesh_coords(rank, (pp, tp))


def global_rank(dp_rank: int, stage: int, pp: int, tp_rank: int = 0, tp: int = 1) -> int:
    return mesh_rank((dp_rank, stage, tp_rank), (pp, tp))
