"""Predicted vs published: every measured run in ``validation/published/`` simulated from its stated
setup, with the mean absolute error. Nothing is fitted to these rows (validation/published/README.md).

Each row of ``runs.csv`` (dense GPT runs: model dims, TP/PP/DP, schedule, micro-batch size and count,
sequence length, recomputation) becomes a run config -- fixed-length data, sequential batching at the
stated micro-batch size, a budget that covers every block (dense attention), the GPU's analytical
profile built on the fly, the node's NVLink and the fabric from the GPU preset -- and is simulated
for one iteration (every iteration of fixed-length data is the same). Rows of ``sparse_runs.csv``
name a config file and overrides (the SparseBalance paper's Table I baseline) and are reported apart:
the MAE target is on the dense rows.

    python benchmarks/published_runs.py [--out results/published_runs] [--only k22-full,k175-sel]

Writes ``published_runs.csv`` (one row per run: predicted, published, error, bubble fraction,
achieved model TFLOP/s per GPU), ``configs/<id>.toml`` (each row's resolved run config) and
``published_runs.png`` (log-log, one marker per source) under ``--out``, and prints the table, the
MAE of the dense rows and the host line.
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

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "validation" / "published"
BLOCK = 128
"""MoBA block size of the dense rows: 2,048 tokens = 16 blocks, all selected (budget 16 = dense)."""


#: GPU of a row -> the cluster preset of its nodes (NVLink inside, the fabric across; simulator/config.py)
NODES = {"a100-80gb": "dgx-a100-80gb", "a100-40gb": "dgx-a100-40gb"}


def dense_config(row: pd.Series) -> dict:
    """The run-config mapping of one dense published run (a Megatron GPT model)."""
    from sparsebalance.simulator.config import CLUSTER_PRESETS

    node = CLUSTER_PRESETS[NODES[row.gpu]]()
    h, seq = int(row.hidden), int(row.seq_len)
    blocks = math.ceil(seq / BLOCK)
    gpus = int(row.tp) * int(row.pp) * int(row.dp)
    if gpus != int(row.gpus):
        raise SystemExit(f"{row.id}: tp x pp x dp = {gpus} but the row says {row.gpus} GPUs")
    return {
        "name": row.id, "iterations": 1, "seed": 0, "profile": f"analytical-{row.gpu}",
        "model": {"name": row.model, "hidden": h, "layers": int(row.layers), "heads": int(row.heads),
                  "kv_heads": int(row.heads), "head_dim": h // int(row.heads), "ffn": 4 * h,
                  "vocab": int(row.vocab), "block_size": BLOCK, "tie_embeddings": True, "mlp": "gelu",
                  "qkv_bias": True, "bias": True, "norm": "layernorm", "positions": "learned",
                  "max_positions": seq, "attention_kernel": row.attention_kernel},
        "cluster": {"preset": node.name, "pp": int(row.pp), "dp": int(row.dp),
                    "tp": int(row.tp), "schedule": row.schedule, "virtual_stages": int(row.virtual_stages),
                    "micro_batch_size": int(row.micro_batch_size), "global_batch": int(row.global_batch),
                    "recompute": row.recompute, "dp_overlap": bool(row.dp_overlap),
                    "grad_reduce_bytes": int(row.grad_reduce_bytes),
                    "sequence_parallel": bool(row.sequence_parallel), "tp_overlap": bool(row.tp_overlap),
                    "nodes": math.ceil(gpus / node.gpus_per_node)},
        "data": {"source": "distribution", "distribution": "fixed", "length": seq,
                 "num_sequences": int(row.global_batch)},
        "policy": {"batching": "sequential", "tuning": "fixed", "k0": blocks, "k_max": max(blocks, 64)},
    }


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
    """The dense rows' MAE and the layer check with each of three terms switched off in turn: GEMMs
    by call size, TP collectives by message size (the A100's measured curves) and Megatron's TP
    overlap -- what each term moves, and whether one of them only looks good on the rows while the
    layer it prices moves away from its measurement. ``rows_of``: the rows to simulate; ``dense``:
    all of them (the layer check's base run)."""
    from dataclasses import replace

    from sparsebalance.simulator.cost import roofline

    rows, saved = [], dict(roofline.HARDWARE)
    try:
        for label, fields, overlap in TERMS:
            for gpu in NODES:
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


def main(argv=None) -> int:
    from tqdm import tqdm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "published_runs")
    ap.add_argument("--only", default="", help="comma-separated row ids (default: all)")
    ap.add_argument("--terms", action="store_true",
                    help="also re-run the dense rows with each A100 term switched off in turn (terms.csv)")
    args = ap.parse_args(argv)
    only = {x for x in args.only.split(",") if x}
    dense = pd.read_csv(PUBLISHED / "runs.csv")
    sparse = pd.read_csv(PUBLISHED / "sparse_runs.csv")
    jobs = [("dense", r, dense_config(r)) for r in dense.itertuples()] + [
        ("sparse", r, sparse_config(r)) for r in sparse.itertuples()]
    jobs = [j for j in jobs if not only or j[1].id in only]
    args.out.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    for kind, r, mapping in tqdm(jobs, desc="published runs", unit="run", file=sys.stderr):
        got = simulate(mapping, args.out)
        rows.append({"id": r.id, "kind": kind, "source": r.source.split(" (")[0], "gpu": r.gpu, "gpus": r.gpus,
                     "published_s": r.measured_iteration_s, **got})
    df = pd.DataFrame(rows)
    df["error_pct"] = 100 * (df["predicted_s"] / df["published_s"] - 1)
    df.to_csv(args.out / "published_runs.csv", index=False)
    figure(df, args.out / "published_runs.png")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(df.drop(columns=["source"]).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    d = df[df["kind"] == "dense"]
    if len(d):
        err = d["error_pct"].abs()
        print(f"dense rows: {len(d)}, mean absolute error {err.mean():.1f} % (worst {err.max():.1f} %, "
              f"{d.loc[err.idxmax(), 'id']}); mean signed error {d['error_pct'].mean():+.1f} %")
    layers = layer_check(dense)
    layers.to_csv(args.out / "layer_check.csv", index=False)
    print("\none layer of the 22B model (micro-batch 4 x 2,048 tokens, TP 8), ours vs Korthikanti et al. Table 4:")
    print(layers.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    if args.terms:
        terms = term_table(dense, dense[dense["id"].isin(only)] if only else dense, args.out)
        terms.to_csv(args.out / "terms.csv", index=False)
        print("\ndense rows with each term switched off in turn (layer: the five Table 4 settings):")
        print(terms.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    print(f"host: {platform.processor() or platform.machine()}, {platform.python_version()}; "
          f"{len(df)} runs simulated in {time.perf_counter() - t0:.1f} s; written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
