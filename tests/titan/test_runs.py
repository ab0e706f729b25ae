"""torchtitan's own trainer running SparseBalance's plan on this CPU (gloo): PP 2 and FSDP 2 against a
single-process reference from the same seed checkpoint, the budgets every stage ran at, and a
checkpoint restart. About 3 minutes: 7 short jobs of a tiny model."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torchtitan")

pytestmark = pytest.mark.slow

STEPS = 3


def _slot_run_config(tmp: Path) -> str:
    """titan-cpu with fixed slots spelt out: a single process replays PP 2's plan."""
    from sparsebalance.titan.setup import preset_path

    text = preset_path("titan-cpu").read_text().replace("[policy]\n", "[policy]\nslot_tokens = 2048\n")
    path = tmp / "titan-cpu-slots.toml"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from sparsebalance.titan.launch import run_job

    tmp = tmp_path_factory.mktemp("titan")
    seed = tmp / "seed"
    run_job("sparsebalance_tiny_single", 1, seed, ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"])
    load = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0"),
            "--training.steps", str(STEPS), "--sparsebalance.record_budgets"]
    out = {"tmp": tmp, "load": load}
    out["pp2"] = run_job("sparsebalance_tiny_pp2", 2, tmp / "pp2", load)
    out["pp_ref"] = run_job("sparsebalance_tiny_single", 1, tmp / "pp_ref",
                            [*load, "--training.global_batch_size", "4",
                             "--dataloader.run_config", _slot_run_config(tmp)])
    out["fsdp2"] = run_job("sparsebalance_tiny_fsdp2", 2, tmp / "fsdp2", load)
    out["fsdp_ref"] = run_job("sparsebalance_tiny_single", 1, tmp / "fsdp_ref", load)
    return out


def test_pp2_losses_equal_the_single_process_reference(runs):
    pp, ref = runs["pp2"].losses, runs["pp_ref"].losses
    assert len(pp) == len(ref) == STEPS
    np.testing.assert_allclose(pp, ref, rtol=2e-5)
    assert pp[-1] < pp[0]  # it trains


def test_fsdp2_losses_equal_the_single_process_reference(runs):
    np.testing.assert_allclose(runs["fsdp2"].losses, runs["fsdp_ref"].losses, rtol=2e-5)


def _plan_budgets(config: str, nproc: int, overrides: list[str]):
    from sparsebalance.titan.launch import check_job
    from sparsebalance.titan.loader import StepPlanner

    setup = check_job(config, nproc, overrides)
    planner = StepPlanner(setup)
    return setup, [planner.next() for _ in range(STEPS)]


def test_every_stage_runs_each_microbatch_at_the_plans_budget(runs):
    """PP 2 x 1F1B: each (step, stage, micro-batch, layer) the MoBA kernel ran at the plan's budget of
    that micro-batch, per document, and on its real documents' tokens only."""
    setup, plans = _plan_budgets("sparsebalance_tiny_pp2", 2, runs["load"])
    rows = runs["pp2"].budgets()
    layers = setup.run.model.layers
    stage_of = {0: range(2), 1: range(2, 4)}
    seen = set()
    for r in rows:
        plan, budgets = plans[r["step"] - 1]
        mb, b = plan.ranks[0][r["microbatch"]], budgets[0][r["microbatch"]]
        assert r["layer"] in stage_of[r["stage"]]
        assert r["topk"] == [b.expand(layers)[r["layer"]]] * len(mb.sequences)
        assert r["tokens"] == mb.tokens - mb.pad
        seen.add((r["step"], r["stage"], r["microbatch"], r["layer"]))
    assert len(seen) == STEPS * setup.microbatches * layers  # every one, each once
    assert any(mb.pad for p, _ in plans for mb in p.ranks[0])  # slots were padded
    assert len({b.mean() for _, bs in plans for b in bs[0]}) > 1  # DST varied the budgets


def test_restart_after_step_2_resumes_step_3_exactly(runs):
    """Stop after step 2 (its checkpoint), restart: step 3's loss and budgets equal the uninterrupted
    run's."""
    from sparsebalance.titan.launch import run_job

    tmp = runs["tmp"]
    first = run_job("sparsebalance_tiny_pp2", 2, tmp / "stop2",
                    [*runs["load"], "--training.steps", "2", "--checkpoint.interval", "1"])
    assert (first.dump / "checkpoint" / "step-2").is_dir()
    again = run_job("sparsebalance_tiny_pp2", 2, tmp / "stop2",
                    [*runs["load"], "--training.steps", "3", "--checkpoint.interval", "1"])
    assert again.first_step == 3 and len(again.losses) == 1
    np.testing.assert_allclose(again.losses[0], runs["pp2"].losses[2], rtol=1e-6)
    step3 = lambda res: sorted((r["stage"], r["microbatch"], r["layer"], tuple(r["topk"]), r["tokens"])
                               for r in res.budgets() if r["step"] == 3)
    assert step3(again) == step3(runs["pp2"])


def test_measured_trace_has_a_row_per_action(tmp_path):
    from sparsebalance.titan.launch import run_job

    res = run_job("sparsebalance_tiny_pp2", 2, tmp_path / "m", ["--training.steps", "2", "--sparsebalance.measure"])
    tr = res.trace()
    fb = tr[tr.op.isin(["F", "B"])]
    assert len(fb) == 2 * 2 * 2 * 4  # steps x stages x (F, B) x micro-batches
    assert set(tr.op) == {"F", "B", "OPTIM"}
    assert (tr.end_s > tr.start_s).all()
    shutil.rmtree(tmp_path / "m" / "checkpoint", ignore_errors=True)
