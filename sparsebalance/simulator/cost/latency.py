"""The latency model: one object that answers what every action of an iteration takes, from a profile.

``LatencyModel`` is a facade over the cost model's parts, each in its own module:

* :mod:`.tables` -- the profile's ops as interpolation tables (attention surfaces, per-token
  curves), range handling (``extrapolate``), the derived split backward, recomputation folded in;
* :mod:`.cp.pricing` -- context parallelism: a sequence's layer on its CP group (ring, hierarchical
  ring or all-gather), folded into the tables once; per-degree attention for ``cp_split =
  "per-sequence"`` (:mod:`.cp.placement`);
* :mod:`.comm` -- P2P, the TP all-reduces a measured shard lacks, the DP gradient
  synchronisation and the optimizer step;
* :mod:`.stagecost` -- ``StageCost``: the one place a stage's time and a micro-batch's whole-model
  forward + backward are summed (``lm.cost``).

Its methods are those of :class:`.query.LatencyQuery` (what the policies and the executor hold) plus
the per-op look-ups tests and tools read. Build it with :func:`load_latency_model`, which checks the
profile against the run first (:mod:`.profilecheck`).
"""

from __future__ import annotations

import numpy as np

from sparsebalance.simulator.config import ClusterConfig, ModelConfig
from sparsebalance.simulator.cost.comm import Communication
from sparsebalance.simulator.cost.cp.placement import PerSequenceCP, Placement
from sparsebalance.simulator.cost.cp.pricing import CPPricing
from sparsebalance.simulator.cost.cp.ring import RingReport
from sparsebalance.simulator.cost.modes import plain, uniform_budgets
from sparsebalance.simulator.cost.profile import Profile
from sparsebalance.simulator.cost.profilecheck import load_checked
from sparsebalance.simulator.cost.query import ScalarStageLatency
from sparsebalance.simulator.cost.stagecost import StageCost
from sparsebalance.simulator.cost.tables import EXTRAPOLATE, PARTS, OpTables
from sparsebalance.simulator.layout import layout_of
from sparsebalance.simulator.plan import split_pad

__all__ = ["EXTRAPOLATE", "PARTS", "LatencyModel", "load_latency_model"]


