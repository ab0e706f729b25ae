"""A seeded multi-query associative-recall task for long-context accuracy (the ``accuracy`` verb).

One example of ``L`` tokens (byte-level ids, vocabulary 256)::

    context (L - 1 - 2P tokens)                                      | queries (1 + 2P tokens)
    F F P3 F F F F ... F P1 F F F ... F F P0 F F ... F P2 F F F ...  F | S K1 V1 K0 V0 K1 V1 K2 V2

``P`` key-value pairs (distinct keys, distinct values) sit in the context, one in each of ``P`` equal
segments, so with enough blocks they fall in different MoBA blocks and the early ones lie far back.
By default a pair is **one token** ``P_i`` = (key, value) fused (``pairs_as = "one"``); ``"two"``
writes ``K_i V_i``. After a separator ``S`` come ``P`` queries ``K V``: the model must produce the
value of each asked key. Keys are asked by ``P`` draws with replacement (``queries = "sample"``), so
no answer follows by elimination from the earlier ones. Loss and accuracy count the answers only.
``F`` is one constant filler token. A model that copies *some* value of the context scores ``1/P``:
the floor of "not learning", not zero.

Why fused pairs (measured on this CPU, tiny model): with two-token pairs recall needs a
previous-token head composed with a matching head; after 2,750 steps (10 min of CPU) held-out
accuracy sat at 0.50-0.55, which is what answering by *elimination* gives when every key is asked
once (1/4, 1/3, 1/2, 1: mean 0.52), and sampling the queries with replacement left it at the copy
floor for 300 steps. Fused pairs reach 0.94 at 64 tokens in 200 steps: the model then spends its
capacity on what this experiment is about, finding the pair's block far back through MoBA's gate.

Lengths follow a truncated Pareto law on ``[min_length, max_length]`` (density ~ L^-(1 + tail)):
many short examples, most tokens in the long tail, like the long-context SFT mixes of the paper.
Every example is a pure function of ``(seed, split, index)``: train and held-out never share a
generator, the data order is the caller's (the loop's seeded shuffle), and nothing is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsebalance.data.sequence import IGNORE_INDEX, Sequence
from sparsebalance.errors import check, check_choice, check_positive

FILLER, SEPARATOR = 0, 1
KEY0, VALUE0 = 2, 128
"""Token ids: keys are KEY0 .. KEY0 + n_keys - 1, values VALUE0 .. VALUE0 + n_values - 1."""
TRAIN, HELDOUT = 0, 1


@dataclass(kw_only=True, slots=True, frozen=True)
class RecallConfig:
    """The recall task: pairs, alphabet, length mix and seed."""

    pairs: int = 4
    """Key-value pairs per example (each asked once at the end)."""
    n_keys: int = 10
    """Size of the key alphabet (ids KEY0..): keys of one example are distinct."""
    n_values: int = 10
    """Size of the value alphabet (ids VALUE0..): values of one example are distinct."""
    min_length: int = 64
    """Shortest training example (tokens)."""
    max_length: int = 1024
    """Longest training example (tokens)."""
    tail: float = 0.5
    """Pareto exponent of the length mix: density ~ L^-(1 + tail) (0 = log-uniform)."""
    queries: str = "sample"
    """Which keys are asked: ``sample`` (P draws with replacement: no answer can be inferred by
    elimination) or ``each`` (every key once, in random order: the last answer follows from the
    first three, so a model that only eliminates already-given values scores 0.52)."""
    pairs_as: str = "one"
    """``two`` tokens per pair (key then value: recall needs a previous-token head composed with a
    matching head) or ``one`` fused token per (key, value) (ids after the keys; one attention layer
    can match and copy)."""
    seed: int = 0
    """Seed of every example (train and held-out streams are separate)."""

    def __post_init__(self) -> None:
        check_positive(self.pairs, "pairs")
        check(KEY0 + self.n_keys <= VALUE0, "n_keys", f"must be in 1..{VALUE0 - KEY0}, got {self.n_keys}")
        check(VALUE0 + self.n_values <= 256, "n_values",
              f"must be in 1..{256 - VALUE0}, got {self.n_values}")
        check(self.pairs <= min(self.n_keys, self.n_values), "pairs",
              f"must be <= n_keys and n_values ({min(self.n_keys, self.n_values)}), got {self.pairs}")
        check(self.min_length >= min_length(self.pairs), "min_length",
              f"must be >= {min_length(self.pairs)} (queries + pairs + filler), got {self.min_length}")
        check(self.max_length >= self.min_length, "max_length",
              f"must be >= min_length ({self.min_length}), got {self.max_length}")
        check(self.tail >= 0, "tail", f"must be >= 0, got {self.tail}")
        check_choice(self.queries, "queries", ("sample", "each"))
        check_choice(self.pairs_as, "pairs_as", ("two", "one"))
        if self.pairs_as == "one":
            check(KEY0 + self.n_keys + self.n_keys * self.n_values <= VALUE0, "n_values",
                  f"fused pairs need n_keys * (n_values + 1) <= {VALUE0 - KEY0}, got "
                  f"{self.n_keys} x ({self.n_values} + 1)")


def min_length(pairs: int) -> int:
    """Fewest tokens an example with ``pairs`` pairs needs: separator, queries and pairs (a context
    of pairs only, no filler)."""
    return 1 + 4 * pairs


@dataclass(frozen=True, slots=True)
class Example:
    """One example: ``tokens`` int64 [L]; the answer to query ``i`` is ``tokens[positions[i] + 1]``."""

    tokens: np.ndarray
    positions: np.ndarray
    """int64 [P]: positions of the queried keys (their next token is the answer)."""

    @property
    def answers(self) -> np.ndarray:
        return self.tokens[self.positions + 1]

    @property
    def labels(self) -> np.ndarray:
        """int64 [L]: each queried key's answer at its position, ``IGNORE_INDEX`` elsewhere (the
        training targets: loss and accuracy count the answers only)."""
        out = np.full(len(self.tokens), IGNORE_INDEX, dtype=np.int64)
        out[self.positions] = self.answers
        return out


class RecallTask:
    """Examples by index; see the module docstring."""

    def __init__(self, cfg: RecallConfig) -> None:
        self.cfg = cfg

    def _rng(self, split: int, index: int, length: int = 0) -> np.random.Generator:
        return np.random.default_rng([self.cfg.seed, split, length, index])

    def train_length(self, index: int) -> int:
        """Length of training example ``index`` (truncated Pareto, inverse transform)."""
        c = self.cfg
        u = self._rng(TRAIN, index).random()
        if c.tail == 0:
            x = c.min_length * (c.max_length / c.min_length) ** u
        else:
            lo, hi = c.min_length ** -c.tail, c.max_length ** -c.tail
            x = (lo - u * (lo - hi)) ** (-1.0 / c.tail)
        return int(min(c.max_length, max(c.min_length, round(x))))

    def example(self, split: int, index: int, length: int) -> Example:
        """Example ``index`` of ``split`` (TRAIN or HELDOUT) with ``length`` tokens."""
        c = self.cfg
        P = c.pairs
        check(length >= min_length(P), "length", f"must be >= {min_length(P)} for {P} pairs, got {length}")
        rng = self._rng(split, index, length)
        keys = KEY0 + rng.choice(c.n_keys, P, replace=False)
        values = VALUE0 + rng.choice(c.n_values, P, replace=False)
        tokens = np.full(length, FILLER, dtype=np.int64)
        ctx = length - 1 - 2 * P
        edges = np.linspace(0, ctx, P + 1).astype(np.int64)
        for i in range(P):  # pair i somewhere in segment i (both tokens inside it; >= 2 long)
            at = int(rng.integers(edges[i], edges[i + 1] - 1))
            if c.pairs_as == "two":
                tokens[at], tokens[at + 1] = keys[i], values[i]
            else:
                tokens[at] = KEY0 + c.n_keys + (keys[i] - KEY0) * c.n_values + (values[i] - VALUE0)
        order = rng.permutation(P) if c.queries == "each" else rng.integers(0, P, P)
        tokens[ctx] = SEPARATOR
        q = ctx + 1 + 2 * np.arange(P)
        tokens[q], tokens[q + 1] = keys[order], values[order]
        return Example(tokens=tokens, positions=q)

    def train_sequences(self, n: int) -> list[Sequence]:
        """``n`` training sequences (ids 0..n-1, lengths from the mix; tokens made on demand)."""
        return [Sequence(id=i, length=self.train_length(i)) for i in range(n)]

    def tokens(self, seq: Sequence) -> Example:
        """The training example behind ``seq`` (made from its id and length)."""
        return self.example(TRAIN, seq.id, seq.length)

    def heldout(self, length: int, n: int) -> list[Example]:
        """``n`` held-out examples of exactly ``length`` tokens (a bucket)."""
        return [self.example(HELDOUT, i, length) for i in range(n)]
