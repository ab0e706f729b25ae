"""Eager against compiled layer and head, side by side: time, launches, the analytical roofline, and
agreement with a float64 reference. Behind ``benchmarks/bench_layer.py`` (CPU) and gpu-check's
``layer`` step (CUDA), so both measure the very closures the profiler times (``profiler.Bench``).

* **Time**: forward and backward (the backward alone, its forward untimed before it) of one decoder
  layer with the profiler's zero-cost attention core (``layer``) and of final norm + LM head + loss
  (``head``), per token count and implementation; the median of ``repeats`` calls measured in rounds
  that interleave the implementations (a burst of load lands on both alike).
* **Launches**: the kernels one forward + backward issues, counted by ``torch.profiler`` (see
  :func:`count_launches`).
* **Analytical**: ``simulator/cost/roofline.py``'s ``dense_time`` / ``head_time`` for the device
  when its name says H100, H200, H20 or A100, and measured / analytical.
"""

from __future__ import annotations

import statistics
from typing import Any

from sparsebalance.simulator.config import ModelConfig

VIEW_OPS = frozenset(f"aten::{n}" for n in (
    "view", "_unsafe_view", "as_strided", "t", "transpose", "expand", "reshape", "_reshape_alias", "detach",
    "alias", "unsqueeze", "squeeze", "slice", "select", "permute", "resolve_conj", "resolve_neg", "empty",
    "empty_strided", "empty_like", "unflatten", "flatten", "split", "chunk", "narrow", "lift_fresh",
    "result_type", "to", "contiguous", "view_as", "unbind", "numpy_T", "set_", "is_nonzero"))
"""aten ops that launch no kernel of their own (metadata, allocation, or a wrapper whose work shows as
a child op)."""
GEMM_OPS = frozenset(f"aten::{n}" for n in ("mm", "addmm", "addmm_", "bmm", "baddbmm", "_addmm_activation"))
"""aten ops that are one kernel even when they call others first (addmm copies its bias in)."""


