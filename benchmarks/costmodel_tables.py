"""The tables of docs/costmodel.md, from the analytical cost model (no measurement, deterministic).

    .venv/bin/python benchmarks/costmodel_tables.py

1. Full budget = dense causal attention: the model's TFLOP/s (attended pairs, causal convention) on
   an H100 SXM for the FlashAttention-3 paper's benchmark shape (16 heads x 128, batch x length =
   16K tokens), kernel only and with our per-call PyTorch overhead, beside the paper's figures.
2. Where the time goes: phases of one qwen2.5-3b layer (TP 2 rank) at 32K tokens on an H200.
3. Budget and the dense path: per length, the first budget the dispatcher runs on the masked dense
   path (``kernelcost.choose_path``), and the priced forward + backward against dense attention.
"""

from __future__ import annotations

import numpy as np

from sparsebalance.simulator.config import ModelConfig, qwen25_3b
from sparsebalance.simulator.cost import kernelcost as kc
from sparsebalance.simulator.cost import roofline as rf

#: FlashAttention-3 paper (arXiv 2407.08608) Fig. 5, forward, causal, head dim 128, H100 SXM5 (TFLOP/s).
FA3_CAUSAL_FWD = {"Triton": {512: 146, 1024: 273, 2048: 323, 4096: 353, 8192: 369, 16384: 378},
                  "FlashAttention-2": {512: 191, 1024: 260, 2048: 298, 4096: 319, 8192: 333, 16384: 335}}
#: Fig. 6, backward, head dim 128 (the panel the search tool returned; no causal backward panel was found).
FA3_BWD = {"FlashAttention-2": {512: 214, 1024: 260, 2048: 291, 4096: 310, 8192: 318, 16384: 322}}


def dense_table() -> None:
    m = ModelConfig(name="fa3-bench", hidden=2048, layers=1, heads=16, kv_heads=16, head_dim=128, ffn=1,
                    vocab=1, block_size=256)
    print("| L | batch | model fwd kernel | model fwd + per-call | Triton causal fwd (paper) | ratio (kernel) "
          "| model bwd kernel | FA2 bwd (paper) | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for L in (512, 1024, 2048, 4096, 8192, 16384):
        batch = 16384 // L
        n = -(-L // 256)
        p = {k: float(v) for k, v in rf.attention_parts(L, n, m, 1, 256, rf.H100).items()}
        pb = {k: float(v) for k, v in rf.attention_parts(L, n, m, 1, 256, rf.H100, backward=True).items()}
        flops = 4 * 128 * 16 * L * (L + 1) / 2
        kern = flops / (p["own"] + p["launch"]) / 1e12
        call = batch * flops / (batch * (p["own"] + p["launch"]) + sum(v for k, v in p.items()
                                                                        if k not in ("own", "launch"))) / 1e12
        # (a dense call: no gate or index, so kernel and call agree up to the launches)
        kb = 2.5 * flops / (pb["kv"] + pb["dq"] + pb["launch"]) / 1e12
        tri, fa2b = FA3_CAUSAL_FWD["Triton"][L], FA3_BWD["FlashAttention-2"][L]
        print(f"| {L} | {batch} | {kern:.0f} | {call:.0f} | {tri} | {kern / tri:.2f} | {kb:.0f} | {fa2b} | {kb / fa2b:.2f} |")


def phase_table() -> None:
    m = qwen25_3b()
    L, n = 32768, 128
    print("\n| budget k | density | gate | index | past fwd | own+merge fwd | launches | fwd total | bwd total "
          "| F+B vs dense |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    dense = float(rf.attention_time(L, n, m, 2, 256, rf.H200) + rf.attention_time(L, n, m, 2, 256, rf.H200, backward=True))
    for k in (4, 8, 16, 32, 64, 128):
        path = "sparse" if k < n else None  # the key-block-major phases (the rule also picks it here)
        p = {a: float(v) * 1e3 for a, v in rf.attention_parts(L, k, m, 2, 256, rf.H200, path=path).items()}
        b = float(rf.attention_time(L, k, m, 2, 256, rf.H200, backward=True, path=path)) * 1e3
        f = sum(p.values())
        print(f"| {k} | 1/{n // k} | {p['gate']:.2f} | {p['index']:.2f} | {p['past']:.2f} | {p['own']:.2f} | "
              f"{p['launch']:.3f} | {f:.2f} | {b:.2f} | {(f + b) / (dense * 1e3):.2f} |")


def dispatch_table() -> None:
    """Per length: where the dispatcher (kernelcost.choose_path) leaves the sparse path for the masked
    dense one, and what the tables price against dense attention at k = 32 and just below n."""
    m = qwen25_3b()
    print("\n| tokens | blocks n | dense F+B (ms) | first k on the masked path | its density "
          "| k = 32: sparse / dense | k = 32: masked / dense | k = 32 priced / dense | k = n - 1 priced / dense |")
    print("|---|---|---|---|---|---|---|---|---|")

    def fb(L, ks, path=None):
        return (rf.attention_time(L, ks, m, 2, 256, rf.H200, path=path)
                + rf.attention_time(L, ks, m, 2, 256, rf.H200, backward=True, path=path)) * 1e3

    for L in (2048, 4096, 8448, 12288, 16384, 32768, 65536, 131072):
        n = -(-L // 256)
        ks = np.arange(1, n + 1)
        path = kc.choose_path(L, ks, rf.attention_shape(m, 2, 256), rf.H200)
        t, dense = fb(L, ks), float(fb(L, n))
        first = ks[path == kc.MASKED]
        k1 = int(first[0]) if first.size else None
        k32 = min(32, n - 1)
        cells = [f"{float(fb(L, k32, p)) / dense:.2f}" for p in ("sparse", "masked")] if n > 32 else ["-", "-"]
        priced = f"{t[31] / dense:.2f}" if n > 32 else "-"
        print(f"| {L} | {n} | {dense:.2f} | {k1 or '-'} | {f'{k1 / n:.2f}' if k1 else '-'} | {cells[0]} | "
              f"{cells[1]} | {priced} | {t[n - 2] / dense:.2f} |")


if __name__ == "__main__":
    dense_table()
    phase_table()
    dispatch_table()
