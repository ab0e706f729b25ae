"""GPU benchmark of the MoBA Triton kernel against dense causal attention (bf16, block 128).

For each total length (one packed sequence) and density (topk / n_blocks), times forward and
forward+backward of ``moba_attention_triton`` and of dense causal attention (torch SDPA, flash backend;
``flash_attn_varlen_func`` when flash-attn is installed), and prints a table with milliseconds, TFLOP/s
and the speedup over dense. FLOPs are counted on attended (query, key) pairs only: forward
4 * D per pair per head, forward+backward 4 * D * 3.5 (backward = 2.5x forward: five matmuls vs two).
The MoBA timing includes block selection (PyTorch, ``gate.py``) and index building.

    .venv/bin/python benchmarks/bench_moba_gpu.py [--lengths 8192 32768 131072] [--densities 0.03125 0.125 0.5]

Exits with code 2 and a message when CUDA is absent.
"""

from __future__ import annotations

import argparse
import sys


def _dense_fn(q, k, v, cu):
    """Dense causal attention: flash_attn varlen if installed, else SDPA restricted to the flash backend."""
    import torch

    try:
        from flash_attn import flash_attn_varlen_func

        L = int(cu[-1])
        return lambda: flash_attn_varlen_func(q, k, v, cu, cu, L, L, causal=True), "flash_attn"
    except ImportError:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        g = q.shape[1] // k.shape[1]
        qt = q.transpose(0, 1).unsqueeze(0)
        kt = k.repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0)
        vt = v.repeat_interleave(g, 1).transpose(0, 1).unsqueeze(0)

        def run():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

        return run, "sdpa-flash"


def _bench(fn, backward: bool) -> float:
    """Median milliseconds of fn (and its backward) via triton.testing.do_bench."""
    import torch
    import triton

    if not backward:
        return triton.testing.do_bench(lambda: fn(), warmup=5, rep=30)
    def step():
        out = fn()
        out.backward(torch.ones_like(out))
    return triton.testing.do_bench(step, warmup=5, rep=30)


def _measure(L: int, dens: float, H: int, HKV: int, D: int, B: int) -> list[dict]:
    """Rows (fwd, fwd+bwd) for one packed sequence of L tokens at density ``dens`` (topk / n_blocks)."""
    import torch

    from sparsebalance.kernels.moba.triton_impl import moba_attention_triton

    g = torch.Generator(device="cuda").manual_seed(L)
    q, k, v = (torch.randn(L, n, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for n in (H, HKV, HKV))
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    topk = max(1, round(dens * -(-L // B)))
    pairs_moba = sum(min(t // B, topk - 1) * B + t % B + 1 for t in range(L)) * H
    pairs_dense = L * (L + 1) // 2 * H
    dense, dense_name = _dense_fn(q, k, v, cu)

    def moba():
        return moba_attention_triton(q, k, v, cu, B, topk)

    rows = []
    for mode, bwd, mult in (("fwd", False, 1.0), ("fwd+bwd", True, 3.5)):
        t_m = _bench(moba, bwd)
        t_d = _bench(dense, bwd)
        rows.append({"tokens": L, "density": dens, "topk": topk, "mode": mode, "moba_ms": t_m, "dense_ms": t_d,
                         "moba_tflops": 4 * D * mult * pairs_moba / t_m / 1e9,
                         "dense_tflops": 4 * D * mult * pairs_dense / t_d / 1e9,
                         "speedup": t_d / t_m, "dense": dense_name})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="MoBA Triton vs dense causal attention on one GPU")
    ap.add_argument("--lengths", type=int, nargs="*", default=[8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--densities", type=float, nargs="*", default=[1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--csv", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_moba_gpu: CUDA is not available; this benchmark needs an NVIDIA GPU", file=sys.stderr)
        return 2
    import pandas as pd
    from tqdm import tqdm

    H, HKV, D, B = args.heads, args.kv_heads, args.head_dim, args.block
    rows = []
    grid = [(L, d) for L in args.lengths for d in args.densities]
    for L, dens in tqdm(grid, desc="bench"):
        rows += _measure(L, dens, H, HKV, D, B)
        torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    df["tflops_ratio"] = df.moba_tflops / df.dense_tflops
    print(f"device: {torch.cuda.get_device_name()}  H={H} H_kv={HKV} D={D} block={B} bf16")
    print(df.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    if args.csv:
        df.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
