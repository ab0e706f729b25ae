"""The decoder layer's dense parts compiled: one option, ``layer_impl``, picks how a Qwen2 layer runs.

* ``eager``: the Hugging Face modules as written (``kernels/qwen2.py``): an fp32 RMSNorm chain of
  seven kernels, RoPE by ``rotate_half`` (slices, a negation, a concatenation), SiLU and the
  multiply apart; on an H100 about 130 launches per layer forward + backward
  (``docs/gpu/h100-2026-11-27``). The reference, and the CPU default (the real run's exact-equality
  tests compare it with a single-process run).
* ``compiled``: the same weights and the same math in two ``torch.compile`` regions around the
  attention: :func:`qkv_rope` (input RMSNorm, the q/k/v projections, RoPE) and :func:`out_mlp` (output
  projection, residual, post-attention RMSNorm, SwiGLU MLP, residual). Inductor fuses each norm,
  the rotary embedding of q and k, the activation with its multiply and the residual adds into single
  kernels forward and backward; the GEMMs stay the library's. The attention between the regions is
  the model's registered attention function (MoBA; the profiler's zero-cost core) called eagerly, so
  its dynamic sparse shapes never enter a compiled graph. The token count is marked dynamic: one
  graph per region (and dtype) serves every micro-batch length, every layer (weights are arguments,
  not guarded constants) and every stage.
* ``auto``: ``compiled`` on CUDA where it can run, ``eager`` elsewhere (see :func:`resolve_layer_impl`).

The model's head follows the same option (``kernels/lmhead.py``): compiled, the final norm is
:func:`rms_norm` compiled and the LM head + loss a chunked linear cross-entropy that never holds the
whole ``[T, vocab]`` logits.

What ``compiled`` cannot do: tensor parallelism (the DTensor plan wraps the projection modules,
``kernels/tp_plan.py``, while the regions read their weights) and a split backward (zero-bubble I/W,
``kernels/split_backward.py``): a compiled region has one backward node that computes the input and
the weight gradients together, so I and W would each run it whole.
"""

from __future__ import annotations

import functools
from typing import Any

from sparsebalance.errors import ConfigError, check_choice

LAYER_IMPLS = ("auto", "eager", "compiled")
"""Allowed values of every ``layer_impl`` option."""
BACKEND = "inductor"
"""torch.compile backend of the compiled regions."""


def resolve_layer_impl(impl: str, device: str, *, tp: int = 1, split_backward: bool = False,
                       field: str = "layer_impl") -> str:
    """``eager`` or ``compiled`` for ``impl`` on ``device``; ConfigError (one line naming ``field``)
    for a value outside :data:`LAYER_IMPLS` or ``compiled`` where it cannot run (tp > 1, a split
    backward). ``auto``: compiled on CUDA with tp = 1 and no split backward, else eager."""
    check_choice(impl, field, LAYER_IMPLS)
    if impl == "auto":
        return "compiled" if str(device).startswith("cuda") and tp == 1 and not split_backward else "eager"
    if impl == "compiled" and tp > 1:
        raise ConfigError(f"{field}: compiled runs with tp = 1 only (the tensor-parallel plan wraps the "
                          f"projections the compiled regions read), got tp = {tp}; use eager or auto")
    if impl == "compiled" and split_backward:
        raise ConfigError(f"{field}: compiled cannot split the backward into input and weight parts "
                          "(zb-h1: a compiled region computes both in one pass); use eager or auto")
    return impl


# -- the dense math, written once: run as is (tests, references) or compiled --------------------------
def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """Qwen2's RMSNorm: in float32, then back to ``x``'s dtype and scaled by ``weight``."""
    import torch

    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x: Any) -> Any:
    import torch

    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def qkv_rope(x: Any, ln_w: Any, eps: float, wq: Any, bq: Any, wk: Any, bk: Any, wv: Any, bv: Any,
             cos: Any, sin: Any, head_dim: int) -> tuple[Any, Any, Any]:
    """Input norm, q/k/v projections and RoPE of hidden ``x`` [1, T, hidden]; ``cos``/``sin``
    [1, T, head_dim] (the rotary embedding's). Returns q [1, T, H, D], k and v [1, T, Hkv, D]."""
    import torch.nn.functional as F

    h = rms_norm(x, ln_w, eps)
    q = F.linear(h, wq, bq).unflatten(-1, (-1, head_dim))
    k = F.linear(h, wk, bk).unflatten(-1, (-1, head_dim))
    v = F.linear(h, wv, bv).unflatten(-1, (-1, head_dim))
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s, v


