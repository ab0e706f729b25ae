"""Speed of the MoBA Triton kernel against dense causal attention on one CUDA GPU.

One packed sequence of L tokens per point, budget k = max(1, round(density x n_blocks)), the lengths
given on the host (no synchronisation). Times, with ``triton.testing.do_bench(...,
return_mode="median")`` (its default is the mean), forward and forward + backward of
``moba_attention_triton`` (gate and index included: what a training step pays) -- first checked once
under ``torch.cuda.set_sync_debug_mode("error")`` (column ``host_syncs``: "none", or the error of the
first synchronising op) and, when that passes, timed under it -- and of dense causal attention
(``flash_attn_varlen_func`` when installed, else SDPA restricted to the flash backend, kv heads
repeated for GQA). TFLOP/s count attended pairs (the causal convention): forward 4 D per pair and
head, forward + backward 14 D (backward = 2.5 x forward). ``predicted_ms`` is the analytical cost
model (``simulator/cost/roofline.py``) for the same shapes on the matching hardware, when the device
name says H100, H200 or H20. :func:`target_table` sets the issue's targets beside the measured points;
:func:`tune` times the launch candidates (``launch.CANDIDATES``) at one point and picks per kernel.
Used by ``benchmarks/bench_moba_gpu.py`` and ``sparsebalance gpu-check``.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def sync_errors(on: bool = True):
    """Every host synchronisation raises inside the block (``torch.cuda.set_sync_debug_mode``)."""
    import torch

    if not on:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _step(fn, backward: bool, guard: bool):
    import torch

    def step():
        with sync_errors(guard):
            out = fn()
            if backward:
                out.backward(torch.ones_like(out))
    return step


def _bench(fn, backward: bool, guard: bool = False) -> float:
    """Median milliseconds of fn (and its backward); ``guard``: under ``sync_errors``."""
    import triton

    return triton.testing.do_bench(_step(fn, backward, guard), warmup=5, rep=30, return_mode="median")


def sync_check(fn) -> str:
    """"none" when a forward + backward of ``fn`` runs under ``sync_errors``, else the first line of
    the error (a synchronising op); the call before it is unguarded (plans, JIT compilation)."""
    _step(fn, True, False)()
    try:
        _step(fn, True, True)()
    except RuntimeError as e:
        return (str(e).splitlines() or ["error"])[0][:200]
    return "none"


def _inputs(L: int, shape: SpeedShape):
    import torch

    g = torch.Generator(device="cuda").manual_seed(L)
    return tuple(torch.randn(L, n, shape.head_dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                 for n in (shape.heads, shape.kv_heads, shape.kv_heads))


def measure_point(L: int, density: float, shape: SpeedShape, *, dense_ms: dict | None = None) -> list[dict]:
    """Rows (fwd, fwd+bwd) for one length and density; ``dense_ms`` caches the dense timings per L."""
    import torch

    from sparsebalance.kernels.moba.triton_impl import moba_attention_triton
    from sparsebalance.simulator.config import ModelConfig
    from sparsebalance.simulator.cost.roofline import attention_time

    H, HKV, D, B = shape.heads, shape.kv_heads, shape.head_dim, shape.block
    q, k, v = _inputs(L, shape)
    cu_host = [0, L]                                     # the lengths on the host: a sync-free call
    nb = blocks(L, B)
    topk = max(1, round(density * nb))
    pairs = _pairs(L, B, topk) * H
    dense_pairs = L * (L + 1) // 2 * H
    cache = {} if dense_ms is None else dense_ms
    hw = hardware_for(torch.cuda.get_device_name())
    model = ModelConfig(name="speed", hidden=H * D, layers=1, heads=H, kv_heads=HKV, head_dim=D, ffn=1,
                        vocab=1, block_size=B)
    moba = lambda: moba_attention_triton(q, k, v, cu_host, B, topk)
    syncs = sync_check(moba)
    rows = []
    for mode, bwd, mult in (("fwd", False, 1.0), ("fwd+bwd", True, 3.5)):
        t_m = _bench(moba, bwd, guard=syncs == "none")
        if (L, mode) not in cache:
            fn, name = dense_fn(q, k, v, torch.tensor([0, L], dtype=torch.int32, device="cuda"))
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
                     "speedup": t_d / t_m, "dense": name, "predicted_ms": pred, "host_syncs": syncs,
                     "statistic": STATISTIC})
    return rows


def _pairs(L: int, B: int, k: int) -> int:
    """Attended pairs of one head (closed form, as roofline.moba_pairs)."""
    from sparsebalance.simulator.cost.roofline import moba_pairs

    return int(moba_pairs(L, B, k))


def speed_table(points, shape: SpeedShape, *, budget_s: float | None = None, progress=None) -> Any:
    """The (length, density) ``points`` as a DataFrame, in the order given; after the first point, stops
    early (rows so far) once ``budget_s`` seconds are spent. ``progress(rows)`` gets the rows so far
    after each point."""
    import pandas as pd
    import torch

    rows, cache, t0 = [], {}, time.monotonic()
    for L, d in points:
        if rows and budget_s is not None and time.monotonic() - t0 > budget_s:
            break
        rows += measure_point(L, d, shape, dense_ms=cache)
        torch.cuda.empty_cache()
        if progress is not None:
            progress(rows)
    return pd.DataFrame(rows)


#: The issue's targets (issue 33), forward + backward at density 1/8: MoBA / dense speedup per length.
TARGETS = {8192: 1.0, 32768: 2.5, 131072: 3.0}
#: Useful TFLOP/s per attended FLOP from 32K tokens on: at least this share of the dense kernel's.
TFLOPS_SHARE = 0.6


def target_table(df) -> Any:
    """The issue's target table from speed rows: per target length at 1/8 (fwd+bwd) the speedup and
    its target; per length >= 32K the TFLOP/s share of dense; and "never slower than dense" over every
    point at density <= 1/4 (one row). Column ``met``: True / False, or None when not measured."""
    import pandas as pd

    fb = df[df["mode"] == "fwd+bwd"] if len(df) else df
    rows = []
    for L, want in TARGETS.items():
        r = fb[(fb.tokens == L) & (fb.density == 1 / 8)] if len(fb) else fb
        got = float(r.speedup.iloc[0]) if len(r) else None
        share = float(r.moba_tflops.iloc[0] / r.dense_tflops.iloc[0]) if len(r) else None
        rows.append({"measure": f"fwd+bwd {L // 1024}K tokens, 1/8", "measured": got, "target": f">= {want}x",
                     "met": None if got is None else got >= want,
                     "tflops_share": share, "tflops_target": f">= {TFLOPS_SHARE}" if L >= 32768 else "",
                     "tflops_met": None if share is None or L < 32768 else share >= TFLOPS_SHARE})
    low = fb[fb.density <= 1 / 4] if len(fb) else fb
    worst = float(low.speedup.min()) if len(low) else None
    rows.append({"measure": f"any point at density <= 1/4 ({len(low)} measured)", "measured": worst,
                 "target": ">= 1x (never slower)", "met": None if worst is None else worst >= 1.0,
                 "tflops_share": None, "tflops_target": "", "tflops_met": None})
    return pd.DataFrame(rows)


def tune(shape: SpeedShape, L: int = 32768, density: float = 1 / 8, *, budget_s: float | None = None,
         progress=None) -> tuple[Any, dict]:
    """Each kernel's launch candidates (``launch.CANDIDATES``; the others at their chosen
    configuration) timed at one point -- forward for the forward kernels and the gate, forward +
    backward for the backward ones -- most valuable kernels first, within ``budget_s``.
    Returns (rows, picks): per kernel the fastest candidate measured."""
    import pandas as pd

    from sparsebalance.kernels.moba import launch
    from sparsebalance.kernels.moba.triton_impl import moba_attention_triton

    q, k, v = _inputs(L, shape)
    topk = max(1, round(density * blocks(L, shape.block)))
    rows, t0 = [], time.monotonic()
    for kernel in ("bwd_kv", "fwd_past", "bwd_dq_past", "fwd_own_merge", "bwd_dq_own", "gate"):
        chosen = launch.chosen(kernel, shape.head_dim).label()
        for cand in launch.CANDIDATES[kernel]:
            if budget_s is not None and time.monotonic() - t0 > budget_s:
                break
            with launch.override({kernel: cand}):
                fn = lambda: moba_attention_triton(q, k, v, [0, L], shape.block, topk)
                try:
                    ms = _bench(fn, kernel.startswith("bwd"))
                except Exception as e:  # noqa: BLE001 -- a candidate the device cannot run is a row, not a stop
                    ms = float("nan")
                    print(f"tune: {kernel} {cand}: {type(e).__name__}: {str(e)[:120]}")
            rows.append({"kernel": kernel, "config": cand, "chosen": cand == chosen, "tokens": L, "density": density,
                         "mode": "fwd+bwd" if kernel.startswith("bwd") else "fwd", "ms": ms, "statistic": STATISTIC})
            if progress is not None:
                progress(rows)
    df = pd.DataFrame(rows)
    picks = {kn: g.loc[g.ms.idxmin(), "config"] for kn, g in df.groupby("kernel") if g.ms.notna().any()} if len(df) else {}
    return df, picks
