"""`sparsebalance accuracy --executor single` (the single-process trainer): rows of --quick --json, the
trainer's step, and every bad input (of either executor) -> one line, exit 2. A random-initialised
checkpoint stands in for the shipped one (seconds, not minutes). The measured grid:
tests/test_accuracy_measured.py."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sparsebalance import cli
from sparsebalance.accuracy import model as M
from sparsebalance.data.recall import RecallConfig

ROW_KEYS = {"config", "anchor", "p", "seed", "bucket", "accuracy", "mean_budget", "coverage",
            "cpu_time_s", "sim_speedup"}
FAST = ["--steps", "2", "--heldout", "2", "--buckets", "64,256"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    net = M.NetConfig()
    M.save(path, M.build(net), net, RecallConfig(), {"coverage_rate": 0.4, "coverage_layer": 0,
                                                     "seed": 0, "command": "test fixture"})
    return path


def test_quick_json_rows(ckpt, tmp_path, capsys):
    assert cli.main(["accuracy", "--executor", "single", "--quick", "--json", "--checkpoint", str(ckpt),
                     "--out", str(tmp_path), *FAST]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["config"], r["bucket"]) for r in rows} == {(c, b) for c in ("fixed", "MEAN0.1")
                                                           for b in (64, 256)}
    assert all(set(r) == ROW_KEYS for r in rows)
    fixed = [r for r in rows if r["config"] == "fixed"]
    assert all(r["sim_speedup"] == 1.0 and r["mean_budget"] == 8 and r["anchor"] is None for r in fixed)
    dst = [r for r in rows if r["config"] == "MEAN0.1"]
    assert all(r["anchor"] == "mean" and r["p"] == 0.1 and 0 <= r["coverage"] <= 1 for r in dst)
    assert all(0 <= r["accuracy"] <= 1 and r["cpu_time_s"] > 0 for r in rows)
    assert (tmp_path / "accuracy_vs_speedup.png").is_file() and (tmp_path / "summary.csv").is_file()


def _bad(argv, capsys, field):
    try:
        rc = cli.main(["accuracy", *argv])
    except SystemExit as e:  # usage errors (argparse types) exit from the parser, also with 2
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err


@pytest.mark.parametrize("argv,field", [
    (["--anchors", "median"], "anchors"),
    (["--ps", "0"], "p"),
    (["--ps", "1.5"], "p"),
    (["--buckets", "8"], "buckets"),           # shorter than any recall example: no held-out examples
    (["--heldout", "0"], "heldout"),
    (["--buckets", "64,4096"], "buckets"),     # beyond the model's 2,048 positions
    (["--jobs", "0"], "--jobs"),
    (["--base", "sparse"], "base"),
])
@pytest.mark.parametrize("executor", ["single", "realrun"])
def test_bad_arguments(argv, field, executor, ckpt, tmp_path, capsys):
    if executor == "realrun" and argv[0] == "--jobs":
        argv = ["--jobs", "0"]  # a parse error before the executor is known: the same line
    _bad(["--executor", executor, "--checkpoint", str(ckpt), "--out", str(tmp_path), *argv], capsys, field)


def test_missing_and_mismatched_checkpoints(ckpt, tmp_path, capsys):
    _bad(["--checkpoint", str(tmp_path / "nowhere")], capsys, "checkpoint")
    doc = json.loads((ckpt / "checkpoint.json").read_text())
    for name, edit, field in (
            ("version", lambda d: d.update(format_version=99), "format_version"),
            ("norate", lambda d: d.pop("coverage_rate"), "coverage_rate"),
            ("preset", lambda d: d["model"].update(preset="qwen2.5-3b"), "preset"),
            ("positions", lambda d: d["model"].update(max_positions=512), "max_length")):
        bad = tmp_path / name
        bad.mkdir()
        d = json.loads(json.dumps(doc))
        edit(d)
        (bad / "checkpoint.json").write_text(json.dumps(d))
        (bad / "model.pt").write_bytes((ckpt / "model.pt").read_bytes())
        _bad(["--checkpoint", str(bad), "--out", str(tmp_path / "o"), "--buckets", "64"], capsys, field)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "checkpoint.json").write_text(json.dumps(doc))
    torch.save({"model.embed_tokens.weight": torch.zeros(3, 3)}, wrong / "model.pt")
    _bad(["--checkpoint", str(wrong), "--out", str(tmp_path / "o"), "--buckets", "64"], capsys, "checkpoint")


def test_gradient_accumulation_over_microbatches_equals_one_packed_step(ckpt):
    """TrainExecutor normalises by the global batch's answers: two micro-batches give the same
    update as one micro-batch holding both sequences (dense budget, so the packing is all that
    differs)."""
    import numpy as np

    from sparsebalance.accuracy.executor import TrainExecutor
    from sparsebalance.data.recall import RecallTask
    from sparsebalance.data.sequence import Sequence
    from sparsebalance.simulator.plan import Plan

    class NoSim:
        def execute(self, it, plan, budgets):
            from sparsebalance.simulator.engine.iteration import IterationResult

            return IterationResult(1.0, None, [[1.0]], [1.0], 0.0)

    seqs = [Sequence(id=1, length=64 * 8), Sequence(id=2, length=200 * 8)]
    params = []
    for plan in (Plan.from_lists([[[seqs[0]], [seqs[1]]]]), Plan.from_lists([[seqs]])):
        c = M.load(ckpt)
        model = c.load_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ex = TrainExecutor(model, opt, RecallTask(c.task), NoSim(), scale=8, block_size=32,
                           coverage_layer=0, clip=0.0)
        budgets = tuple(tuple(64 for _ in r) for r in plan.ranks)
        res = ex.execute(0, plan, budgets)
        assert set(res.coverage) == {1, 2} and len(res.coverage[2]) == 7
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    np.testing.assert_allclose(params[0].numpy(), params[1].numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("text,field", [
    ("stepz = 3\n", "stepz"),                 # unknown key: the allowed ones are named
    ('steps = "many"\n', "steps"),
    ("seeds = []\n", "seeds"),
    ('ps = ["a"]\n', "ps"),
    ("ps = [1.5]\n", "p"),                    # read, then checked by ExperimentConfig
])
def test_bad_config_file(text, field, ckpt, tmp_path, capsys):
    cfg = tmp_path / "exp.toml"
    cfg.write_text(text)
    _bad(["--executor", "single", "--checkpoint", str(ckpt), "--config", str(cfg), "--out", str(tmp_path / "o")],
         capsys, field)


def test_config_file_then_flags_override():
    import tempfile
    from pathlib import Path

    from sparsebalance.commands.accuracy import _experiment

    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "exp.toml"
        cfg.write_text("steps = 4\nseeds = [3, 4]\nps = [0.2]\nlr = 2e-3\n")
        args = cli.build_parser("accuracy").parse_args(["accuracy", "--executor", "single", "--config", str(cfg),
                                                         "--ps", "0.3"])
        exp = _experiment(args)
    assert (exp.steps, exp.seeds, exp.ps, exp.lr) == (4, (3, 4), (0.3,), 2e-3)


def test_token_batches_pack_greedily_in_order_under_the_cap():
    """``token_batches`` (what evaluation and pre-training step over), against a brute-force oracle:
    the examples in order, each run the longest prefix of the rest within the cap (one example
    alone when it exceeds it), answers labelled at their positions."""
    import numpy as np

    from sparsebalance.accuracy.executor import token_batches
    from sparsebalance.data.recall import Example

    rng = np.random.default_rng(7)
    lengths = rng.integers(3, 40, size=23).tolist() + [90, 5]
    exs = [Example(tokens=rng.integers(1, 100, size=n), positions=np.array([0, n // 2]))
           for n in lengths]
    cap = 60
    want, i = [], 0
    while i < len(lengths):
        j = i + 1
        while j < len(lengths) and sum(lengths[i:j + 1]) <= cap:
            j += 1
        want.append(lengths[i:j])
        i = j
    got = list(token_batches(exs, cap))
    assert [np.diff(b.cu_seqlens.numpy()).tolist() for b in got] == want
    ids = np.concatenate([b.input_ids[0].numpy() for b in got])
    assert np.array_equal(ids, np.concatenate([e.tokens for e in exs]))
    labels = np.concatenate([b.labels[0].numpy() for b in got])
    answers = np.concatenate([e.answers for e in exs])
    assert np.array_equal(labels[labels >= 0], answers)
