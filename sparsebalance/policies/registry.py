"""Policy names -> classes. Command lines and configs name policies; an unknown name lists the known.

Batching: ``sequential``, ``lbb``, ``sorted``, ``quadratic``, ``sab``,
``sab-order`` (SAB + schedule-aware micro-batch order, :mod:`.ordering`). Tuning: ``fixed``, ``fixed-dense``
(:class:`.tuning.FixedDense`), ``dst``, ``dst-cp`` (critical-path DST, :mod:`.critical`).
Every class takes nothing (batching without parameters) or the :class:`PolicyConfig`.
"""

from __future__ import annotations

from sparsebalance.errors import check_choice
from sparsebalance.policies.batching import LengthBased, Quadratic, Sequential, Sorted
from sparsebalance.policies.config import PolicyConfig
from sparsebalance.policies.critical import CriticalPathDST
from sparsebalance.policies.ordering import ScheduleAwareOrder
from sparsebalance.policies.sab import SparsityAware
from sparsebalance.policies.tuning import DynamicSparsity, Fixed, FixedDense

BATCHING: dict[str, type] = {
    "sequential": Sequential,
    "lbb": LengthBased,
    "sorted": Sorted,
    "quadratic": Quadratic,
    "sab": SparsityAware,
    "sab-order": ScheduleAwareOrder,
}
TUNING: dict[str, type] = {"fixed": Fixed, "fixed-dense": FixedDense, "dst": DynamicSparsity,
                           "dst-cp": CriticalPathDST}

_NEEDS_CONFIG = {SparsityAware, ScheduleAwareOrder, Fixed, FixedDense, DynamicSparsity, CriticalPathDST}


def _make(table: dict[str, type], name: str, field: str, cfg: PolicyConfig):
    check_choice(name, field, table)
    cls = table[name]
    return cls(cfg) if cls in _NEEDS_CONFIG else cls()


def make_batching(cfg: PolicyConfig):
    """A fresh batching policy (its state, e.g. SAB's EMA, starts empty)."""
    return _make(BATCHING, cfg.batching, "policy.batching", cfg)


def make_tuning(cfg: PolicyConfig):
    """A fresh tuning policy."""
    return _make(TUNING, cfg.tuning, "policy.tuning", cfg)
