"""Launch configurations of the MoBA Triton kernels timed side by side on one CUDA GPU.

    python benchmarks/tune_launch_gpu.py --out results/tune-launch     # ~2-3 min on an H100

Why: ``triton_impl.launch_config`` was picked from the sm_90 compile report alone (no spills where
possible, wgmma everywhere) and never timed; on an H100 (gpu-check, 2026-11-26) the backward ran at
~45 TFLOP/s. Each variant (BLOCK_M, BLOCK_N, warps, stages; one for all four kernels) runs the
speed grid's shape (qwen2.5-3b on a TP-2 rank: 8 query heads, 1 kv head, D = 128, block 256, bf16)
at a few (length, density) points: forward and forward + backward medians (do_bench, as
``kernels/moba/speed.py``), device time per kernel (torch.profiler, mean of 3 calls), and the
output and dq against the current configuration's (relative error: every variant must compute the
same attention). Writes ``tune_launch.csv``; prints the table, fastest forward + backward first.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: (BLOCK_M, BLOCK_N, num_warps, num_stages); the first is the configuration in use
VARIANTS = [(64, 64, 8, 2), (64, 64, 4, 2), (64, 64, 8, 3), (128, 64, 8, 2), (64, 128, 8, 2),
            (32, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2), (128, 32, 8, 2), (32, 128, 4, 2)]
POINTS = [(16384, 0.125), (32768, 0.125), (4096, 0.25)]


def _kernel_ms(torch, step, calls: int = 3) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.key.startswith("_") and e.key.endswith("_kernel"):
            dev = getattr(e, "self_device_time_total", None)
            dev = getattr(e, "self_cuda_time_total", 0.0) if dev is None else dev
            out[e.key.strip("_").removesuffix("_kernel")] = dev / calls / 1e3
    return out


def _point(torch, ti, speed, L: int, density: float, shape) -> dict:
    H, HKV, D, B = shape.heads, shape.kv_heads, shape.head_dim, shape.block
    g = torch.Generator(device="cuda").manual_seed(L)
    q, k, v = (torch.randn(L, n, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for n in (H, HKV, HKV))
    do = torch.randn(L, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0, L], dtype=torch.int32, device="cuda")
    topk = max(1, round(density * (-(-L // B))))

    def fwd():
        return ti.moba_attention_triton(q, k, v, cu, B, topk)

    def step():
        q.grad = None
        fwd().backward(do)

    step()
    out, dq = fwd().detach().float(), q.grad.detach().float()
    return {"tokens": L, "density": density, "topk": topk, "fwd_ms": speed._bench(fwd, False),
            "fwd_bwd_ms": speed._bench(step, False), **_kernel_ms(torch, step), "_out": out, "_dq": dq}


def run_variant(torch, ti, speed, variant, points, shape) -> list[dict]:
    bm, bn, warps, stages = variant
    ti.launch_config = lambda block_size, head_dim, dtype: {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps,
                                                            "num_stages": stages}
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "warps": warps, "stages": stages,
             **_point(torch, ti, speed, L, d, shape)} for L, d in points]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/tune-launch"))
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting variants after this")
    args = ap.parse_args()
    import pandas as pd
    import torch

    from sparsebalance.kernels.moba import speed
    from sparsebalance.kernels.moba import triton_impl as ti

    if not torch.cuda.is_available():
        print("tune_launch_gpu: no CUDA GPU here; nothing measured", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    shape, t0, rows, ref = speed.SpeedShape(), time.monotonic(), [], {}
    for variant in VARIANTS:
        if rows and time.monotonic() - t0 > args.budget_s:
            break
        t1 = time.monotonic()
        try:
            got = run_variant(torch, ti, speed, variant, POINTS, shape)
        except Exception as exc:  # noqa: BLE001 -- a variant that does not compile is a row, not the end
            rows.append({"BLOCK_M": variant[0], "BLOCK_N": variant[1], "warps": variant[2], "stages": variant[3],
                         "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            print(f"{variant}: {rows[-1]['error']}", flush=True)
            continue
        for r in got:
            key = (r["tokens"], r["density"])
            ref.setdefault(key, (r["_out"], r["_dq"]))
            o, dq = ref[key]
            r["out_rel_err"] = float((r.pop("_out") - o).norm() / o.norm())
            r["dq_rel_err"] = float((r.pop("_dq") - dq).norm() / dq.norm())
            rows.append(r)
        print(f"{variant}: {time.monotonic() - t1:.0f} s; " + "; ".join(
            f"{r['tokens']}: fwd {r['fwd_ms']:.2f} fwd+bwd {r['fwd_bwd_ms']:.2f} ms" for r in got), flush=True)
        pd.DataFrame(rows).to_csv(args.out / "tune_launch.csv", index=False)
    table = pd.DataFrame(rows)
    table["statistic"] = speed.STATISTIC
    table.to_csv(args.out / "tune_launch.csv", index=False)
    ok = table[table.get("fwd_bwd_ms").notna()] if "fwd_bwd_ms" in table else table
    cols = [c for c in ("tokens", "topk", "BLOCK_M", "BLOCK_N", "warps", "stages", "fwd_ms", "fwd_bwd_ms",
                        "fwd_past", "fwd_own_merge", "bwd_past", "bwd_own", "dq_rel_err") if c in ok]
    print(ok.sort_values(["tokens", "fwd_bwd_ms"])[cols].to_string(index=False, float_format="%.3f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
