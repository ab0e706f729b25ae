"""The backward split into input gradient (I) and weight gradient (W), as torch.distributed.pipelining
runs it for its zero-bubble schedules; used by the profiler (``layer_bwd_input``/``_weight``) and by
realrun's ZB-H1, so the profile times the very code the real run executes.

How (torch 2.13's ``torch.distributed.pipelining._backward``, called, not copied): I runs
``torch.autograd.grad`` from the outputs to the inputs with the graph kept, and on the way records the
gradient that reaches every autograd node where a weight's branch joins the input path (e.g. the
matmul of a linear layer); W later runs ``torch.autograd.grad`` from those recorded nodes to the
weights only. Nothing is computed twice: I + W does the work of one whole backward. The inputs must
be leaves that require grad: a first stage detaches the embedding's output into such a leaf, runs its
layers from it, and does the embedding's backward in W (``emb_out.backward(leaf.grad)``), so the
embedding's backward is all weight gradient, as the latency model assumes. Private torch API: torch
is pinned to 2.13 (Makefile), and ``tests/kernels/test_split_backward.py`` checks the split against
a whole backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def backward_input(outputs: Sequence[Any], grads: Sequence[Any] | None, inputs: Sequence[Any],
                   params: Sequence[Any]) -> tuple[tuple[Any, ...], Any]:
    """I: gradients of ``inputs`` (also accumulated into their ``.grad``) and the state W needs.
    ``grads`` None: ``outputs`` are losses (seeded with ones)."""
    from torch.distributed.pipelining._backward import stage_backward_input

    return stage_backward_input(list(outputs), None if grads is None else list(grads), list(inputs),
                                iter(params))


def backward_weight(params: Sequence[Any], state: Any) -> None:
    """W: accumulate the weights' gradients into ``.grad`` from I's recorded state."""
    from torch.distributed.pipelining._backward import stage_backward_weight

    stage_backward_weight(iter(params), state)
