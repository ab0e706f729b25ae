"""Bad input: one line naming the field, exit code 2, before any process starts."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")


def test_a_config_without_varlen_attention_is_refused():
    from sparsebalance.errors import ConfigError
    from sparsebalance.simulator.config import tiny
    from sparsebalance.titan.attention import use_moba
    from sparsebalance.titan.compat import import_torchtitan

    import_torchtitan()
    from torchtitan.models.qwen3 import model_registry

    spec = model_registry("debugmodel", attn_backend="flex")
    with pytest.raises(ConfigError, match="no varlen attention .*flex"):
        use_moba(spec.model, block_size=tiny().block_size)
    varlen = model_registry("debugmodel", attn_backend="varlen")
    assert use_moba(varlen.model, block_size=32) == 8


def test_a_model_without_moba_layers_is_refused():
    from sparsebalance.errors import ConfigError
    from sparsebalance.titan.compat import import_torchtitan
    from sparsebalance.titan.model import model_config_of

    import_torchtitan()
    from torchtitan.models.qwen3 import model_registry

    with pytest.raises(ConfigError, match="no MoBA layers"):
        model_config_of(model_registry("debugmodel", attn_backend="varlen").model, dtype="float32")


def test_model_config_of_reads_the_titan_dims():
    from sparsebalance.simulator.config import tiny
    from sparsebalance.titan.model import model_config_of, qwen3_spec

    m = tiny()
    got = model_config_of(qwen3_spec(m).model, dtype="float32")
    for f in ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab", "block_size", "dtype_bytes"):
        assert getattr(got, f) == getattr(m, f), f
    assert got.qkv_bias is False


@pytest.mark.parametrize("overrides, field", [
    (["--training.seq_len", "512"], "training.seq_len: the slot"),
    (["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"], "pipeline_parallel_schedule"),
    (["--parallelism.module_fqns_per_model_part", "None"], "module_fqns_per_model_part"),
    (["--training.local_batch_size", "9"], "slot_tokens: .* do not pack|global_batch"),
])
def test_bad_pp_jobs_are_one_line_before_launch(overrides, field):
    from sparsebalance.errors import ConfigError
    from sparsebalance.titan.launch import check_job

    with pytest.raises(ConfigError, match=field):
        check_job("sparsebalance_tiny_pp2", 2, overrides)


def test_validate_refuses_a_bad_job_with_exit_2_and_starts_nothing(run_cli, tmp_path):
    r = run_cli("validate", "--trainer", "torchtitan", "--config", "sparsebalance_tiny_pp2",
                "--set", "training.seq_len=512", "--out", tmp_path / "v")
    assert r.code == 2
    assert "slot (512 tokens) is smaller than the longest document" in r.err
    assert len(r.err.strip().splitlines()) == 1
    assert not (tmp_path / "v").exists()


_REGISTRY = '''
from torchtitan.models.qwen3 import model_registry
from sparsebalance.titan.config_registry import sparsebalance_tiny_pp2


def flex_job():
    """A torchtitan job whose model uses flex attention (no varlen attention for MoBA to replace)."""
    job = sparsebalance_tiny_pp2()
    job.model_spec = model_registry("debugmodel", attn_backend="flex")
    return job


def no_moba_job():
    """Varlen attention, but not MoBA: the loader's budgets would reach no MoBA layer."""
    job = sparsebalance_tiny_pp2()
    job.model_spec = model_registry("debugmodel", attn_backend="varlen")
    return job
