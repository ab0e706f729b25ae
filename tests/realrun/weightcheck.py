"""Post-step weights of a distributed run against the single-process reference, within what AdamW
allows.

AdamW turns a near-zero gradient into a step of about lr whatever its rounding
(|m_hat / sqrt(v_hat)| <= 1.01 in the first steps), so another summation order (pipelining, DP,
TP) may move such an element anywhere within 2 lr per step of the reference. Every element must
stay within that bound; all but 0.1 % of the elements of the checked tensors must also be tight.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


def assert_weights_match(merged: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], *,
                         lr: float, steps: int, noise_only: Callable[[str], bool] = lambda k: False,
                         tight: Callable[[str], bool] = lambda k: False) -> None:
    """``noise_only(name)``: a tensor whose exact gradient is zero (only the bound applies);
    ``tight(name)``: a tensor that must match elementwise (rtol 1e-4, atol 2e-6); every other
    tensor: the bound, and at most 0.1 % of all their elements outside the tight tolerance."""
    assert set(merged) == set(ref)
    bound = 2 * 1.01 * lr * steps
    off = total = 0
    for k, v in ref.items():
        d = (merged[k].double() - v.double()).abs()
        assert float(d.max()) <= bound, (k, float(d.max()), bound)
        if noise_only(k):
            continue
        if tight(k):
            torch.testing.assert_close(merged[k], v, rtol=1e-4, atol=2e-6, msg=f"weight {k}")
            continue
        off += int((d > 2e-6 + 1e-4 * v.double().abs()).sum())
        total += d.numel()
    assert off <= 1e-3 * total, (off, total)
