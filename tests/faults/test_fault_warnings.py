"""Warnings by weight (issue 35, item 1): a warning that changes what a result means is printed with
stderr not a terminal, written into the results' ``summary.json`` (a sweep: per run in
``warnings.csv``), and under ``--strict`` is exit 2 with no results directory; notes are counted.
An unknown key in any table of a run config, and a value not allowed, are one line for every verb.
The verbs run in this process (``run_cli``: stderr captured, so never a terminal); sizes, keys and
memory limits are drawn per seed."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest
from faultkit import SWEEP_BASE

from sparsebalance.errors import MeaningWarning

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "qwen25-3b_h200_dp4pp4.toml"
LONGEST = 524_288  # analytical-h200's longest attention length (tokens)
SEEDS = range(2)


def _case(kind: str, rng: random.Random) -> tuple[list[str], str]:
    """(--set items that make ``kind``'s warning, a text the warning holds)."""
    if kind == "another-device":
        return [f"profile='{rng.choice(['analytical-h100', 'analytical-h20'])}'"], "but cluster.device is 'h200'"
    if kind == "extrapolated":  # sequences past the profile's longest length
        n = rng.randint(int(LONGEST * 1.05), 2 * LONGEST)
        return ["data.distribution='fixed'", f"data.length={n}", "data.num_sequences=16",
                f"data.max_length={n}"], "is outside the profiled range"
    if kind == "over-memory":  # the weights fit (checked before), the activations do not
        return [f"cluster.device_memory={rng.uniform(20e9, 35e9):.4g}"], "above cluster.device_memory"
    raise AssertionError(kind)


KINDS = ("another-device", "extrapolated", "over-memory")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_meaning_warning_is_shown_recorded_and_refused_under_strict(tmp_path, run_cli, kind, seed):
    sets, needle = _case(kind, random.Random(f"{kind}-{seed}"))
    argv = ["simulate", "--config", EXAMPLE, "--iterations", "1", "--no-trace",
            *[x for s in sets for x in ("--set", s)]]
    r = run_cli(*argv, "--out", tmp_path / "o")
    shown = [ln for ln in r.err.splitlines() if ln.startswith("sparsebalance: warning: ") and needle in ln]
    assert r.code == 0 and shown, r.err  # before: "1 warning(s) not shown" and exit 0
    recorded = json.loads((tmp_path / "o" / "summary.json").read_text())["warnings"]
    assert any(needle in w for w in recorded) and len(recorded) == len(set(recorded))
    assert {ln.removeprefix("sparsebalance: warning: ") for ln in shown} <= set(recorded)
    r = run_cli(*argv, "--out", tmp_path / "s", "--strict")
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert r.code == 2 and "Traceback" not in r.err, r.err
    assert lines[-1].startswith("sparsebalance simulate: error: ") and "--strict" in lines[-1] and needle in lines[-1]
    assert not (tmp_path / "s").exists()


def test_a_run_without_such_warnings_records_none_and_counts_its_notes(tmp_path, run_cli):
    """The shipped analytical profile's accepted non-monotone points are a note: counted, not shown,
    and --strict runs."""
    r = run_cli("simulate", "--config", EXAMPLE, "--iterations", "1", "--no-trace", "--out", tmp_path / "o",
                "--strict")
    assert r.code == 0 and "1 note(s) not shown" in r.err and "warning:" not in r.err, r.err
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["warnings"] == []
    loud = run_cli("simulate", "--config", EXAMPLE, "--iterations", "1", "--no-trace", "--out", tmp_path / "v", "-v")
    assert "sparsebalance: warning: profile" in loud.err and "falls as work grows" in loud.err


@pytest.mark.parametrize("seed", SEEDS)
def test_a_sweep_keeps_each_runs_warnings_and_strict_stores_none(tmp_path, run_cli, seed):
    """Each run's warnings travel in its record (any backend, worker processes too): warnings.csv has
    one row per run and warning; --strict stops at the first and leaves no directory."""
    rng = random.Random(seed)
    base = tmp_path / "base.toml"
    base.write_text(SWEEP_BASE.replace("iterations = 2", "iterations = 1").replace(
        "global_batch = 8", f"global_batch = 8\ndevice_memory = {rng.uniform(30e9, 60e9):.4g}").replace(
        "token_cap = 65536", "token_cap = 262144"))
    argv = ("sweep", "--config", base, "--batching", "sab", "--seeds", "0,1", "--jobs", str(1 + seed))  # in process, then workers
    r = run_cli(*argv, "--out", tmp_path / "s", "--strict")
    assert r.code == 2 and "--strict" in r.err and "above cluster.device_memory" in r.err, r.err
    assert not (tmp_path / "s").exists()
    r = run_cli(*argv, "--out", tmp_path / "w")
    assert r.code == 0, r.err
    assert sum("above cluster.device_memory" in ln for ln in r.err.splitlines()) >= 1
    import pandas as pd

    table = pd.read_csv(tmp_path / "w" / "warnings.csv")
    assert set(table.run_id) == set(pd.read_csv(tmp_path / "w" / "summary.csv").run_id)  # every run warned
    assert table.warning.str.contains("above cluster.device_memory").all()
    texts = json.loads((tmp_path / "w" / "summary.json").read_text())["warnings"]
    assert set(table.warning) == set(texts)
    again = run_cli(*argv, "--out", tmp_path / "w")  # resumed: the stored runs keep theirs
    assert again.code == 0 and "4 already in" in again.out
    assert pd.read_csv(tmp_path / "w" / "warnings.csv").equals(table)


def test_every_package_warning_has_a_kind():
    """Every warnings.warn in the package names MeaningWarning or NoteWarning: a new warning must
    choose (docs/reliability.md lists them)."""
    import re

    pkg = ROOT / "sparsebalance"
    calls = []
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        for m in re.finditer(r"warnings\.warn\(", text):
            depth, i = 1, m.end()
            while depth:  # the call's whole argument list
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            calls.append((path.relative_to(ROOT), text[m.end():i - 1]))
    assert len(calls) >= 8
    untyped = [p for p, args in calls if not re.search(r"\b(MeaningWarning|NoteWarning)\b", args)]
    assert untyped == []


# -- unknown keys and values not allowed ------------------------------------------------------------
TABLES = ("model", "cluster", "data", "policy", "realrun", "")


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 12))) + "_x"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("table", TABLES)
def test_an_unknown_key_in_any_table_is_refused_by_every_verb(tmp_path, run_cli, no_launch, table, seed):
    """Before: simulate accepted any key (and any value) in [realrun], which only train read."""
    rng = random.Random(f"{table}-{seed}")
    key = _word(rng)
    cfg = tmp_path / "run.toml"
    body = EXAMPLE.read_text()
    line = f"{key} = {rng.choice(['1', 'true', repr(_word(rng))])}"
    if not table:
        body = f"{line}\n{body}"
    elif f"[{table}]" in body:
        body = body.replace(f"[{table}]", f"[{table}]\n{line}")
    else:
        body += f"\n[{table}]\n{line}\n"
    cfg.write_text(body)
    name = f"{table}.{key}" if table else key
    for verb, more in (("simulate", []), ("sweep", ["--batching", "sab"]), ("ablation", []), ("train", []),
                       ("validate", [])):
        out = tmp_path / verb
        r = run_cli(verb, "--config", cfg, *more, "--out", out)
        lines = [ln for ln in r.err.splitlines() if ln.strip()]
        assert r.code == 2 and len(lines) == 1, (verb, r.err)
        assert f"{name}: unknown field" in lines[0] and "allowed fields are" in lines[0], (verb, lines[0])
        assert not out.exists()


@pytest.mark.parametrize("seed", SEEDS)
def test_a_value_not_allowed_names_the_allowed_ones(tmp_path, run_cli, seed):
    rng = random.Random(seed)
    cfg = tmp_path / "run.toml"
    cfg.write_text(EXAMPLE.read_text() + f'\n[realrun]\nbackend = "{rng.choice(["mpi", "ucc", _word(rng)])}"\n')
    r = run_cli("simulate", "--config", cfg, "--iterations", "1", "--out", tmp_path / "o")
    assert r.code == 2 and "realrun.backend:" in r.err and "choose one of gloo, nccl" in r.err, r.err
    assert not (tmp_path / "o").exists()


def test_meaning_warning_is_also_the_categories_it_had():
    assert issubclass(MeaningWarning, UserWarning) and issubclass(MeaningWarning, RuntimeWarning)
