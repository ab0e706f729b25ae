"""Each rank builds only its stage: weights equal the full model's same pieces (seeded or from a
checkpoint in every supported format), parameter count and memory are the stage's share."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sparsebalance.errors import ConfigError
from sparsebalance.kernels import qwen2_init as Q
from sparsebalance.kernels.qwen2 import build_qwen2
from sparsebalance.realrun.checkpoint import check_checkpoint
from sparsebalance.realrun.config import RealrunConfig
from sparsebalance.realrun.stage import build_stage_module
from sparsebalance.runconfig import load_run_config
from sparsebalance.simulator.config import ClusterConfig, tiny
from sparsebalance.simulator.cost.latency import load_latency_model

ROOT = Path(__file__).resolve().parents[2]


def _run_cfg(tmp_path, *, pp, layers=4, tied=False, seed=5):
    p = tmp_path / "run.toml"
    p.write_text(f"""
name = "sb"
seed = {seed}
profile = "analytical-h200"
[model]
preset = "tiny"
layers = {layers}
tie_embeddings = {str(tied).lower()}
[cluster]
pp = {pp}
dp = 1
global_batch = 2
[data]
source = "text_dir"
path = "stdlib"
""")
    return load_run_config(p)


def _stage_numel(module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


@pytest.mark.parametrize("pp,layers,tied", [(2, 4, False), (3, 5, False), (3, 5, True)])
def test_stage_weights_equal_the_full_build_and_count_the_stage_share(tmp_path, pp, layers, tied):
    cfg = _run_cfg(tmp_path, pp=pp, layers=layers, tied=tied)
    full = build_qwen2(cfg.model, seed=cfg.seed).state_dict()
    lm = load_latency_model("analytical-h200", cfg.model, ClusterConfig(pp=pp, dp=1, global_batch=2))
    seen = set()
    for s in range(pp):
        mod = build_stage_module(cfg, RealrunConfig(), s, pp, torch.device("cpu"))
        assert list(mod.layer_range) == list(lm.stage_layers(s))
        for name, t in mod.global_state_dict().items():
            assert torch.equal(t, full[name]), name
            seen.add(name)
        # the stage's share by the simulator's own count (an independent formula of the dims);
        # a tied head on a last stage without the embedding holds its own copy, as Megatron's does
        assert _stage_numel(mod) == lm.stage_params(s)
        assert all(not p.is_meta for p in mod.parameters())
    assert seen == set(full)


def test_pieces_build_nothing_else():
    m = tiny()
    net = Q.skeleton(__import__("sparsebalance.kernels.qwen2", fromlist=["qwen2_config"]).qwen2_config(m))
    Q.materialize(net, Q.pieces(range(1, 3), embed=False, head=False), Q.seeded_fill(0, 0.02),
                  dtype=torch.float32, device=torch.device("cpu"))
    assert Q.materialized_pieces(net) == ["model.layers.1", "model.layers.2"]
    assert net.model.embed_tokens.weight.is_meta and net.lm_head.weight.is_meta


def _save(net, d: Path, fmt: str) -> Path:
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    net.config.to_json_file(str(d / "config.json"))
    sd = {k: v.contiguous() for k, v in net.state_dict().items()}
    if net.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    if fmt == "bin":
        torch.save(sd, d / "pytorch_model.bin")
    elif fmt == "safetensors":
        save_file(sd, str(d / "model.safetensors"))
    else:  # two shards + index, as HF writes large models
        names = sorted(sd)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for f, ks in shards.items():
            save_file({k: sd[k] for k in ks}, str(d / f))
        wm = {k: f for f, ks in shards.items() for k in ks}
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return d


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "bin"])
def test_stage_from_checkpoint_equals_the_saved_model(tmp_path, fmt):
    cfg = _run_cfg(tmp_path, pp=2, tied=True)
    src = build_qwen2(cfg.model, seed=11)  # another seed than the run's: weights must come from disk
    ck = _save(src, tmp_path / "ck", fmt)
    check_checkpoint(ck, cfg.model)
    want = src.state_dict()
    for s in range(2):
        mod = build_stage_module(cfg, RealrunConfig(checkpoint=str(ck), dtype="float64"), s, 2,
                                 torch.device("cpu"))
        got = mod.global_state_dict()
        for name, t in got.items():
            assert t.dtype == torch.float64
            assert torch.equal(t, want[name].double()), name
    # the last stage's tied head came from the embedding (absent from the files)
    assert torch.equal(got["lm_head.weight"], want["model.embed_tokens.weight"].double())


def test_checkpoint_that_does_not_match_the_run_is_refused(tmp_path):
    cfg = _run_cfg(tmp_path, pp=2)
    ck = _save(build_qwen2(replace(cfg.model, hidden=32, heads=2, kv_heads=1), seed=0),
               tmp_path / "ck", "safetensors")
    with pytest.raises(ConfigError, match=r"realrun.checkpoint: .*model.hidden = 64 .*hidden_size = 32"):
        check_checkpoint(ck, cfg.model)
    with pytest.raises(ConfigError, match="realrun.checkpoint: .* is not a local directory"):
        check_checkpoint(tmp_path / "nope", cfg.model)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((ck / "config.json").read_text())
    with pytest.raises(ConfigError, match="realrun.checkpoint: .*"):
        check_checkpoint(tmp_path / "empty", cfg.model)


PEAK = """
import resource, sys, json, torch
from sparsebalance.realrun.config import RealrunConfig
from sparsebalance.realrun.stage import build_stage_module
from sparsebalance.runconfig import load_run_config
cfg = load_run_config(sys.argv[1])
import transformers.models.qwen2.modeling_qwen2  # imports done before the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
mod = build_stage_module(cfg, RealrunConfig(), 1, 4, torch.device("cpu"))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"kib": peak - base, "params": sum(p.numel() for p in mod.parameters())}))
"""


def test_a_middle_stage_never_allocates_the_whole_model(tmp_path):
    """Stage 1 of 4 of a 250 MB model (embedding 65 MB, head 65 MB, 8 layers of 15 MB): the peak
    memory the build adds stays near the stage's 30 MB, far below the whole model."""
    p = tmp_path / "mid.toml"
    p.write_text("""
name = "mid"
profile = "analytical-h200"
[model]
hidden = 512
layers = 8
heads = 8
kv_heads = 2
head_dim = 64
ffn = 2048
vocab = 32000
[cluster]
pp = 4
dp = 1
global_batch = 4
[data]
source = "text_dir"
path = "stdlib"
""")
    cfg = load_run_config(p)
    r = subprocess.run([sys.executable, "-c", PEAK, str(p)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    m = cfg.model
    stage_bytes = 2 * m.params_per_layer * 4
    full_bytes = (m.layers * m.params_per_layer + 2 * m.embedding_params + m.hidden) * 4
    assert out["params"] == 2 * m.params_per_layer
    assert out["kib"] * 1024 < stage_bytes + 0.15 * full_bytes < 0.5 * full_bytes