def out_mlp(attn: Any, x: Any, wo: Any, bo: Any, ln_w: Any, eps: float, wg: Any, wu: Any, wd: Any) -> Any:
    """Output projection of the attention ``attn`` [1, T, H, D], residual onto ``x`` [1, T, hidden],
    post-attention norm, SwiGLU MLP (``down(silu(gate(y)) * up(y))``) and its residual."""
    import torch.nn.functional as F

    h = x + F.linear(attn.flatten(-2), wo, bo)
    y = rms_norm(h, ln_w, eps)
    return h + F.linear(F.silu(F.linear(y, wg)) * F.linear(y, wu), wd)


@functools.cache
def compiled(fn: Any, backend: str = BACKEND) -> Any:
    """``fn`` torch.compile'd as one graph (one per process and backend: its Dynamo cache is shared by
    every caller)."""
    import torch

    return torch.compile(fn, fullgraph=True, backend=backend)


def mark_tokens_dynamic(*tensors: Any, dim: int = 1) -> None:
    """Mark the token dimension dynamic, so a new micro-batch length reuses the compiled graph."""
    import torch

    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, dim)


def _pre(layer: Any, hidden: Any, cos: Any, sin: Any) -> tuple[Any, Any, Any]:
    """Region 1 of ``layer``: q [1, T, H, D], k, v [1, T, Hkv, D]."""
    a, ln = layer.self_attn, layer.input_layernorm
    mark_tokens_dynamic(hidden, cos, sin)
    return compiled(qkv_rope)(hidden, ln.weight, ln.variance_epsilon, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight,
                              a.k_proj.bias, a.v_proj.weight, a.v_proj.bias, cos, sin, a.head_dim)


def _post(layer: Any, out: Any, hidden: Any) -> Any:
    """Region 2 of ``layer`` on the attention output ``out`` [1, T, H, D]: the layer's output."""
    a, mlp, ln = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    out = out.contiguous()
    mark_tokens_dynamic(out)
    return compiled(out_mlp)(out, hidden, a.o_proj.weight, a.o_proj.bias, ln.weight, ln.variance_epsilon,
                             mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


def layer_forward(layer: Any, hidden: Any, position_embeddings: tuple[Any, Any], **attn_kwargs: Any) -> Any:
    """One HF ``Qwen2DecoderLayer`` on ``hidden`` [1, T, hidden], compiled: the two regions and, between
    them, the attention function the model's config names (``attn_kwargs`` go to it, e.g. ``moba=``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    a = layer.self_attn
    if a.config.hidden_act != "silu":
        raise ConfigError(f"layer_impl: compiled runs the SwiGLU (silu) MLP of Qwen2, got hidden_act "
                          f"{a.config.hidden_act!r}; use eager")
    q, k, v = _pre(layer, hidden, *position_embeddings)
    core = ALL_ATTENTION_FUNCTIONS[a.config._attn_implementation]
    out, _ = core(a, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, dropout=0.0,
                  scaling=a.scaling, **attn_kwargs)
    return _post(layer, out, hidden)


def warm_up(layer: Any, tokens: int = 64) -> None:
    """Compile the two regions for ``layer``'s shapes, dtype and device before anything is timed: one
    forward + backward on seeded random input with the attention replaced by its input (q), the
    layer's gradients cleared after. Any later token count reuses these graphs."""
    import torch

    p = layer.input_layernorm.weight
    gen = torch.Generator(device=p.device).manual_seed(0)
    x = torch.randn(1, tokens, p.shape[0], generator=gen, device=p.device, dtype=p.dtype, requires_grad=True)
    angle = torch.rand(1, tokens, layer.self_attn.head_dim, generator=gen, device=p.device)
    with torch.enable_grad():
        q, k, v = _pre(layer, x, angle.cos().to(p.dtype), angle.sin().to(p.dtype))
        y = _post(layer, q * 1.0, x)  # an attention output of the right shape, in the graph
        (y.float().sum() + k.float().sum() + v.float().sum()).backward()
    for t in layer.parameters():
        t.grad = None
