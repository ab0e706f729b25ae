"""A measurement judges itself (issue 23, item 5): on host-load records and probe scales generated per
seed (loads around the thresholds, probes around the tolerance), the verdict follows the rule; a
disturbed round is repeated at most ``--retries`` times; the result is reported from undisturbed
rounds when there are two, else flagged in the summary line and the JSON. One slow end-to-end test
runs ``validate`` while two busy loops the test started take the cores. The seed is in each id."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from sparsebalance.analysis.disturbance import (
    ENOUGH_ROUNDS,
    FOREIGN_MAX_SHARE,
    FOREIGN_MEAN_SHARE,
    PROBE_TOLERANCE,
    RUN_TOLERANCE,
    Verdict,
    judge,
    probe_disagreement,
    repeat_disturbed,
    run_disagreement,
    select,
)

SEEDS = range(5)


def _around(rng: random.Random, limit: float) -> float:
    """A value from a fifth to twice ``limit``, half of them within 10 % of it (where rules break)."""
    if rng.random() < 0.5:
        return limit * rng.uniform(0.9, 1.1)
    return limit * math.exp(rng.uniform(math.log(0.2), math.log(2.0)))


@pytest.mark.parametrize("seed", SEEDS)
def test_generated_host_loads_are_judged_by_the_rule(seed):
    """The rule, restated here: load on the host's spare cores does not count; the rest is
    disturbing when its wall-weighted mean passes 5 % of the run's cores, one run's passes 10 %,
    or steal passes 5 %."""
    rng = random.Random(seed)
    for _ in range(200):
        cores = rng.choice([1, 2, 4])
        host = cores + rng.choice([0, 0, 1, 2])
        spare = host - cores
        runs = []
        for _ in range(rng.choice([1, 2, 2, 3])):
            share = FOREIGN_MAX_SHARE if rng.random() < 0.5 else FOREIGN_MEAN_SHARE
            runs.append({"wall_s": rng.uniform(1, 60), "own_cpu_s": rng.uniform(1, 100),
                         "foreign_cores": spare + _around(rng, share * cores) if rng.random() < 0.8
                         else rng.uniform(0, spare + 0.01),
                         "steal_cores": _around(rng, FOREIGN_MEAN_SHARE * cores) if rng.random() < 0.2 else 0.0})
        wall = sum(r["wall_s"] for r in runs)
        mean = sum(r["foreign_cores"] * r["wall_s"] for r in runs) / wall
        worst = max(r["foreign_cores"] for r in runs)
        steal = sum(r["steal_cores"] * r["wall_s"] for r in runs) / wall
        want = (max(0.0, mean - spare) > FOREIGN_MEAN_SHARE * cores
                or (len(runs) > 1 and max(0.0, worst - spare) > FOREIGN_MAX_SHARE * cores)
                or steal > FOREIGN_MEAN_SHARE * cores)
        v = judge(runs, cores=cores, host_cores=host)
        assert v.disturbed == want, (runs, cores, host, v)
        assert bool(v.reasons) == want and (v.severity > 1.0) == want
        assert ("DISTURBED (" in v.tag()) == want and v.to_dict()["disturbed_reasons"] == v.reasons


@pytest.mark.parametrize("seed", SEEDS)
def test_generated_probes_are_judged_against_the_tolerance(seed):
    """Probes whose scales agree but one, off by exp(d): that probe is disturbed exactly when
    |d| > the calibration's tolerance; the others (at the median) never are; one probe is never."""
    rng = random.Random(seed)
    for _ in range(100):
        ops = rng.sample(["attn_fwd", "attn_bwd", "layer_fwd", "layer_bwd", "head_bwd"], rng.randint(1, 4))
        base = {op: math.exp(rng.uniform(-0.5, 0.5)) for op in ops}
        n = rng.randint(3, 6)
        probes = [dict(base) for _ in range(n)]
        odd, op = rng.randrange(n), rng.choice(ops)
        d = rng.choice([-1, 1]) * _around(rng, PROBE_TOLERANCE)
        probes[odd][op] = base[op] * math.exp(d)
        for i in range(n):
            dis = probe_disagreement(probes, i)
            v = judge([], cores=2, host_cores=2, probe=dis)
            want = i == odd and abs(d) > PROBE_TOLERANCE
            assert v.disturbed == want, (probes, i, d)
            if want:
                assert dis[1] == op and op in v.reasons[0]
        assert probe_disagreement(probes[:1], 0) is None


