"""gpu-check's steps run here as far as a CPU allows, so that a lent GPU's minutes are not spent on a
bug of the step's own code: the accuracy step end to end on a tiny case (Triton interpreter), the
speed step's loop and table with the CUDA measurement replaced, the profile's comparison with the
analytical model on a real profile table."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from sparsebalance.gpucheck import steps


def _ctx(tmp_path, seconds: float = 120.0) -> steps.Step:
    for d in ("out", "work"):
        (tmp_path / d).mkdir(exist_ok=True)
    return steps.Step(out=tmp_path / "out", work=tmp_path / "work", deadline=time.monotonic() + seconds,
                      device="cpu")


def test_accuracy_step_writes_every_path_of_the_plan(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the compiled step runs in gpu-check itself")
    from sparsebalance.kernels.moba import check

    tiny = check.Case(lens=(37, 70, 21), heads=2, kv_heads=1, dim=16, block=16, topk=(2, 3, 1), seed=5)
    monkeypatch.setattr(check, "GPU_CASES", {"tiny": tiny})
    monkeypatch.setattr(check, "ACCURACY_PLAN", [("tiny", "float32")])
    status, figures, file = steps.accuracy(_ctx(tmp_path))
    df = pd.read_csv(tmp_path / "out" / file)
    assert status == "ok", figures
    assert len(df) == 3 * 4 and set(df.path) == {"auto", "sparse", "masked"} and df.ok.all()
    assert set(df.tensor) == {"out", "dq", "dk", "dv"} and (df.case == "tiny").all()
    assert figures.startswith("12/12 tensors within 2x PyTorch's error")


def test_speed_step_table_headline_and_early_stop(tmp_path, monkeypatch):
    from sparsebalance.kernels.moba import speed

    calls = []

    def fake_point(L, density, shape, *, dense_ms=None):  # the CUDA timing, replaced
        calls.append((L, density))
        return [{"tokens": L, "density": density, "topk": 1, "mode": m, "moba_ms": 1.0, "dense_ms": 2.0,
                 "moba_tflops": 1.0, "dense_tflops": 1.5, "speedup": 2.0, "dense": "sdpa-flash",
                 "predicted_ms": None, "host_syncs": "none", "statistic": speed.STATISTIC}
                for m in ("fwd", "fwd+bwd")]

    tuned = []
    monkeypatch.setattr(speed, "measure_point", fake_point)
    monkeypatch.setattr(speed, "tune", lambda shape, **kw: (tuned.append(kw) or [{"x": 1}], {"bwd_kv": "32x64x8x2"}))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(steps, "TUNE_S", 0.0)
    status, fig, file = steps.speed(_ctx(tmp_path))
    df = pd.read_csv(tmp_path / "out" / file)
    assert status == "ok" and len(df) == 2 * len(steps.SPEED_LENGTHS) * len(steps.SPEED_DENSITIES)
    assert "32K at 1/8 fwd+bwd: MoBA 1.00 ms, sdpa-flash 2.00 ms (2.00x)" in fig and "median" in fig
    assert "host syncs: none" in fig and "targets met 2/4" in fig and "picks bwd_kv 32x64x8x2" in fig
    assert calls[:3] == [(32768, 1 / 8), (8192, 1 / 8), (131072, 1 / 8)]  # the target points first
    targets = (tmp_path / "work" / "speed_targets.md").read_text()
    assert "fwd+bwd 128K tokens, 1/8" in targets and ">= 2.5x" in targets
    assert '"bwd_kv": "32x64x8x2"' in (tmp_path / "work" / "launch_picks.json").read_text()
    calls.clear()
    status, fig, _ = steps.speed(_ctx(tmp_path, seconds=10))  # under the step's margin: one point, then stop
    assert status == "partial" and len(calls) == 1 and fig.startswith("1/20 points")


def test_profile_comparison_with_the_analytical_model(tmp_path):
    from sparsebalance.simulator.config import tiny
    from sparsebalance.simulator.cost.catalog import load_profile

    table = load_profile("cpu-tiny").table
    assert steps.versus_analytical(table, tiny(), "cpu") is None  # no analytical hardware for a CPU
    cmp = steps.versus_analytical(table, tiny(), "NVIDIA H100 80GB HBM3")
    assert len(cmp) > 0 and set(cmp.op) <= set(table.op) and "optim" not in set(cmp.op)
    assert {"attn_fwd", "attn_bwd", "layer_fwd", "layer_bwd", "head_fwd"} <= set(cmp.op)
    assert np.all(np.isfinite(cmp.ratio)) and (cmp.ratio > 0).all()
    r = cmp.iloc[0]
    assert r.ratio == pytest.approx(r.latency_s_measured / r.latency_s_analytical)
