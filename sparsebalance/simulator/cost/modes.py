"""The passes of a stage and the budgets a cost look-up takes: the small vocabulary every cost
module shares (``StageCost``, its totals, the per-sequence CP split, the query's scalar bases)."""

from __future__ import annotations

from numbers import Integral
from typing import cast

import numpy as np

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.budget import Budget

#: mode -> (backward, part of a split backward): F, B, and the split backward's I and W
MODES = {"F": (False, None), "B": (True, None), "I": (True, "input"), "W": (True, "weight")}


def plain(budget: Budget | int) -> int | Budget:
    """A uniform budget as its int (the key every cache and array path uses); a per-layer
    :class:`Budget` as it is. Anything else is refused here, at the model's door."""
    if type(budget) is int:
        return budget
    if isinstance(budget, Budget):
        return cast(int, budget.value) if budget.is_uniform else budget
    if isinstance(budget, Integral) and not isinstance(budget, bool):
        return int(budget)
    raise ConfigError(f"budget: expected an int or a Budget (Budget.per_layer for one int per layer), "
                      f"got {budget!r}")


def uniform_budgets(budgets) -> np.ndarray:
    """The ints of uniform budgets; a per-layer budget is refused (``cp_split = "per-sequence"``
    places each micro-batch at one budget)."""
    out = []
    for b in budgets:
        if isinstance(b, Budget):
            if not b.is_uniform:
                raise ConfigError("cluster.cp_split: 'per-sequence' places each micro-batch at one budget; "
                                  "per-layer budgets (policy.per_layer) are not supported with it")
            b = b.value
        out.append(int(b))
    return np.array(out, dtype=np.int64)
