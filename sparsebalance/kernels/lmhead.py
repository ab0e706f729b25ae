"""The LM head and its loss without the whole logits: linear + cross-entropy chunked over the vocabulary.

Eager, the head computes ``logits = h W^T`` [T, V] in the model dtype, casts them to float32 and runs
cross entropy: at 8K tokens and Qwen2's 152K vocabulary that is 2.5 GB of bf16 logits, 5 GB of fp32
logits and as much again for their log-softmax, and the head runs at 2.5-3x its roofline on an H100
(``docs/gpu/h100-2026-11-27``). :func:`linear_cross_entropy` computes the same summed loss and the
same gradients holding one **vocabulary chunk** of logits at a time ([T, cols], ``cols`` from
:data:`CHUNK_ELEMENTS`):

* forward, per chunk: the chunk's logits (one GEMM, in the model dtype as eager), a running
  log-sum-exp per token in float32 (float64 for float64 input) and the target logit where the label
  falls in the chunk; saved: ``h``, ``W``, the labels and the log-sum-exp (T floats);
* backward, per chunk: the logits again (one GEMM), ``dlogits = (softmax - onehot) x dloss`` in the
  accumulation dtype, rounded to the model dtype as eager's gradient is; the chunk's rows of ``dW``
  in one GEMM written in place (``dW``'s rows split by chunk: no accumulation, one rounding as eager),
  ``dh`` accumulated over chunks in float32 (``[T, hidden]``: small).

Why over the vocabulary and not over tokens: chunking tokens would accumulate ``dW`` ([V, hidden],
311M values for Qwen2.5-3B) across chunks, in bf16 (a rounding per chunk) or through an fp32 copy (a
pass over 1.2 GB per chunk); chunking the vocabulary accumulates only ``dh``. Cost: one GEMM more
than eager (the backward recomputes the logits), no ``[T, V]`` float32 tensor ever. The elementwise
work of a chunk (:func:`lse_update`, :func:`chunk_grad`) is one compiled kernel each with
``layer_impl = "compiled"``, plain PyTorch otherwise (the float64 tests).
"""

from __future__ import annotations

import functools
from typing import Any

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 28
"""Logits held at once (bf16: 512 MiB): the vocabulary chunk is ``CHUNK_ELEMENTS // tokens`` columns,
a multiple of 128 (at least 128), or the whole vocabulary when that is smaller."""


def vocab_chunk(tokens: int, vocab: int, max_elements: int = CHUNK_ELEMENTS) -> int:
    """Columns of one vocabulary chunk for ``tokens`` rows (see :data:`CHUNK_ELEMENTS`)."""
    cols = max(max_elements // max(tokens, 1), 1)
    if cols >= vocab:
        return vocab
    return cols - cols % 128 if cols >= 128 else cols


def _acc(dtype: Any) -> Any:
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def lse_update(logits: Any, lab: Any, m: Any, s: Any, tgt: Any) -> tuple[Any, Any, Any]:
    """One chunk of the online log-sum-exp: ``logits`` [T, c], ``lab`` [T] the labels relative to the
    chunk's first column, running max ``m``, sum ``s`` (of exp(logit - m)) and target logit ``tgt``."""
    import torch

    z = logits.to(_acc(logits.dtype))
    m_new = torch.maximum(m, z.amax(1))
    s = s * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(1)
    hit = (lab >= 0) & (lab < z.shape[1])
    picked = z.gather(1, lab.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1)
    return m_new, s, tgt + torch.where(hit, picked, torch.zeros_like(picked))


def chunk_grad(logits: Any, lab: Any, lse: Any, scale: Any) -> Any:
    """``(softmax - onehot) x scale`` of one chunk, in ``logits``' dtype; ``scale`` [T] is the loss
    gradient on labelled rows, 0 on ignored ones."""
    import torch

    z = logits.to(_acc(logits.dtype))
    cols = torch.arange(z.shape[1], device=z.device)
    onehot = (cols[None, :] == lab[:, None]).to(z.dtype)
    return ((torch.exp(z - lse[:, None]) - onehot) * scale[:, None]).to(logits.dtype)


def _ops(compile_: bool) -> tuple[Any, Any]:
    if not compile_:
        return lse_update, chunk_grad
    from sparsebalance.kernels.fastlayer import compiled

    return compiled(lse_update), compiled(chunk_grad)


def _call(op: Any, compile_: bool, *args: Any) -> Any:
    """``op(*args)``; compiled, every dimension of every argument marked dynamic first (chunks differ
    in tokens and in columns: one graph serves them all)."""
    if compile_:
        from sparsebalance.kernels.fastlayer import mark_tokens_dynamic

        for t in args:
            for d in range(t.dim()):
                mark_tokens_dynamic(t, dim=d)
    return op(*args)


@functools.cache
def _function() -> Any:
    import torch

    class LinearCrossEntropy(torch.autograd.Function):
        """Summed cross entropy of ``h W^T`` over labelled tokens, by vocabulary chunk (module docstring)."""

        @staticmethod
        def forward(ctx: Any, h: Any, w: Any, labels: Any, cols: int, compile_: bool) -> Any:
            lse_op, _ = _ops(compile_)
            acc = _acc(h.dtype)
            T = h.shape[0]
            m = torch.full((T,), float("-inf"), dtype=acc, device=h.device)
            s, tgt = torch.zeros(T, dtype=acc, device=h.device), torch.zeros(T, dtype=acc, device=h.device)
            for lo in range(0, w.shape[0], cols):
                logits = h @ w[lo:lo + cols].t()
                m, s, tgt = _call(lse_op, compile_, logits, labels - lo, m, s, tgt)
            lse = m + torch.log(s)
            ctx.save_for_backward(h, w, labels, lse)
            ctx.cols, ctx.compile_ = cols, compile_
            return torch.where(labels != IGNORE_INDEX, lse - tgt, torch.zeros_like(lse)).sum()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            h, w, labels, lse = ctx.saved_tensors
            _, grad_op = _ops(ctx.compile_)
            need_h, need_w = ctx.needs_input_grad[:2]
            scale = (labels != IGNORE_INDEX).to(lse.dtype) * grad
            dh = torch.zeros(h.shape, dtype=_acc(h.dtype), device=h.device) if need_h else None
            dw = torch.empty_like(w) if need_w else None
            for lo in range(0, w.shape[0], ctx.cols):
                wc = w[lo:lo + ctx.cols]
                logits = h @ wc.t()
                g = _call(grad_op, ctx.compile_, logits, labels - lo, lse, scale)
                if need_w:
                    torch.mm(g.t(), h, out=dw[lo:lo + ctx.cols])
                if need_h:
                    if dh.dtype == g.dtype:
                        dh.addmm_(g, wc)
                    else:  # bf16/fp16: the chunk's product rounded once, summed in float32
                        dh.add_(g @ wc)
            return (None if dh is None else dh.to(h.dtype)), dw, None, None, None

    return LinearCrossEntropy


def linear_cross_entropy(h: Any, weight: Any, labels: Any, *, compile_: bool = False,
                         max_elements: int = CHUNK_ELEMENTS) -> Any:
    """Summed next-token cross entropy of ``h @ weight.T`` over tokens whose label is not
    ``IGNORE_INDEX``: ``h`` [T, hidden], ``weight`` [V, hidden], ``labels`` int64 [T]; a 0-dim tensor
    in float32 (float64 for float64 input), as ``qwen2.lm_loss_sum`` of the whole logits gives."""
    cols = vocab_chunk(int(h.shape[0]), int(weight.shape[0]), max_elements)
    return _function().apply(h, weight, labels, cols, compile_)
