"""Record, then check, that a refactor leaves every decision and study number bit for bit alone.

What it records (floats as their exact hex, so "the same" means the same bits):

* **decisions**: the seeded cases of ``tests/policies/test_decisions_unchanged.py`` (dst-cp and
  sab-order on 1F1B, GPipe, interleaved, ZB-H1, ZB-V and DualPipeV) -- their plans, budgets and
  stats -- and, on each case's plan, the budgets of ``dst`` and ``fixed`` and the packing of ``sab``
  and ``lbb``, plus one simulated iteration of the result (iteration time, extras, the trace);
* **model**: the latency model's answers on seeded micro-batches under a dozen clusters (TP on a
  measured shard, recomputation, every CP layout and exchange, a CP degree per sequence, the
  profile's CP rows, interleaved and split-backward schedules): stage times (int and per-layer
  budgets), the whole-model F + B, P2P, all-reduce, optimizer, CP reports, memory, and one executor
  iteration with its CP trace rows;
* **studies**: the CLI's ablation (Table I), CP ablation, CP-split and schedule studies in their
  quick seeded forms (the CLI tests' iterations and seeds), every CSV they write except the
  wall-clock ``timing*.csv``.

Usage::

    python benchmarks/check_refactor_invariance.py record  [--out FILE]   # the baseline
    python benchmarks/check_refactor_invariance.py check   [--baseline FILE] [--only SECTION,...]

``check`` exits 1 listing every key that differs (or is missing / new), 0 when all are equal.
The baseline of this tree is ``benchmarks/invariance_baseline.json``: recorded before the cost
model's rebuild of issue 34 (which left all 17,358 values unchanged), then re-recorded on 2026-11-28
after issue 33's kernel cost model changed the analytical profiles on purpose, and on 2026-11-29
after issue 36's terms (FSDP, the DP link, ring steps as calls, the pipeline implementation; then the
measured Hopper GEMM rate, the streamed LM-head loss, TE's TP overlap and the ring collectives' step
latency); re-record it whenever
a change means to move numbers, and say so in the commit. Heavy (a few minutes of CPU): run it under the machine's lock.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tempfile
import time
import warnings
import zlib
from dataclasses import fields, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "benchmarks" / "invariance_baseline.json"
SECTIONS = ("decisions", "model", "studies")


def exact(x):
    """A JSON-able exact form: floats as hex, arrays as nested lists of those."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x).hex()
    if isinstance(x, np.ndarray):
        return exact(x.tolist())
    if isinstance(x, dict):
        return {str(k): exact(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [exact(v) for v in x]
    if x is None or isinstance(x, str):
        return x
    return repr(x)


def frame_digest(df) -> str:
    """sha256 of a data frame's values in exact form (column names, then rows)."""
    h = hashlib.sha256()
    h.update(json.dumps(list(map(str, df.columns))).encode())
    for col in df.columns:
        h.update(json.dumps(exact(df[col].tolist())).encode())
    return h.hexdigest()


# -- decisions --------------------------------------------------------------------------------------
def decisions() -> dict:
    sys.path.insert(0, str(ROOT / "tests" / "policies"))
    from test_decisions_unchanged import CASES, SPLIT_CASES, context

    from sparsebalance.policies.ordering import ScheduleAwareOrder
    from sparsebalance.policies.registry import make_batching, make_tuning
    from sparsebalance.simulator.engine.executor import SimulatorExecutor
    from sparsebalance.simulator.plan import Plan

    def ids(plan):
        return [[[s.id for s in mb.sequences] for mb in r] for r in plan.ranks]

    def vals(budgets):
        return [[b.to_json() for b in row] for row in budgets]

    out = {}
    for n, case in enumerate(CASES + SPLIT_CASES):
        seqs, ctx = context(*case, batching="sab-order")
        dp, m = case[0], case[2]
        rec = {}
        for cap in (60, 400):
            pol = ScheduleAwareOrder(ctx.policy, max_evaluations=cap)
            plan = pol.plan(seqs, ctx)
            rec[f"sab_order_{cap}"] = {"plan": ids(plan), "stats": exact(pol.stats)}
        rng = np.random.default_rng(case[5])
        order = rng.permutation(len(seqs))
        plan = Plan.from_lists([[[seqs[order[r * m + j]]] for j in range(m)] for r in range(dp)])
        cp = make_tuning(replace(ctx.policy, tuning="dst-cp"))
        b_cp = cp.budgets(plan, ctx)
        rec["dst_cp"] = {"budgets": vals(b_cp), "stats": exact(cp.stats)}
        dst = make_tuning(replace(ctx.policy, tuning="dst"))
        b_dst = dst.budgets(plan, ctx)
        rec["dst"] = {"budgets": vals(b_dst)}
        rec["fixed"] = {"budgets": vals(make_tuning(replace(ctx.policy, tuning="fixed")).budgets(plan, ctx))}
        for name in ("sab", "lbb", "sorted", "quadratic"):
            pol = make_batching(replace(ctx.policy, batching=name))
            rec[name] = {"plan": ids(pol.plan(seqs, ctx))}
        ex = SimulatorExecutor(ctx.latency, ctx.model, ctx.cluster)
        for name, b in (("dst_cp", b_cp), ("dst", b_dst)):
            res = ex.execute(0, plan, b)
            rec[f"iteration_{name}"] = {"time": exact(res.iteration_time_s), "extra": exact(res.extra),
                                        "trace": frame_digest(res.trace),
                                        "microbatch_latency": exact(res.microbatch_latency_s)}
        out[f"case{n}:{case[3]}:dp{case[0]}pp{case[1]}m{case[2]}"] = rec
    return out


# -- the model --------------------------------------------------------------------------------------
def _clusters():
    """(name, profile, model preset, cluster overrides) of the probed settings."""
    return [
        ("pp4dp2", "analytical-h200", "qwen2.5-3b", {"pp": 4, "dp": 2, "global_batch": 16}),
        ("pp4dp2-full-recompute-overlap-zero1", "analytical-h200", "qwen2.5-3b",
         {"pp": 4, "dp": 2, "global_batch": 16, "recompute": "full", "dp_overlap": True, "zero1": True}),
        ("pp2-selective-interleaved", "analytical-h200", "qwen2.5-3b",
         {"pp": 2, "dp": 2, "global_batch": 8, "recompute": "selective", "schedule": "interleaved",
          "virtual_stages": 2}),
        ("pp2-zbh1-tp2", "analytical-h200", "qwen2.5-3b",
         {"pp": 2, "dp": 1, "tp": 2, "global_batch": 4, "schedule": "zb-h1"}),
        ("pp2-zbv", "analytical-h200", "qwen2.5-3b",
         {"pp": 2, "dp": 1, "global_batch": 8, "schedule": "zbv", "virtual_stages": 2}),
        ("cpu-tiny-tp2-measured-shard", "cpu-tiny-tp2", "tiny",
         {"pp": 2, "dp": 1, "tp": 2, "global_batch": 4, "recompute": "full"}),
        ("cpu-tiny-cp2-rows", "cpu-tiny-cp2", "tiny",
         {"pp": 2, "dp": 1, "cp": 2, "cp_layout": "zigzag", "cp_comm": "allgather", "global_batch": 4}),
        ("cp4-ring-zigzag", "analytical-h200", "qwen2.5-3b",
         {"pp": 2, "dp": 1, "cp": 4, "cp_layout": "zigzag", "cp_comm": "ring", "global_batch": 4,
          "recompute": "full"}),
        ("cp16-hier-best", "analytical-h200", "qwen2.5-3b",
         {"preset": "h200-4x8", "pp": 2, "dp": 1, "tp": 1, "cp": 16, "cp_layout": "best",
          "cp_comm": "hierarchical", "global_batch": 4, "recompute": "full"}),
        ("cp8-stripe-allgather-local", "analytical-h200", "qwen2.5-3b",
         {"pp": 1, "dp": 1, "cp": 8, "cp_layout": "stripe", "cp_comm": "allgather", "cp_selection": "local",
          "global_batch": 2}),
        ("cp16-per-sequence", "analytical-h200", "qwen2.5-3b",
         {"preset": "h200-4x8", "pp": 2, "dp": 1, "tp": 1, "cp": 16, "cp_layout": "best",
          "cp_comm": "hierarchical", "cp_split": "per-sequence", "global_batch": 4, "recompute": "full"}),
    ]


def model() -> dict:
    from sparsebalance.data.sequence import Sequence
    from sparsebalance.simulator.budget import Budget
    from sparsebalance.simulator.config import cluster_from_mapping, model_from_mapping
    from sparsebalance.simulator.cost.latency import load_latency_model
    from sparsebalance.simulator.cost.memory import memory_report, static_bytes, token_cap_for_memory
    from sparsebalance.simulator.engine.executor import SimulatorExecutor
    from sparsebalance.simulator.plan import Plan
    from sparsebalance.simulator.schedule.graph import schedule_graph

    out = {}
    for name, profile, preset, over in _clusters():
        mdl = model_from_mapping({"preset": preset})
        cl = cluster_from_mapping(over)
        lm = load_latency_model(profile, mdl, cl, extrapolate="clamp" if preset == "tiny" else "warn")
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        bs = mdl.block_size
        if preset == "tiny":
            lens = rng.integers(40, 3000, 24)
        elif cl.cp > 1:
            lens = rng.integers(2 * bs * cl.cp // 2, 256 * 1024, 12)
        else:
            lens = rng.integers(1000, 64 * 1024, 24)
        mbs = [tuple(int(x) for x in lens[i:i + w]) for i, w in zip(range(0, len(lens), 3), rng.integers(1, 4, 99))]
        mbs = [mb for mb in mbs if mb]
        ks = [int(k) for k in rng.integers(1, 33, len(mbs))]
        rec = {}
        split = cl.schedule in ("zb-h1", "zbv", "dualpipev")
        modes = ("F", "B", "I", "W") if split else ("F", "B")
        rec["stage_times_int"] = exact(lm.stage_times(mbs, ks, modes))
        if cl.cp_split != "per-sequence":
            per_layer = [Budget.per_layer(tuple(int(x) for x in rng.integers(1, 33, mdl.layers))) for _ in mbs[:3]]
            rec["stage_times_per_layer"] = exact(lm.stage_times(mbs[:3], per_layer, modes))
            rec["mb_latency_per_layer"] = exact([lm.microbatch_latency(mb, b) for mb, b in zip(mbs[:3], per_layer)])
        rec["mb_latencies"] = exact(lm.microbatch_latencies(mbs, ks))
        rec["mb_latencies_one_k"] = exact(lm.microbatch_latencies(mbs, 7))
        rec["mb_latency"] = exact([lm.microbatch_latency(mb, k) for mb, k in zip(mbs, ks)])
        rec["stage_time"] = exact([lm.stage_time(mbs[0], ks[0], s, backward=bw, chunk=c)
                                   for s in range(cl.pp) for c in range(cl.virtual_stages) for bw in (False, True)])
        rec["attention_many"] = exact([lm.attention_many(lens, k, backward=bw) for k in (1, 5, 40) for bw in (0, 1)])
        rec["p2p"] = exact([lm.p2p_time(int(t)) for t in (1000, 40000, 300000)])
        rec["cp_tokens"] = exact([lm.cp_tokens(mb, k) for mb, k in zip(mbs, ks)])
        rec["allreduce"] = exact([lm.allreduce_time(s) for s in range(cl.pp)])
        rec["grad_sync_exposed"] = exact([lm.grad_sync_exposed(s, w) for s in range(cl.pp) for w in (0.01, 1.0)])
        rec["optimizer"] = exact([lm.optimizer_time(s) for s in range(cl.pp)])
        rec["tp_allreduce"] = exact(lm.tp_allreduce_time(np.array([100.0, 5000.0])))
        if cl.cp > 1:
            reps = []
            for L, k in zip(lens[:6], ks):
                for bw in (False, True):
                    r = lm.cp_report(int(L), k, backward=bw)
                    reps.append(None if r is None else exact({f.name: getattr(r, f.name) for f in fields(r)}))
            rec["cp_report"] = reps
            pl = lm.cp_placement(mbs[0], ks[0])
            rec["cp_placement"] = None if pl is None else exact({f.name: getattr(pl, f.name) for f in fields(pl)})
        g = schedule_graph(cl.schedule, cl.pp, cl.microbatches_per_rank, cl.virtual_stages)
        tok = np.array([[sum(mbs[(r * g.m + j) % len(mbs)]) for j in range(g.m)] for r in range(cl.dp)], float)
        mem = memory_report(mdl, cl, g, tok)
        rec["memory"] = exact({"static": mem.static, "act": mem.activations, "transient": mem.transient})
        rec["static"] = exact(static_bytes(mdl, cl))
        if cl.device_memory:
            try:
                rec["token_cap"] = token_cap_for_memory(mdl, cl, g)
            except Exception as e:  # noqa: BLE001 (recorded as it is)
                rec["token_cap"] = str(e)
        seqs = [Sequence(id=i, length=L) for i, L in enumerate(x for mb in mbs for x in mb)]
        it = iter(seqs)
        m = g.m
        grid = [[[next(it) for _ in mbs[(r * m + j) % len(mbs)]] if (r * m + j) < len(mbs) else [seqs[0]]
                 for j in range(m)] for r in range(cl.dp)]
        plan = Plan.from_lists(grid)
        budgets = [[ks[(r * m + j) % len(ks)] for j in range(m)] for r in range(cl.dp)]
        ex = SimulatorExecutor(lm, mdl, cl)
        res = ex.execute(0, plan, budgets)
        rec["iteration"] = {"time": exact(res.iteration_time_s), "extra": exact(res.extra),
                            "trace": frame_digest(res.trace), "ops": sorted(set(res.trace["op"]))}
        out[name] = rec
    return out


# -- studies ----------------------------------------------------------------------------------------
STUDIES = {
    "ablation": ["ablation", "--iterations", "3", "--seeds", "0"],
    "ablation_seeds": ["ablation", "--iterations", "2", "--seeds", "0,1"],
    "cp": ["ablation", "--cp", "--iterations", "3", "--seeds", "0,1"],
    "cp_split": ["ablation", "--cp-split", "--iterations", "2", "--seeds", "0,1"],
    "schedules": ["ablation", "--schedules", "1f1b,interleaved,zb-h1,zbv,dualpipev", "--iterations", "1",
                  "--seeds", "0,1"],
}


def studies(only: list[str] | None = None) -> dict:
    import pandas as pd

    from sparsebalance import cli

    out = {}
    for name, argv in STUDIES.items():
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp) / name
            t0 = time.perf_counter()
            rc = cli.main([*argv, "--out", str(d), "--no-progress"])
            print(f"  study {name}: rc {rc}, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            rec = {"rc": rc}
            for f in sorted(d.glob("*.csv")):
                if f.name.startswith("timing"):
                    continue  # wall-clock decision times: not deterministic
                df = pd.read_csv(f, float_precision="round_trip")
                rec[f.name] = {str(c): exact(df[c].tolist()) for c in df.columns}
            out[name] = rec
    return out


def run(sections, study_names=None) -> dict:
    warnings.simplefilter("ignore")
    got = {}
    for s in sections:
        t0 = time.perf_counter()
        with _quiet():
            got[s] = studies(study_names) if s == "studies" else globals()[s]()
        print(f"{s}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return got


class _quiet:
    """Swallow the studies' printed tables (stdout), keep stderr."""

    def __enter__(self):
        self._old, sys.stdout = sys.stdout, io.StringIO()

    def __exit__(self, *exc):
        sys.stdout = self._old


def diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a:
                out.append(f"{path}/{k}: new")
            elif k not in b:
                out.append(f"{path}/{k}: missing")
            else:
                out += diff(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += diff(x, y, f"{path}[{i}]")
        return out
    return [] if a == b else [f"{path}: {_show(a)} -> {_show(b)}"]


def _show(x) -> str:
    s = json.dumps(x)
    return s if len(s) < 120 else s[:117] + "..."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("record", "check"))
    ap.add_argument("--out", type=Path, default=BASELINE, help="record: where the baseline goes")
    ap.add_argument("--baseline", type=Path, default=BASELINE, help="check: the recorded baseline")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections, of {', '.join(SECTIONS)}")
    ap.add_argument("--studies", default=None, help="with studies: only these (names of STUDIES)")
    a = ap.parse_args(argv)
    sections = [s for s in a.only.split(",") if s]
    bad = set(sections) - set(SECTIONS)
    if bad:
        ap.error(f"--only: unknown section(s) {sorted(bad)}")
    names = a.studies.split(",") if a.studies else None
    got = run(sections, names)
    if a.mode == "record":
        a.out.write_text(json.dumps(got, indent=0, sort_keys=True) + "\n")
        print(f"recorded {', '.join(sections)} to {a.out}")
        return 0
    base = json.loads(a.baseline.read_text())
    problems = []
    for s in sections:
        want = base.get(s)
        if want is None:
            problems.append(f"/{s}: not in the baseline")
            continue
        if s == "studies" and names:
            want = {k: v for k, v in want.items() if k in names}
        problems += diff(want, got[s], f"/{s}")
    for p in problems[:200]:
        print(p)
    n_keys = sum(1 for _ in _leaves(got))
    print(f"{'SAME' if not problems else 'DIFFERENT'}: {len(problems)} difference(s) over {n_keys} recorded values "
          f"({', '.join(sections)})")
    return 0 if not problems else 1


def _leaves(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, list):
        for v in x:
            yield from _leaves(v)
    else:
        yield x


if __name__ == "__main__":
    sys.exit(main())
