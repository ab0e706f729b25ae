"""The real run with context parallelism (gloo, CPU): a PP 1 x CP 2 and a PP 2 x CP 2 run's losses
and post-step weights equal the single-process reference, for the ring and the all-gather exchange;
every CP collective is a CP_COMM row of the measured trace, inside its action."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from weightcheck import assert_weights_match, merged_state, reference_check, torchrun_realrun

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
    cfg_path = tmp / "run.toml"
    cfg_path.write_text(CONFIG.format(out=tmp / "results", pp=pp, layout=layout, comm=comm))
    res = torchrun_realrun(cfg_path, 2 * pp, tmp / "state", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    cfg, _, plans, _, _, ref_state = reference_check(cfg_path, tmp / "results" / "t")
    merged = merged_state(tmp / "state", 2 * pp, atol=1e-6, what="CP ranks")  # a stage's CP ranks: same weights
    assert_weights_match(merged, ref_state, lr=cfg.realrun["lr"], steps=len(plans), max_off=1e-2)
    _check_cp_comm_rows(tmp / "results" / "t" / "measured_trace.csv", layers=4 // pp, comm=comm)


def _check_cp_comm_rows(path: Path, *, layers: int, comm: str) -> None:
    """The measured trace times every CP collective inside its action: per layer, an F has the
    K/V all-gather (ring: the gate's pooled means and the one hop of 2 ranks), a B the K/V gathered
    again and the gradients' way back (all-reduce; ring: the hop of K/V with dK/dV, and dK/dV's hop
    home)."""
    import pandas as pd

    tr = pd.read_csv(path)
    comm_rows, actions = tr[tr.op == "CP_COMM"], tr[tr.op.isin(["F", "B"])]
    assert len(actions) and len(comm_rows)
    per_f, per_b = {"allgather": (1, 2), "ring": (2, 2)}[comm]
    inside = 0
    for a in actions.itertuples():
        mine = comm_rows[(comm_rows.iteration == a.iteration) & (comm_rows.stage == a.stage)
                         & (comm_rows.start_s >= a.start_s) & (comm_rows.end_s <= a.end_s)]
        assert len(mine) == layers * (per_f if a.op == "F" else per_b), (a, len(mine))
        assert (mine.microbatch == a.microbatch).all()
        inside += len(mine)
    assert inside == len(comm_rows)  # none outside an action


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


def test_cp_on_a_gpu_is_refused_in_one_line(run_cli, tmp_path):
    """Both CP exchanges compute on the CPU MoBA path: device = "cuda" with cp > 1 is one line."""
    cfg = tmp_path / "run.toml"
    text = CONFIG.format(out=tmp_path / "results", pp=1, layout="zigzag", comm="ring")
    cfg.write_text(text.replace("[realrun]\n", '[realrun]\ndevice = "cuda"\n'))
    r = run_cli("train", "--config", cfg)
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1, r.err
    assert "realrun.device: context parallelism in the real run computes on the CPU path; must be cpu" in r.err
