"""Model FLOPs of a batch, Megatron's convention: what "achieved model FLOP/s per GPU" counts.

Per sequence of ``L`` tokens, forward = ``2 x L x (layers x params_per_layer + hidden x vocab)``
(every weight a multiply-add per token, the LM head included) ``+ layers x 4 x L^2 x heads x
head_dim`` (Q K^T and the product with V over the full L x L square: the causal half and the sparse
budget are not discounted), and the backward twice the forward. The recomputed forward is not
counted (model FLOPs, not hardware FLOPs). For a GPT-3 model this is Korthikanti et al. 2022
(arXiv 2205.05198) Eq. 7, ``72 B L s h^2 (1 + s / (6 h) + V / (12 h L))``, up to the norms' and
biases' few parameters that ``params_per_layer`` also counts (relative 1e-4 at h = 12,288).
"""

from __future__ import annotations

from collections.abc import Iterable

from sparsebalance.simulator.config import ModelConfig


def model_flops(model: ModelConfig, lengths: Iterable[int]) -> float:
    """Model FLOPs of forward + backward over sequences of ``lengths`` tokens (module docstring)."""
    weights = model.layers * model.params_per_layer + model.hidden * model.vocab
    attention = model.layers * 4 * model.heads * model.head_dim
    total = 0.0
    for L in lengths:
        total += 2.0 * L * weights + float(attention) * L * L
    return 3.0 * total
