"""A micro-batch's MoBA budget: the one value that travels from a tuning policy to the kernel.

A budget says how many key blocks each query block attends (its own block included), either the
same number in every layer (``Budget.uniform(k)``) or one number per global layer
(``Budget.per_layer(ks)``). Policies return it, the latency model prices it, the executor and the
real run's message carry it, ``kernels.qwen2.MobaArgs`` hands one layer's int to the kernel (which
calls it top-k and turns it into a tensor). It is validated here, when built, and nowhere else:
every int is >= 1, and a per-layer budget is checked against the model's depth where a model is
known (:meth:`Budget.check_layers`).

The two forms stay distinct even when a per-layer budget holds one value throughout: the latency
model prices a uniform budget as one array look-up and a per-layer one layer by layer, and those two
sums need not round alike, so collapsing them would change simulated figures in the last bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from numbers import Integral

import numpy as np

from sparsebalance.errors import ConfigError


def _as_k(x, where: str) -> int:
    if isinstance(x, bool) or not isinstance(x, Integral):
        raise ConfigError(f"{where}: expected an int >= 1 (key blocks attended), got {x!r}")
    k = int(x)
    if k < 1:
        raise ConfigError(f"{where}: must be >= 1 (key blocks attended, own block included), got {k}")
    return k


@dataclass(frozen=True, slots=True)
class Budget:
    """MoBA budget of one micro-batch (hashable; equal when the form and the values are equal)."""

    value: int | tuple[int, ...]
    """Key blocks attended per query block: an int for every layer, or a tuple with one int per
    global layer (layer 0 first). Build it with :meth:`uniform` or :meth:`per_layer`."""

    def __post_init__(self) -> None:
        v = self.value
        if isinstance(v, tuple):
            if not v:
                raise ConfigError("budget: a per-layer budget needs at least one layer")
            if not all(type(x) is int and x >= 1 for x in v):  # the fast path: plain ints
                object.__setattr__(self, "value", tuple(_as_k(x, f"budget layer {i}") for i, x in enumerate(v)))
        elif type(v) is not int or v < 1:
            object.__setattr__(self, "value", _as_k(v, "budget"))

    @classmethod
    def uniform(cls, k: int) -> Budget:
        """The same ``k`` in every layer."""
        return cls(k)

    @classmethod
    def per_layer(cls, ks: Iterable[int]) -> Budget:
        """One int per global layer, in layer order."""
        return cls(tuple(ks))

    @property
    def is_uniform(self) -> bool:
        return not isinstance(self.value, tuple)

    @property
    def layers(self) -> int | None:
        """Layers a per-layer budget covers (None: uniform, any depth)."""
        return None if not isinstance(self.value, tuple) else len(self.value)

    @property
    def ks(self) -> tuple[int, ...]:
        """The per-layer ints, or ``(k,)`` for a uniform budget (every layer alike)."""
        return self.value if isinstance(self.value, tuple) else (self.value,)

    def expand(self, layers: int) -> tuple[int, ...]:
        """One int per layer of a ``layers``-layer model."""
        v = self.check_layers(layers).value
        return v if isinstance(v, tuple) else (v,) * layers

    def at(self, layer: int) -> int:
        """Key blocks attended at global layer ``layer``."""
        v = self.value
        if not isinstance(v, tuple):
            return v
        if not 0 <= layer < len(v):
            raise ConfigError(f"budget: layer {layer} is outside this per-layer budget's {len(v)} layers")
        return v[layer]

    def mean(self) -> float:
        """Mean over layers (what tables and traces report)."""
        return float(np.mean(self.value)) if isinstance(self.value, tuple) else float(self.value)

    def check_layers(self, layers: int) -> Budget:
        """``self``, after checking that a per-layer budget has one int per layer of a ``layers``-layer model."""
        n = self.layers
        if n is not None and n != layers:
            raise ConfigError(f"budget: a per-layer budget needs one int per layer ({layers}), got {n}")
        return self

    def restrict(self, layers: range) -> Budget:
        """The budget of ``layers`` run as layers 0..len(layers)-1 (one stage's layers built on
        their own): a per-layer budget re-indexed, a uniform one unchanged."""
        v = self.value
        return self if not isinstance(v, tuple) else Budget(tuple(v[i] for i in layers))

    def to_json(self) -> int | list[int]:
        """An int or a list of ints (the form in ``plans.json`` and the real run's message)."""
        return list(self.value) if isinstance(self.value, tuple) else self.value

    @classmethod
    def from_json(cls, obj, where: str = "budget") -> Budget:
        """Inverse of :meth:`to_json`; an error names ``where`` and what was found."""
        if isinstance(obj, list):
            return cls(tuple(_as_k(x, f"{where}[{i}]") for i, x in enumerate(obj)))
        return cls(_as_k(obj, where))

    @classmethod
    def of(cls, x: Budget | int | Iterable[int], where: str = "budget") -> Budget:
        """``x`` as a budget: a Budget as it is, an int uniform, a sequence of ints per layer (for
        callers building budgets by hand: tests, notebooks, the Python API)."""
        if isinstance(x, Budget):
            return x
        if isinstance(x, Integral) and not isinstance(x, bool):
            return cls(_as_k(x, where))
        if isinstance(x, (tuple, list, np.ndarray)):
            return cls(tuple(_as_k(v, f"{where}[{i}]") for i, v in enumerate(x)))
        raise ConfigError(f"{where}: expected a Budget, an int or a list of per-layer ints, got {x!r}")
