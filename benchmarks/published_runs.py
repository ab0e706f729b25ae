"""Predicted vs published: every measured run in ``validation/published/`` simulated from its stated
setup, with the error per row, per source and overall. Nothing is fitted to these rows
(validation/published/README.md).

Each row of ``runs.csv`` (model dims, TP/PP/DP/CP, DP mode, schedule, micro-batch size and count,
sequence length, recomputation; ``published_rows.py`` reads it) becomes a run config -- fixed-length
data, sequential batching at the stated micro-batch size, a budget that covers every block (dense
attention), the GPU's analytical profile built on the fly, the node's NVLink and the fabric from the
GPU preset -- and is simulated for one iteration (every iteration of fixed-length data is the same).
A row whose setup needs what the simulator has no model of yet (FSDP / ZeRO-2/3, FP8, a non-Megatron
pipeline) is listed as "not yet modelled"; one that needs only an overlap the simulator cannot express
is priced with that communication exposed and marked "approximate". Rows of ``sparse_runs.csv`` name
a config file and overrides (the SparseBalance paper's Table I baseline) and are reported apart: the
MAE targets are on the dense rows.

    python benchmarks/published_runs.py [--out results/published_runs] [--only k22-full,k175-sel] [--terms]

``--terms`` also re-prices the A100 rows with each A100 term off (``terms.csv``) and the FSDP rows
with their collectives' link replaced (``fsdp_terms.csv``).

Writes ``published_runs.csv`` (one row per run: status, predicted, published, error, bubble fraction,
achieved model TFLOP/s per GPU, peak memory), ``published_sources.csv`` (rows, priced rows, MAE,
worst and signed error per source and over all), ``configs/<id>.toml`` (each priced row's resolved run
config) and ``published_runs.png`` (log-log, one marker per source) under ``--out``, and prints them,
the unpriced rows by reason and the host line.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_rows import BLOCK, NODES, PUBLISHED, ROOT, dense_config, gaps, load_runs

#: GPUs whose preset terms ``--terms`` switches off (the A100's measured curves)
A100S = tuple(g for g in NODES if g.startswith("a100"))


def simulate(mapping: dict, out: Path, base_dir: Path = ROOT) -> dict:
    """Simulate a run-config mapping; its resolved config saved as ``out/configs/<name>.toml``."""
    import warnings

    from sparsebalance.runconfig import dump_toml, run_config_from_mapping
    from sparsebalance.runner import run_simulation

    cfg = run_config_from_mapping(mapping, base_dir=str(base_dir))
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "configs" / f"{cfg.name}.toml").write_text(dump_toml(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # profile notes; the figures are what this prints
        m = run_simulation(cfg, progress=False).metrics
    c = cfg.cluster
    return {"predicted_s": float(m["iteration_time_s"].mean()),
            "bubble_fraction": float(m["bubble_fraction"].mean()),
            "model_tflops_per_gpu": float((m["model_flops"] / m["iteration_time_s"]).mean() / c.gpus / 1e12),
            "peak_memory_gb": float(m["peak_memory_gb"].max())}


def layer_check(dense: pd.DataFrame, config=dense_config) -> pd.DataFrame:
    """One transformer layer, ours vs measured (``layer_times.csv``, Korthikanti et al. Table 4): the
    forward and backward of one micro-batch through one layer, on the base run's model and plan
    (``config``: row -> run-config mapping) -- where the iteration-level residual comes from."""
    import warnings

    from sparsebalance.runconfig import run_config_from_mapping
    from sparsebalance.simulator.cost.latency import load_latency_model

    out = []
    for r in pd.read_csv(PUBLISHED / "layer_times.csv").itertuples():
        base = dense[dense["id"] == r.base_run].iloc[0]
        mapping = config(base)
        mapping["cluster"] |= {"recompute": r.recompute, "sequence_parallel": bool(r.sequence_parallel)}
        cfg = run_config_from_mapping(mapping, base_dir=str(ROOT))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lm = load_latency_model(cfg.profile, cfg.model, cfg.cluster)
        lengths = [int(base.seq_len)] * int(base.micro_batch_size)
        k = math.ceil(int(base.seq_len) / BLOCK)
        fwd = sum(lm.attention(L, k) for L in lengths) + lm.dense(sum(lengths))
        bwd = sum(lm.attention(L, k, backward=True) for L in lengths) + lm.dense(sum(lengths), backward=True)
        out.append({"experiment": r.experiment, "forward_ms": 1e3 * fwd, "measured_forward_ms": r.measured_forward_ms,
                    "backward_ms": 1e3 * bwd, "measured_backward_ms": r.measured_backward_ms,
                    "error_pct": 100 * ((fwd + bwd) * 1e3 / (r.measured_forward_ms + r.measured_backward_ms) - 1)})
    return pd.DataFrame(out)


def sparse_config(row: pd.Series) -> dict:
    from sparsebalance.commands.simulate import parse_override
    from sparsebalance.readfile import load_config_file
    from sparsebalance.runconfig import apply_override

    data = load_config_file(ROOT / row.config, "config")
    for item in str(row.overrides).split(";") if isinstance(row.overrides, str) and row.overrides else []:
        apply_override(data, *parse_override(item))
    data["name"] = row.id
    data["seed"] = 0
    return data


def figure(df: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 5.0))
    for (source, group), marker in zip(df.groupby("source", sort=False), "osD^v<>"):
        ax.scatter(group["published_s"], group["predicted_s"], marker=marker, label=source, zorder=3)
    lo = 0.7 * min(df["published_s"].min(), df["predicted_s"].min())
    hi = 1.4 * max(df["published_s"].max(), df["predicted_s"].max())
    xs = np.array([lo, hi])
    ax.plot(xs, xs, "k-", lw=0.8, label="predicted = published")
    ax.fill_between(xs, 0.9 * xs, 1.1 * xs, color="0.85", label="within 10 %")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="published iteration time (s)",
           ylabel="predicted iteration time (s)", title="Published runs: predicted vs measured")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    fig.savefig(path.with_suffix(".svg"))
    plt.close(fig)


#: The dense rows' terms that ``--terms`` switches off one at a time: (label, A100 fields, tp_overlap).
TERMS = (("as shipped", {}, None),
         ("no GEMM curve (every GEMM at the best shape's 271.2 / 312)", {"gemm_curve": (), "gemm_efficiency": 271.2 / 312}, None),
         ("no NCCL curve (every collective at the 230 GB/s plateau)", {"tp_busbw_curve": ()}, None),
         ("no TP overlap (every backward collective exposed)", {}, False),
         ("none of the three", {"gemm_curve": (), "gemm_efficiency": 271.2 / 312, "tp_busbw_curve": ()}, False))


def term_table(dense: pd.DataFrame, rows_of: pd.DataFrame, out: Path) -> pd.DataFrame:
    """The A100 rows' MAE and the layer check with each of three terms switched off in turn: GEMMs
    by call size, TP collectives by message size (the A100's measured curves) and Megatron's TP
    overlap -- what each term moves, and whether one of them only looks good on the rows while the
    layer it prices moves away from its measurement. ``rows_of``: the priced A100 rows to simulate;
    ``dense``: all rows (the layer check's base run)."""
    from dataclasses import replace

    from sparsebalance.simulator.cost import roofline

    rows, saved = [], dict(roofline.HARDWARE)
    try:
        for label, fields, overlap in TERMS:
            for gpu in A100S:
                roofline.HARDWARE[gpu] = replace(saved[gpu], **fields)
            roofline._built.cache_clear()  # the profile cache is keyed by the hardware: rebuild

            def config(row, overlap=overlap):
                mapping = dense_config(row)
                if overlap is not None:
                    mapping["cluster"]["tp_overlap"] = overlap
                return mapping

            err = pd.Series([100 * (simulate(config(r), out / "terms")["predicted_s"] / r.measured_iteration_s - 1)
                             for r in rows_of.itertuples()])
            layers = layer_check(dense, config)
            rows.append({"terms": label, "mae_pct": err.abs().mean(), "worst_pct": err.abs().max(),
                         "signed_pct": err.mean(), "layer_min_pct": layers["error_pct"].min(),
                         "layer_max_pct": layers["error_pct"].max()})
    finally:
        roofline.HARDWARE.update(saved)
        roofline._built.cache_clear()
    return pd.DataFrame(rows)


def _one_nic(c, n, collective="allreduce"):
    """One GPU's NIC for every FSDP collective, at the shipped link's latency (its ring steps included)."""
    from sparsebalance.simulator.cost.link import group_link

    return c.allreduce_bandwidth, group_link(c, n, collective)[1]


#: The FSDP rows' link variants that ``--terms`` prices: (label, group_link replacement or None).
FSDP_LINKS = (("as shipped (NVLink in a node, NIC x ranks per node across)", None),
              ("every FSDP collective on one NIC per GPU", _one_nic),
              ("FSDP communication free", lambda c, n, collective="allreduce": (math.inf, 0.0)))


def fsdp_term_table(rows_of: pd.DataFrame, out: Path) -> pd.DataFrame:
    """The priced zero2 / zero3 rows' MAE with their collectives' link replaced in turn (``FSDP_LINKS``):
    what the FSDP terms move, and how much of the residual is left when they cost nothing."""
    from sparsebalance.simulator.cost import fsdp

    rows, saved = [], fsdp.group_link
    try:
        for label, link in FSDP_LINKS:
            fsdp.group_link = link or saved
            err = pd.Series([100 * (simulate(dense_config(r), out / "terms")["predicted_s"] / r.measured_iteration_s - 1)
                             for r in rows_of.itertuples()])
            rows.append({"fsdp_link": label, "rows": len(err), "mae_pct": err.abs().mean(),
                         "worst_pct": err.abs().max(), "signed_pct": err.mean()})
    finally:
        fsdp.group_link = saved
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per source and overall: rows, priced rows (exactly / with an approximation), MAE, worst and mean
    signed error over the priced rows; the overall line is the mean over every priced row."""
    out = []
    for source, g in list(df.groupby("source", sort=False)) + [("all sources", df)]:
        p = g[g["status"] != "not yet modelled"]
        err = p["error_pct"]
        out.append({"source": source, "rows": len(g), "priced": len(p),
                    "approximate": int((p["status"] == "approximate").sum()),
                    "mae_pct": err.abs().mean() if len(p) else math.nan,
                    "worst_pct": err.abs().max() if len(p) else math.nan,
                    "signed_pct": err.mean() if len(p) else math.nan})
    return pd.DataFrame(out)


def report(df: pd.DataFrame, out: Path) -> None:
    """Print the priced rows, the per-source and overall errors, and the rows not yet modelled."""
    fmt = {"float_format": lambda v: f"{v:.3f}", "index": False}
    priced = df[df["status"] != "not yet modelled"]
    cols = ["id", "gpu", "gpus", "dp_mode", "published_s", "predicted_s", "error_pct", "bubble_fraction",
            "model_tflops_per_gpu", "peak_memory_gb", "status"]
    with pd.option_context("display.width", 220, "display.max_columns", 20, "display.max_colwidth", 60):
        print(priced[cols].to_string(**fmt))
        approx = priced[priced["status"] == "approximate"]
        for note, g in approx.groupby("notes", sort=False):
            print(f"  approximate ({len(g)}: {', '.join(g['id'])}): {note}")
        s = summary(df[df["kind"] == "dense"])
        s.to_csv(out / "published_sources.csv", index=False)
        print("\nper source (dense rows; MAE over the priced rows):")
        print(s.to_string(float_format=lambda v: f"{v:.1f}", index=False))
        todo = df[df["status"] == "not yet modelled"]
        if len(todo):
            print(f"\nnot yet modelled: {len(todo)} rows")
            for note, g in todo.groupby("notes", sort=False):
                print(f"  {note}: {len(g)} rows ({', '.join(g['id'].head(6))}{', ...' if len(g) > 6 else ''})")


def main(argv=None) -> int:
    from tqdm import tqdm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "published_runs")
    ap.add_argument("--only", default="", help="comma-separated row ids (default: all)")
    ap.add_argument("--terms", action="store_true",
                    help="also re-run the priced A100 rows with each A100 term switched off in turn (terms.csv)")
    args = ap.parse_args(argv)
    only = {x for x in args.only.split(",") if x}
    dense = load_runs()
    sparse = pd.read_csv(PUBLISHED / "sparse_runs.csv")
    jobs = [("dense", r) for r in dense.itertuples()] + [("sparse", r) for r in sparse.itertuples()]
    jobs = [j for j in jobs if not only or j[1].id in only]
    args.out.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    for kind, r in tqdm(jobs, desc="published runs", unit="run", file=sys.stderr):
        blocking, approx = gaps(r) if kind == "dense" else ([], [])
        row = {"id": r.id, "kind": kind, "source": r.source.split(" (")[0], "gpu": r.gpu, "gpus": r.gpus,
               "dp_mode": getattr(r, "dp_mode", "ddp"), "published_s": r.measured_iteration_s,
               "status": "not yet modelled" if blocking else "approximate" if approx else "priced",
               "notes": "; ".join(blocking or approx)}
        if not blocking:
            row |= simulate(dense_config(r) if kind == "dense" else sparse_config(r), args.out)
        rows.append(row)
    df = pd.DataFrame(rows)
    for col in ("predicted_s", "bubble_fraction", "model_tflops_per_gpu", "peak_memory_gb"):
        df[col] = df.get(col, math.nan)
    df["error_pct"] = 100 * (df["predicted_s"] / df["published_s"] - 1)
    df.to_csv(args.out / "published_runs.csv", index=False)
    figure(df[df["status"] != "not yet modelled"], args.out / "published_runs.png")
    report(df, args.out)
    layers = layer_check(dense)
    layers.to_csv(args.out / "layer_check.csv", index=False)
    print("\none layer of the 22B model (micro-batch 4 x 2,048 tokens, TP 8), ours vs Korthikanti et al. Table 4:")
    print(layers.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    if args.terms:
        a100 = dense[dense["gpu"].isin(A100S) & dense["id"].isin(df.loc[df["status"] != "not yet modelled", "id"])]
        terms = term_table(dense, a100, args.out)
        terms.to_csv(args.out / "terms.csv", index=False)
        print("\npriced A100 rows with each term switched off in turn (layer: the five Table 4 settings):")
        print(terms.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
        fsdp_rows = dense[dense["dp_mode"].isin(["zero2", "zero3"])
                          & dense["id"].isin(df.loc[df["status"] != "not yet modelled", "id"])]
        links = fsdp_term_table(fsdp_rows, args.out)
        links.to_csv(args.out / "fsdp_terms.csv", index=False)
        print("\npriced FSDP / ZeRO-2/3 rows with their collectives' link replaced in turn:")
        print(links.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    print(f"host: {platform.processor() or platform.machine()}, {platform.python_version()}; "
          f"{int(df['predicted_s'].notna().sum())} of {len(df)} runs simulated in {time.perf_counter() - t0:.1f} s; "
          f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
