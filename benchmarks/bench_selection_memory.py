"""Peak extra memory of MoBA gate + index building, the kernels' allocations alone (no kernel runs).

For each length, a fresh subprocess allocates q [T, H, D] and k [T, H_kv, D] (bf16) on the CPU,
builds the call's plan, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``), reads its
resident set, runs ``triton_select.build_index`` with the Triton kernels stubbed out
(``hostcheck.stubbed``: every allocation and PyTorch op of the device path happens -- the block
means, the entry keys and codes, the sort and its outputs, the tables -- but no kernel) and reads
the peak RSS (VmHWM in ``/proc/self/status``: the high-water mark, so short-lived temporaries
count). Linux only. Prints, in MiB: the peak extra memory, the index it returns (sorted codes and
tables: what the kernels keep for the backward), and for comparison the two biggest
O(T x n_blocks) int64 temporaries of the index builder before the key-block-major kernel.

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
from sparsebalance.kernels.moba import hostcheck
from sparsebalance.kernels.moba.triton_impl import plan_for
from sparsebalance.kernels.moba.triton_select import build_index
L, H, HKV, D, B, K = (int(x) for x in sys.argv[1:7])
def status(key):  # bytes
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
g = torch.Generator().manual_seed(0)
q = torch.randn(L, H, D, generator=g).to(torch.bfloat16)
k = torch.randn(L, HKV, D, generator=g).to(torch.bfloat16)
plan = plan_for(q, k, [0, L], [K], B, path="sparse")
with hostcheck.stubbed():
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
    base = status("VmRSS")
    idx = build_index(plan, q, k)
    peak = status("VmHWM")
kept = sum(t.numel() * t.element_size() for t in (idx.codes, idx.ptr, idx.cum_fwd, idx.cum_bwd))
print(json.dumps({"extra": peak - base, "kept": kept, "chunks": plan.nc, "k1p": plan.k1p}))
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