@pytest.mark.parametrize("seed", SEEDS)
def test_generated_runs_are_judged_against_the_same_plans_other_runs(seed):
    """Runs of two policies, each policy's rounds at its own time but one run off by exp(d): that
    run's try is disturbed exactly when |d| > the tolerance; the others never are; with fewer than
    three other runs of its policy a run is not judged."""
    rng = random.Random(seed)
    for _ in range(100):
        n = rng.randint(4, 7)
        base = {"baseline": rng.uniform(0.1, 2.0), "sab+dst": rng.uniform(0.1, 2.0)}
        tries = [[(p, base[p] * math.exp(rng.uniform(-0.01, 0.01))) for p in base] for _ in range(n)]
        odd, pol = rng.randrange(n), rng.choice(list(base))
        d = rng.choice([-1, 1]) * _around(rng, RUN_TOLERANCE)
        tries[odd] = [(p, s * math.exp(d) if p == pol else s) for p, s in tries[odd]]
        for i in range(n):
            others = [x for j, t in enumerate(tries) if j != i for x in t]
            v = judge([], cores=2, host_cores=2, run=run_disagreement(tries[i], others))
            want = i == odd and abs(d) > RUN_TOLERANCE + 0.02
            if i != odd or abs(abs(d) - RUN_TOLERANCE) > 0.02:  # the jitter decides within 0.02
                assert v.disturbed == want, (tries, i, d)
            if v.disturbed:
                assert pol in v.reasons[0] and "same plans" in v.reasons[0]
        assert run_disagreement(tries[0], tries[1] + tries[2]) is None  # two others per policy: not judged


def _script(rng: random.Random, rounds: int, retries: int) -> dict[tuple[int, int], bool]:
    """Per (round, try): is it disturbed (generated; about half of the tries are)."""
    return {(r, a): rng.random() < 0.5 for r in range(rounds) for a in range(retries + 1)}


@pytest.mark.parametrize("seed", SEEDS)
def test_a_disturbed_round_is_repeated_at_most_retries_times(seed):
    rng = random.Random(seed)
    for _ in range(50):
        rounds, retries = rng.randint(1, 5), rng.randint(0, 3)
        script = _script(rng, rounds, retries)
        calls: list[tuple[int, int]] = []

        def attempt(r, a, script=script, calls=calls):
            calls.append((r, a))
            bad = script[(r, a)]
            return Verdict(bad, ["generated"] if bad else [], 2.0 if bad else 0.5), (r, a)

        tries = repeat_disturbed(rounds, retries, attempt)
        for r, ts in enumerate(tries):
            first_clean = next((a for a in range(retries + 1) if not script[(r, a)]), retries)
            assert [t.attempt for t in ts] == list(range(first_clean + 1))  # stops at the first clean try
            assert len(ts) <= retries + 1 and all(t.payload == (r, t.attempt) for t in ts)
        assert calls == [(t.round, t.attempt) for ts in tries for t in ts]
        sel = select(tries)
        clean = [r for r, ts in enumerate(tries) if not ts[-1].verdict.disturbed]
        if len(clean) >= min(ENOUGH_ROUNDS, rounds):
            assert [t.round for t in sel.kept] == clean and not sel.verdict.disturbed
            assert sel.dropped == [r for r in range(rounds) if r not in clean]
        else:
            assert [t.round for t in sel.kept] == list(range(rounds)) and sel.verdict.disturbed
            assert sel.dropped == [] and len(sel.verdict.reasons) == rounds - len(clean)


def test_retries_below_zero_are_refused():
    with pytest.raises(ValueError, match="retries"):
        repeat_disturbed(1, -1, lambda r, a: (Verdict(False), None))