'''


@pytest.mark.parametrize("preset, says", [
    ("flex_job", "no varlen attention (it uses flex attention"),
    ("no_moba_job", "no MoBA layers"),
])
def test_a_config_of_ones_own_without_moba_is_one_line_and_exit_2(run_cli, tmp_path, monkeypatch, preset, says):
    (tmp_path / "sb_own_registry.py").write_text(_REGISTRY)
    monkeypatch.syspath_prepend(str(tmp_path))
    r = run_cli("validate", "--trainer", "torchtitan", "--config", f"sb_own_registry:{preset}",
                "--out", tmp_path / "v")
    assert r.code == 2
    assert says in r.err
    assert len(r.err.strip().splitlines()) == 1
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize("config, nproc, overrides, want", [
    ("sparsebalance_tiny_fsdp2", 2, [], {"dp_mode": "zero3", "fsdp_shard": None, "fsdp_grad_sync": None,
                                         "pp_impl": "ideal"}),
    ("sparsebalance_tiny_fsdp2", 2, ["--parallelism.fsdp_reshard_after_forward", "never"],
     {"dp_mode": "zero2", "fsdp_grad_sync": None}),
    ("sparsebalance_tiny_pp2", 2, [], {"dp_mode": "ddp", "pp_impl": "torch"}),  # PP 2 on 2 processes: dp 1
])
def test_the_jobs_data_parallelism_becomes_the_runs_dp_mode(config, nproc, overrides, want):
    """FSDP2 over the DP ranks is priced as the simulator's zero3 (reshard after forward, torchtitan's
    default without PP) or zero2 (``never``); a job without DP replicas stays ddp; a pipelined job
    follows torch.distributed.pipelining (``pp_impl = "torch"``: blocking 1F1B sends)."""
    from sparsebalance.titan.launch import check_job

    c = check_job(config, nproc, overrides).run.cluster
    for field, value in want.items():
        assert getattr(c, field) == value, field


def test_fsdp_under_pp_gathers_once_per_step():
    from types import SimpleNamespace

    from sparsebalance.titan.setup import dp_mode_of

    par = SimpleNamespace(data_parallel_replicate_degree=1, data_parallel_shard_degree=-1,
                          fsdp_reshard_after_forward="default")
    assert dp_mode_of(par, 2, True)["dp_mode"] == "zero2" and dp_mode_of(par, 2, True)["fsdp_grad_sync"] == "last"
    hsdp = SimpleNamespace(data_parallel_replicate_degree=2, data_parallel_shard_degree=2,
                           fsdp_reshard_after_forward="default")
    assert dp_mode_of(hsdp, 4, False)["fsdp_shard"] == 2
    ddp = SimpleNamespace(data_parallel_replicate_degree=4, data_parallel_shard_degree=1)
    assert dp_mode_of(ddp, 4, False)["dp_mode"] == "ddp"


def test_the_trainer_probe_runs_plans_of_its_own(tmp_path):
    """The probe's run config moves both seeds and keeps the rest: its global batches are not the
    judged runs' (so the fit never sees a plan it is judged on), its policy is the one asked for."""
    from sparsebalance.commands._titan_probe import PROBE_SEED
    from sparsebalance.commands.validate_titan import _variant
    from sparsebalance.titan.launch import check_job
    from sparsebalance.titan.loader import StepPlanner

    setup = check_job("sparsebalance_tiny_pp2", 2, [])
    path = _variant(setup, {"batching": "lbb", "tuning": "fixed"}, tmp_path, "baseline", seed_offset=PROBE_SEED)
    probe = check_job("sparsebalance_tiny_pp2", 2, ["--dataloader.run_config", path])
    assert probe.run.seed == setup.run.seed + PROBE_SEED and probe.run.data.seed == setup.run.data.seed + PROBE_SEED
    assert (probe.run.policy.batching, probe.run.policy.tuning) == ("lbb", "fixed")
    assert probe.run.model == setup.run.model and probe.run.profile == setup.run.profile
    ids = [{s.id for s in StepPlanner(st).next()[0].sequences()} for st in (setup, probe)]
    assert ids[0] != ids[1]


def test_stage_modules_follow_the_layer_split_with_lighter_end_stages():
    """torchtitan's module list per stage is our split: 6 layers on 2 stages as 3 + 3 evenly, and as
    3 + 3 again with one layer fewer on each end (8 spread as 4 + 4, less 1 each); 8 on 3 stages with
    one fewer on the ends: 10 spread as 4, 3, 3 -> 3, 3, 2."""
    from sparsebalance.titan.setup import stage_modules

    assert stage_modules(6, 2) == [["tok_embeddings", "layers.0", "layers.1", "layers.2"],
                                   ["layers.3", "layers.4", "layers.5", "norm", "lm_head"]]
    three = stage_modules(8, 3, end_fewer=1)
    assert three == [["tok_embeddings", "layers.0", "layers.1", "layers.2"],
                     ["layers.3", "layers.4", "layers.5"], ["layers.6", "layers.7", "norm", "lm_head"]]