class LatencyModel(ScalarStageLatency):
    """Predicts seconds of attention, dense layers, stages and micro-batches; P2P, all-reduce and
    optimizer time. Build it with :func:`load_latency_model`. Lengths and tokens are in tokens,
    budgets are MoBA top-k (an int, or a :class:`~sparsebalance.simulator.budget.Budget`)."""

    def __init__(self, profile: Profile, model: ModelConfig, cluster: ClusterConfig, *,
                 extrapolate: str = "warn") -> None:
        self.profile, self.model, self.cluster, self.extrapolate = profile, model, cluster, extrapolate
        self.block_size = model.block_size
        self.layout = layout_of(model, cluster)
        """Where the layers and parameters live (``simulator/layout.py``): the one split."""
        self.tables = OpTables(profile, model, cluster, extrapolate=extrapolate)
        self.cp = CPPricing(self.tables, model, cluster, self.layout)
        self.cp.fold()
        self.tables.fold_recompute(str(cluster.recompute), list(self.cp.degree_surfaces.values()))
        self.comm = Communication(self.tables, model, cluster, self.layout)
        self.cost = StageCost(self, self.tables, self.comm, self.layout)
        """Stage and whole-model times (``simulator/cost/stagecost.py``): the one sum."""
        self.per_sequence = PerSequenceCP(self.cost, self.attention_at_degree) \
            if cluster.cp_split == "per-sequence" else None
        """``cluster.cp_split = "per-sequence"``: each micro-batch placed on its CP group with a
        degree per sequence (``simulator/cost/cp/placement.py``); stage and micro-batch times go through it."""
        self.cost.per_sequence = self.per_sequence
        if cluster.cp > 1 and cluster.cp_split == "whole":  # one ring per packed micro-batch
            self.cost.joint = self.cp.joint_delta
        self.tables.warn_missing_ops()

    # -- what the profile holds, per op ---------------------------------------------------------
    @property
    def notes(self) -> list[str]:
        """What the model derived rather than read from the profile (e.g. the split backward)."""
        return self.tables.notes

    @property
    def call(self) -> dict[bool, float]:
        """Seconds of one layer's attention call paid once per packed micro-batch (forward, backward)."""
        return self.tables.call

    @property
    def cp_attention(self) -> str:
        """What prices CP attention work (``cluster.cp`` > 1), in words."""
        return self.cp.description

    def effective_budget(self, seq_len: int, budget: int) -> int:
        """min(budget, number of blocks): a top-k at or beyond the block count is dense."""
        return self.tables.effective_budget(seq_len, budget)

    def attention(self, seq_len: int, budget: int, *, backward: bool = False) -> float:
        """Seconds of one layer's MoBA attention for one sequence of ``seq_len`` tokens (on its CP
        group with CP)."""
        return self.tables.attention(seq_len, budget, backward=backward)

    def attention_many(self, seq_len, budget, *, backward: bool = False) -> np.ndarray:
        """Vectorised :meth:`attention`: bitwise its values."""
        return self.tables.attention_many(seq_len, budget, backward=backward)

    def op_many(self, op: str, x) -> np.ndarray:
        """Vectorised per-token op (``layer_fwd``, ``embed_bwd``, ...) for an array of token counts."""
        return self.tables.op_many(op, x)

    def dense(self, tokens: int, *, backward: bool = False, part: str | None = None) -> float:
        """Seconds of one layer's dense part on ``tokens`` tokens, its TP all-reduces included
        (``StageCost.dense``)."""
        return self.cost.dense(tokens, backward=backward, part=part)

    def embed(self, tokens: int, *, backward: bool = False, part: str | None = None) -> float:
        """Embedding lookup; its backward is all weight gradient (the input is token ids)."""
        return self.cost.embed(tokens, backward=backward, part=part)

    def head(self, tokens: int, *, backward: bool = False, part: str | None = None) -> float:
        """Final norm + LM head + loss."""
        return self.cost.per_token("head", tokens, backward=backward, part=part)

    def per_token_many(self, name: str, tokens, *, backward: bool = False, part: str | None = None) -> np.ndarray:
        """Vectorised :meth:`dense` (``name`` "layer"), :meth:`embed` or :meth:`head`."""
        return self.cost.per_token_many(name, tokens, backward=backward, part=part)

    # -- stages and micro-batches (StageCost) ---------------------------------------------------
    def stage_layers(self, stage: int, chunk: int = 0) -> range:
        """Global layer indices of model chunk ``chunk`` on pipeline stage ``stage``."""
        return self.layout.stage_layers(stage, chunk)

    def stage_time(self, lengths, budget, stage: int, *, backward: bool, chunk: int = 0,
                   part: str | None = None) -> float:
        """Seconds of one (virtual) stage's forward or backward for a micro-batch of ``lengths``
        (``StageCost.stage_time``); ``part`` "input" / "weight": that part of a split backward."""
        if self.per_sequence is None:
            self.layout.stage_layers(stage, chunk)  # checks stage and chunk
        return self.cost.stage_time(lengths, budget, chunk * self.cluster.pp + stage, backward=backward, part=part)

    def stage_times(self, microbatches, budgets, modes=("F", "B")) -> dict[str, np.ndarray]:
        """Seconds [V, M] per mode ("F", "B", and a split backward's "I", "W") of micro-batch i (a
        tuple of lengths) at ``budgets[i]`` on every virtual stage: :meth:`StageCost.times` when every
        budget is uniform, else :meth:`stage_time` per element (memoised: per-layer budgets recur)."""
        if self.per_sequence is not None:
            return self.cost.times(microbatches, budgets, modes)
        plained = [plain(b) for b in budgets]
        if all(type(b) is int for b in plained):
            return self.cost.times(microbatches, np.array(plained, dtype=np.int64), modes)
        return super().stage_times(microbatches, plained, modes)

    def microbatch_latency(self, lengths, budget) -> float:
        """Seconds of forward + backward of a micro-batch over the whole model (all stages and
        chunks, no P2P): what the policies balance (``StageCost.microbatch_latency``)."""
        return self.cost.microbatch_latency(lengths, budget)

    def microbatch_latencies(self, microbatches, budgets) -> np.ndarray:
        """Vectorised :meth:`microbatch_latency` (``StageCost.microbatch_latencies``)."""
        return self.cost.microbatch_latencies(microbatches, budgets)

    # -- context parallelism (cp/) --------------------------------------------------------------
    def cp_report(self, L: int, k: int, *, backward: bool = False, degree: int | None = None) -> RingReport | None:
        """One layer of a sequence on the CP group (``CPPricing.report``), or None."""
        return self.cp.report(L, k, backward=backward, degree=degree)

    def cp_joint(self, lengths, k: int, *, backward: bool = False) -> RingReport | None:
        """One layer of a packed micro-batch on one ring of the CP group (``CPPricing.joint``), or None."""
        return self.cp.joint(lengths, k, backward=backward)

    def attention_at_degree(self, seq_len: int, budget: int, degree: int, *, backward: bool = False) -> float:
        """One layer's attention of one sequence split over ``degree`` of the CP ranks: the main
        surface at degree cp (:meth:`attention`), the degree's own below it."""
        if degree == self.cluster.cp:
            return self.attention(seq_len, budget, backward=backward)
        return self.cp.attention_at_degree(seq_len, budget, degree, backward=backward)

    def cp_placement(self, lengths, budget) -> Placement | None:
        """:meth:`.cp.placement.PerSequenceCP.placement` under ``cp_split = "per-sequence"``, else None."""
        if self.per_sequence is None:
            return None
        return self.per_sequence.placement(lengths, int(uniform_budgets([budget])[0]))

    def cp_tokens(self, lengths, budget) -> int:
        """Tokens the busiest CP rank holds x cp (P2P and memory divide by cp): the micro-batch's
        tokens unless each sequence has its own CP degree."""
        if self.per_sequence is None:
            return split_pad(lengths)[1]
        return self.per_sequence.busiest_tokens(lengths, int(uniform_budgets([budget])[0]))

    # -- communication and optimizer (comm.py) ---------------------------------------------------
    def p2p_time(self, tokens: int) -> float:
        """Seconds to send one micro-batch's activations to the next stage."""
        return self.comm.p2p_time(tokens)

    def tp_allreduce_time(self, tokens):
        """Seconds of one TP ring all-reduce of a [tokens, hidden] activation (numpy-broadcastable)."""
        return self.comm.tp_allreduce_time(tokens)

    def stage_params(self, stage: int) -> int:
        """Parameters held by device ``stage`` before TP splitting (:meth:`Layout.device_params`)."""
        return self.layout.device_params(stage)

    def allreduce_time(self, stage: int) -> float:
        """Seconds of the DP gradient synchronisation of device ``stage``, nothing overlapping it."""
        return self.comm.allreduce_time(stage)

    def grad_sync_exposed(self, stage: int, window: float) -> float:
        """Seconds of it left after the device's last backward action (``window`` seconds long)."""
        return self.comm.grad_sync_exposed(stage, window)

    def param_gather_exposed(self, stage: int, window: float) -> float:
        """Seconds of ZeRO-1's overlapped parameter gather left after the device's first forward
        action (``window`` seconds long)."""
        return self.comm.param_gather_exposed(stage, window)

    def optimizer_time(self, stage: int) -> float:
        """Seconds of one optimizer step over device ``stage``'s parameters."""
        return self.comm.optimizer_time(stage)


def load_latency_model(profile: str | Profile, model: ModelConfig, cluster: ClusterConfig, *,
                       base_dir: str = ".", extrapolate: str = "warn",
                       allow_nonmonotone: bool = False) -> LatencyModel:
    """Load ``profile`` (shipped name, directory or CSV path, or a Profile) and build the latency model
    for ``model`` on ``cluster``; the profile is checked against the run first
    (:func:`.profilecheck.load_checked`: matching dims, re-derived analytical profiles, monotone
    latencies unless ``allow_nonmonotone`` or the sidecar's note)."""
    from sparsebalance.errors import check_choice

    check_choice(extrapolate, "extrapolate", EXTRAPOLATE)
    prof = load_checked(profile, model, cluster, base_dir=base_dir, allow_nonmonotone=allow_nonmonotone)
    return LatencyModel(prof, model, cluster, extrapolate=extrapolate)
