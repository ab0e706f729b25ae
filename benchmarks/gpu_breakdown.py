"""Where a GPU's time goes: the device's two ceilings, the host's cost per op, and a per-call breakdown
of the ops the profile times (MoBA attention, one decoder layer, the LM head with its loss).

    python benchmarks/gpu_breakdown.py --out results/gpu-breakdown      # on a CUDA machine, ~2 min

Why: the measured H100 profile (gpu-check, 2026-11-26) is 2-60x the analytical one op by op; this
says which part of each gap is the host (Python + dispatch + launches, which the analytical model
prices at 4 us per op) and which the device (kernel time against the measured ceilings). Prints one
table per part and writes ``breakdown.json`` (every figure) beside it. Ceilings per METHOD.md: a large
device-to-device copy (bytes read + written) and a large bf16 matrix product, medians of do_bench.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _bench(fn) -> float:
    """Median milliseconds of ``fn`` (CUDA events, do_bench)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def ceilings(torch) -> dict:
    """Copy bandwidth (TB/s, read + write) and bf16 GEMM rate (TFLOP/s), plus the 3B layer's GEMMs."""
    n = 1 << 29  # 1 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    out = {"copy_tb_s": 2 * n * 2 / _bench(lambda: dst.copy_(src)) / 1e9}
    src = dst = None  # the 2 GiB go before the products
    s = 8192
    a, b = (torch.randn(s, s, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out["gemm_8192_tflop_s"] = 2 * s ** 3 / _bench(lambda: a @ b) / 1e9
    t = 16384  # tokens of one 3B micro-batch: qkv, o, gate+up, down projections
    for name, (k, n_) in {"qkv": (2048, 2560), "o": (2048, 2048), "gate_up": (2048, 22016),
                          "down": (11008, 2048)}.items():
        a = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(k, n_, device="cuda", dtype=torch.bfloat16)
        out[f"gemm_{name}_tflop_s"] = 2 * t * k * n_ / _bench(lambda a=a, w=w: a @ w) / 1e9
    return out


DEV = "cuda"  # --device cpu runs the host and call parts here, to check the script before a lease


def _sync(torch) -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def host_cost(torch) -> dict:
    """Microseconds per small op when the host is the limit: 5,000 in-place adds, synchronised once."""
    x = torch.ones(1024, device=DEV)
    for _ in range(200):
        x.add_(1)
    _sync(torch)
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(5000):
            x.add_(1)
        _sync(torch)
        runs.append((time.perf_counter() - t0) / 5000 * 1e6)
    return {"us_per_op_median": statistics.median(runs), "us_per_op_runs": runs}


def _profile(torch, fn, calls: int) -> dict:
    """Per call: host wall (ms, synchronised), device kernel time (ms), kernels, host syncs, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    _sync(torch)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(torch)
    wall = (time.perf_counter() - t0) / calls * 1e3
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        _sync(torch)
    kernels, syncs, launches, device_us = {}, 0, 0, 0.0
    for e in prof.key_averages():
        if "LaunchKernel" in e.key:
            launches += e.count
        dev = getattr(e, "self_device_time_total", None)
        dev = getattr(e, "self_cuda_time_total", 0.0) if dev is None else dev
        if "Synchronize" in e.key or e.key in ("cudaMemcpy", "cudaMemcpyAsync"):
            syncs += e.count
        if str(getattr(e, "device_type", "")).endswith("CUDA") and dev > 0:
            kernels[e.key] = (kernels.get(e.key, (0, 0.0))[0] + e.count, kernels.get(e.key, (0, 0.0))[1] + dev)
            device_us += dev
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:6]
    return {"wall_ms": wall, "device_ms": device_us / calls / 1e3,
            "kernels": sum(c for c, _ in kernels.values()) / calls, "syncs_or_copies": syncs / calls,
            "launches": launches / calls,
            "top": [(k[:70], c / calls, us / calls / 1e3) for k, (c, us) in top]}


def calls(torch) -> dict:
    """fwd + bwd of MoBA attention (3B heads) at two sizes, the 3B decoder layer and the LM head."""
    from sparsebalance.kernels import moba_attention
    from sparsebalance.kernels.profiler import Bench, ProfileGrid
    from sparsebalance.simulator.config import qwen25_3b

    model = qwen25_3b()
    dtype = "bfloat16" if DEV == "cuda" else "float32"
    bench = Bench(model, ProfileGrid(device=DEV, dtype=dtype, seq_lens=(1024,), budgets=(1,)))
    g = torch.Generator(device=DEV).manual_seed(0)
    sizes = ((1024, 4), (16384, 8)) if DEV == "cuda" else ((1024, 4),)
    out = {}
    for tokens, budget in sizes:
        q = torch.randn(tokens, model.heads, model.head_dim, device=DEV, dtype=getattr(torch, dtype),
                        generator=g).requires_grad_()
        k, v = (torch.randn(tokens, model.kv_heads, model.head_dim, device=DEV, dtype=getattr(torch, dtype),
                            generator=g).requires_grad_() for _ in range(2))
        cu = torch.tensor([0, tokens], dtype=torch.int32, device=DEV)
        do = torch.randn_like(q)

        def attn(q=q, k=k, v=v, cu=cu, do=do, budget=budget):
            moba_attention(q, k, v, cu, block_size=model.block_size, topk=budget).backward(do)

        out[f"moba_fwd_bwd_{tokens}_k{budget}"] = _profile(torch, attn, 5)
    for tokens in (1024, 16384) if DEV == "cuda" else (1024,):
        (_, fwd, _), (_, bwd, _) = bench.items("layer", tokens, 0)[:2]
        out[f"layer_fwd_bwd_{tokens}"] = _profile(torch, lambda fwd=fwd, bwd=bwd: bwd(fwd()), 5)
    head_tokens = 16384 if DEV == "cuda" else 1024
    (_, hf, _), (_, hb, _) = bench.items("head", head_tokens, 0)[:2]
    out[f"head_fwd_bwd_{head_tokens}"] = _profile(torch, lambda: hb(hf()), 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/gpu-breakdown"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: run the host and call parts here (a check of the script, no ceilings)")
    args = ap.parse_args()
    import torch

    global DEV
    DEV = args.device
    if DEV == "cuda" and not torch.cuda.is_available():
        print("gpu_breakdown: no CUDA GPU here; nothing measured", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__}
    parts = (("ceilings", ceilings),) if DEV == "cuda" else ()
    for name, part in (*parts, ("host", host_cost), ("calls", calls)):
        t0 = time.perf_counter()
        try:
            res[name] = part(torch)
        except Exception as exc:  # noqa: BLE001 -- one part failing must not lose the others' figures
            res[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{name} ({time.perf_counter() - t0:.0f} s): {json.dumps(res[name], default=str)[:3000]}",
              flush=True)
        (args.out / "breakdown.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"\n{'call':<26} {'wall ms':>9} {'device ms':>10} {'kernels':>8} {'launches':>9} {'syncs':>6}")
    for name, r in res.get("calls", {}).items():
        if isinstance(r, dict) and "wall_ms" in r:
            print(f"{name:<26} {r['wall_ms']:>9.3f} {r['device_ms']:>10.3f} {r['kernels']:>8.0f} "
                  f"{r['launches']:>9.0f} {r['syncs_or_copies']:>6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
