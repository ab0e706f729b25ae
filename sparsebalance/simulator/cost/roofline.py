"""ANALYTICAL profiles (no measurement): H100 SXM, H200 SXM, H20, A100; our MoBA kernel + dense layers.

Attention ops price what ``kernels/moba/triton_impl.py`` executes (``simulator/cost/kernelcost.py``):
executed tile pairs, the fused gate's scoring loop and the sync-free index of a sparse sequence, the
LSE-merge traffic of partial outputs, the backward's seven matmuls a pair, and every launch. Each
tensor-core kernel's time is ``max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x memory
efficiency))`` at this kernel's measured efficiencies. Dense layer parts: the GEMMs at ``max(FLOPs / (peak x
gemm_efficiency), bytes / (bandwidth x memory_efficiency))`` (with a measured ``gemm_curve``: each
projection at the share of its call's size), then the elementwise kernels (norms, residual adds, the
MLP's activation) at the streaming bandwidth, + launches (+ the TP collectives of a Megatron layer,
at the bus bandwidth of their message size with a ``tp_busbw_curve``; the backward's hidden under
its GEMMs with ``tp_overlap``: :func:`tp_backward_comm`).

Every constant states its source in hardware.py and docs/costmodel.md (data sheets, published figures,
measurements with their commands); ``launch_overhead`` only partly (a measured floor, docs/costmodel.md
section 7). The sidecar says ``analytical: true``.

FLOP counts (per GPU, one TP rank, heads split over ``tp``; kv heads replicated when fewer than tp):

* MoBA forward: 4 x head_dim per executed (query, key) pair (QK^T and PV); backward: 8 x head_dim
  per pair of the dK/dV kernel (S, dP, dV, dK) and 6 x head_dim per pair of the dQ kernels (S, dP,
  dQ); the gate is priced by its loop's instructions, not by FLOPs (``kernelcost.gate_counts``).
* Dense part of a layer: 2 x tokens x params_per_layer / tp forward, twice that backward.
* LM head: 2 x tokens x hidden x vocab / tp forward, twice that backward; plus fp32 logits traffic.
* Split backward (``layer_bwd_input`` / ``layer_bwd_weight``, ``head_bwd_input`` /
  ``head_bwd_weight``; see :func:`dense_split_time`): each part is one of the backward's two GEMM
  passes (dX = dY W^T and dW = X^T dY have the forward's FLOPs each), so each part is priced as the
  forward's FLOPs and bytes with half the backward's launches; the TP all-reduces of a Megatron
  layer's backward carry input gradients and go to the input part. I + W = B exactly.

An analytical profile is computed for one model's dims, TP degree and block size;
``sparsebalance.simulator.cost.latency`` re-derives it for another model from the hardware parameters in
the sidecar's ``roofline`` entry instead of rescaling numbers.

Regenerate the shipped profiles with ``python -m sparsebalance.simulator.cost.roofline --out
sparsebalance/data/profiles``.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pandas as pd

from sparsebalance.data.sequence import blocks
from sparsebalance.simulator.config import ModelConfig, qwen25_3b
from sparsebalance.simulator.cost import kernelcost as kc
from sparsebalance.simulator.cost.hardware import (  # noqa: F401  (re-exported: the presets' old home)
    A100_40GB,
    A100_80GB,
    H20,
    H100,
    H200,
    HARDWARE,
    Hardware,
)
from sparsebalance.simulator.cost.profile import Profile, monotone_violations
from sparsebalance.simulator.cost.profilemeta import FORMAT_VERSION, MODEL_DIMS, ProfileMeta
from sparsebalance.simulator.cost.tpoverlap import te_layer_comm

COMMAND = "python -m sparsebalance.simulator.cost.roofline --out sparsebalance/data/profiles"

#: Kernel launches per dense op (norms, GEMMs, activations, ...; embedding; final norm, head, loss).
KERNELS = {"layer_fwd": 10, "layer_bwd": 20, "embed_fwd": 1, "embed_bwd": 2, "head_fwd": 4, "head_bwd": 6}


def default_seq_lens(lo: int = 16, hi: int = 524288) -> np.ndarray:
    """Powers of two and the 1.5x points between them, from ``lo`` to ``hi`` tokens."""
    pts = set()
    p = 1
    while p <= hi:
        for x in (p, 3 * p // 2):
            if lo <= x <= hi:
                pts.add(x)
        p *= 2
    return np.array(sorted(pts), dtype=np.int64)


DEFAULT_BUDGETS = np.array(list(range(1, 17)) + [20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128]
                           + [192, 256, 384, 512, 768, 1024, 1536, 2048], dtype=np.int64)
"""Budgets of an analytical profile: dense below 16, then every length's block count up to 512K tokens
at block 256 (the grid's 2^i and 1.5 x 2^i lengths have 2^j and 1.5 x 2^j blocks), so a dense budget
(k >= blocks) of a grid length is a grid point."""


def moba_pairs(seq_len, block_size: int, budget):
    """Exact (query, key) pairs MoBA attends for one sequence (numpy-broadcastable ints).

    Blocks c = 0..n-1 of sizes s_c (all ``block_size`` but the last, n = ceil(L / B)); a query in
    block c sees its own block causally and min(k-1, c) earlier blocks in full, so
    pairs = sum_c s_c (s_c + 1) / 2 + B s_c min(k-1, c), in closed form below. At k >= n this is the
    dense causal count L (L + 1) / 2.
    """
    L = np.asarray(seq_len, dtype=np.int64)
    k = np.asarray(budget, dtype=np.int64)
    B = int(block_size)
    n = blocks(L, B)
    r = L - (n - 1) * B  # tokens in the last block
    m = n - 1  # full blocks before the last one
    a = k - 1
    t = np.minimum(a, np.maximum(m - 1, 0))
    full = m * (B * (B + 1) // 2) + B * B * (t * (t + 1) // 2 + t * (m - 1 - t))
    last = r * (r + 1) // 2 + B * r * np.minimum(a, m)
    return full + last


def _roof(flops, bytes_, eff: float, hw: Hardware, kernels: int):
    return (np.maximum(flops / (hw.peak_flops * eff), bytes_ / (hw.memory_bandwidth * hw.memory_efficiency))
            + kernels * hw.launch_overhead)


def _tp_allreduce(tokens, model: ModelConfig, tp: int, hw: Hardware, count: int):
    """``count`` ring all-reduces of a [tokens, hidden] activation across the TP group (Megatron f/g)."""
    if tp == 1:
        return 0.0 * np.asarray(tokens, dtype=float)
    nbytes = np.asarray(tokens, dtype=float) * model.hidden * model.dtype_bytes
    return count * 2 * (tp - 1) / tp * nbytes / hw.busbw(nbytes)


def attention_shape(model: ModelConfig, tp: int, block_size: int) -> kc.Shape:
    """Attention dims on one TP rank: heads split over tp, kv heads replicated when fewer than tp."""
    return kc.Shape(heads=math.ceil(model.heads / tp), kv_heads=math.ceil(model.kv_heads / tp),
                    head_dim=model.head_dim, block=block_size, dtype_bytes=model.dtype_bytes)


def attention_parts(seq_len, budget, model: ModelConfig, tp: int, block_size: int, hw: Hardware, *,
                    backward: bool = False, path=None) -> dict:
    """Seconds of each phase of one layer's MoBA attention for one sequence (numpy-broadcastable), on
    ``path`` ("sparse", "masked"; a budget at or beyond the block count is always dense); by default
    the path the kernel's dispatcher picks (:func:`kernelcost.choose_path`)."""
    return kc.phase_times(seq_len, budget, attention_shape(model, tp, block_size), hw, backward=backward,
                          path=path)


#: Bytes moved per element of one head's L x L score matrix by the unfused attention core
#: (``unfused_attention_time``): forward Q K^T written (2), softmax read + write (4), dropout read +
#: write + 1-byte mask (5), read by the product with V (2); backward dP written (2), dropout's
#: backward (read dP and the mask, write: 5), softmax's (read P and dP, write dS: 6), dS read by the
#: dQ and dK GEMMs (4), the dropped-out P re-read for dV (2).
UNFUSED_SCORE_BYTES = {False: 13, True: 19}
#: Kernels of the unfused core: bmm, softmax, dropout, bmm; backward bmm x 4, dropout, softmax.
UNFUSED_KERNELS = {False: 4, True: 6}


def unfused_attention_time(seq_len, model: ModelConfig, tp: int, hw: Hardware, *, backward: bool = False):
    """Seconds of one layer's dense attention for one sequence the way Megatron-LM computed it before
    FlashAttention (``model.attention_kernel = "unfused"``; Korthikanti et al. 2022, section 4.1,
    lists its tensors): per TP rank (heads / tp heads), the two batched GEMMs over the full L x L
    square (4 L^2 head_dim FLOPs per head forward, twice that backward: dV, dP, dQ, dK) at the GEMM
    efficiency, plus the score traffic (``UNFUSED_SCORE_BYTES`` per element per head) at the
    streaming bandwidth, plus Q, K, V read and the output written; each kernel launched once."""
    L = np.asarray(seq_len, dtype=float)
    heads = math.ceil(model.heads / tp)
    mult = 2 if backward else 1
    flops = mult * 4 * L * L * model.head_dim * heads
    gemm_bytes = mult * 4 * L * heads * model.head_dim * model.dtype_bytes
    scores = UNFUSED_SCORE_BYTES[backward] * L * L * heads
    bw = hw.memory_bandwidth * hw.memory_efficiency
    # one batched GEMM call covers the sequence's heads (Megatron batches the micro-batch's sequences
    # too; a row is one sequence, so the call is keyed on its share: the curve's lower side)
    share = hw.gemm_share(2 * L * L * model.head_dim * heads)
    return (np.maximum(flops / (hw.peak_flops * share), gemm_bytes / bw) + scores / bw
            + UNFUSED_KERNELS[backward] * hw.launch_overhead)


def attention_time(seq_len, budget, model: ModelConfig, tp: int, block_size: int, hw: Hardware, *,
                   backward: bool = False, path=None):
    """Seconds of one layer's attention for one sequence (numpy-broadcastable): the sum of
    :func:`attention_parts` (by default on the path the dispatcher picks), or for
    ``model.attention_kernel = "unfused"`` :func:`unfused_attention_time` (dense, any budget)."""
    if model.attention_kernel == "unfused":
        return unfused_attention_time(seq_len, model, tp, hw, backward=backward) + 0 * np.asarray(budget)
    return sum(attention_parts(seq_len, budget, model, tp, block_size, hw, backward=backward, path=path).values())


def _dense_work(T: np.ndarray, model: ModelConfig, tp: int) -> tuple[np.ndarray, np.ndarray]:
    """(GEMM FLOPs, GEMM bytes) of one layer's dense forward on ``T`` tokens, one TP rank: 2 x tokens
    x weights, the weights read once and each projection's input and output (QKV: h in, q + 2 kv
    out; O: q in, h out; MLP up: h in, ffn (GELU) or 2 ffn (SwiGLU's gate and up) out; down: ffn in,
    h out; projection outputs and the MLP width split over tp). Its elementwise kernels:
    :func:`elementwise`."""
    h, db = model.hidden, model.dtype_bytes
    qkv = (model.heads + 2 * model.kv_heads) * model.head_dim / tp
    q = model.heads * model.head_dim / tp
    up = (2 if model.mlp == "swiglu" else 1) * model.ffn / tp
    flops = 2 * T * model.params_per_layer / tp
    gemm = model.params_per_layer / tp * db + T * (4 * h + qkv + q + up + model.ffn / tp) * db
    return flops, gemm


UNPAD_KERNELS = {False: 5, True: 7}
"""Kernels of flash-attn's unpad / pad (forward: 3 gathers, a zero-fill and an index-put; backward:
a gather and 3 zero-fill + scatter pairs)."""


def elementwise(T, model: ModelConfig, tp: int, sp: bool = False, *, backward: bool = False) -> tuple[np.ndarray, int]:
    """(bytes, kernels beyond ``KERNELS``) of one layer's elementwise kernels on ``T`` tokens, one TP
    rank, which stream after the GEMMs rather than hide under them (``model.layer_ops``). Per token,
    in elements of hn (the hidden size, 1/tp of it with sequence parallelism), f = ffn / tp, qkv and
    q (the projections' widths / tp):

    * forward: 2 norms (read + write hn) and 2 residual adds (read 2 hn, write hn): 10 hn; the MLP's
      activation: GELU read + write f, SwiGLU read 2 f + write f fused (3 f), as silu then a product
      eager (5 f); ``eager-unpad`` adds the unpad gathers of Q, K and V (read + write qkv) and the
      output's pad (zero-fill, read and write q): 2 qkv + 3 q;
    * backward, ``fused``: twice the forward's;
    * backward, eager: each norm's dX (read dY, X, write dX) and dgamma/dbeta (read dY, X) kernels,
      10 hn; the residual gradients' accumulation (read 2, write 1 per add), 6 hn; the activation's
      backward reading its input (GELU 3 f; SwiGLU: the product's two and silu's, 9 f); one
      reduction of the output gradient per bias (QKV: qkv; out, up, down: 2 hn + f, or 2 f for
      SwiGLU's gate and up); the fused QKV projection's split backward (read + write qkv);
      ``eager-unpad`` adds the pad's backward gather (2 q) and the unpads' scatters into zeros (3 qkv).

    Sources: torch 2.1's ATen kernels for layer_norm / gelu backward and autograd's gradient
    accumulation; llm-foundry ``5e85bd62d`` ``layers/blocks.py`` (MPTBlock), ``layers/attention.py``
    (``flash_attn_fn``: ``bert_padding.unpad_input`` / ``pad_input``), ``layers/ffn.py`` (MPTMLP)."""
    T = np.asarray(T, dtype=float)
    hn = model.hidden / tp if sp and tp > 1 else model.hidden
    f = model.ffn / tp
    qkv = (model.heads + 2 * model.kv_heads) * model.head_dim / tp
    q = model.heads * model.head_dim / tp
    glu = model.mlp == "swiglu"
    eager, unpad = model.layer_ops != "fused", model.layer_ops == "eager-unpad"
    fwd = 10 * hn + ((5 if eager else 3) if glu else 2) * f
    if not backward:
        extra = (1 if eager and glu else 0) + (UNPAD_KERNELS[False] if unpad else 0)
        return T * (fwd + (2 * qkv + 3 * q if unpad else 0)) * model.dtype_bytes, extra
    if not eager:
        return T * 2 * fwd * model.dtype_bytes, 0
    biases = (qkv if model.qkv_bias else 0) + (2 * hn + (2 if glu else 1) * f if model.bias else 0)
    n_bias = int(model.qkv_bias) + (3 if model.bias else 0)
    elems = 16 * hn + (9 if glu else 3) * f + biases + 2 * qkv + (2 * q + 3 * qkv if unpad else 0)
    extra = 2 + 2 + n_bias + 1 + (2 if glu else 0) + (UNPAD_KERNELS[True] if unpad else 0)
    return T * elems * model.dtype_bytes, extra


def gemm_calls(T, model: ModelConfig, tp: int) -> dict[str, np.ndarray]:
    """FLOPs of each projection GEMM of one layer's forward on ``T`` tokens, one TP rank: QKV and the
    MLP's up projection (column-parallel), the attention output and the MLP's down projection
    (row-parallel). The backward runs each twice with the same FLOPs (dX = dY W^T, dW = X^T dY)."""
    T = np.asarray(T, dtype=float)
    h, q = model.hidden, model.heads * model.head_dim / tp
    qkv = (model.heads + 2 * model.kv_heads) * model.head_dim / tp
    up = (2 if model.mlp == "swiglu" else 1) * model.ffn / tp
    return {"qkv": 2 * T * h * qkv, "o": 2 * T * q * h, "up": 2 * T * h * up, "down": 2 * T * model.ffn / tp * h}


def gemm_share(T, model: ModelConfig, tp: int, hw: Hardware):
    """Share of peak of one layer's GEMMs together: each projection at :meth:`Hardware.gemm_share` of
    its call's FLOPs, combined by time (FLOPs / sum of FLOPs / rate); exactly ``gemm_efficiency``
    without a GEMM curve."""
    if not hw.gemm_curve:
        return hw.gemm_efficiency
    calls = gemm_calls(T, model, tp).values()
    return sum(calls) / sum(f / hw.gemm_share(f) for f in calls)


def _dense_roof(flops, gemm, elementwise, hw: Hardware, kernels: int, share):
    """GEMMs at their roofline (at ``share`` of peak: :func:`gemm_share`), then the elementwise
    kernels at the streaming bandwidth, + launches."""
    return (_roof(flops, gemm, share, hw, kernels)
            + elementwise / (hw.memory_bandwidth * hw.memory_efficiency))


def tp_backward_comm(tokens, model: ModelConfig, tp: int, hw: Hardware, *, sp: bool = False,
                     overlap: bool = False, impl: str = "megatron"):
    """Seconds of one layer's backward TP collectives that the GPU waits for.

    Without ``overlap`` every collective is exposed: 2 all-reduces of the input gradient (the
    column-parallel linears' ``f``), or with ``sp`` the 2 all-gathers of the row-parallel linears'
    output gradient, the 2 reduce-scatters of the column-parallel input gradient, and the 2
    all-gathers of the column-parallel linears' sequence-sharded input, which each gathers again for
    its weight gradient (3 all-reduces' bytes in all; an all-gather or a reduce-scatter moves
    (tp - 1) / tp of the tensor, half an all-reduce, at the same bus bandwidth). With ``overlap`` (Megatron-LM's
    ``LinearWithGradAccumulationAndAsyncCommunication``, its default since 2021-22): a column-parallel
    linear (QKV, MLP up) launches its input gradient's all-reduce, or with SP its reduce-scatter,
    asynchronously and computes its weight gradient meanwhile, and with SP its input's re-gather runs
    beside the input-gradient GEMM; only what outlasts that GEMM is exposed. The row-parallel
    all-gathers of SP block. Each overlapped GEMM is priced alone (the collective's SM and memory
    use slowing it is not priced). With ``impl = "te"`` (and ``sp``), Transformer Engine's overlap
    (:mod:`tpoverlap`) also hides the row-parallel all-gathers under their input-gradient GEMMs."""
    T = np.asarray(tokens, dtype=float)
    one = _tp_allreduce(T, model, tp, hw, 1)  # an all-reduce's time; an all-gather or a reduce-scatter: half
    if not overlap:
        return (3 if sp else 2) * one
    if impl == "te" and sp:
        return te_layer_comm(one / 2, _gemm_seconds(T, model, tp, hw), tp, backward=True)
    calls = gemm_calls(T, model, tp)
    gemm = {k: calls[k] / (hw.peak_flops * hw.gemm_share(calls[k])) for k in ("qkv", "up")}
    if not sp:
        return sum(np.maximum(0.0, one - g) for g in gemm.values())
    return one + sum(2 * np.maximum(0.0, one / 2 - g) for g in gemm.values())


def _gemm_seconds(T, model: ModelConfig, tp: int, hw: Hardware) -> dict[str, np.ndarray]:
    """Seconds of each projection's GEMM of one layer's forward (compute-bound, at its size's share)."""
    return {k: f / (hw.peak_flops * hw.gemm_share(f)) for k, f in gemm_calls(T, model, tp).items()}


def dense_time(tokens, model: ModelConfig, tp: int, hw: Hardware, *, backward: bool = False, sp: bool = False,
               overlap: bool = False, impl: str = "megatron"):
    """Seconds of one layer's dense part (norms, QKV/O, MLP) on ``tokens`` tokens (``sp``: sequence
    parallelism, :func:`elementwise`; the forward's 2 TP all-reduces, the backward's TP collectives
    by :func:`tp_backward_comm`, hidden under the GEMMs with ``overlap``; with ``impl = "te"`` and
    ``sp`` the forward's too, :func:`tpoverlap.te_layer_comm`); the backward moves twice the
    forward's GEMM FLOPs and bytes, and the elementwise bytes :func:`elementwise` counts."""
    T = np.asarray(tokens, dtype=float)
    flops, gemm = _dense_work(T, model, tp)
    stream, extra = elementwise(T, model, tp, sp, backward=backward)
    mult = 2 if backward else 1
    kernels = KERNELS["layer_bwd" if backward else "layer_fwd"] + extra
    if backward:
        comm = tp_backward_comm(T, model, tp, hw, sp=sp, overlap=overlap, impl=impl)
    elif overlap and impl == "te" and sp and tp > 1:
        comm = te_layer_comm(_tp_allreduce(T, model, tp, hw, 1) / 2, _gemm_seconds(T, model, tp, hw), tp,
                             backward=False)
    else:
        comm = _tp_allreduce(T, model, tp, hw, 2)
    return _dense_roof(mult * flops, mult * gemm, stream, hw, kernels, gemm_share(T, model, tp, hw)) + comm


def embed_time(tokens, model: ModelConfig, tp: int, hw: Hardware, *, backward: bool = False):
    """Seconds of the (vocab-parallel) embedding lookup, or its gradient scatter-add (a learned
    position table: a second lookup of the same size)."""
    T = np.asarray(tokens, dtype=float)
    nbytes = 2 * T * model.hidden * model.dtype_bytes * (2 if backward else 1)
    if model.positions == "learned":
        nbytes = 2 * nbytes
    kernels = KERNELS["embed_bwd" if backward else "embed_fwd"]
    return _roof(0.0 * T, nbytes, hw.gemm_efficiency, hw, kernels) + _tp_allreduce(
        T, model, tp, hw, 0 if backward else 1)


def head_time(tokens, model: ModelConfig, tp: int, hw: Hardware, *, backward: bool = False):
    """Seconds of final norm + LM head + cross-entropy (fp32 logits, vocab split over TP): the head's
    GEMM at its roofline, then the loss's kernels streaming the fp32 logits (forward 3 passes, backward
    2) after it, not hidden under it: they are separate kernels that wait for the GEMM's output, as
    the dense layer's elementwise kernels are (:func:`_dense_roof`). On an H100 the loss's softmax alone
    took 13.2 + 13.5 ms of a 3B head's 89.6 ms at 16K tokens (docs/results.md, "On an H100")."""
    T = np.asarray(tokens, dtype=float)
    flops = 2 * T * model.hidden * model.vocab / tp
    logits = T * model.vocab / tp * 4
    weights = model.hidden * model.vocab / tp * model.dtype_bytes
    share = hw.gemm_share(flops)
    stream = hw.memory_bandwidth * hw.memory_efficiency
    if backward:
        return _roof(2 * flops, 2 * weights, share, hw, KERNELS["head_bwd"]) + 2 * logits / stream
    return _roof(flops, weights, share, hw, KERNELS["head_fwd"]) + 3 * logits / stream


# -- split backward (input gradient I / weight gradient W) of the dense ops -------------------------
# Kept apart from the attention model above: zero-bubble schedules price I and W separately.

def dense_split_time(tokens, model: ModelConfig, tp: int, hw: Hardware, part: str, sp: bool = False):
    """Seconds of the ``part`` ("input" or "weight") of one layer's dense backward: one GEMM pass
    (forward FLOPs and bytes, half of ``layer_bwd``'s launches); the input part also carries the
    layer's two TP all-reduces, sequence parallelism's re-gathers (issued with the input gradient)
    and the elementwise backward. ``input + weight == dense_time(backward=True)`` up to rounding
    without ``overlap``; with it the whole backward is shorter, since a deferred weight gradient
    (the split's purpose) has no collective beside it to hide."""
    T = np.asarray(tokens, dtype=float)
    flops, gemm = _dense_work(T, model, tp)
    share = gemm_share(T, model, tp, hw)
    if part == "input":  # the elementwise backward (norms, activation) is on the input-gradient path
        stream, extra = elementwise(T, model, tp, sp, backward=True)
        return (_dense_roof(flops, gemm, stream, hw, KERNELS["layer_bwd"] // 2 + extra, share)
                + tp_backward_comm(T, model, tp, hw, sp=sp))
    return _roof(flops, gemm, share, hw, KERNELS["layer_bwd"] // 2)


def head_split_time(tokens, model: ModelConfig, tp: int, hw: Hardware, part: str):
    """Seconds of the ``part`` of the LM head's backward: dX or dW, each the forward's GEMM FLOPs,
    weight bytes and half of ``head_bwd``'s launches; the loss gradient's two passes over the fp32
    logits (:func:`head_time`) run once, before dX, so they are on the input part."""
    T = np.asarray(tokens, dtype=float)
    flops = 2 * T * model.hidden * model.vocab / tp
    logits = T * model.vocab / tp * 4
    weights = model.hidden * model.vocab / tp * model.dtype_bytes
    share = hw.gemm_share(flops)
    gemm = _roof(flops, weights, share, hw, KERNELS["head_bwd"] // 2)
    if part == "input":
        return gemm + 2 * logits / (hw.memory_bandwidth * hw.memory_efficiency)
    return gemm


def split_backward_rows(tokens, model: ModelConfig, tp: int, hw: Hardware, sp: bool = False) -> list[pd.DataFrame]:
    """Profile rows of the split backward ops at ``tokens``."""
    out = []
    for name, part in (("layer", "input"), ("layer", "weight"), ("head", "input"), ("head", "weight")):
        lat = (dense_split_time(tokens, model, tp, hw, part, sp) if name == "layer"
               else head_split_time(tokens, model, tp, hw, part))
        out.append(pd.DataFrame({"op": f"{name}_bwd_{part}", "seq_len": tokens, "budget": 0, "latency_s": lat}))
    return out


def build_table(hw: Hardware, model: ModelConfig, tp: int, block_size: int, *,
                seq_lens: np.ndarray | None = None, budgets: np.ndarray | None = None,
                tokens: np.ndarray | None = None, sequence_parallel: bool = False,
                tp_overlap: bool = False, tp_overlap_impl: str = "megatron") -> pd.DataFrame:
    """The profile rows of one (hardware, model, tp, block size).

    Attention rows price the path the kernel's dispatcher runs (:func:`kernelcost.choose_path`, the
    same function the dispatcher calls): below the block count the cheaper of the sparse
    key-block-major path and the masked dense path, both exact MoBA; at or beyond it dense attention.
    Each row is the cost of that one path (forward and backward rows of the same choice). The masked
    path pays the gate on top of the dense tiles, so just below the block count latency can exceed
    the full budget's (docs/costmodel.md, "Budget and the dense path"; noted in the sidecar)."""
    seq_lens = default_seq_lens() if seq_lens is None else np.asarray(seq_lens, dtype=np.int64)
    budgets = DEFAULT_BUDGETS if budgets is None else np.asarray(budgets, dtype=np.int64)
    tokens = default_seq_lens(16, 1048576) if tokens is None else np.asarray(tokens, dtype=np.int64)
    S, K = np.meshgrid(seq_lens, budgets, indexing="ij")
    path = kc.choose_path(S.ravel(), K.ravel(), attention_shape(model, tp, block_size), hw)
    frames = []
    for op, bwd in (("attn_fwd", False), ("attn_bwd", True)):
        lat = attention_time(S.ravel(), K.ravel(), model, tp, block_size, hw, backward=bwd, path=path)
        frames.append(pd.DataFrame({"op": op, "seq_len": S.ravel(), "budget": K.ravel(), "latency_s": lat}))
    for name, fn in (("layer", dense_time), ("embed", embed_time), ("head", head_time)):
        for suffix, bwd in (("fwd", False), ("bwd", True)):
            lat = (dense_time(tokens, model, tp, hw, backward=bwd, sp=sequence_parallel, overlap=tp_overlap,
                              impl=tp_overlap_impl)
                   if name == "layer"
                   else fn(tokens, model, tp, hw, backward=bwd))
            frames.append(pd.DataFrame({"op": f"{name}_{suffix}", "seq_len": tokens, "budget": 0,
                                        "latency_s": lat}))
    frames += split_backward_rows(tokens, model, tp, hw, sequence_parallel)
    return pd.concat(frames, ignore_index=True)


def build_profile(hw: Hardware, model: ModelConfig, tp: int, block_size: int | None = None, *,
                  sequence_parallel: bool = False, tp_overlap: bool = False,
                  tp_overlap_impl: str = "megatron") -> Profile:
    """An analytical profile (table + sidecar) for ``model`` at ``tp`` on ``hw`` (with Megatron's
    sequence parallelism where ``sequence_parallel`` and tp > 1, and the backward's TP collectives
    overlapped with its GEMMs where ``tp_overlap``: :func:`tp_backward_comm`; the forward's too with
    ``tp_overlap_impl = "te"`` and sequence parallelism: :mod:`tpoverlap`). A pure function of its arguments,
    so it is computed once per process for each and handed out as a copy (a run, a sweep's points
    and the re-derivation check ask for the same profile again and again)."""
    block = model.block_size if block_size is None else block_size
    overlap = bool(tp_overlap and tp > 1)
    impl = tp_overlap_impl if overlap and sequence_parallel else "megatron"  # TE's overlap needs SP
    table, meta = _built(hw, model, int(tp), int(block), bool(sequence_parallel and tp > 1), overlap, impl)
    return Profile(table=table.copy(), meta=meta, source=f"analytical-{hw.device}")


@functools.lru_cache(maxsize=32)
def _built(hw: Hardware, model: ModelConfig, tp: int, block: int, sp: bool,
           overlap: bool, impl: str = "megatron") -> tuple[pd.DataFrame, ProfileMeta]:
    table = build_table(hw, model, tp, block, sequence_parallel=sp, tp_overlap=overlap, tp_overlap_impl=impl)
    # the fixed cost of a call is paid once per packed micro-batch (the varlen kernel's launch, index
    # and glue ops), not per sequence: the rows leave it out and the sidecar carries it
    call = {"fwd": kc.call_fixed(hw), "bwd": kc.call_fixed(hw, backward=True)}
    if model.attention_kernel == "unfused":  # Megatron's batched kernels: launched once per micro-batch
        call = {"fwd": UNFUSED_KERNELS[False] * hw.launch_overhead, "bwd": UNFUSED_KERNELS[True] * hw.launch_overhead}
    for op, key in (("attn_fwd", "fwd"), ("attn_bwd", "bwd")):
        rows = table["op"] == op
        table.loc[rows, "latency_s"] = np.maximum(0.0, table.loc[rows, "latency_s"] - call[key])
    meta = replace(sidecar(hw, model, tp, block), attention_call_s=call)
    if sp:  # absent when off: the shipped sidecars stay as they are
        meta = replace(meta, sequence_parallel=True)
    if overlap:
        meta = replace(meta, tp_overlap=True)
    if impl != "megatron":
        meta = replace(meta, tp_overlap_impl=impl)
    bad = monotone_violations(Profile(table=table, meta=meta, source=f"analytical-{hw.device}"), block)
    if bad:  # the note is read from the table just built, so it joins the sidecar after building
        note = (f"{len(bad)} attention point(s) fall as budget or length grows, as the kernel does: just below "
                "the block count the dispatcher runs the masked dense path, which pays the gate on top of the "
                "dense tiles that the full budget (dense, no gate) runs alone; rows of blocks c <= k - 1 take "
                "every past block unscored, so a larger budget scores fewer rows; and where the path changes "
                "between neighbouring points (chosen by forward + backward) one pass can get cheaper while "
                "the other gets dearer (docs/costmodel.md, 'Budget and the dense path')")
        meta = replace(meta, nonmonotone=note)
    return table, meta


def sidecar(hw: Hardware, model: ModelConfig, tp: int, block_size: int) -> ProfileMeta:
    import numpy
    import pandas

    from sparsebalance import __version__

    return ProfileMeta(
        format_version=FORMAT_VERSION, device=hw.device, dtype="bf16", analytical=True,
        model={"name": model.name} | {k: getattr(model, k) for k in MODEL_DIMS}
              | {"dtype_bytes": model.dtype_bytes} | model.arch,
        block_size=block_size, tp=tp,
        how=("analytical roofline of our MoBA kernel (simulator/cost/kernelcost.py): executed tile pairs "
             "(key-block-major gather, own block, dense path at full budget), the fused gate's scoring loop, "
             "the sync-free index, LSE-merge traffic, 7-matmul backward, launches; each sequence on the path "
             "the kernel's dispatcher picks (kernelcost.choose_path: sparse, or the masked dense "
             "path below the block count; dense at it); per kernel max(FLOPs / "
             "(peak x efficiency), bytes / (HBM bandwidth x efficiency)) at the kernel's measured "
             "efficiencies; dense layers likewise; constants and sources in docs/costmodel.md; not measured"),
        command=COMMAND,
        versions={"sparsebalance": __version__, "numpy": numpy.__version__, "pandas": pandas.__version__},
        memory_bandwidth=hw.memory_bandwidth * hw.memory_efficiency,
        roofline=asdict(hw),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="sparsebalance/data/profiles", help="parent directory")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (the paper: 2)")
    args = ap.parse_args(argv)
    model = qwen25_3b()
    for hw in (H100, H200, H20):
        prof = build_profile(hw, model, args.tp)
        path = prof.save(Path(args.out) / f"analytical-{hw.device}")
        print(f"wrote {path} ({len(prof.table)} rows)")


if __name__ == "__main__":
    main()
