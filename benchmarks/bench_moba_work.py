"""Work before speed: executed (query, key) pairs of the MoBA kernels over the attended pairs.

Counts, from the index tables a kernel call builds (no kernel runs), the pairs that pass through a
``tl.dot`` in the forward (see ``sparsebalance/kernels/moba/work.py``) for

* ``union``  -- the query-tile-major kernel of commit 301d238 (each 64-row query tile loops over the
  union of the blocks its rows chose), and
* ``gather`` -- the shipped key-block-major kernels (per key block, the rows that chose it; the
  backward ratio is the mean of its dK/dV and dQ kernels'),

on gate scores from two sources at densities 1/4 .. 1/32 (budget k = round(density x n_blocks)):

* ``tiny-stdlib``: q/k (after RoPE) of every layer of the tiny Qwen2 model (random init, seed 0,
  as realrun builds it) run on a real document of the Python standard library (byte tokens);
* ``random``: i.i.d. standard-normal q/k of the same shapes.

    .venv/bin/python benchmarks/bench_moba_work.py [--length 32768] [--block 128] [--csv out.csv]

Prints one row per (source, layer, density): attended pairs, executed pairs of both decompositions
and their ratios. CPU only, deterministic (no timing).
"""

from __future__ import annotations

import argparse
import sys

DENSITIES = (1 / 4, 1 / 8, 1 / 16, 1 / 32)


def tiny_qk(length: int, seed: int = 0) -> list[tuple]:
    """(q [L, H, D], k [L, H_kv, D]) of each layer of the tiny model on one stdlib document."""
    import torch

    from sparsebalance.data.config import DataConfig
    from sparsebalance.data.sources import load_sequences
    from sparsebalance.kernels.qwen2 import MobaArgs, build_qwen2, pack, run_layers
    from sparsebalance.simulator.config import tiny

    seqs = load_sequences(DataConfig(source="text_dir", path="stdlib", num_sequences=1, min_length=length,
                                     max_length=length, shuffle=False))
    model = tiny()
    net = build_qwen2(model, seed=seed)
    batch = pack([seqs[0].tokens])
    # the forward's own MoBA budget only shapes later layers' inputs: 16 blocks of 32 tokens
    moba = MobaArgs(cu_seqlens=batch.cu_seqlens, budget=16, block_size=model.block_size, backend="torch")
    out = []
    with torch.no_grad():
        h = net.model.embed_tokens(batch.input_ids)
        for i, layer in enumerate(net.model.layers):
            moba.coverage_layer = i
            h = run_layers(net, h, batch, moba, layers=[layer])
            q, k, _ = moba.captured
            out.append((q.float().contiguous(), k.float().contiguous()))
    return out


def random_qk(length: int, heads: int, kv_heads: int, dim: int, seed: int = 0) -> tuple:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(length, heads, dim, generator=g), torch.randn(length, kv_heads, dim, generator=g)


def count(q, k, block: int, density: float, block_m: int, block_n: int) -> dict:
    """One row: attended and executed pairs (union and the shipped key-block-major kernels) for one
    sequence; the selection by ``gate.py`` in PyTorch, the shipped kernels' work from their plan."""
    from sparsebalance.kernels.moba import work
    from sparsebalance.kernels.moba.triton_impl import plan_for

    L, H, _ = q.shape
    nb = -(-L // block)
    topk = max(1, round(density * nb))
    plan = plan_for(q, k, [0, L], [topk], block, path="sparse")
    sel = work.selection(q, k, [0, L], block, [topk], plan.k1p)
    attended = work.attended_pairs([L], block, [topk], H)
    union = work.union_work(sel, [L], block, block_m, block_n)
    row = {"blocks": nb, "topk": topk, "density": density, "attended": attended, "union": union,
           "union_ratio": union / attended}
    hkv = k.shape[1]
    counts = work.bucket_counts(plan, sel=sel)
    g = work.executed(plan, counts)
    # gate statistic behind the model's padding term: share of (chunk, past block, kv head) buckets
    # that some row chose (the model assumes all of them)
    avail = sum(hkv * max(0, min(nb - 1, (c.row1 - 1) // block)) for c in plan.chunks)
    return row | {"gather": g["fwd"], "gather_ratio": g["fwd"] / attended,
                  "gather_bwd_ratio": (g["kv"] + g["dq"]) / 2 / attended,
                  "buckets_used": int((counts > 0).sum()) / avail if avail else float("nan")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    import pandas as pd
    import torch

    torch.set_num_threads(1)
    rows = []
    sources = [("tiny-stdlib", i, qk) for i, qk in enumerate(tiny_qk(args.length))]
    q0, k0 = sources[0][2]
    sources.append(("random", -1, random_qk(args.length, q0.shape[1], k0.shape[1], q0.shape[2])))
    for name, layer, (q, k) in sources:
        for d in DENSITIES:
            rows.append({"source": name, "layer": layer} | count(q, k, args.block, d, args.block_m, args.block_n))
            print(rows[-1], file=sys.stderr, flush=True)
    df = pd.DataFrame(rows)
    print(f"L={args.length} block={args.block} block_m={args.block_m} block_n={args.block_n} "
          f"H={q0.shape[1]} H_kv={k0.shape[1]} D={q0.shape[2]}")
    print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    summary = df.groupby(["source", "density"])[[c for c in df.columns if c.endswith("ratio")]].agg(["mean", "min", "max"])
    print(summary.to_string(float_format=lambda x: f"{x:.2f}"))
    if args.csv:
        df.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
