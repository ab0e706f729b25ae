"""The SLURM script names a GPU example config that exists and loads (every check of a launch but
the CUDA one, which needs a GPU), sized to the job the script asks for; no deprecated NCCL variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm" / "sbatch_realrun.sh"


def _default_config() -> str:
    m = re.search(r"^CONFIG=\$\{1:-([^}]+)\}", SCRIPT.read_text(), re.MULTILINE)
    assert m, "the SLURM script must name a default config: CONFIG=${1:-examples/...}"
    return m.group(1)


def test_slurm_script_names_an_existing_gpu_config_that_loads(monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from sparsebalance.realrun.config import realrun_config, world_size
    from sparsebalance.runconfig import load_run_config
    from sparsebalance.runner import prepare

    path = ROOT / _default_config()
    assert path.is_file(), f"{path} named by {SCRIPT.name} does not exist"
    cfg = load_run_config(path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # only the CUDA check is skipped
    rr = realrun_config(cfg)
    assert (rr.backend, rr.device) == ("nccl", "cuda")
    text = SCRIPT.read_text()
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", text).group(1))
    gpus = int(re.search(r"#SBATCH --gpus-per-node=(\d+)", text).group(1))
    assert world_size(cfg) == nodes * gpus
    prepared = prepare(cfg)  # data, latency model, policies
    assert len(prepared.sequences) >= cfg.cluster.global_batch


def test_no_deprecated_nccl_variables():
    deprecated = r"(?<!TORCH_)NCCL_(ASYNC_ERROR_HANDLING|BLOCKING_WAIT|DESYNC_DEBUG|ENABLE_TIMING)"
    for f in [SCRIPT, *ROOT.glob("examples/*.toml"), *ROOT.glob("docs/*.md")]:
        hits = re.findall(deprecated, f.read_text())
        assert not hits, f"{f}: deprecated NCCL variable(s) {hits}; use the TORCH_NCCL_ names"
