"""The rows of ``validation/published/runs.csv`` as run configs, and what the simulator cannot price yet.

A row states a published run (validation/published/README.md describes every column). Columns added
after the first nine rows have defaults that keep those rows' meaning (:data:`DEFAULTS`), so an
older file still loads. :func:`gaps` says, from the row's stated setup alone, what the simulator
lacks: *blocking* gaps (a DP mode or precision it has no model of) leave the row unpriced ("not yet
modelled"); *approximations* (an overlap it cannot express) price the row with that communication
exposed, and the report says so. Nothing here looks at a prediction.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
PRICED_PP_IMPLS = ("megatron-2022", "megatron", "meta")
"""Pipeline implementations of published rows the simulator prices (``cluster.pp_impl``)."""
PUBLISHED = ROOT / "validation" / "published"
BLOCK = 128
"""MoBA block size of the dense rows: every block selected (the budget covers the sequence) = dense."""

#: GPU of a row -> the cluster preset of its nodes (NVLink inside, the fabric across; simulator/config.py)
NODES = {"a100-80gb": "dgx-a100-80gb", "a100-40gb": "dgx-a100-40gb", "h100": "h100-4x8", "h200": "h200-4x8"}
#: the per-GPU NIC line rate (Gb/s) each preset's fabric stands for
NODE_NIC_GBPS = {"dgx-a100-80gb": 200, "dgx-a100-40gb": 200, "h100-4x8": 400, "h200-4x8": 400}

#: column -> default for rows written before the column existed (the first nine rows' meaning:
#: Megatron GPT, MHA, 4h GELU MLP, LayerNorm, biases, learned positions, tied embeddings, DDP)
DEFAULTS = {"kv_heads": None, "ffn": None, "mlp": "gelu", "norm": "layernorm", "positions": "learned",
            "bias": True, "tie_embeddings": True, "params_stated": None, "cp": 1, "cp_comm": "ring",
            "pp_impl": "megatron-2022", "dp_mode": "ddp", "param_gather_overlap": False, "fsdp_shard": None,
            "fsdp_reshard_after_forward": None, "fsdp_prefetch": "", "param_gather_bytes": None,
            "grad_clip": True, "nic_gbps": None, "published_metric": "s/iteration", "published_value": None,
            "conversion": "", "precision": "bf16", "layer_ops": "fused"}
BOOLS = ("bias", "tie_embeddings", "sequence_parallel", "dp_overlap", "param_gather_overlap", "grad_clip")
DP_MODES = ("ddp", "zero1", "zero2", "zero3")
TP_OVERLAPS = ("false", "true", "te")
LAYER_OPS = ("fused", "eager", "eager-unpad")
"""How a row's layer ran its elementwise ops (``ModelConfig.layer_ops``)."""


