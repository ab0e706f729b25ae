"""Which batching and tuning policy a run uses, and their parameters."""

from __future__ import annotations

from dataclasses import dataclass

from sparsebalance.errors import check, check_choice, check_positive

ANCHORS = ("mean", "min", "max")
ANCHOR_SCOPES = ("global", "pipeline")


@dataclass(kw_only=True, slots=True, frozen=True)
class PolicyConfig:
    """A batching policy x a tuning policy. Names come from ``sparsebalance.policies.registry``."""

    batching: str = "sequential"
    """Batching policy name (sequential, lbb, sorted, quadratic, sab)."""
    tuning: str = "fixed"
    """Tuning policy name (fixed, dst)."""
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
    packer: str = "lpt-swap"
    """SAB packer: lpt or lpt-swap (LPT then pairwise improvement swaps)."""

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
        check_choice(self.packer, "packer", ("lpt", "lpt-swap"))
