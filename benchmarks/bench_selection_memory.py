"""Peak extra memory of MoBA block selection + index building on the CPU (the chunked path).

For each length, a fresh subprocess allocates q [T, H, D] and k [T, H_kv, D] (bf16), resets the
kernel's peak-RSS mark (``/proc/self/clear_refs``), reads its resident set, runs
``triton_select.build_index`` (selection in row chunks of ~2^24 gate scores, then the per-chunk
gathered index) and reads the peak RSS (VmHWM in ``/proc/self/status``: the high-water mark, so
short-lived temporaries count). Linux only. Prints, in MiB: the peak extra memory, the
index it returns (``sel`` + gathered codes + tables: what the kernels keep), and for comparison
the two biggest O(T x n_blocks) int64 temporaries the previous index builder allocated (the
per-tile selection copy [T, H, K1P] and the per-tile block bitmap's cumulative sum).

    .venv/bin/python benchmarks/bench_selection_memory.py [--lengths 32768 131072] [--budget 32]

Not a timed benchmark; figures depend only on the shapes and on PyTorch's CPU allocator.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
from sparsebalance.kernels.moba.triton_select import build_index
L, H, HKV, D, B, K = (int(x) for x in sys.argv[1:7])
def status(key):  # bytes
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
g = torch.Generator().manual_seed(0)
q = torch.randn(L, H, D, generator=g).to(torch.bfloat16)
k = torch.randn(L, HKV, D, generator=g).to(torch.bfloat16)
cu = torch.tensor([0, L], dtype=torch.int32)
build_index(q[:4096], k[:4096], torch.tensor([0, 4096], dtype=torch.int32), B, torch.tensor([K]), 64)  # warm-up
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
base = status("VmRSS")
idx = build_index(q, k, cu, B, torch.tensor([K]), 64)
peak = status("VmHWM")
kept = idx.sel.numel() * 4 + sum(c.codes.numel() * 4 + c.fwd_items.numel() * 4 + c.bwd_items.numel() * 4
                                 + c.own_items.numel() * 4 + c.q_tiles.numel() * 4 for c in idx.chunks)
print(json.dumps({"extra": peak - base, "kept": kept, "chunks": len(idx.chunks), "k1p": idx.k1p}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=[32768, 131072])
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--heads", type=int, default=16, help="query heads (qwen2.5-3b, TP 1)")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=256)
    args = ap.parse_args(argv)
    H, HKV, D, B, K = args.heads, args.kv_heads, args.head_dim, args.block, args.budget
    mib = 2 ** 20
    print(f"H={H} H_kv={HKV} D={D} block={B} topk={K}, bf16 q/k on the CPU, one sequence")
    print("| tokens | peak extra (MiB) | index kept (MiB) | chunks | old: [T,H,K1P] int64 + [T/64,H,n] int64 (MiB) |")
    print("|---|---|---|---|---|")
    for L in args.lengths:
        out = subprocess.run([sys.executable, "-c", CHILD, *map(str, (L, H, HKV, D, B, K))],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        n = -(-L // B)
        old = (L * H * r["k1p"] * 8 + (L // 64) * H * n * 8) / mib
        print(f"| {L} | {r['extra'] / mib:.0f} | {r['kept'] / mib:.0f} | {r['chunks']} | {old:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