def count_launches(fn: Any, device: str) -> int:
    """Kernels that one call of ``fn`` issues. CUDA: the device-side kernel, copy and fill events.
    CPU: the aten ops that compute themselves (not in :data:`VIEW_OPS`, and no op below them but views,
    or a GEMM of :data:`GEMM_OPS`) plus
    Inductor's C++ kernels, which the profiler records only when they were compiled with
    ``torch._inductor.config.cpp.enable_kernel_profile`` (``benchmarks/bench_layer.py`` sets it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = str(device).startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    if cuda:
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    n = 0
    for e in events:
        if e.name.startswith("aten::") and e.name not in VIEW_OPS:
            n += e.name in GEMM_OPS or not any(c.name.startswith("aten::") and c.name not in VIEW_OPS
                                               for c in e.cpu_children)
        elif e.name.startswith("cpp_fused") or "_cpp_fused_" in e.name:
            n += 1
    return n


def _analytical(model: ModelConfig, device_name: str, op: str, tokens: int) -> tuple[float, float]:
    """(forward, backward) seconds of the analytical model, NaN without hardware for the device."""
    from sparsebalance.kernels.moba.speed import hardware_for
    from sparsebalance.simulator.cost import roofline

    hw = hardware_for(device_name)
    if hw is None:
        return float("nan"), float("nan")
    fn = roofline.dense_time if op == "layer" else roofline.head_time
    return tuple(float(fn(tokens, model, 1, hw, backward=b)) for b in (False, True))


def layer_table(model: ModelConfig, tokens: tuple[int, ...], *, device: str = "cpu", dtype: str = "float32",
                impls: tuple[str, ...] = ("eager", "compiled"), repeats: int = 10, warmup: int = 2,
                seed: int = 0, progress: Any = None, stop: Any = None) -> Any:
    """One row per (impl, op, tokens): ``fwd_s``, ``bwd_s`` (medians; ``*_min_s``, ``*_max_s`` their
    spread over the repeats), ``launches`` (forward +
    backward), ``analytical_fwd_s``, ``analytical_bwd_s``, ``ratio_fwd``, ``ratio_bwd``. ``progress``:
    called with the rows so far after each token count (a step killed later keeps them); ``stop``:
    asked before each token count after the first, True ends the table there."""
    import numpy as np
    import pandas as pd
    import torch

    from sparsebalance.kernels.profiler import Bench, ProfileGrid

    bench = Bench(model, ProfileGrid(device=device, dtype=dtype, layer_impl="eager", seed=seed, repeats=repeats,
                                     warmup=warmup))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    rows: list[dict] = []
    for T in tokens:
        if rows and stop is not None and stop():
            break
        calls = {}
        for impl in impls:  # closures per implementation, on the same weights and the same inputs
            bench.use(impl)
            for op in ("layer", "head"):
                (_, fwd, _), (_, bwd, setup) = bench.items(op, T, 0)[:2]
                calls[impl, op] = (fwd, bwd, setup)
        for fwd, bwd, setup in calls.values():
            for _ in range(warmup):
                bench.timer.once(fwd)
                bench.timer.once(bwd, setup)
        times: dict = {key: ([], []) for key in calls}
        order = np.random.default_rng(seed + T)
        for _ in range(repeats):
            for i in order.permutation(len(calls)):
                key = list(calls)[i]
                fwd, bwd, setup = calls[key]
                times[key][0].append(bench.timer.once(fwd))
                times[key][1].append(bench.timer.once(bwd, setup))
        for (impl, op), (fwd, bwd, setup) in calls.items():
            a_f, a_b = _analytical(model, name, op, T)
            tf, tb = times[impl, op]
            f, b = statistics.median(tf), statistics.median(tb)
            rows.append({"impl": impl, "op": op, "tokens": T, "fwd_s": f, "bwd_s": b, "fwd_min_s": min(tf),
                         "fwd_max_s": max(tf), "bwd_min_s": min(tb), "bwd_max_s": max(tb),
                         "launches": count_launches(lambda fwd=fwd, bwd=bwd: bwd(fwd()), device),
                         "analytical_fwd_s": a_f, "analytical_bwd_s": a_b, "ratio_fwd": f / a_f, "ratio_bwd": b / a_b})
        if progress is not None:
            progress(rows)
    return pd.DataFrame(rows)


def agreement(model: ModelConfig, tokens: int, *, device: str = "cpu", dtype: str = "float32", seed: int = 0) -> Any:
    """Eager and compiled decoder layer in ``dtype`` against the same layer in float64, on one causal
    sequence of ``tokens`` with transformers' SDPA attention (real gradients reach q and k): one row
    per tensor (``out``, ``dx``, each weight's gradient) with each implementation's relative error
    ``|x - ref| / |ref|`` and ``ok``: compiled's error at most twice eager's + 1e-3."""
    import copy

    import pandas as pd
    import torch

    from sparsebalance.kernels.fastlayer import layer_forward
    from sparsebalance.kernels.qwen2 import build_qwen2_pieces
    from sparsebalance.kernels.qwen2_init import layer_piece

    net = build_qwen2_pieces(model, [layer_piece(0)], seed=seed, dtype="float64", device=device)
    net.config._attn_implementation = "sdpa"
    ref = net.model.layers[0]
    low = copy.deepcopy(ref).to(getattr(torch, dtype))
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(1, tokens, model.hidden, generator=gen, device=device, dtype=torch.float64)
    dy = torch.randn(1, tokens, model.hidden, generator=gen, device=device, dtype=torch.float64)
    pos = torch.arange(tokens, device=device)[None]

    def run(layer: Any, impl: str) -> dict[str, Any]:
        xi = x.detach().to(layer.input_layernorm.weight.dtype).requires_grad_()
        pe = net.model.rotary_emb(xi, pos)
        y = (layer_forward(layer, xi, pe) if impl == "compiled"
             else layer(xi, attention_mask=None, position_ids=pos, position_embeddings=pe))
        y.backward(dy.to(y.dtype))
        got = {"out": y.detach(), "dx": xi.grad} | {n: p.grad for n, p in layer.named_parameters()}
        layer.zero_grad(set_to_none=True)
        return {k: v.double() for k, v in got.items()}

    want, eager, comp = run(ref, "eager"), run(low, "eager"), run(low, "compiled")
    rows = []
    for k, r in want.items():
        e, c = (float((d[k] - r).norm() / r.norm()) for d in (eager, comp))
        rows.append({"tensor": k, "err_eager": e, "err_compiled": c, "ok": c <= 2 * e + 1e-3})
    return pd.DataFrame(rows)
