"""The kernel's measured coverage and the policy model's coverage are one quantity (docs/coverage.md).

1. Exact: gate scores built so that every query's past-block probabilities follow the model's rank
   law (block means = orthonormal basis vectors, query = sqrt(D) * log-weights) -> the kernel's C(k)
   equals ``parametric_curve`` to rounding, for both shapes.
2. Fitted, random q/k: curves measured by the kernel are reproduced by the parametric model with a
   fitted rate within MAX_ABS_ERR_RANDOM (max over sequences and k; measured 0.006 at q/k scale 1,
   0.046 at scale 3: the power law is a model, not the truth).
3. Fitted, the shipped pretrained checkpoint's q/k on held-out recall examples, at the layer DST
   watches (layer 0): within MAX_ABS_ERR_CHECKPOINT (measured 0.020, rate 0.90; docs/coverage.md).
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sparsebalance.kernels import moba_coverage
from sparsebalance.policies.coverage import fit_rate, parametric_curve

MAX_ABS_ERR_RANDOM = 0.06
MAX_ABS_ERR_CHECKPOINT = 0.03


def _law_qk(L: int, B: int, D: int, rate: float, shape: str):
    n = -(-L // B)
    assert n <= D
    k = torch.zeros(L, 1, D, dtype=torch.float64)
    for j in range(n):
        k[j * B:(j + 1) * B, 0, j] = 1.0                      # block j's mean key = e_j
    q = torch.zeros(L, 1, D, dtype=torch.float64)
    for t in range(L):
        i = t // B
        for j in range(i):                                   # most recent past block = rank 1
            r = i - j
            w = r ** -rate if shape == "power" else math.exp(-rate * (r - 1))
            q[t, 0, j] = math.sqrt(D) * math.log(w)
    return q, k


@pytest.mark.parametrize("L,B,rate,shape", [(64, 4, 1.5, "power"), (61, 4, 0.7, "power"),
                                            (40, 3, 0.9, "geometric"), (16, 16, 2.0, "power")])
def test_kernel_measures_exactly_the_model_curve_on_law_built_scores(L, B, rate, shape):
    q, k = _law_qk(L, B, 16, rate, shape)
    n = -(-L // B)
    got = moba_coverage(q, k, torch.tensor([0, L], dtype=torch.int32), B, list(range(1, n + 1)))[0]
    np.testing.assert_allclose(got.numpy(), parametric_curve(L, B, rate, shape), rtol=0, atol=1e-12)


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_model_fitted_to_random_gate_scores_reproduces_them(scale):
    g = torch.Generator().manual_seed(int(scale))
    curves = []
    for L in (200, 513, 1024):
        q = torch.randn(L, 4, 16, generator=g) * scale
        k = torch.randn(L, 2, 16, generator=g) * scale
        n = -(-L // 32)
        c = moba_coverage(q, k, torch.tensor([0, L], dtype=torch.int32), 32, list(range(1, n + 1)))
        curves.append((L, c[0].numpy()))
    rate, err = fit_rate(curves, 32, "power")
    worst = max(float(np.max(np.abs(parametric_curve(L, 32, rate) - c))) for L, c in curves)
    assert worst == pytest.approx(err) and worst <= MAX_ABS_ERR_RANDOM, (rate, worst)


def test_model_fitted_to_the_pretrained_checkpoint_reproduces_its_gate_scores():
    """The shipped checkpoint's q/k at the layer DST watches, on held-out recall examples of every
    bucket: the parametric model with the fitted rate reproduces the kernel's curves, and the fit is
    the one recorded in checkpoint.json (what the accuracy experiment's policies use)."""
    pytest.importorskip("transformers")
    from sparsebalance.accuracy.model import load
    from sparsebalance.accuracy.pretrain import layer_curves
    from sparsebalance.data.recall import RecallTask

    ckpt = load(None)
    model = ckpt.load_model()
    task = RecallTask(ckpt.task)
    n = ckpt.meta["pretrain"]["coverage_examples"]
    exs = [e for b in ckpt.meta["buckets"] for e in task.heldout(b, n)]
    layer = ckpt.meta["coverage_layer"]
    curves = layer_curves(model, exs, ckpt.net.dims.block_size, ckpt.meta["pretrain"]["k0"], [layer])[layer]
    rate, err = fit_rate(curves, ckpt.net.dims.block_size, "power")
    assert rate == pytest.approx(ckpt.meta["coverage_rate"], rel=1e-3)
    assert err <= MAX_ABS_ERR_CHECKPOINT, (rate, err)
