"""Any decoder from a Hugging Face config.json: parameter counts against the published ones, the
architecture reaching the cost model, and bad files refused in one line."""

from __future__ import annotations

import json

import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.config import ClusterConfig, ModelConfig, qwen25_3b
from sparsebalance.simulator.hfconfig import model_from_hf
from sparsebalance.simulator.layout import layout_of

LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
             "tie_word_embeddings": False, "hidden_act": "silu"}
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
PYTHIA_160M = {"model_type": "gpt_neox", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
               "intermediate_size": 3072, "vocab_size": 50304, "tie_word_embeddings": False}
QWEN25_3B = {"model_type": "qwen2", "hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16,
             "num_key_value_heads": 2, "intermediate_size": 11008, "vocab_size": 151936,
             "tie_word_embeddings": True}


def total_params(model: ModelConfig) -> int:
    return layout_of(model, ClusterConfig(pp=1, dp=1, global_batch=1)).device_params(0)


@pytest.mark.parametrize("cfg,published", [
    (LLAMA2_7B, 6_738_415_616),   # Llama 2 7B (sum of the checkpoint's tensors)
    (GPT2, 124_439_808),          # GPT-2 small (the 124M model; learned positions, tied head)
    (PYTHIA_160M, 162_322_944),   # Pythia-160M, "total params" in the Pythia paper's Table 1
])
def test_parameter_count_is_the_published_one(cfg, published):
    assert total_params(model_from_hf(cfg)) == published


def test_qwen2_file_is_the_preset_and_the_architecture_reads_from_the_family():
    m = model_from_hf(QWEN25_3B)
    ref = qwen25_3b()
    assert (m.hidden, m.layers, m.heads, m.kv_heads, m.head_dim, m.ffn, m.vocab, m.tie_embeddings) == \
        (ref.hidden, ref.layers, ref.heads, ref.kv_heads, ref.head_dim, ref.ffn, ref.vocab, ref.tie_embeddings)
    assert m.params_per_layer == ref.params_per_layer
    g = model_from_hf(GPT2)
    assert (g.mlp, g.norm, g.positions, g.max_positions, g.bias, g.ffn) == ("gelu", "layernorm", "learned", 1024,
                                                                             True, 4 * 768)
    assert model_from_hf(LLAMA2_7B).qkv_bias is False


def test_a_file_on_disk_and_overrides(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(LLAMA2_7B))
    m = model_from_hf(p, block_size=128, name="llama-2-7b")
    assert m.block_size == 128 and m.name == "llama-2-7b" and m.hidden == 4096


def test_the_run_config_reads_hf_config_relative_to_itself(tmp_path):
    from sparsebalance.runconfig import load_run_config

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(GPT2))
    (tmp_path / "run.toml").write_text('[model]\nhf_config = "m/config.json"\nblock_size = 64\n')
    cfg = load_run_config(tmp_path / "run.toml")
    assert cfg.model.mlp == "gelu" and cfg.model.block_size == 64 and cfg.model.vocab == 50257


def test_gelu_mlp_reaches_the_analytical_cost():
    """Same dims, SwiGLU vs GELU: the roofline's dense FLOPs follow the weights (3 vs 2 MLP matrices)."""
    import numpy as np

    from sparsebalance.simulator.cost.roofline import _dense_work

    swi = ModelConfig(hidden=1024, layers=2, heads=8, kv_heads=8, head_dim=128, ffn=4096, vocab=1000)
    gelu = ModelConfig(hidden=1024, layers=2, heads=8, kv_heads=8, head_dim=128, ffn=4096, vocab=1000, mlp="gelu")
    T = np.array([4096.0])
    (f_s, _), (f_g, _) = _dense_work(T, swi, 1), _dense_work(T, gelu, 1)
    attn = 4 * 1024 * 1024 + 3 * 1024  # Q, K, V, O weights and the Q, K, V biases
    assert f_s[0] == 2 * 4096 * (attn + 3 * 1024 * 4096 + 2 * 1024)
    assert f_g[0] == 2 * 4096 * (attn + 2 * 1024 * 4096 + 2 * 1024)


def test_a_profile_for_qwen2_is_not_used_for_another_architecture():
    from sparsebalance.simulator.cost.latency import load_latency_model

    cl = ClusterConfig(pp=1, dp=1, global_batch=1, device="h100")
    gpt2 = model_from_hf(GPT2, block_size=64)
    lm = load_latency_model("analytical-h100", gpt2, cl)  # analytical: re-derived for it
    assert "re-derived" in lm.profile.source and lm.profile.meta.model["mlp"] == "gelu"
    with pytest.raises(ConfigError, match=r"model.mlp 'swiglu' \(run: 'gelu'\)"):
        load_latency_model("cpu-tiny", ModelConfig(**{**_tiny_dims(), "mlp": "gelu"}), cl)


def _tiny_dims() -> dict:
    from dataclasses import asdict

    from sparsebalance.simulator.config import tiny

    return asdict(tiny())


def test_the_real_run_refuses_another_architecture():
    from sparsebalance.kernels.qwen2 import check_qwen2_architecture

    check_qwen2_architecture(qwen25_3b())
    with pytest.raises(ConfigError, match="Qwen2-architecture decoders only.*mlp = 'gelu'"):
        check_qwen2_architecture(model_from_hf(GPT2))


@pytest.mark.parametrize("cfg,match", [
    ({"model_type": "t5"}, "model_type 't5' is not supported; choose one of llama"),
    ({**LLAMA2_7B, "hidden_size": None}, "hidden_size is missing"),
    ({**LLAMA2_7B, "hidden_size": "4096"}, "hidden_size must be a positive integer, got '4096'"),
    ({**LLAMA2_7B, "num_key_value_heads": 5}, "kv_heads"),
    ({**GPT2, "tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
])
def test_bad_configs_are_one_line(cfg, match):
    with pytest.raises(ConfigError, match=match) as e:
        model_from_hf(cfg)
    assert "\n" not in str(e.value)


def test_bad_files_exit_2_in_one_line(tmp_path, run_cli):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    for name, want in (("bad.json", "is not valid JSON"), ("list.json", "expected a JSON object"),
                       ("missing.json", "missing.json")):
        (tmp_path / "run.toml").write_text(f'iterations = 1\n[model]\nhf_config = "{name}"\n')
        r = run_cli("simulate", "--config", tmp_path / "run.toml", "--out", tmp_path / "o", "--no-progress")
        assert r.code == 2 and want in r.err and len(r.err.strip().splitlines()) == 1, r.err
        assert not (tmp_path / "o").exists()


def test_train_refuses_another_architecture_before_launch(tmp_path, run_cli):
    (tmp_path / "run.toml").write_text(
        'iterations = 1\nprofile = "cpu-tiny"\n[model]\npreset = "tiny"\nmlp = "gelu"\n'
        '[cluster]\ndevice = "cpu"\npp = 2\nglobal_batch = 4\n'
        '[data]\nsource = "text_dir"\npath = "stdlib"\nglob = "**/__init__.py"\n')
    r = run_cli("train", "--config", tmp_path / "run.toml", "--out", tmp_path / "o")
    assert r.code == 2 and "Qwen2-architecture decoders only" in r.err and "mlp = 'gelu'" in r.err, r.err
    assert not (tmp_path / "o").exists()
