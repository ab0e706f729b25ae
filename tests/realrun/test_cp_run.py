"""The real run with context parallelism (gloo, CPU): a PP 1 x CP 2 and a PP 2 x CP 2 run's losses
and post-step weights equal the single-process reference, for the ring and the all-gather exchange."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from weightcheck import assert_weights_match, torchrun_realrun

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
name = "t"
iterations = 2
seed = 3
profile = "analytical-h200"
output_dir = "{out}"
[model]
preset = "tiny"
[cluster]
pp = {pp}
dp = 1
cp = 2
cp_layout = "{layout}"
cp_comm = "{comm}"
schedule = "1f1b"
global_batch = 4
[data]
source = "text_dir"
path = "stdlib"
num_sequences = 16
seed = 0
min_length = 100
max_length = 400
[policy]
batching = "sequential"
tuning = "dst"
k0 = 3
k_min = 1
k_max = 8
[realrun]
timeout_s = 60
lr = 0.003
"""


def _run(tmp: Path, pp: int, layout: str, comm: str) -> None:
    from sparsebalance.data import load_sequences
    from sparsebalance.realrun.reference import reference_run
    from sparsebalance.realrun.results import load_plans
    from sparsebalance.runconfig import load_run_config

    cfg_path = tmp / "run.toml"
    cfg_path.write_text(CONFIG.format(out=tmp / "results", pp=pp, layout=layout, comm=comm))
    res = torchrun_realrun(cfg_path, 2 * pp, tmp / "state", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp / "results" / "t"
    cfg = load_run_config(cfg_path)
    metrics = pd.read_csv(out / "metrics.csv")
    plans, budgets = load_plans(out / "plans.json")
    tokens = {s.id: s.tokens for s in load_sequences(cfg.data, base_dir=cfg.base_dir)}
    ref_losses, ref_state = reference_run(cfg, plans, budgets, tokens)
    np.testing.assert_allclose(metrics["loss"].to_numpy(), ref_losses, rtol=2e-5)
    merged = {}
    for r in range(2 * pp):  # the two CP ranks of a stage hold the same weights
        for k, v in torch.load(tmp / "state" / f"rank{r}.pt").items():
            if k in merged:
                assert torch.allclose(merged[k], v, rtol=0, atol=1e-6), f"CP ranks differ on {k} (rank {r})"
            merged[k] = v
    assert_weights_match(merged, ref_state, lr=cfg.realrun["lr"], steps=len(plans), max_off=1e-2)


@pytest.mark.parametrize("layout,comm", [("zigzag", "ring"), ("stripe", "allgather")])
def test_cp2_matches_single_process(tmp_path, layout, comm):
    _run(tmp_path, 1, layout, comm)


def test_pp2_cp2_ring_matches_single_process(tmp_path):
    _run(tmp_path, 2, "contiguous", "ring")


@pytest.mark.parametrize("extra,fragment", [
    ('tp = 2\nreplicate_kv_heads = true', "cluster.tp: context parallelism in the real run needs tp = 1"),
    ('cp_layout = "best"', "cluster.cp_layout: 'best' is not allowed; choose one of contiguous, zigzag, stripe"),
    ('cp_comm = "hierarchical"\ngpus_per_node = 1', "cluster.cp_comm: 'hierarchical' is not allowed; choose one of ring, allgather"),
])
def test_what_the_real_run_cannot_do_with_cp_is_one_line(run_cli, tmp_path, extra, fragment):
    text = CONFIG.format(out=tmp_path / "results", pp=1, layout="zigzag", comm="ring")
    text = text.replace('cp_layout = "zigzag"\ncp_comm = "ring"\n', "") if "cp_" in extra else text
    cfg = tmp_path / "run.toml"
    cfg.write_text(text.replace("[cluster]\n", "[cluster]\n" + extra + "\n"))
    r = run_cli("train", "--config", cfg)
    assert r.code == 2 and fragment in r.err and len(r.err.strip().splitlines()) == 1, r.err
