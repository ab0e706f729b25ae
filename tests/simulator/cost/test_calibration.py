"""Profiles that travel: a profile whose points are off by known factors is detected and rescaled
exactly (deterministic fake probe), fingerprints are compared, the probe grid lies on the profile."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from sparsebalance.simulator.cost import calibration as C
from sparsebalance.simulator.cost.catalog import load_profile

FACTORS = {"attn_fwd": 1.3, "attn_bwd": 1.45, "layer_fwd": 0.8, "layer_bwd": 1.1, "embed_fwd": 1.2,
           "embed_bwd": 1.2, "head_fwd": 0.9, "head_bwd": 1.0}


def test_probe_grid_lies_on_the_profile_and_within_the_run():
    prof = load_profile("cpu-tiny")
    g = C.probe_grid(prof, max_len=2048)
    attn = prof.rows("attn_fwd")
    assert set(g.seq_lens) <= set(attn["seq_len"]) and max(g.seq_lens) == 2048
    assert set(g.budgets) <= set(attn["budget"]) and len(g.budgets) == 2
    assert set(g.tokens) <= set(prof.rows("layer_fwd")["seq_len"]) and max(g.tokens) <= 2048
    # no max length: the longest profiled length is probed
    assert max(C.probe_grid(prof).seq_lens) == attn["seq_len"].max()
    # the run's default budget and the next grid value (DST moves around it); clipped at the top
    assert C.probe_grid(prof, budget=8).budgets == (8, 16)
    assert C.probe_grid(prof, budget=6).budgets == (8, 16)
    assert C.probe_grid(prof, budget=64).budgets == (16, 32)


def test_known_factors_are_detected_and_rescaled_exactly(scaled_probe):
    prof = load_profile("cpu-tiny")
    grid = C.probe_grid(prof, max_len=2048)
    cal = C.fit(prof, scaled_probe(prof, grid, FACTORS), fingerprint_here={"cpu_model": "x"})
    assert set(cal.scales) == set(FACTORS)
    for op, f in FACTORS.items():
        assert cal.scales[op] == pytest.approx(f, rel=1e-12)
        assert cal.spreads[op] == pytest.approx(0.0, abs=1e-12)
    assert not cal.reshape
    # optim was not probed: it takes the median of the probed scales
    assert cal.default_scale == pytest.approx(float(np.median(list(FACTORS.values()))))
    scaled = C.rescale(prof, cal)
    merged = prof.table.merge(scaled.table, on=["op", "seq_len", "budget"], suffixes=("", "_new"))
    want = merged["op"].map(lambda op: FACTORS.get(op, cal.default_scale))
    np.testing.assert_allclose(merged["latency_s_new"], merged["latency_s"] * want, rtol=1e-12)
    assert scaled.meta.calibration["scales"]["attn_bwd"] == pytest.approx(1.45)
    line = cal.line(applied=True)
    assert line.startswith("calibration:") and "attn_bwd x1.45" in line and "rescaled per op" in line
    assert "\n" not in line


def test_noisy_points_give_the_geometric_mean_and_flag_a_shape_change(scaled_probe):
    prof = load_profile("cpu-tiny")
    grid = C.probe_grid(prof, max_len=2048)
    probe = scaled_probe(prof, grid, {op: 1.0 for op in FACTORS})
    attn = probe["op"] == "attn_bwd"
    mult = np.where(probe.loc[attn, "seq_len"] == max(grid.seq_lens), 2.0, 0.5)  # a different shape
    probe.loc[attn, "latency_s"] *= mult
    cal = C.fit(prof, probe)
    logs = np.log(mult)
    assert cal.scales["attn_bwd"] == pytest.approx(math.exp(logs.mean()))
    assert cal.spreads["attn_bwd"] == pytest.approx(logs.std(ddof=1))
    assert cal.reshape and "re-measure" in cal.line(applied=True)


def test_fingerprints_are_compared_key_by_key():
    rec = {"device_kind": "cpu", "cpu_model": "AMD EPYC", "cores": 2, "torch_threads": 1, "host": "a"}
    here = {"device_kind": "cpu", "cpu_model": "Intel Xeon", "cores": 2, "torch_threads": 4, "host": "b"}
    assert C.fingerprint_mismatch(rec, here) == ["cpu_model: AMD EPYC -> Intel Xeon", "torch_threads: 1 -> 4"]
    assert C.fingerprint_mismatch(rec, dict(rec)) == []
    assert C.fingerprint_mismatch(None, here) == []
    gpu = {"device_kind": "cuda", "gpu_name": "NVIDIA H200", "gpu_sm_clock_max_mhz": 1980.0}
    assert C.fingerprint_mismatch(gpu, {**gpu, "gpu_sm_clock_max_mhz": 1755.0}) == \
        ["gpu_sm_clock_max_mhz: 1980.0 -> 1755.0"]


def test_device_kind_decides_whether_a_probe_can_run():
    prof = load_profile("cpu-tiny")
    assert C.needs_probe(prof) and C.same_device_kind(prof, {"device_kind": "cpu"})
    gpu_prof = replace(prof, meta=replace(prof.meta, device="NVIDIA H200", machine={"device_kind": "cuda"},
                                          concurrency=None))  # one copy: a GPU is measured alone
    assert not C.same_device_kind(gpu_prof, {"device_kind": "cpu"})
    assert C.same_device_kind(gpu_prof, {"device_kind": "cuda", "gpu_name": "NVIDIA H100"})
    assert not C.needs_probe(load_profile("analytical-h200"))


def test_probe_rows_off_the_profile_grid_are_refused():
    prof = load_profile("cpu-tiny")
    bad = pd.DataFrame([("attn_fwd", 100, 3, 1.0)], columns=["op", "seq_len", "budget", "latency_s"])
    with pytest.raises(ValueError, match="not a point of the profile"):
        C.fit(prof, bad)


def test_ring_step_rows_take_their_attention_op_scale(scaled_probe):
    """attn_*_cp_step rows are never probed (keyed by pairs): they take the scale of their CP
    attention op where probed, else of the one-GPU attention op, not the median of every op."""
    prof = load_profile("cpu-tiny")
    steps = pd.DataFrame([(op, p, 8, 1e-3) for op in ("attn_fwd_cp_step", "attn_bwd_cp_step") for p in (5000, 9000)],
                         columns=["op", "seq_len", "budget", "latency_s"])
    with_steps = replace(prof, table=pd.concat([prof.table, steps], ignore_index=True))
    grid = C.probe_grid(prof, max_len=2048)
    cal = C.fit(with_steps, scaled_probe(prof, grid, FACTORS))
    scaled = C.rescale(with_steps, cal).table
    for op, proxy in (("attn_fwd_cp_step", "attn_fwd"), ("attn_bwd_cp_step", "attn_bwd")):
        got = scaled[scaled.op == op]["latency_s"]
        assert got.tolist() == pytest.approx([1e-3 * FACTORS[proxy]] * 2, rel=1e-12)
        assert FACTORS[proxy] != pytest.approx(cal.default_scale)
    cal.scales["attn_fwd_cp"] = 0.7  # a probed CP op comes first
    assert C.scale_of(cal, "attn_fwd_cp_step") == 0.7 and C.scale_of(cal, "optim") == cal.default_scale
