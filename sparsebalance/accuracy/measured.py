"""The measured accuracy experiment: its settings and its arms (``sparsebalance accuracy``).

Every arm (a batching x tuning policy) continues the same long-context checkpoint on the same global
batches of the recall task, in **one** torchrun launch per seed of the real run's PP 2 executor on
gloo (``pipeline.py``), so each arm's iteration times and its accuracy come from the same runs.
The arms' iterations are interleaved (iteration ``i`` of every arm, in a seeded order, before
iteration ``i + 1``), so a drift of the shared machine's speed over minutes falls on every arm alike
and the measured speedups are paired within seconds.

Arms (names as in the tables):

* ``fixed``: LBB + MoBA at ``k0`` everywhere: the paper's baseline and the speedup reference;
* ``SAB-fixed``: SAB + ``k0`` (the paper's +SAB row);
* ``fixed-dense``: LBB + ``k0``, or full attention where the latency table predicts it no slower
  (``policies.tuning.FixedDense``): a baseline that takes the kernel's dense shortcut, which plain
  ``fixed`` leaves (on this CPU, at 1-2K tokens and k0 = 32, the sparse path costs more than dense);
  the second speed reference;
* ``MEAN0.1`` ... ``MIN0.3``: SAB + DST (anchor, p); ``LBB-MEAN0.1`` ...: the same without SAB;
* ``MAX`` / ``LBB-MAX``: DST with the MAX anchor, run once: MAX only raises budgets (the anchor is
  the slowest micro-batch, so every k* >= k0), and p bounds lowering only, so MAX's budgets are the
  same for every p (``tests/policies``) and MAX0.1 = MAX0.2 = MAX0.3;
* ``FREE``: LBB + ``dst-cp`` with no lowering round (``cp_rounds = 0``) and ``cp_raise_tol = 0``:
  budgets only rise, and only where the schedule's predicted iteration time does not grow (the
  pipeline's bubbles): the paper's "free accuracy".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sparsebalance.errors import check, check_choice, check_positive
from sparsebalance.policies.config import ANCHORS, COVERAGE_AGGS

BATCHINGS = ("sab", "lbb")
BASES = ("fixed", "SAB-fixed", "fixed-dense", "FREE")
POOL_OFFSET = 10_000_000
"""Training ids of the continuation start here (pretraining used 0..): disjoint streams."""
POOL_STRIDE = 1_000_000
"""Each seed draws its pool of ids from its own range."""


@dataclass(kw_only=True, slots=True, frozen=True)
class MeasuredConfig:
    """The measured experiment's knobs (``accuracy`` flags; ``--config`` TOML)."""

    iterations: int = 8
    """Iterations (global batches) per arm; iteration 0 pays one-off costs and is left out of the
    speeds (it still trains)."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """Seeds: each draws its own pool of training examples and data order (one launch each)."""
    anchors: tuple[str, ...] = ANCHORS
    """DST anchors in the grid."""
    ps: tuple[float, ...] = (0.1, 0.2, 0.3)
    """DST coverage thresholds in the grid (MAX is run once: p does not bind it)."""
    batchings: tuple[str, ...] = BATCHINGS
    """Batching of the DST arms: sab (SAB + DST) and lbb (DST without SAB)."""
    base: tuple[str, ...] = BASES
    """Arms run besides DST: fixed (always: the reference), SAB-fixed, fixed-dense, FREE."""
    k0: int = 32
    """Default MoBA budget (blocks of 32 tokens): MoBA's default top-k 32, and at 1K-8K tokens the
    paper's block counts (32-256 blocks of 256 tokens at 8K-64K), so budgets and coverage curves carry
    over."""
    k_max: int = 64
    """Largest budget DST may raise to."""
    lr: float = 5e-4
    """AdamW learning rate of the continuation (after a linear warm-up of ``warmup`` iterations)."""
    warmup: int = 2
    """Iterations of linear learning-rate warm-up (a fresh AdamW moves every weight by ~lr at once)."""
    pool: int = 32
    """Training examples per seed; epochs reshuffle them, so from the second epoch on DST's floors
    use the gate coverage measured when a sequence last came round (before, the fitted rate)."""
    buckets: tuple[int, ...] = (1024, 4096, 8192)
    """Held-out lengths (tokens); accuracy is reported per bucket."""
    heldout: int = 8
    """Held-out examples per bucket (4 answers each)."""
    global_batch: int = 8
    """Examples per iteration: one micro-batch each on one pipeline (the paper's 16 over DP 4 x PP 4
    is 4 per pipeline)."""
    token_cap: int | None = None
    """Packing cap of a micro-batch (tokens); None = one example per micro-batch (the paper's
    micro-batch size 1)."""
    profile: str = "cpu-tiny-long"
    """Latency profile of this model on this CPU: SAB's and DST's predictions and the simulated
    speedups."""
    coverage_agg: str = "tokens"
    """Micro-batch coverage of packed sequences (tokens or min), docs/coverage.md."""
    timeout_s: float = 300.0
    """Seconds a collective may wait before a rank gives up (held-out evaluation included)."""

    def __post_init__(self) -> None:
        for f in ("iterations", "k0", "k_max", "pool", "global_batch", "heldout"):
            check_positive(getattr(self, f), f)
        check_positive(self.warmup, "warmup", allow_zero=True)
        check(self.iterations >= 2, "iterations",
              f"must be >= 2 (iteration 0 is left out of the speeds), got {self.iterations}")
        check(self.k_max >= self.k0, "k_max", f"must be >= k0 ({self.k0}), got {self.k_max}")
        check(math.isfinite(self.lr) and self.lr > 0, "lr", f"must be a finite number > 0, got {self.lr!r}")
        check(len(self.seeds) > 0, "seeds", "give at least one seed")
        check(len(set(self.seeds)) == len(self.seeds), "seeds", f"must be distinct, got {list(self.seeds)}")
        for s in self.seeds:
            check(0 <= s < 1000, "seeds", f"must lie in [0, 1000), got {s}")
        for a in self.anchors:
            check_choice(a, "anchors", ANCHORS)
        for p in self.ps:
            check(0.0 < p < 1.0, "p", f"must lie in (0, 1), got {p}")
        for b in self.batchings:
            check_choice(b, "batchings", BATCHINGS)
        for b in self.base:
            check_choice(b, "base", BASES)
        check(len(self.buckets) > 0, "buckets", "give at least one bucket")
        check(self.pool >= self.global_batch, "pool",
              f"must be >= global_batch ({self.global_batch}), got {self.pool}")
        if self.token_cap is not None:
            check_positive(self.token_cap, "token_cap")
        check_choice(self.coverage_agg, "coverage_agg", COVERAGE_AGGS)
        check(1.0 <= self.timeout_s <= 86400.0, "timeout_s", f"must lie in [1, 86400], got {self.timeout_s}")


@dataclass(kw_only=True, slots=True, frozen=True)
class Arm:
    """One configuration of the grid: a batching x tuning policy."""

    name: str
    batching: str
    tuning: str
    anchor: str | None = None
    p: float | None = None

    def policy_fields(self, cfg: MeasuredConfig, coverage_rate: float) -> dict:
        """The ``PolicyConfig`` fields of this arm."""
        kw = {"batching": self.batching, "tuning": self.tuning, "k0": cfg.k0, "k_max": cfg.k_max,
              "anchor": self.anchor or "mean", "p": self.p or 0.1, "token_cap": cfg.token_cap,
              "coverage_rate": coverage_rate, "coverage_agg": cfg.coverage_agg}
        if self.tuning == "dst-cp":  # FREE: no lowering round, raises only into free bubbles
            kw |= {"cp_rounds": 0, "cp_raise_tol": 0.0}
        return kw


def arms(cfg: MeasuredConfig) -> list[Arm]:
    """Every arm of one seed, the reference ``fixed`` first."""
    out = [Arm(name="fixed", batching="lbb", tuning="fixed")]
    if "SAB-fixed" in cfg.base:
        out.append(Arm(name="SAB-fixed", batching="sab", tuning="fixed"))
    if "fixed-dense" in cfg.base:
        out.append(Arm(name="fixed-dense", batching="lbb", tuning="fixed-dense"))
    for b in cfg.batchings:
        prefix = "" if b == "sab" else "LBB-"
        for a in cfg.anchors:
            if a == "max":  # p never binds MAX: one arm stands for every p
                out.append(Arm(name=f"{prefix}MAX", batching=b, tuning="dst", anchor=a, p=cfg.ps[0]))
                continue
            out += [Arm(name=f"{prefix}{a.upper()}{p}", batching=b, tuning="dst", anchor=a, p=p) for p in cfg.ps]
    if "FREE" in cfg.base:
        out.append(Arm(name="FREE", batching="lbb", tuning="dst-cp"))
    return out


def quick(cfg: MeasuredConfig) -> MeasuredConfig:
    """``--quick``: fixed and SAB + DST MEAN0.1, one seed, a few iterations, a small held-out set."""
    return replace(cfg, iterations=min(cfg.iterations, 4), seeds=cfg.seeds[:1], anchors=("mean",), ps=(0.1,),
                   batchings=("sab",), base=(), heldout=min(cfg.heldout, 4), pool=min(cfg.pool, 64))
