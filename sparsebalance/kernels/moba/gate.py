"""The MoBA gate, shared by every fast implementation: block means, gate scores, top-k selection.

For one sequence of length ``L`` with block size ``B``: key block ``j`` covers ``[jB, min((j+1)B, L))``,
its gate key is the mean of its keys; query ``t`` (in block ``c = t // B``) scores the past blocks
``j < c`` by ``s(t, j) = q_t · mean_j`` (per query head, with that head's kv head ``h // (H / H_kv)``)
and attends the ``topk - 1`` best ones fully (all of them when ``c <= topk - 1``).

**Tie-break** (every implementation follows it): among equal scores the lower block index wins.
**Precision**: scores are computed in float32 for half-precision inputs, else in the input dtype.
Selection is not differentiable (computed on detached tensors).
"""

from __future__ import annotations

from typing import Any

from sparsebalance.data.sequence import blocks


def gate_dtype(dtype: Any) -> Any:
    """dtype the gate is computed in: float32 for bf16/fp16 inputs, else the input dtype."""
    import torch

    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def block_means(k: Any, block_size: int) -> Any:
    """Mean key of each block of one sequence: ``k`` ``[L, H_kv, D]`` -> ``[n_blocks, H_kv, D]``.

    The last block may be partial; its mean is over its actual length.
    """
    import torch

    L, hk, d = k.shape
    nb = blocks(L, block_size)
    kd = k.detach().to(gate_dtype(k.dtype))
    full = (L // block_size) * block_size
    means = kd[:full].reshape(-1, block_size, hk, d).mean(dim=1)
    if full < L:
        means = torch.cat([means, kd[full:].mean(dim=0, keepdim=True)], dim=0)
    return means[:nb]


def gate_scores(q: Any, means: Any) -> Any:
    """Gate scores ``[L, H, n_blocks]`` of one sequence: ``q`` ``[L, H, D]``, ``means`` ``[nb, H_kv, D]``.

    Unscaled dot products (the 1/sqrt(D) scale does not change the ranking); future and own blocks
    are not masked here (see :func:`past_mask`).
    """
    import torch

    L, H, D = q.shape
    nb, hk, _ = means.shape
    g = H // hk
    qg = q.detach().to(means.dtype).reshape(L, hk, g, D)
    return torch.einsum("tkgd,jkd->tkgj", qg, means).reshape(L, H, nb)


def past_mask(t0: int, rows: int, n_blocks: int, block_size: int, device: Any = None) -> Any:
    """``[rows, n_blocks]`` bool: True where block ``j`` is strictly before the block of query ``t0 + r``."""
    import torch

    c = torch.arange(t0, t0 + rows, device=device) // block_size
    return torch.arange(n_blocks, device=device)[None, :] < c[:, None]


def _select_exact(s: Any, past: Any, n: int) -> Any:
    """Chosen-block mask ``[R, H, nb]`` with the lower-index tie-break (slow path, any rows)."""
    import torch

    kth = torch.topk(s, n, dim=-1).values[..., -1:]
    above = s > kth
    equal = s == kth
    need = n - above.sum(dim=-1, keepdim=True)
    return (above | (equal & (torch.cumsum(equal, dim=-1) <= need))) & past[:, None, :]


def select_topk(scores: Any, past: Any, n_select: int) -> tuple[Any, Any]:
    """Choose ``n_select`` past blocks per row with the lower-index tie-break.

    ``scores`` ``[R, H, nb]`` (any float dtype), ``past`` ``[R, nb]`` bool (which blocks are past).
    Returns ``idx`` ``[R, H, n_select]`` int64 (chosen block indices in ascending order; unused slots
    hold 0 and come last) and ``valid`` ``[R, H, n_select]`` bool (False for unused slots, which happen
    when a row has fewer than ``n_select`` past blocks). Exact for ties: every score above the
    ``n_select``-th largest value ``v`` is taken and the remaining slots go to the lowest-index blocks
    equal to ``v``. ``torch.topk`` gives no tie guarantee, so rows where ``v`` is shared by a chosen
    and an unchosen block (seen by asking topk for one candidate more) are redone by the exact, slower
    rule; with real-valued scores such rows are rare.
    """
    import torch

    R, H, nb = scores.shape
    if n_select <= 0 or nb == 0:
        empty = torch.zeros(R, H, 0, dtype=torch.int64, device=scores.device)
        return empty, empty.bool()
    n = min(n_select, nb)
    s = scores.masked_fill(~past[:, None, :], float("-inf"))
    # One extra candidate tells whether the n-th value is shared with an unchosen block.
    vals, ids = torch.topk(s, min(n + 1, nb), dim=-1)
    if n < nb:
        ambiguous = (vals[..., n] == vals[..., n - 1]) & torch.isfinite(vals[..., n])   # [R, H]
        vals, ids = vals[..., :n], ids[..., :n]
    else:
        ambiguous = torch.zeros(R, H, dtype=torch.bool, device=s.device)
    if bool(ambiguous.any()):
        rows = ambiguous.nonzero(as_tuple=True)
        chosen = _select_exact(s[rows].unsqueeze(1), past[rows[0]], n)[:, 0]  # [A, nb]
        key = torch.where(chosen, nb - torch.arange(nb, device=s.device), 0)
        ids[rows] = torch.topk(key, n, dim=-1).indices
    # Ascending block order, unused slots (-inf picks: not a past block) last.
    ids = torch.where(vals > float("-inf"), ids, nb).sort(dim=-1).values
    valid = ids < nb
    idx = torch.where(valid, ids, 0)
    if n < n_select:  # fewer blocks than slots: pad with unused slots
        pad = n_select - n
        idx = torch.cat([idx, idx.new_zeros(R, H, pad)], dim=-1)
        valid = torch.cat([valid, valid.new_zeros(R, H, pad)], dim=-1)
    return idx, valid


def select_blocks(q: Any, k: Any, block_size: int, topk: int) -> tuple[Any, Any]:
    """Selection of one sequence: ``(idx, valid)`` each ``[L, H, topk - 1]`` (see :func:`select_topk`)."""
    means = block_means(k, block_size)
    scores = gate_scores(q, means)
    past = past_mask(0, q.shape[0], means.shape[0], block_size, q.device)
    return select_topk(scores, past, topk - 1)
