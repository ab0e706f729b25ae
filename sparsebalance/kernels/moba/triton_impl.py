"""MoBA block-sparse attention in Triton: validation, the plan per shape key, the autograd.Function.

Layout (FlashAttention varlen): q [T, H, D], k and v [T, H_kv, D], cu_seqlens [N + 1] (a host list or
CPU tensor for a call without host synchronisation; a CUDA tensor is read once, which synchronises),
topk an int or [N] budgets (own block included). Semantics: ``naive.py`` / README.

Per call: the plan (``plan.py``: every table that follows from lengths, budgets and shapes, and the
path of each sequence, :func:`sequence_kinds`) is looked up by its shape key -- built on the first call of a
shape, reused by every layer after; the gate and index (``triton_gate.py``, ``triton_select.py``),
the forward (``triton_fwd.py``) and the backward (``triton_bwd.py``) then run with fixed-size
tensors and grids sized from host upper bounds: no ``.item()``, ``nonzero``, data-dependent shape or
copy to the host anywhere (tests/kernels/test_triton_host.py records every such op).
"""

from __future__ import annotations

import itertools
import os

import torch

from sparsebalance.errors import ConfigError
from sparsebalance.kernels.moba import launch
from sparsebalance.kernels.moba.plan import DENSE, MASKED, SPARSE, MobaPlan, build_plan, get_plan
from sparsebalance.kernels.moba.triton_bwd import moba_backward
from sparsebalance.kernels.moba.triton_fwd import moba_forward
from sparsebalance.kernels.moba.triton_select import MobaIndex, build_index

#: Bytes of partial outputs (one D-vector per chosen block) held at once; larger calls run the forward
#: in chunks of whole key blocks (same result, a few more launches).
PARTIAL_BYTES = 1 << 30
#: Least gathered entries per backward piece (long row lists of popular key blocks are split into
#: pieces; ``plan.bwd_entries`` grows the piece to make about ``plan.PROGRAMS`` programs).
BWD_ENTRIES = 2048
#: Least (row tile x query head) pairs per own-block backward piece (long dense rows are split;
#: grown the same way).
OWN_TILES = 32
PATHS = ("auto", "sparse", "masked")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def min_tile(device: torch.device | str) -> int:
    """Smallest query / key tile (rows) the kernels accept on ``device``: 16 where they are compiled
    for a GPU (``tl.dot`` needs every dimension >= 16 there; seen on an H100, 2026-11-26), 1 under the
    interpreter, which runs any tile and is how the tests cover several tiles per block at tiny sizes."""
    return 1 if _interpreting() or torch.device(device).type != "cuda" else 16


def configs(block: int, head_dim: int, device: torch.device, block_m: int | None = None,
            block_n: int | None = None) -> dict:
    """Launch configuration per kernel (``launch.config``), tiles capped at the block; ``block_m`` /
    ``block_n`` replace the attention kernels' tiles (tests). Interpreted, the gate takes 64 (row,
    head) pairs a program: the interpreter's cost is per operation, not per element."""
    from dataclasses import replace

    out = {}
    for name in launch.KERNELS:
        c = launch.config(name, head_dim, device)
        if name == "gate":
            c = replace(c, block_m=64) if _interpreting() else c
        else:
            c = replace(c, block_m=min(block_m or c.block_m, block), block_n=min(block_n or c.block_n, block))
        out[name] = c
    # the dQ kernels walk the forward's items and query tiles: same row tiles
    out["bwd_dq_past"] = replace(out["bwd_dq_past"], block_m=out["fwd_past"].block_m)
    out["bwd_dq_own"] = replace(out["bwd_dq_own"], block_m=out["fwd_own_merge"].block_m)
    return out


def dispatch_hardware(device: torch.device):
    """The hardware whose cost model the dispatcher consults: the analytical H100, H200 or H20 named
    by the CUDA device, else the H100 (also on the CPU, where only the interpreter runs the kernel)."""
    import re

    from sparsebalance.simulator.cost.roofline import H100, HARDWARE

    if device.type != "cuda":
        return H100
    m = re.search(r"\bH(100|200|20)\b", torch.cuda.get_device_name(device))
    return HARDWARE[f"h{m.group(1)}"] if m else H100


