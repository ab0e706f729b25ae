"""``sparsebalance train`` rejects bad configs before any process starts."""

from __future__ import annotations

import pytest

from sparsebalance.errors import ConfigError

pytest.importorskip("torch")

BASE = """
name = "t"
iterations = 2
profile = "analytical-h200"
[model]
preset = "tiny"
[cluster]
pp = 2
global_batch = 4
[data]
source = "text_dir"
path = "stdlib"
num_sequences = 16
max_length = 256
[policy]
tuning = "dst"
k0 = 2
k_max = 8
[realrun]
"""


@pytest.mark.parametrize("extra,field", [
    ('backend = "nccl"', "realrun.backend"),
    ("coverage_layer = 7", "realrun.coverage_layer"),
    ("timeout_s = -1", "realrun.timeout_s"),
])
def test_validate_for_launch_rejects(tmp_path, extra, field):
    from sparsebalance.commands.train import validate_for_launch

    p = tmp_path / "run.toml"
    p.write_text(BASE + extra + "\n")
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate_for_launch(str(p), [])


def test_nproc_must_match(tmp_path):
    import argparse

    from sparsebalance.commands import train

    p = tmp_path / "run.toml"
    p.write_text(BASE)
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    with pytest.raises(ConfigError, match="--nproc"):
        train.run(parser.parse_args(["--config", str(p), "--nproc", "3"]))


def test_torchrun_command_shape():
    from sparsebalance.commands.train import torchrun_command

    cmd = torchrun_command("x.toml", 4, master_port=1234)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node", "4"]
    assert cmd[-4:] == ["-m", "sparsebalance.realrun", "--config", "x.toml"]


@pytest.mark.parametrize("extra,needle", [
    ('schedule = "zbv"\nvirtual_stages = 2', "cluster.schedule: 'zbv' is not allowed; choose one of gpipe, 1f1b, interleaved, zb-h1"),
    ('schedule = "interleaved"\nvirtual_stages = 3', "cluster.virtual_stages: pp x virtual_stages = 2 x 3"),
    ("tp = 3", "cluster.tp: must divide model.heads (4) so every rank holds whole heads, got 3"),
    ("tp = 4", "must divide model.kv_heads (2), got 4"),
])
@pytest.mark.parametrize("verb", ["train", "validate"])
def test_a_schedule_or_mesh_the_model_cannot_run(tmp_path, capsys, extra, needle, verb):
    """One line, exit 2, before any process starts (the tiny model: 4 layers, 4 heads, 2 KV heads)."""
    from sparsebalance import cli

    p = tmp_path / "run.toml"
    p.write_text(BASE.replace("[cluster]\n", "[cluster]\n" + extra + "\n") + "\n")
    assert cli.main([verb, "--config", str(p), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "o").exists()


def test_the_worker_itself_rejects_a_mesh_with_exit_code_2(tmp_path):
    """``python -m sparsebalance.realrun`` (what torchrun starts) on a bad mesh: one line, exit 2,
    before it joins any process group."""
    import os
    import subprocess
    import sys

    p = tmp_path / "run.toml"
    p.write_text(BASE.replace("[cluster]\n", "[cluster]\ntp = 3\n") + "\n")
    res = subprocess.run([sys.executable, "-m", "sparsebalance.realrun", "--config", str(p), "--quiet"],
                         capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "RANK": "0"})
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    want = "realrun: error: cluster.tp: must divide model.heads (4) so every rank holds whole heads, got 3"
    assert lines == [want], res.stderr
