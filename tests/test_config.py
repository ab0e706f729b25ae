"""Typed configs: presets, TOML loading with overrides, and errors that name the field."""

from __future__ import annotations

import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.runconfig import dump_toml, load_run_config, run_config_from_mapping
from sparsebalance.simulator.config import (
    CLUSTER_PRESETS,
    MODEL_PRESETS,
    ClusterConfig,
    cluster_from_mapping,
    model_from_mapping,
)


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_model_presets_are_valid(name):
    m = MODEL_PRESETS[name]()
    assert m.heads % m.kv_heads == 0
    assert m.params_per_layer > 0


def test_qwen25_3b_public_dims_and_param_count():
    m = MODEL_PRESETS["qwen2.5-3b"]()
    # Qwen2.5-3B has 3.09B parameters (model card); embeddings are tied so counted once.
    total = m.layers * m.params_per_layer + m.embedding_params + m.hidden
    assert 3.0e9 < total < 3.2e9


@pytest.mark.parametrize("name", sorted(CLUSTER_PRESETS))
def test_cluster_presets(name):
    c = CLUSTER_PRESETS[name]()
    if name.startswith("dgx-"):  # one node's hardware: the run sets its own plan
        assert c.gpus == c.gpus_per_node == 8 and c.device == name[len("dgx-"):]
        assert c.device_memory == {"dgx-a100-80gb": 80e9, "dgx-a100-40gb": 40e9}[name]
    else:  # the paper's 4 x 8 settings
        assert c.gpus == 32 and c.microbatches_per_rank == 4


@pytest.mark.parametrize(
    "table, fragment",
    [
        ({"pp": 0}, "pp: must be > 0"),
        ({"schedule": "zigzag"}, "schedule: 'zigzag' is not allowed; choose one of gpipe, 1f1b, interleaved"),
        ({"schedule": "interleaved"}, "virtual_stages"),
        ({"dp": 3, "global_batch": 16}, "global_batch"),
        ({"pp": "four"}, "pp: expected an integer"),
        ({"ppp": 2}, "ppp: unknown field"),
        ({"preset": "nope"}, "cluster.preset: unknown cluster preset 'nope'"),
    ],
)
def test_cluster_errors_name_the_field(table, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        cluster_from_mapping(table)
    assert fragment in str(e.value)
    assert str(e.value).startswith("cluster.")


def test_model_kv_heads_must_divide_heads():
    with pytest.raises(ConfigError, match="model.kv_heads: must divide heads"):
        model_from_mapping({"preset": "qwen2.5-3b", "kv_heads": 3})


def test_preset_with_override():
    c = cluster_from_mapping({"preset": "h200-4x8", "dp": 2, "pp": 4, "tp": 1})
    assert (c.dp, c.pp, c.tp, c.name) == (2, 4, 1, "h200-4x8")
    assert c.microbatches_per_rank == 8


def test_run_config_round_trip(tmp_path):
    text = """
name = "t"
iterations = 3
[model]
preset = "tiny"
[cluster]
pp = 2
dp = 2
global_batch = 8
[policy]
batching = "sab"
tuning = "dst"
anchor = "min"
p = 0.2
"""
    path = tmp_path / "run.toml"
    path.write_text(text)
    cfg = load_run_config(path)
    assert cfg.model.name == "tiny" and cfg.cluster.pp == 2 and cfg.policy.anchor == "min"
    assert cfg.base_dir == str(tmp_path)
    again = tmp_path / "again.toml"
    again.write_text(dump_toml(cfg))
    cfg2 = load_run_config(again)
    assert cfg2.to_dict() | {"base_dir": ""} == cfg.to_dict() | {"base_dir": ""}


def test_overrides_and_policy_errors(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('name = "t"\n')
    cfg = load_run_config(path, {"policy.k0": 16, "cluster.pp": 2})
    assert cfg.policy.k0 == 16 and cfg.cluster.pp == 2
    with pytest.raises(ConfigError, match=r"policy.p: must lie in \(0, 1\)"):
        load_run_config(path, {"policy.p": 1.5})
    with pytest.raises(ConfigError, match="policy.k_max: must be >= k0"):
        load_run_config(path, {"policy.k_max": 8})
    with pytest.raises(ConfigError, match="policy.anchor: 'median' is not allowed; choose one of mean, min, max"):
        load_run_config(path, {"policy.anchor": "median"})


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_run_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_run_config(bad)
    with pytest.raises(ConfigError, match="iterations: must be > 0"):
        run_config_from_mapping({"iterations": 0})


def test_cluster_defaults_are_single_device():
    c = ClusterConfig()
    assert (c.pp, c.dp, c.tp) == (1, 1, 1)