def sequence_kinds(lengths: list[int], topks: list[int], block: int, heads: int, kv_heads: int, head_dim: int,
                   elem: int, device: torch.device, path: str = "auto") -> list[int]:
    """Per sequence DENSE (k >= n), or for k < n the SPARSE key-block-major or the MASKED dense path:
    ``"auto"`` takes the one ``simulator.cost.kernelcost.choose_path`` prices lower for forward +
    backward (the rule the analytical profiles price); ``"sparse"`` / ``"masked"`` force one."""
    from sparsebalance.data.sequence import blocks

    if not lengths:
        return []
    if path != "auto":
        return [DENSE if k >= blocks(L, block) else (MASKED if path == "masked" else SPARSE)
                for L, k in zip(lengths, topks)]
    import numpy as np

    from sparsebalance.simulator.cost import kernelcost as kc

    shape = kc.Shape(heads=heads, kv_heads=kv_heads, head_dim=head_dim, block=block, dtype_bytes=elem)
    return [int(x) for x in kc.choose_path(np.asarray(lengths), np.asarray(topks), shape, dispatch_hardware(device))]


def _host_ints(x, name: str) -> list[int]:
    """A host list of ints from a list, tuple or tensor (a CUDA tensor is read once: a sync)."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ConfigError(f"{name}: must be 1-D, got shape {tuple(x.shape)}")
        return x.tolist()
    return [int(v) for v in x]


def _topks(topk, n: int) -> list[int]:
    if isinstance(topk, int) and not isinstance(topk, bool):
        ks = [topk] * n
    elif isinstance(topk, torch.Tensor) and topk.dim() == 0:
        ks = [int(topk)] * n
    else:
        ks = _host_ints(topk, "topk")
    if len(ks) != n:
        raise ConfigError(f"topk: must be an int or a tensor [N={n}], got {len(ks)} values")
    if min(ks, default=1) < 1:
        raise ConfigError(f"topk: must be >= 1, got {ks}")
    return ks


def _validate(q, k, v, cu: list[int], block_size) -> None:
    """ConfigError naming the first bad argument (messages are built only on failure: this runs per call)."""
    if q.dim() != 3:
        raise ConfigError(f"q: must be [T, H, D], got shape {tuple(q.shape)}")
    T, H, D = q.shape
    if k.dim() != 3 or k.shape[0] != T or k.shape[2] != D:
        raise ConfigError(f"k: must be [T, H_kv, D] matching q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ConfigError(f"v: must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if H % k.shape[1]:
        raise ConfigError(f"k: H={H} must be divisible by H_kv={k.shape[1]}")
    if not q.dtype == k.dtype == v.dtype:
        raise ConfigError(f"q: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ConfigError(f"q: dtype {q.dtype} is not allowed; choose one of float32, float16, bfloat16")
    if D < 16 or D & (D - 1):
        raise ConfigError(f"q: head_dim must be a power of two >= 16, got {D}")
    if not isinstance(block_size, int) or block_size < 16 or block_size & (block_size - 1):
        raise ConfigError(f"block_size: must be a power of two >= 16 for the Triton kernel, got {block_size!r}")
    if len(cu) < 2:
        raise ConfigError("cu_seqlens: must be a 1-D tensor [N + 1], N >= 1")
    if cu[0] != 0 or any(b <= a for a, b in itertools.pairwise(cu)):
        raise ConfigError("cu_seqlens: must start at 0 and be strictly increasing")
    if cu[-1] != T:
        raise ConfigError(f"cu_seqlens: must end at T={T}, got {cu[-1]}")


def plan_for(q, k, cu: list[int], ks: list[int], block_size: int, *, path: str = "auto", block_m=None,
             block_n=None) -> MobaPlan:
    """The cached plan of this call's shape key (lengths, budgets, block, heads, dims, dtype, device,
    path, tiles, the module's caps): built and checked on the first call of a shape only."""
    key = (tuple(cu), tuple(ks), block_size, q.shape[1], k.shape[1], q.shape[2], q.dtype, q.device, path, block_m,
           block_n, PARTIAL_BYTES, BWD_ENTRIES, OWN_TILES, _interpreting(), tuple(sorted(launch._override.items())))

    def build():
        if path not in PATHS:
            raise ConfigError(f"path: must be one of {', '.join(PATHS)}, got {path!r}")
        low = min_tile(q.device)
        for name, t in (("block_m", block_m), ("block_n", block_n)):
            if t is not None and (t < 1 or t & (t - 1) or block_size % t):
                raise ConfigError(f"{name}: must be a power of two dividing block_size={block_size}, got {t}")
            if t is not None and t < low:
                raise ConfigError(f"{name}: must be >= {low} on {q.device.type} (tl.dot needs 16-row tiles "
                                  f"when compiled), got {t}")
        lens = [b - a for a, b in itertools.pairwise(cu)]
        H, HKV, D = q.shape[1], k.shape[1], q.shape[2]
        kinds = sequence_kinds(lens, ks, block_size, H, HKV, D, q.element_size(), q.device, path)
        return build_plan(cu, ks, kinds, H=H, HKV=HKV, D=D, block=block_size, elem=q.element_size(),
                          cfg=configs(block_size, D, q.device, block_m, block_n), device=q.device,
                          partial_bytes=PARTIAL_BYTES, bwd_entries_arg=BWD_ENTRIES, own_tiles=OWN_TILES,
                          kw_min=1 if _interpreting() else 16)

    return get_plan(key, build)


