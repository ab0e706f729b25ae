"""Public MoBA entry points: ``moba_attention`` (backend dispatch) and ``moba_coverage``.

Both validate their inputs first; bad input raises :class:`sparsebalance.errors.ConfigError`
(a ``ValueError``) whose message starts with the argument's name.

Host synchronisation: ``cu_seqlens`` may be given on the host (a list of ints or a CPU int32 tensor)
and ``topk`` as an int, a list or a CPU tensor; the Triton backend then runs without a single
device-to-host synchronisation. A ``cu_seqlens`` or ``topk`` tensor on the GPU is read once per call
to validate it and to plan the kernels (one synchronisation each).
"""

from __future__ import annotations

import itertools
from typing import Any

from sparsebalance.errors import ConfigError, check_choice

BACKENDS = ("auto", "triton", "torch", "naive")


def _cu_host(cu_seqlens: Any, total: int, device: Any) -> list[int]:
    """Validate ``cu_seqlens`` (int32 tensor on q's device or the CPU, or a list of ints); its values
    on the host (reading a GPU tensor synchronises)."""
    import torch

    if isinstance(cu_seqlens, (list, tuple)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens):
            raise ConfigError("cu_seqlens: a list must hold ints")
        c = list(cu_seqlens)
    elif isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1:
        if cu_seqlens.device not in (device, torch.device("cpu")):
            raise ConfigError(f"cu_seqlens: must be on {device} or the CPU, got {cu_seqlens.device}")
        c = cu_seqlens.tolist()
    else:
        raise ConfigError("cu_seqlens: must be a 1-D torch.int32 tensor [N + 1] or a list of ints")
    if len(c) < 2:
        raise ConfigError("cu_seqlens: needs at least 2 entries (one sequence)")
    if c[0] != 0:
        raise ConfigError(f"cu_seqlens: must start at 0, got {c[0]}")
    if any(b <= a for a, b in itertools.pairwise(c)):
        raise ConfigError("cu_seqlens: must be strictly increasing (no empty sequences)")
    if c[-1] != total:
        raise ConfigError(f"cu_seqlens: must end at the token count T = {total}, got {c[-1]}")
    return c


def _check_qk(q: Any, k: Any) -> None:
    import torch

    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ConfigError(f"{name}: must be a 3-D tensor [T, heads, head_dim]")
        if not x.is_floating_point():
            raise ConfigError(f"{name}: must be a floating-point tensor, got {x.dtype}")
    if q.shape[1] < 1 or q.shape[2] < 1 or q.shape[0] < 1:
        raise ConfigError(f"q: every dimension of [T, heads, head_dim] must be >= 1, got {tuple(q.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ConfigError(f"k: shape {tuple(k.shape)} does not match q {tuple(q.shape)} "
                          "(need [T, H_kv, D] with the T and D of q)")
    if k.dtype != q.dtype:
        raise ConfigError(f"k: dtype {k.dtype} differs from q's {q.dtype}")
    if k.device != q.device:
        raise ConfigError(f"k: device {k.device} differs from q's {q.device}")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1] != 0:
        raise ConfigError(f"k: kv heads ({k.shape[1]}) must divide the query heads H ({q.shape[1]})")


def _check_block_size(block_size: Any) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size: must be an integer >= 1, got {block_size!r}")


def _topk_host(topk: Any, n: int) -> list[int]:
    """Validate ``topk`` (int >= 1, or integer tensor / list [N] >= 1); its values on the host."""
    import torch

    if isinstance(topk, torch.Tensor):
        if topk.is_floating_point() or topk.is_complex() or topk.dtype == torch.bool:
            raise ConfigError(f"topk: tensor must have an integer dtype, got {topk.dtype}")
        if topk.dim() != 1 or topk.numel() != n:
            raise ConfigError(f"topk: tensor must have shape [N] = [{n}] (one per sequence), "
                              f"got {tuple(topk.shape)}")
        ks = topk.tolist()
    elif isinstance(topk, (list, tuple)):
        if len(topk) != n or not all(isinstance(x, int) and not isinstance(x, bool) for x in topk):
            raise ConfigError(f"topk: a list must hold N = {n} ints, got {topk!r}")
        ks = list(topk)
    elif isinstance(topk, bool) or not isinstance(topk, int):
        raise ConfigError(f"topk: must be an int or an integer tensor [N], got {type(topk).__name__}")
    else:
        ks = [topk] * n
    if n and min(ks) < 1:
        raise ConfigError(f"topk: must be >= 1, got {min(ks)}")
    return ks


