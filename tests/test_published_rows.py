"""The published rows themselves (issue 36, item 4): enough truth from enough sources, every
conversion from the published metric recomputed here from the source's own FLOP count, the stated
parameter counts matched by the model dims, the first nine rows' meaning kept by the column
defaults, and what the simulator cannot price yet named from the row alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest

from sparsebalance.simulator.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "validation" / "published" / "runs.csv"
spec = importlib.util.spec_from_file_location("published_rows", ROOT / "benchmarks" / "published_rows.py")
rows_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rows_mod)


@pytest.fixture(scope="module")
def runs():
    return rows_mod.load_runs()


def model_of(row) -> ModelConfig:
    return ModelConfig(**rows_mod.dense_config(row)["model"])


def test_enough_truth_from_enough_sources(runs):
    """>= 25 rows from >= 3 sources, >= 5 FSDP / ZeRO-3 rows, >= 5 H100/H200 rows; every row says where
    it comes from and what was assumed; the held-out sets are not among them."""
    sources = runs["source"].str.split(" (", regex=False).str[0]
    assert len(runs) >= 25 and sources.nunique() >= 3 and runs["id"].is_unique
    assert (runs["dp_mode"] == "zero3").sum() >= 5
    assert runs["gpu"].isin(["h100", "h200"]).sum() >= 5
    for col in ("source", "table", "assumed", "conversion"):
        assert runs[col].astype(str).str.strip().str.len().gt(0).all(), col
    held_out = runs["source"].str.contains("Narayanan|torchtitan", case=False)
    assert not held_out.any()
    readme = (ROOT / "validation" / "published" / "README.md").read_text()
    for col in pd.read_csv(RUNS, nrows=0).columns:  # every column described
        assert f"`{col}`" in readme, col


def test_stated_parameter_counts_match_the_dims(runs):
    """Where a source states the parameter count (LLM Foundry's NumParams), the model the row builds
    has exactly that many: layers, embedding (+ learned positions), untied head, final norm."""
    stated = runs[runs["params_stated"].notna()]
    assert len(stated) >= 70
    for row in stated.itertuples():
        m = model_of(row)
        total = m.layers * m.params_per_layer + m.embedding_params + m.norm_params
        total += 0 if m.tie_embeddings else m.head_params
        assert total == int(row.params_stated), row.id


def megatron_flops(m: ModelConfig, batch: int, s: int) -> float:
    """Megatron-Core r0.8.0 ``num_floating_point_operations`` (training.py L73-108), written here from
    its formula: 12 B s L h^2 ((1 + g/a + s/h) q/h + ffn/h x gated + V / (2 L h))."""
    h = m.hidden
    gated = 1.5 if m.mlp == "swiglu" else 1.0
    attn = (1 + m.kv_heads / m.heads + s / h) * (m.heads * m.head_dim / h)
    return 12 * batch * s * m.layers * h * h * (attn + m.ffn / h * gated + m.vocab / (2 * m.layers * h))


def palm_flops_per_token(m: ModelConfig, s: int) -> float:
    """PaLM's model FLOPs per token (Chowdhery et al. 2022, App. B): 6 N + 12 L H Q T, N the matmul
    weights (layers and the LM head; the input embedding is a lookup)."""
    n = m.layers * m.params_per_layer + m.head_params
    return 6 * n + 12 * m.layers * m.heads * m.head_dim * s


def test_every_conversion_is_recomputed(runs):
    seen = set()
    for row in runs.itertuples():
        metric, value, t = row.published_metric, float(row.published_value), row.measured_iteration_s
        seen.add(metric)
        if metric == "s/iteration":
            assert t == value, row.id
        elif metric == "tokens/s":
            assert t == pytest.approx(row.global_batch * row.seq_len / value, rel=1e-4), row.id
        elif metric == "TFLOP/s per GPU":
            m = model_of(row)
            if row.source.startswith("Megatron-LM README"):
                flops = megatron_flops(m, row.global_batch, row.seq_len)
            else:
                assert row.source.startswith("Llama 3 paper"), row.id
                flops = row.global_batch * row.seq_len * palm_flops_per_token(m, row.seq_len)
            assert t == pytest.approx(flops / (value * 1e12 * row.gpus), rel=1e-4), row.id
        else:
            raise AssertionError(f"{row.id}: unknown metric {metric!r}")
    assert seen == {"s/iteration", "tokens/s", "TFLOP/s per GPU"}


def test_megatron_readme_rows_reproduce_its_aggregate_petaflops(runs):
    """The table's last column (aggregate PFLOP/s) is TFLOP/s per GPU x GPUs: a transcription check."""
    agg = {"1p7b": 19.6, "7p1b": 44.7, "16b": 93.9, "32b": 176.5, "70b": 322.3, "119b": 645.9, "177b": 997.2,
           "314b": 1457.4, "462b": 2825.6}
    mlm = runs[runs["id"].str.startswith("mlm-h100-")].set_index("id")
    assert len(mlm) == 9
    for name, pflops in agg.items():
        r = mlm.loc[f"mlm-h100-{name}"]
        assert r["published_value"] * r["gpus"] / 1e3 == pytest.approx(pflops, abs=0.06), name


def test_the_first_nine_rows_keep_their_meaning(tmp_path, runs):
    """Written with only the columns they had, the nine Korthikanti rows load to the same run configs."""
    old_cols = ["id", "source", "table", "model", "gpu", "gpus", "hidden", "layers", "heads", "vocab", "seq_len",
                "tp", "pp", "dp", "schedule", "virtual_stages", "micro_batch_size", "global_batch",
                "attention_kernel", "recompute", "sequence_parallel", "tp_overlap", "dp_overlap",
                "grad_reduce_bytes", "precision", "measured_iteration_s", "assumed"]
    full = pd.read_csv(RUNS)
    old = full[full["source"].str.startswith("Korthikanti")][old_cols]
    assert len(old) == 9
    old.to_csv(tmp_path / "runs.csv", index=False)
    loaded = rows_mod.load_runs(tmp_path / "runs.csv")
    for row in loaded.itertuples():
        assert rows_mod.dense_config(row) == rows_mod.dense_config(runs[runs["id"] == row.id].iloc[0]), row.id
        assert rows_mod.gaps(row) == ([], [])


def test_gaps_name_what_the_simulator_lacks(runs):
    for row in runs.itertuples():
        blocking, approx = rows_mod.gaps(row)
        assert not blocking, row.id  # FSDP / ZeRO-2/3 and Llama 3's pipeline are priced
        if row.pp_impl == "meta":  # Llama 3: its pipeline, one layer fewer on the end stages, FSDP once a step
            config = rows_mod.dense_config(row)["cluster"]
            assert (config["pp_impl"], config["end_stage_layers_fewer"], config["fsdp_grad_sync"]) == (
                "meta", 1, "last"), row.id
        if row.source.startswith("Korthikanti"):
            assert (blocking, approx) == ([], []), row.id
        if row.source.startswith("Megatron-LM README"):
            assert not blocking, row.id  # --overlap-param-gather is priced (cluster.param_gather_overlap)
            assert not approx, row.id  # TE's comm-GEMM overlap is priced (simulator/cost/tpoverlap.py)
            config = rows_mod.dense_config(row)["cluster"]
            assert config["tp_overlap_impl"] == ("te" if row.tp > 1 else "megatron"), row.id
    priced = sum(not rows_mod.gaps(r)[0] for r in runs.itertuples())
    assert priced == len(runs) == 92
    other = runs.iloc[0].copy()
    other["pp_impl"], other["pp"] = "deepspeed", 2
    assert any("pipeline implementation 'deepspeed'" in b for b in rows_mod.gaps(other)[0])


def test_a_bad_row_is_one_line(tmp_path):
    df = pd.read_csv(RUNS).head(2)
    bad = df.copy()
    bad.loc[0, "dp_mode"] = "zero4"
    bad.to_csv(tmp_path / "a.csv", index=False)
    with pytest.raises(SystemExit, match="k22-full: dp_mode must be one of ddp, zero1, zero2, zero3, got 'zero4'"):
        rows_mod.load_runs(tmp_path / "a.csv")
    bad = df.copy()
    bad.loc[1, "gpus"] = 7
    bad.to_csv(tmp_path / "b.csv", index=False)
    with pytest.raises(SystemExit, match="k22-sel: tp x pp x dp x cp = 8 but the row says 7 GPUs"):
        rows_mod.load_runs(tmp_path / "b.csv")
