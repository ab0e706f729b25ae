"""Bitonic sorting networks over the rows of a [rows, 2^M] Triton tensor (the gate's top-k).

A row is viewed as a hypercube of M axes of size 2 ([rows, 2, ..., 2]); a compare-exchange along
axis i pairs the elements whose positions differ in bit i. The partner of an element is read as
(sum of the pair) - element: a plain ``tl.sum`` over the size-2 axis (integer wrap-around keeps it
exact), which compiles to register moves and shuffles and which the Triton interpreter evaluates
with one numpy call -- a custom combine function (xor) would run element by element there.

* :func:`sort_rows`: bitonic sort, ascending or descending;
* :func:`merge_rows`: bitonic merge of a row that is already a bitonic sequence.

The gate keeps the best ``kw`` keys sorted descending and folds in ``kw`` new ones per step:
new ascending, elementwise max with the best (the ``kw`` largest of both, as a bitonic sequence),
then one merge -- M (M + 1) / 2 + M compare-exchanges per step.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sort_rows(x, DESC: tl.constexpr, M: tl.constexpr):
    """Each row of ``x`` [rows, 2^M] sorted (descending if ``DESC``). Stage s < M orders runs of 2^s
    alternately up and down (pairs of runs become bitonic), the last stage all one way. One flat
    function: every call of a nested jit function costs the interpreter milliseconds."""
    R: tl.constexpr = x.shape[0]
    h = tl.reshape(x, [R] + [2] * M)
    for s in tl.static_range(1, M + 1):
        if s < M:
            desc = tl.reshape(tl.arange(0, 2), [1] + [1] * (M - 1 - s) + [2] + [1] * s) ^ DESC
        else:
            desc = DESC
        for i in tl.static_range(s - 1, -1, -1):
            other = tl.sum(h, axis=M - i, keep_dims=True) - h       # the partner along axis i
            right = tl.reshape(tl.arange(0, 2), [1] + [1] * (M - 1 - i) + [2] + [1] * i)
            h = tl.where((right ^ desc) != 0, tl.maximum(h, other), tl.minimum(h, other))
    return tl.reshape(h, [R, 2 ** M])


@triton.jit
def merge_rows(x, DESC: tl.constexpr, M: tl.constexpr):
    """Each row of ``x`` [rows, 2^M], a bitonic sequence, sorted (descending if ``DESC``)."""
    R: tl.constexpr = x.shape[0]
    h = tl.reshape(x, [R] + [2] * M)
    for i in tl.static_range(M - 1, -1, -1):
        other = tl.sum(h, axis=M - i, keep_dims=True) - h
        right = tl.reshape(tl.arange(0, 2), [1] + [1] * (M - 1 - i) + [2] + [1] * i)
        h = tl.where((right ^ DESC) != 0, tl.maximum(h, other), tl.minimum(h, other))
    return tl.reshape(h, [R, 2 ** M])