class _Prober:
    """validate's prober without torch: probes agree (scale 1), so only the loads judge."""

    def __init__(self) -> None:
        self.taken = 0

    def probe(self) -> int:
        self.taken += 1
        return self.taken - 1

    def scales(self) -> list[dict]:
        return [{"layer_fwd": 1.0}] * self.taken


def _try_of(d: Path) -> tuple[int, int]:
    """(round, try) from a run directory's name: ``round<r>`` or ``round<r>-try<a>``."""
    r, _, a = d.name.removeprefix("round").partition("-try")
    return int(r), int(a or 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_validate_rounds_run_again_into_their_own_directories(tmp_path, seed):
    """``commands/_rounds.run_rounds`` with a generated launcher (1 foreign core on the tries the
    script disturbs, 0 on the others): ABBA order, one directory per try, at most ``retries``
    repeats, every try in the record, one DISTURBED line per disturbed try."""
    from sparsebalance.commands._rounds import run_rounds, tries_record

    rng = random.Random(seed)
    rounds, retries = rng.randint(1, 4), rng.randint(0, 2)
    script = _script(rng, rounds, retries)
    started: list[tuple[str, Path]] = []

    def launch(sets, cfg, d):
        started.append((cfg, d))
        bad = script[_try_of(d)]
        return 0, {"wall_s": 10.0, "own_cpu_s": 20.0, "foreign_cores": 1.0 if bad else 0.0, "steal_cores": 0.0}

    prober = _Prober()
    pair = (("baseline", "B", []), ("sab+dst", "P", []))
    lines: list[str] = []
    chosen, tries = run_rounds(pair, tmp_path, rounds=rounds, retries=retries, prober=prober, launch=launch,
                               cores=2, host_cores=2, emit=lines.append)
    want_dirs = []
    for r in range(rounds):
        last = next((a for a in range(retries + 1) if not script[(r, a)]), retries)
        assert [t.attempt for t in tries[r]] == list(range(last + 1))
        for a in range(last + 1):
            sub = f"round{r}" if a == 0 else f"round{r}-try{a}"
            order = ("B", "P") if r % 2 == 0 else ("P", "B")
            want_dirs += [(c, tmp_path / "runs" / ("baseline" if c == "B" else "sab_dst") / sub) for c in order]
            assert tries[r][a].verdict.disturbed == script[(r, a)]
    assert started == want_dirs and prober.taken == sum(len(ts) for ts in tries)
    assert len(lines) == sum(script[(t.round, t.attempt)] for ts in tries for t in ts)
    assert all("DISTURBED (other processes used" in ln for ln in lines)
    rec = tries_record(tries, chosen, prober.scales())
    assert [(x["round"], x["attempt"]) for x in rec] == [(t.round, t.attempt) for ts in tries for t in ts]
    assert {(x["round"], x["attempt"]) for x in rec if x["kept"]} == {(t.round, t.attempt) for t in chosen.kept}
    assert all(x["disturbed"] == (x["foreign_mean"] == 1.0) and x["probe_disagreement"] in (None, 0.0) for x in rec)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_summary_line_carries_the_verdict(seed):
    """validate's summary line from a generated summary: DISTURBED with every reason, or the rounds
    left out, or undisturbed; and how many rounds were run again."""
    from sparsebalance.commands._validate_report import verdict_text

    rng = random.Random(seed)
    tries = [{"round": r, "attempt": a} for r in range(3) for a in range(rng.randint(1, 3))]
    again = sum(t["attempt"] > 0 for t in tries)
    reasons = [f"round {r}: other processes used {rng.uniform(0.2, 2):.2f} cores" for r in range(rng.randint(1, 3))]
    text = verdict_text({"disturbed": True, "disturbed_reasons": reasons, "rounds_dropped": [], "round_tries": tries})
    assert text.startswith(f" -- DISTURBED ({'; '.join(reasons)})")
    assert (f"; {again} disturbed round(s) run again" in text) == (again > 0)
    text = verdict_text({"disturbed": False, "disturbed_reasons": [], "rounds_dropped": [1], "round_tries": tries})
    assert "DISTURBED" not in text and "rounds 1 disturbed and left out" in text
    text = verdict_text({"disturbed": False, "disturbed_reasons": [], "rounds_dropped": [],
                         "round_tries": [{"round": 0, "attempt": 0}]})
    assert text == " -- undisturbed"


@pytest.mark.slow
def test_validate_beside_busy_loops_is_flagged_and_repeated(tmp_path, run_cli):
    """Two busy loops started here take the host's cores while ``validate`` runs one round with one
    retry: the round is judged disturbed, run once more (and no more), and the summary line and
    summary.json say DISTURBED with the reason."""
    pytest.importorskip("torch")
    cfg = tmp_path / "run.toml"
    cfg.write_text(VALIDATE_RUN)
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        out = tmp_path / "v"
        r = run_cli("validate", "--config", cfg, "--out", out, "--rounds", "1", "--retries", "1",
                    "--profile-as-is", "--no-progress")
    finally:
        for p in loops:
            p.kill()
            p.wait()
    assert r.code == 0, r.err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["disturbed"] is True and summary["retries"] == 1
    assert any("other processes used" in x for x in summary["disturbed_reasons"])
    assert [(t["round"], t["attempt"], t["disturbed"]) for t in summary["round_tries"]] == [(0, 0, True), (0, 1, True)]
    assert (out / "runs" / "baseline" / "round0-try1" / "metrics.csv").exists()
    line = next(ln for ln in r.out.splitlines() if ln.startswith("mean absolute iteration-time error"))
    assert "DISTURBED (round 0: other processes used" in line and "1 disturbed round(s) run again" in line
    assert "validate: round 0 (try 1) DISTURBED" in r.out


#: the smallest validate: PP 2 on this CPU, one iteration of 4 short real-text sequences
VALIDATE_RUN = """
name = "busy"
iterations = 1
profile = "cpu-tiny"
latency_extrapolate = "clamp"
[model]
preset = "tiny"
[cluster]
device = "cpu"
pp = 2
global_batch = 4
[data]
source = "text_dir"
path = "stdlib"
glob = "**/__init__.py"
num_sequences = 0
min_length = 64
max_length = 256
[policy]
batching = "sab"
tuning = "dst"
k0 = 4
k_max = 8
[realrun]
threads = 1
timeout_s = 300
"""


def test_a_run_far_from_its_other_rounds_is_run_again(tmp_path):
    """``run_rounds`` with ``run_time``: every run 1 s but the baseline of round 3's first try (3 s,
    no load recorded anywhere): that try is disturbed by its run alone (three rounds before it to
    judge it against), run again, and not reported; the record carries every run's seconds."""
    from sparsebalance.commands._rounds import run_rounds, tries_record

    def launch(sets, cfg, d):
        return 0, {"wall_s": 10.0, "own_cpu_s": 20.0, "foreign_cores": 0.0, "steal_cores": 0.0}

    def run_time(d):
        return 3.0 if (d.parent.name, d.name) == ("baseline", "round3") else 1.0

    lines: list[str] = []
    chosen, tries = run_rounds((("baseline", "B", []), ("sab+dst", "P", [])), tmp_path, rounds=5, retries=1,
                               prober=_Prober(), launch=launch, cores=2, host_cores=2, emit=lines.append,
                               run_time=run_time)
    assert [len(ts) for ts in tries] == [1, 1, 1, 2, 1]
    assert tries[3][0].verdict.disturbed and not any(t.verdict.disturbed for ts in tries for t in ts
                                                     if (t.round, t.attempt) != (3, 0))
    assert len(lines) == 1 and "baseline run off the median" in lines[0] and "factor 3.00" in lines[0]
    assert {(t.round, t.attempt) for t in chosen.kept} == {(0, 0), (1, 0), (2, 0), (3, 1), (4, 0)}
    rec = tries_record(tries, chosen, [])
    assert rec[3]["run_seconds"] == [{"policy": "sab+dst", "mean_iteration_s": 1.0},
                                     {"policy": "baseline", "mean_iteration_s": 3.0}]
