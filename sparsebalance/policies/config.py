"""Which batching and tuning policy a run uses, and their parameters."""

from __future__ import annotations

from dataclasses import dataclass

from sparsebalance.errors import check, check_choice, check_positive

ANCHORS = ("mean", "min", "max")
ANCHOR_SCOPES = ("global", "pipeline")
PACKERS = ("lpt", "lpt-swap")
COVERAGE_SHAPES = ("power", "geometric")
COVERAGE_AGGS = ("tokens", "min")
SLOT_BATCHING = ("lbb", "quadratic", "sab")
"""Batching policies that pack into fixed slots (two-stage LPT under the slot's token cap)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class PolicyConfig:
    """A batching policy x a tuning policy. Names come from ``sparsebalance.policies.registry``."""

    batching: str = "sequential"
    """Batching policy name (sequential, lbb, sorted, quadratic, sab, sab-order)."""
    tuning: str = "fixed"
    """Tuning policy name (fixed, dst, dst-cp)."""
    k0: int = 32
    """Default MoBA budget (top-k blocks, own block included)."""
    k_min: int = 1
    """Smallest budget DST may choose (1 = own block only)."""
    k_max: int = 64
    """Largest budget DST may choose."""
    anchor: str = "mean"
    """DST anchor: mean, min or max of predicted micro-batch latencies."""
    anchor_scope: str = "global"
    """DST anchor over all micro-batches of the iteration (global) or per DP pipeline (pipeline)."""
    p: float = 0.1
    """DST routing-coverage threshold: budgets never go below the smallest k with C(k) >= 1 - p."""
    per_layer: bool = False
    """DST chooses a budget per layer (else one per micro-batch)."""
    ema_decay: float = 0.9
    """SAB: weight of the past in the EMA of DST budgets per length bucket."""
    token_cap: int | None = None
    """Packing policies: max tokens per micro-batch (None = micro_batch_size sequences each)."""
    min_microbatches: int | None = None
    """Token-cap packing: at least this many micro-batches per rank (None = cluster.pp, so every
    pipeline stage has work in steady state; 2 x pp for dualpipev); never more than the rank's
    sequences."""
    packer: str = "lpt-swap"
    """SAB packer: lpt or lpt-swap (LPT then pairwise improvement swaps)."""
    swap_rounds: int = 100
    """lpt-swap: at most this many improving swaps/moves per packing (each lowers the makespan)."""
    bucket_base: float = 2.0
    """SAB: sequences share an EMA budget when floor(log_base(length)) is equal (2 = octaves)."""
    coverage_rate: float = 1.5
    """Coverage model: decay rate of gate-score mass with block rank for sensitivity 1.0."""
    coverage_shape: str = "power"
    """Coverage model: power (mass ~ rank^-rate) or geometric (mass ~ exp(-rate (rank - 1)))."""
    coverage_agg: str = "tokens"
    """Micro-batch coverage of packed sequences: tokens (token-weighted mean) or min."""
    slot_tokens: int | None = None
    """Fixed slots, for pipelines whose receive buffers have one shape (torch's pipelining, as in
    torchtitan): every micro-batch is exactly this many tokens, its documents followed by a pad
    document (dense work, no attention, no label), and each DP rank gets exactly
    ``min_microbatches`` (None: the schedule's fewest) of them, each with at least one document.
    Packing (lbb, quadratic, sab) is two-stage LPT under this cap; a global batch that does not fit
    is refused. Excludes ``token_cap`` (the slot is the cap) and ``memory_aware``."""
    memory_aware: bool = False
    """SAB / sab-order: cap micro-batch tokens so the plan fits ``cluster.device_memory`` under the
    memory model (sparsebalance.simulator.cost.memory), on top of ``token_cap``."""
    cp_rounds: int = 64
    """dst-cp: at most this many lowering rounds per iteration (each one batched evaluation)."""
    cp_raise_tol: float = 0.0
    """dst-cp: relative growth of the predicted iteration time the raising phase may spend on
    coverage (0 = only free bubbles; never beyond the fixed-budget time)."""

    def __post_init__(self) -> None:
        check_positive(self.k0, "k0")
        check_positive(self.k_min, "k_min")
        check(self.k_max >= self.k0, "k_max", f"must be >= k0 ({self.k0}), got {self.k_max}")
        check(self.k_min <= self.k0, "k_min", f"must be <= k0 ({self.k0}), got {self.k_min}")
        check_choice(self.anchor, "anchor", ANCHORS)
        check_choice(self.anchor_scope, "anchor_scope", ANCHOR_SCOPES)
        check(0.0 < self.p < 1.0, "p", f"must lie in (0, 1), got {self.p}")
        check(0.0 <= self.ema_decay < 1.0, "ema_decay", f"must lie in [0, 1), got {self.ema_decay}")
        if self.token_cap is not None:
            check_positive(self.token_cap, "token_cap")
        if self.min_microbatches is not None:
            check_positive(self.min_microbatches, "min_microbatches")
        check_choice(self.packer, "packer", PACKERS)
        check_positive(self.swap_rounds, "swap_rounds", allow_zero=True)
        check(self.bucket_base > 1.0, "bucket_base", f"must be > 1, got {self.bucket_base}")
        check_positive(self.coverage_rate, "coverage_rate")
        check_choice(self.coverage_shape, "coverage_shape", COVERAGE_SHAPES)
        check_choice(self.coverage_agg, "coverage_agg", COVERAGE_AGGS)
        check(isinstance(self.memory_aware, bool), "memory_aware",
              f"must be true or false, got {self.memory_aware!r}")
        if self.slot_tokens is not None:
            check_positive(self.slot_tokens, "slot_tokens")
            check(self.token_cap is None, "token_cap", "must be unset with slot_tokens (the slot is the cap)")
            check(not self.memory_aware, "memory_aware", "must be false with slot_tokens (the slot is fixed)")
            check(self.batching in SLOT_BATCHING, "batching",
                  f"fixed slots (slot_tokens) pack with one of {', '.join(SLOT_BATCHING)}, got {self.batching!r}")
            check(self.tuning in ("fixed", "dst"), "tuning",
                  f"fixed slots (slot_tokens) are tuned by fixed or dst, got {self.tuning!r}")
        check_positive(self.cp_rounds, "cp_rounds", allow_zero=True)
        check(0.0 <= self.cp_raise_tol < 1.0, "cp_raise_tol",
              f"must lie in [0, 1), got {self.cp_raise_tol}")
        check(self.k_max >= self.k_min, "k_max", f"must be >= k_min ({self.k_min}), got {self.k_max}")
