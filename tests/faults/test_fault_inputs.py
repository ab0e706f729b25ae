"""The malformed-input table: every bad input is refused before any work with exit code 2 and ONE
line on stderr that names the field, never a traceback, and leaves no results directory behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from faultkit import TINY_RUN

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "qwen25-3b_h200_dp4pp4.toml"
CPU_TINY = ROOT / "sparsebalance" / "data" / "profiles" / "cpu-tiny"


@pytest.fixture
def files(tmp_path):
    """Inputs the table refers to, by name."""
    f = {"tmp": tmp_path, "example": EXAMPLE}
    (tmp_path / "a_file").write_text("x")
    f["a_file"] = tmp_path / "a_file"
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("someone's results")
    f["full"] = full
    (tmp_path / "bad.toml").write_text("name = \n")
    f["bad_toml"] = tmp_path / "bad.toml"
    (tmp_path / "list.json").write_text("[1, 2]")
    f["list_json"] = tmp_path / "list.json"
    # a measured profile without its note accepting noise, and one with a 1e-9 s point
    for name, edit in (("nomono", None), ("dip", ("attn_fwd", 256, 4))):
        d = tmp_path / name
        shutil.copytree(CPU_TINY, d)
        meta = json.loads((d / "profile.json").read_text())
        meta.pop("nonmonotone", None)
        (d / "profile.json").write_text(json.dumps(meta))
        if edit:
            import pandas as pd

            t = pd.read_csv(d / "profile.csv")
            sel = (t.op == edit[0]) & (t.seq_len == edit[1]) & (t.budget == edit[2])
            t.loc[sel, "latency_s"] = 1e-9
            t.to_csv(d / "profile.csv", index=False)
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(TINY_RUN.format(name="tiny", profile=d))
        f[name] = cfg
    base_a, base_b = tmp_path / "base_a.toml", tmp_path / "base_b.toml"
    base_a.write_text('[cluster]\ndp = 2\npp = 2\nglobal_batch = 8\n[data]\nnum_sequences = 64\n')
    base_b.write_text(base_a.read_text())
    f["base_a"] = base_a
    grid = tmp_path / "grid.toml"
    grid.write_text('base = "base_b.toml"\n[grid]\n"policy.batching" = ["sab"]\n')
    f["grid"] = grid
    bad_grid = tmp_path / "bad_grid.toml"
    bad_grid.write_text('grid = 1\n')
    f["bad_grid"] = bad_grid
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({"forward": [[1e308, 1e308], [1e308, 1e308]],
                                "backward": [[1e308, 1e308], [1e308, 1e308]]}))
    f["huge"] = huge
    return f


SIM = ("simulate", "--config", "{example}", "--iterations", "1", "--no-trace", "--out", "{tmp}/o")
SWEEP = ("sweep", "--config", "{base_a}", "--batching", "sab", "--out", "{tmp}/o")

#: (id, argv, text the one line must contain)
TABLE = [
    ("dataset-smaller-than-batch", SIM + ("--set", "data.num_sequences=4"), "global batch"),
    ("section-set-to-scalar", SIM + ("--set", "cluster=3"), "cluster"),
    ("key-under-a-scalar", SIM + ("--set", "cluster.pp.x=1"), "cluster.pp"),
    ("negative-seed", SIM + ("--set", "seed=-1"), "seed: must be >= 0"),
    ("negative-data-seed", SIM + ("--set", "data.seed=-1"), "data.seed"),
    ("tp-3-with-16-heads", SIM + ("--set", "cluster.dp=1", "--set", "cluster.tp=3"), "model.heads"),
    ("tp-7-with-16-heads", SIM + ("--set", "cluster.dp=1", "--set", "cluster.tp=7"), "model.heads"),
    ("tp-above-kv-heads", SIM + ("--set", "cluster.dp=1", "--set", "cluster.tp=4"), "replicate_kv_heads"),
    ("plan-exceeds-cluster", SIM + ("--set", "cluster.nodes=1"), "exceeds the cluster"),
    ("tp-across-nodes", SIM + ("--set", "cluster.tp=16"), "gpus_per_node"),
    ("infinite-bandwidth", SIM + ("--set", "cluster.p2p_bandwidth=inf"), "p2p_bandwidth"),
    ("unknown-key", SIM + ("--set", "nope=1"), "nope: unknown field"),
    ("zero-iterations-in-config", SIM[:4] + ("--set", "iterations=0", "--out", "{tmp}/o"), "iterations"),
    ("iterations-flag-0", ("simulate", "--config", "{example}", "--iterations", "0"), "--iterations"),
    ("trace-limit-0", SIM + ("--trace-limit", "0"), "--trace-limit"),
    ("out-under-a-file", SIM[:-1] + ("{a_file}/x",), "is a file, not a directory"),
    ("out-unwritable", SIM[:-1] + ("/proc/sparsebalance/x",), "--out: cannot write"),
    ("out-holds-results", SIM[:-1] + ("{full}",), "--force"),
    ("force-on-foreign-dir", SIM[:-1] + ("{full}", "--force"), "did not write"),
    ("config-not-toml", ("simulate", "--config", "{bad_toml}"), "not valid TOML"),
    ("config-json-list", ("simulate", "--config", "{list_json}"), "expected a table"),
    ("config-missing", ("simulate", "--config", "{tmp}/none.toml"), "no such file"),
    ("nonmonotone-profile", ("simulate", "--config", "{nomono}", "--out", "{tmp}/o"), "falls as work grows"),
    ("profile-with-1e-9-point", ("simulate", "--config", "{dip}", "--out", "{tmp}/o"), "falls as work grows"),
    ("ablation-negative-seed", ("ablation", "--seeds", "-1", "--out", "{tmp}/o"), "--seeds"),
    ("ablation-iterations-0", ("ablation", "--iterations", "0", "--out", "{tmp}/o"), "--iterations"),
    ("sweep-jobs-0", SWEEP + ("--jobs", "0"), "--jobs"),
    ("sweep-iterations-0", SWEEP + ("--iterations", "0"), "--iterations"),
    ("sweep-negative-seed", SWEEP + ("--seeds", "-1"), "--seeds"),
    ("sweep-two-bases", ("sweep", "--config", "{base_a}", "--grid", "{grid}", "--out", "{tmp}/o"), "--config"),
    ("sweep-grid-not-a-table", ("sweep", "--grid", "{bad_grid}", "--out", "{tmp}/o"), "grid"),
    ("sweep-out-under-a-file", SWEEP[:-1] + ("{a_file}/x",), "is a file"),
    ("pipeline-overflowing-durations", ("pipeline", "--config", "{huge}", "--json"), "not a finite number"),
    ("pipeline-virtual-stages-0", ("pipeline", "--config", "{huge}", "--virtual-stages", "0"),
     "--virtual-stages"),
    ("train-port-out-of-range", ("train", "--config", "{example}", "--master-port", "99999"), "--master-port"),
    ("train-nproc-0", ("train", "--config", "{example}", "--nproc", "0"), "--nproc"),
    ("validate-rounds-0", ("validate", "--config", "{example}", "--rounds", "0"), "--rounds"),
    ("validate-retries-negative", ("validate", "--config", "{example}", "--retries", "-1"), "--retries"),
    ("validate-without-config", ("validate",), "--config"),
    ("profile-repeats-0", ("profile", "--out", "{tmp}/p", "--repeats", "0"), "--repeats"),
    # results paths that are not a directory of their own (tests/faults/test_fault_out_paths.py)
    ("profile-out-empty", ("profile", "--out", ""), "--out: empty path"),
    ("sweep-out-dot", SWEEP[:-1] + (".",), "must name a directory of its own"),
    ("sweep-out-cwd-force", SWEEP[:-1] + (str(Path.cwd()), "--force"), "resolves to"),
    ("ablation-out-parent", ("ablation", "--out", "..", "--force"), "must name a directory of its own"),
    ("simulate-name-dotdot", SIM + ("--set", "name='..'"), "name: must be a label"),
    # list flags that would run nothing or drop an axis, numbers that would overflow or poison
    ("sweep-seeds-only-commas", SWEEP + ("--seeds", ",,"), "--seeds: no integers"),
    ("sweep-batching-only-comma", SWEEP + ("--batching", ","), "--batching: no names"),
    ("sweep-stray-comma", SWEEP + ("--seeds", "1,2,"), "empty item"),
    ("ablation-seeds-twice", ("ablation", "--seeds", "0,0", "--out", "{tmp}/o"), "given twice"),
    ("schedules-twice", ("ablation", "--schedules", "1f1b,1f1b", "--out", "{tmp}/o"), "given twice"),
    ("num-sequences-1e12", SIM + ("--set", "data.num_sequences=1e12"), "num_sequences: must be <="),
    ("iterations-1e30", SIM[:3] + ("--set", "iterations=1e30", "--out", "{tmp}/o"), "iterations: 1e+30 is out of range"),
    ("p-nan", SIM + ("--set", "policy.p=nan"), "policy.p: must be a finite number"),
    ("train-lr-inf", ("train", "--config", "{example}", "--set", "realrun.lr=inf"), "realrun.lr: must be a finite"),
    # a check that needs no run is made before the results directory exists (issue 23, item 3)
    ("model-over-device-memory", SIM + ("--set", "model.layers=4000"), "cannot hold one micro-batch"),
]


@pytest.mark.parametrize("argv,needle", [pytest.param(a, n, id=i) for i, a, n in TABLE])
def test_bad_input_is_one_line_exit_2(files, run_cli, argv, needle):
    before = sorted(p.name for p in files["tmp"].iterdir())
    r = run_cli(*(a.format(**files) for a in argv))
    assert r.code == 2, (r.code, r.err)
    lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.err
    assert needle in lines[0] and "Traceback" not in r.err
    assert sorted(p.name for p in files["tmp"].iterdir()) == before, "output created for a refused input"
    assert (files["full"] / "keep.txt").read_text() == "someone's results"


@pytest.mark.parametrize("flags,needle", [
    (("--seq-lens", "64"), "--seq-lens"),          # one point cannot be interpolated
    (("--budgets", "2,2"), "--budgets"),
    (("--out", "{a_file}"), "--out"),              # an existing file: refused before measuring
])
def test_profile_refuses_before_measuring(files, run_cli, monkeypatch, flags, needle):
    pytest.importorskip("torch")
    import sparsebalance.kernels.profiler as prof

    monkeypatch.setattr(prof, "run_profile", lambda *a, **k: pytest.fail("measured a refused input"))
    argv = ["profile", "--out", str(files["tmp"] / "p"), *(f.format(**files) for f in flags)]
    r = run_cli(*argv)
    assert r.code == 2 and needle in r.err and len(r.err.strip().splitlines()) == 1


def test_nonmonotone_profile_accepted_on_request_with_the_points_named(files, run_cli):
    r = run_cli("simulate", "--config", files["dip"], "--out", files["tmp"] / "o", "--no-trace",
                "--allow-nonmonotone", "-v")
    assert r.code == 0, r.err
    assert "attn_fwd at budget 4: seq_len 128 -> 256 falls" in r.err


def test_comma_lists_are_refused_when_they_would_run_nothing_or_twice():
    """Generated lists (seeded): any with an empty item, no item or a repeat is one line naming the
    flag; every other comes back whole, in order."""
    import numpy as np

    from sparsebalance.commands._args import comma_list
    from sparsebalance.errors import ConfigError

    rng = np.random.default_rng(23)
    for _ in range(300):
        vals = [str(v) for v in rng.integers(0, 6, rng.integers(0, 5))]
        if rng.random() < 0.4 and vals:
            vals.insert(int(rng.integers(0, len(vals) + 1)), " " * int(rng.integers(0, 2)))
        text = ",".join(vals)
        bad = not vals or any(not v.strip() for v in vals) or len(set(vals)) < len(vals)
        if bad:
            with pytest.raises(ConfigError, match="^--seeds: "):
                comma_list(text, "--seeds", int)
        else:
            assert comma_list(text, "--seeds", int) == [int(v) for v in vals]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_edited_analytical_profile_is_refused_not_silently_replaced(tmp_path, run_cli, seed):
    """An analytical profile is re-derived from its sidecar for another model; an edited table (a
    random subset of latencies scaled, per seed) would vanish in that re-derivation: one line, exit 2.
    The unedited copy still runs."""
    import numpy as np
    import pandas as pd

    shipped = ROOT / "sparsebalance" / "data" / "profiles" / "analytical-h200"
    for name, edit in (("edited", True), ("copy", False)):
        d = tmp_path / name
        shutil.copytree(shipped, d)
        if edit:
            rng = np.random.default_rng(seed)
            t = pd.read_csv(d / "profile.csv")
            rows = rng.random(len(t)) < rng.uniform(0.001, 0.5)
            rows[rng.integers(len(t))] = True
            t.loc[rows, "latency_s"] *= rng.uniform(1.5, 20)
            t.to_csv(d / "profile.csv", index=False, float_format="%.17g")
    args = ("simulate", "--config", EXAMPLE, "--iterations", "1", "--no-trace", "--set", "model.preset='qwen2.5-0.5b'")
    r = run_cli(*args, "--set", f"profile='{tmp_path / 'edited'}'", "--out", tmp_path / "o1")
    lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
    assert r.code == 2 and len(lines) == 1 and "not what that sidecar derives" in lines[0], r.err
    assert not (tmp_path / "o1").exists()
    r = run_cli(*args, "--set", f"profile='{tmp_path / 'copy'}'", "--out", tmp_path / "o2")
    assert r.code == 0, r.err


def test_a_warning_that_changes_the_result_is_shown_off_a_terminal(tmp_path, run_cli):
    """Off a terminal other warnings are only counted; one that changes what the result means (the
    profile is another device's) is printed whatever stderr is."""
    r = run_cli("simulate", "--config", EXAMPLE, "--iterations", "1", "--no-trace", "--out", tmp_path / "o",
                "--set", "profile='analytical-h100'")
    assert r.code == 0, r.err
    shown = [ln for ln in r.err.splitlines() if ln.startswith("sparsebalance: warning: ")]
    assert len(shown) == 1 and "is for device 'h100' but cluster.device is 'h200'" in shown[0], r.err


def test_a_big_grid_says_its_size_before_validating(files, capsys):
    """A grid of hundreds of points is validated before any runs (a minute or more at 10,000): the
    sweep says how many points first, and shows validation progress when asked."""
    from sparsebalance import cli
    from sparsebalance.commands.sweep_grid import plan_runs

    seeds = ",".join(str(i) for i in range(34))  # 102 points: just over the size that is announced
    args = cli.build_parser("sweep").parse_args(["sweep", "--config", str(files["base_a"]), "--batching", "sab,lbb",
                                                 "--seeds", seeds, "--out", str(files["tmp"] / "o"), "--progress"])
    specs, _, _ = plan_runs(args)
    err = capsys.readouterr().err
    assert len(specs) == 3 * 34  # sab, lbb and the baseline per seed
    assert f"sweep: {len(specs)} grid points; validating each before any runs" in err
    assert "validating" in err.split("grid points", 1)[1]  # the progress bar after the line