def validate(q: Any, k: Any, v: Any, cu_seqlens: Any, block_size: Any, topk: Any) -> tuple[list[int], list[int]]:
    """Check every argument of ``moba_attention``; return (cu_seqlens, topk) on the host."""
    import torch

    _check_qk(q, k)
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(k.shape):
        got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        raise ConfigError(f"v: shape {got} must equal k's {tuple(k.shape)}")
    if v.dtype != q.dtype:
        raise ConfigError(f"v: dtype {v.dtype} differs from q's {q.dtype}")
    if v.device != q.device:
        raise ConfigError(f"v: device {v.device} differs from q's {q.device}")
    cu = _cu_host(cu_seqlens, q.shape[0], q.device)
    _check_block_size(block_size)
    return cu, _topk_host(topk, len(cu) - 1)


def moba_attention(q: Any, k: Any, v: Any, cu_seqlens: Any, block_size: int = 64, topk: Any = 4,
                   backend: str = "auto") -> Any:
    """MoBA attention over packed sequences; returns ``[T, H, D]`` like ``q``.

    ``q`` ``[T, H, D]``, ``k``/``v`` ``[T, H_kv, D]`` (``H % H_kv == 0``), ``cu_seqlens`` int32 ``[N + 1]``
    (0, ..., T, strictly increasing; a list or CPU tensor keeps the Triton backend free of host syncs), ``block_size`` in tokens, ``topk`` (blocks attended per query,
    own block included) an int or an integer tensor ``[N]``. ``backend``: ``"auto"`` (Triton on CUDA
    tensors, the chunked PyTorch implementation elsewhere), ``"triton"``, ``"torch"`` or ``"naive"``.
    """
    import torch

    check_choice(backend, "backend", BACKENDS)
    cu, ks = validate(q, k, v, cu_seqlens, block_size, topk)
    if backend == "auto":
        backend = "triton" if q.device.type == "cuda" else "torch"
    if backend == "triton":
        from sparsebalance.kernels.moba.triton_impl import moba_attention_triton

        return moba_attention_triton(q, k, v, cu, block_size, ks)  # host values: no synchronisation
    cu_t, topk_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(ks, dtype=torch.int64)
    if backend == "naive":
        from sparsebalance.kernels.moba.naive import moba_attention_naive

        return moba_attention_naive(q, k, v, cu_t, block_size, topk_t)
    from sparsebalance.kernels.moba.chunked import moba_attention_chunked

    return moba_attention_chunked(q, k, v, cu_t, block_size, topk_t)


def moba_coverage(q: Any, k: Any, cu_seqlens: Any, block_size: int, topks: Any) -> Any:
    """Routing coverage C(k) ``[N, len(topks)]`` float64 of each sequence at each budget, measured
    from the gate scores of ``q``/``k`` (definition: ``docs/coverage.md``)."""
    import torch

    _check_qk(q, k)
    cu = torch.tensor(_cu_host(cu_seqlens, q.shape[0], q.device), dtype=torch.int32, device=q.device)
    _check_block_size(block_size)
    try:
        ks = [int(x) for x in topks]
    except (TypeError, ValueError):
        raise ConfigError(f"topks: must be a sequence of integers >= 1, got {topks!r}") from None
    if not ks or min(ks) < 1:
        raise ConfigError(f"topks: must be a non-empty sequence of integers >= 1, got {ks}")
    from sparsebalance.kernels.moba.coverage import coverage

    return coverage(q, k, cu, block_size, ks)