def index_for(q, k, cu_seqlens, block_size: int, topk, *, path: str = "auto", write_sel: bool = True,
              block_m=None, block_n=None) -> tuple[MobaPlan, MobaIndex]:
    """(plan, index) of a call, with the selection table ``sel`` (tests and tools)."""
    cu = _host_ints(cu_seqlens, "cu_seqlens")
    plan = plan_for(q, k, cu, _topks(topk, len(cu) - 1), block_size, path=path, block_m=block_m, block_n=block_n)
    return plan, build_index(plan, q.detach(), k.detach(), write_sel=write_sel)


class _MobaTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan):
        idx = build_index(plan, q.detach(), k.detach())
        o, lse = moba_forward(plan, idx, q, k, v, interpreting=_interpreting())
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan, ctx.idx = plan, idx
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = moba_backward(ctx.plan, ctx.idx, q, k, v, o, lse, do.contiguous(),
                                   interpreting=_interpreting())
        return dq, dk, dv, None


def moba_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, block_size: int, topk, *,
                          block_m: int | None = None, block_n: int | None = None, path: str = "auto") -> torch.Tensor:
    """MoBA attention with the Triton kernels; differentiable in q, k, v.

    q: [T, H, D]; k, v: [T, H_kv, D]; cu_seqlens: [N + 1] boundaries (a host list / CPU tensor: no
    host sync); topk: int or [N] budgets (own block included). Returns out [T, H, D] in q's dtype.
    ``block_m`` / ``block_n`` (query and key tile rows, powers of two dividing ``block_size``)
    replace the attention kernels' tiles of ``launch.py``. ``path``: per sequence with topk <
    n_blocks, ``"auto"`` runs the cheaper by the cost model of the sparse key-block-major path and
    the masked dense path (:func:`sequence_kinds`); ``"sparse"`` or ``"masked"`` force one. Every
    path computes the same MoBA attention.
    """
    cu = _host_ints(cu_seqlens, "cu_seqlens")
    _validate(q, k, v, cu, block_size)
    ks = _topks(topk, len(cu) - 1)
    plan = plan_for(q, k, cu, ks, block_size, path=path, block_m=block_m, block_n=block_n)
    return _MobaTriton.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan)
