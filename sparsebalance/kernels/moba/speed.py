"""Speed of the MoBA Triton kernel against dense causal attention on one CUDA GPU.

One packed sequence of L tokens per point, budget k = max(1, round(density x n_blocks)). Times, with
``triton.testing.do_bench(..., return_mode="median")`` (its default is the mean), forward and
forward + backward of ``moba_attention_triton``
(selection and index building included: what a training step pays) and of dense causal attention
(``flash_attn_varlen_func`` when installed, else SDPA restricted to the flash backend, kv heads
repeated for GQA). TFLOP/s count attended pairs (the causal convention): forward 4 D per pair and
head, forward + backward 14 D (backward = 2.5 x forward). ``predicted_ms`` is the analytical cost
model (``simulator/cost/roofline.py``) for the same shapes on the matching hardware, when the device
name says H100, H200 or H20. Used by ``benchmarks/bench_moba_gpu.py`` and ``sparsebalance gpu-check``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sparsebalance.data.sequence import blocks


@dataclass(kw_only=True, slots=True, frozen=True)
class SpeedShape:
    """Attention shape of the speed grid (default: qwen2.5-3b on one TP-2 rank, paper block)."""

    heads: int = 8
    """Query heads."""
    kv_heads: int = 1
    """Key/value heads."""
    head_dim: int = 128
    """Head dimension."""
    block: int = 256
    """MoBA block size."""


def hardware_for(device_name: str):
    """The analytical Hardware whose label is a word of the CUDA device name (None if none is)."""
    from sparsebalance.simulator.cost.roofline import HARDWARE

    words = device_name.lower().replace("-", " ").split()
    return next((hw for key, hw in HARDWARE.items() if key in words), None)


def dense_fn(q, k, v, cu) -> tuple[Any, str]:
    """Dense causal attention: flash_attn varlen if installed, else SDPA on the flash backend."""
    import torch

    try:
        from flash_attn import flash_attn_varlen_func

        L = int(cu[-1])
        return (lambda: flash_attn_varlen_func(q, k, v, cu, cu, L, L, causal=True)), "flash_attn"
    except ImportError:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        g = q.shape[1] // k.shape[1]
        # kv heads repeated once, outside the timed call (flash_attn takes GQA natively; SDPA's flash
        # backend needs equal head counts): the dense time is the attention kernel's alone
        qt, kt, vt = (x.repeat_interleave(r, 1).transpose(0, 1).unsqueeze(0).detach().requires_grad_()
                      for x, r in ((q, 1), (k, g), (v, g)))

        def run():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

        return run, "sdpa-flash"


#: What a time in the table is (the ``statistic`` column).
STATISTIC = "median of triton.testing.do_bench (CUDA events; warmup 5 ms, rep 30 ms)"


def _bench(fn, backward: bool) -> float:
    """Median milliseconds of fn (and its backward)."""
    import torch
    import triton

    if not backward:
        return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")

    def step():
        out = fn()
        out.backward(torch.ones_like(out))

    return triton.testing.do_bench(step, warmup=5, rep=30, return_mode="median")


def measure_point(L: int, density: float, shape: SpeedShape, *, dense_ms: dict | None = None) -> list[dict]:
    """Rows (fwd, fwd+bwd) for one length and density; ``dense_ms`` caches the dense timings per L."""
    import torch

    from sparsebalance.kernels.moba.triton_impl import moba_attention_triton
    from sparsebalance.simulator.config import ModelConfig
    from sparsebalance.simulator.cost.roofline import attention_time

    H, HKV, D, B = shape.heads, shape.kv_heads, shape.head_dim, shape.block
    g = torch.Generator(device="cuda").manual_seed(L)
    q, k, v = (torch.randn(L, n, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for n in (H, HKV, HKV))
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    nb = blocks(L, B)
    topk = max(1, round(density * nb))
    pairs = _pairs(L, B, topk) * H
    dense_pairs = L * (L + 1) // 2 * H
    cache = {} if dense_ms is None else dense_ms
    hw = hardware_for(torch.cuda.get_device_name())
    model = ModelConfig(name="speed", hidden=H * D, layers=1, heads=H, kv_heads=HKV, head_dim=D, ffn=1,
                        vocab=1, block_size=B)
    rows = []
    for mode, bwd, mult in (("fwd", False, 1.0), ("fwd+bwd", True, 3.5)):
        t_m = _bench(lambda: moba_attention_triton(q, k, v, cu, B, topk), bwd)
        if (L, mode) not in cache:
            fn, name = dense_fn(q, k, v, cu)
            cache[(L, mode)] = (_bench(fn, bwd), name)
        t_d, name = cache[(L, mode)]
        pred = None
        if hw is not None:
            pred = float(attention_time(L, topk, model, 1, B, hw))
            if bwd:
                pred += float(attention_time(L, topk, model, 1, B, hw, backward=True))
            pred *= 1e3
        rows.append({"tokens": L, "density": density, "topk": topk, "mode": mode, "moba_ms": t_m, "dense_ms": t_d,
                     "moba_tflops": 4 * D * mult * pairs / t_m / 1e9,
                     "dense_tflops": 4 * D * mult * dense_pairs / t_d / 1e9,
                     "speedup": t_d / t_m, "dense": name, "predicted_ms": pred, "statistic": STATISTIC})
    return rows


def _pairs(L: int, B: int, k: int) -> int:
    """Attended pairs of one head (closed form, as roofline.moba_pairs)."""
    from sparsebalance.simulator.cost.roofline import moba_pairs

    return int(moba_pairs(L, B, k))


def speed_table(lengths, densities, shape: SpeedShape, *, budget_s: float | None = None, progress=None) -> Any:
    """The grid as a DataFrame, in the order given; after the first point, stops early (rows so far)
    once ``budget_s`` seconds are spent. ``progress(rows)`` gets the rows so far after each point."""
    import pandas as pd
    import torch

    rows, cache, t0 = [], {}, time.monotonic()
    for L in lengths:
        for d in densities:
            if rows and budget_s is not None and time.monotonic() - t0 > budget_s:
                return pd.DataFrame(rows)
            rows += measure_point(L, d, shape, dense_ms=cache)
            torch.cuda.empty_cache()
            if progress is not None:
                progress(rows)
    return pd.DataFrame(rows)