def _bool(value, column: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise SystemExit(f"runs.csv: {column} must be true or false, got {value!r}")
    return text == "true"


def load_runs(path: Path = PUBLISHED / "runs.csv") -> pd.DataFrame:
    """The published rows with every column present (defaults filled), booleans parsed, and the
    stated plan checked: tp x pp x dp x cp = gpus, dp_mode and tp_overlap among the allowed values."""
    df = pd.read_csv(path, dtype={"tp_overlap": str, "cp_comm": str, "fsdp_prefetch": str})
    for col, default in DEFAULTS.items():
        if col not in df:
            df[col] = default
        elif default is not None:
            df[col] = df[col].where(df[col].notna(), default)
    df["kv_heads"] = df["kv_heads"].fillna(df["heads"]).astype(int)
    df["ffn"] = df["ffn"].fillna(4 * df["hidden"]).astype(int)
    for col in BOOLS:
        df[col] = [_bool(v, col) for v in df[col]]
    df["tp_overlap"] = df["tp_overlap"].astype(str).str.strip().str.lower()
    for row in df.itertuples():
        gpus = int(row.tp) * int(row.pp) * int(row.dp) * int(row.cp)
        if gpus != int(row.gpus):
            raise SystemExit(f"{row.id}: tp x pp x dp x cp = {gpus} but the row says {row.gpus} GPUs")
        if row.dp_mode not in DP_MODES:
            raise SystemExit(f"{row.id}: dp_mode must be one of {', '.join(DP_MODES)}, got {row.dp_mode!r}")
        if row.tp_overlap not in TP_OVERLAPS:
            raise SystemExit(f"{row.id}: tp_overlap must be one of {', '.join(TP_OVERLAPS)}, got {row.tp_overlap!r}")
        if row.layer_ops not in LAYER_OPS:
            raise SystemExit(f"{row.id}: layer_ops must be one of {', '.join(LAYER_OPS)}, got {row.layer_ops!r}")
    return df


def gaps(row) -> tuple[list[str], list[str]]:
    """(blocking, approximations) of one row for today's simulator: blocking gaps leave it unpriced,
    approximations price it with the named communication exposed."""
    blocking, approx = [], []
    if "fp8" in str(row.precision).lower():
        blocking.append(f"FP8 (precision = {row.precision})")
    if row.pp > 1 and row.pp_impl not in PRICED_PP_IMPLS:
        blocking.append(f"pipeline implementation {row.pp_impl!r} (modelled: {', '.join(PRICED_PP_IMPLS)})")
    if row.tp_overlap == "te" and row.tp > 1 and not row.sequence_parallel:
        approx.append("TE comm-GEMM overlap without sequence parallelism: priced as Megatron's async overlap")
    node = NODES.get(row.gpu)
    if node and not pd.isna(row.nic_gbps) and int(row.nic_gbps) != NODE_NIC_GBPS[node]:
        approx.append(f"network: {int(row.nic_gbps)} Gb/s per GPU, preset {node} stands for {NODE_NIC_GBPS[node]}")
    if node is None:
        blocking.append(f"no cluster preset for GPU {row.gpu!r}")
    return blocking, approx


def dense_config(row) -> dict:
    """The run-config mapping of one published run: fixed-length data at the stated micro-batch size,
    a budget covering every block (dense attention), the GPU's analytical profile, the node preset."""
    from sparsebalance.simulator.config import CLUSTER_PRESETS

    node = CLUSTER_PRESETS[NODES[row.gpu]]()
    h, seq = int(row.hidden), int(row.seq_len)
    blocks = math.ceil(seq / BLOCK)
    gpus = int(row.tp) * int(row.pp) * int(row.dp) * int(row.cp)
    kernel = "moba" if row.attention_kernel == "flash" else row.attention_kernel  # moba at a full budget = flash
    cluster = {"preset": node.name, "pp": int(row.pp), "dp": int(row.dp), "tp": int(row.tp),
               "schedule": row.schedule, "virtual_stages": int(row.virtual_stages),
               "micro_batch_size": int(row.micro_batch_size), "global_batch": int(row.global_batch),
               "recompute": row.recompute, "dp_overlap": bool(row.dp_overlap),
               "grad_reduce_bytes": int(row.grad_reduce_bytes), "sequence_parallel": bool(row.sequence_parallel),
               "tp_overlap": row.tp_overlap in ("true", "te"), "dp_mode": row.dp_mode,
               "tp_overlap_impl": "te" if row.tp_overlap == "te" and bool(row.sequence_parallel) else "megatron",
               "param_gather_overlap": row.dp_mode == "zero1" and bool(row.param_gather_overlap),
               "nodes": math.ceil(gpus / node.gpus_per_node),
               # the pipeline implementation the row ran (blocking sends, P2P split over TP, tied
               # embedding's all-reduce) and its gradient clipping (the norm's barrier); other
               # implementations are not priced with pp > 1 (gaps) and keep the ideal pipeline
               "pp_impl": row.pp_impl if row.pp_impl in PRICED_PP_IMPLS else "ideal",
               "grad_clip": bool(row.grad_clip)}
    if row.dp_mode in ("zero2", "zero3"):
        cluster |= {"param_gather_bytes": int(row.param_gather_bytes)}
        if not pd.isna(row.fsdp_shard) and int(row.fsdp_shard) != int(row.dp) * int(row.cp):
            cluster["fsdp_shard"] = int(row.fsdp_shard)
        if row.pp_impl == "meta":  # Llama 3 with PP: gathered once, reduced once per step
            cluster["fsdp_grad_sync"] = "last"
        if row.dp_mode == "zero3":  # Composer's default BACKWARD_POST where the row assumes it
            cluster["fsdp_backward_prefetch"] = "post" if "BACKWARD_POST" in str(row.fsdp_prefetch) else "pre"
    if row.pp_impl == "meta" and int(row.pp) > 1:  # Llama 3: one layer fewer on the first and last stage
        cluster["end_stage_layers_fewer"] = 1
    if int(row.cp) > 1:
        cluster |= {"cp": int(row.cp), "cp_comm": row.cp_comm or "ring"}
    return {
        "name": row.id, "iterations": 1, "seed": 0, "profile": f"analytical-{row.gpu}",
        "model": {"name": row.model, "hidden": h, "layers": int(row.layers), "heads": int(row.heads),
                  "kv_heads": int(row.kv_heads), "head_dim": h // int(row.heads), "ffn": int(row.ffn),
                  "vocab": int(row.vocab), "block_size": BLOCK, "tie_embeddings": bool(row.tie_embeddings),
                  "mlp": row.mlp, "qkv_bias": bool(row.bias), "bias": bool(row.bias), "norm": row.norm,
                  "positions": row.positions, "max_positions": seq if row.positions == "learned" else 0,
                  "attention_kernel": kernel, "layer_ops": row.layer_ops},
        "cluster": cluster,
        "data": {"source": "distribution", "distribution": "fixed", "length": seq,
                 "num_sequences": int(row.global_batch)},
        "policy": {"batching": "sequential", "tuning": "fixed", "k0": blocks, "k_max": max(blocks, 64)},
    }
