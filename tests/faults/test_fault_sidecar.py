"""A measured profile's sidecar that does not describe its table (issue 23, item 4). What a table and
its sidecar can be checked for: the sidecar's own records of the device (label, machine fingerprint,
concurrency) must agree, else one line and exit 2; the sidecar's layer dims must be the run's
(already an error); attention budgets past the block count of the longest length under the sidecar's block size
(a table measured for another model) are a shown warning. Every shipped profile loads as before.
Mutations are drawn from a seed (in the test id)."""

from __future__ import annotations

import json
import random
import shutil
import warnings

import pytest
from faultkit import TINY_RUN

from sparsebalance.errors import ConfigError, MeaningWarning
from sparsebalance.simulator.cost.catalog import SHIPPED_DIR, load_profile, shipped_profiles

RUN = TINY_RUN.replace('device = "cpu"\n', "").replace("{name}", "s")  # the cluster's device is its default
GPUS = ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090", "h20")


@pytest.mark.parametrize("name", shipped_profiles())
def test_every_shipped_profile_loads_without_a_contradiction_or_a_foreign_table(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", MeaningWarning)
        prof = load_profile(name)
    prof.meta.check_consistent(name)


def _copy(tmp_path, table_of: str, sidecar_of: str, edit) -> str:
    d = tmp_path / "prof"
    d.mkdir()
    shutil.copy(SHIPPED_DIR / table_of / "profile.csv", d / "profile.csv")
    meta = json.loads((SHIPPED_DIR / sidecar_of / "profile.json").read_text())
    edit(meta)
    (d / "profile.json").write_text(json.dumps(meta))
    return str(d)


def _contradictions(rng: random.Random) -> list[tuple[str, object, str]]:
    """(shipped profile, sidecar edit, words the line must hold): each edit makes the sidecar
    disagree with itself about the device its table was measured on."""
    gpu = rng.choice(GPUS)
    other = rng.choice([g for g in GPUS if g != "NVIDIA H100 80GB HBM3"])
    cpu = f"cpu {rng.choice(['x86_64', 'aarch64', 'AMD EPYC'])}, {rng.randint(1, 64)} thread(s)"
    return [
        ("cpu-tiny", lambda m: m.update(device=gpu), "names a GPU but machine.device_kind"),
        ("h100-measured-3b", lambda m: m.update(device=cpu), "names a CPU but machine.device_kind"),
        ("h100-measured-0.5b", lambda m: m.update(device=other), "was measured on machine.gpu_name"),
        ("h100-measured-3b", lambda m: m.update(concurrency=rng.randint(2, 64)), "is how CPU tables"),
        ("cpu-tiny", lambda m: m["machine"].update(device_kind=rng.choice(["gpu", "rocm", "", "CPU "])),
         "machine.device_kind must be cpu or cuda"),
    ]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", range(5))
def test_self_contradicting_sidecar_is_one_line(tmp_path, run_cli, seed, case):
    name, edit, words = _contradictions(random.Random(seed))[case]
    prof = _copy(tmp_path, name, name, edit)
    cfg = tmp_path / "run.toml"
    cfg.write_text(RUN.format(profile=prof))
    out = tmp_path / "out"
    r = run_cli("simulate", "--config", cfg, "--no-trace", "--profile-as-is", "--out", out)
    lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
    assert r.code == 2 and len(lines) == 1 and "Traceback" not in r.err, r.err[-2000:]
    assert words in lines[0] and f"{prof}/profile.csv" in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.parametrize("seed", range(3))
def test_sidecar_model_other_than_the_runs_is_one_line(tmp_path, run_cli, seed):
    """Already refused before issue 23 (latency.py's _mismatches): kept that way. The dims of one
    layer, vocabulary and head; not ``layers``: a profile's latencies are per layer."""
    rng = random.Random(seed)
    dim = rng.choice(["hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"])
    prof = _copy(tmp_path, "cpu-tiny", "cpu-tiny", lambda m: m["model"].update({dim: m["model"][dim] * 2}))
    cfg = tmp_path / "run.toml"
    cfg.write_text(RUN.format(profile=prof))
    r = run_cli("simulate", "--config", cfg, "--no-trace", "--profile-as-is", "--out", tmp_path / "out")
    lines = [ln for ln in r.err.strip().splitlines() if ln.strip() and "warning" not in ln]
    assert r.code == 2 and len(lines) == 1, r.err[-2000:]
    assert "does not match the run" in lines[0] and f"model.{dim}" in lines[0], lines[0]


def test_cpu_table_under_a_3b_sidecar_is_a_shown_warning(tmp_path, run_cli):
    """The reported case: cpu-tiny's table (block 32) under h100-measured-3b's sidecar (block 256):
    budgets up to 32 blocks where the longest length has 16. Its own sidecar gives no warning."""
    prof = _copy(tmp_path, "cpu-tiny", "h100-measured-3b", lambda m: None)
    with pytest.warns(MeaningWarning, match=r"budgets reach 32 blocks.*4096 tokens.*16 block\(s\) of 256"):
        load_profile(prof)
    cfg = tmp_path / "run.toml"
    cfg.write_text(RUN.format(profile=prof).replace('"tiny"', '"qwen2.5-3b"'))
    r = run_cli("simulate", "--config", cfg, "--no-trace", "--profile-as-is", "--out", tmp_path / "out")
    shown = [ln for ln in r.err.splitlines() if ln.startswith("sparsebalance: warning: ")]
    assert any("another model than its sidecar names" in ln for ln in shown), r.err[-2000:]


def test_measured_profile_built_in_memory_is_checked_too():
    """Profile() itself checks (a calibrated copy, a profile a test builds), not only the loader."""
    from dataclasses import replace

    prof = load_profile("cpu-tiny")
    with pytest.raises(ConfigError, match="names a GPU"):
        replace(prof, meta=replace(prof.meta, device="NVIDIA H200"))
