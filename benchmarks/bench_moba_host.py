"""Host time of one MoBA Triton call, its Triton kernels stubbed out: what the Python and PyTorch ops
around the kernels cost the host per call (``kernels/moba/hostcheck.py``).

    .venv/bin/python benchmarks/bench_moba_host.py [--repeats 2000]

For each path (sparse, masked, dense) on tiny CPU tensors (the compute of the few PyTorch ops is
negligible there): the first call of the shape (the plan is built and uploaded) and, with the plan
cached, the min / median / 95th percentile over ``--repeats`` calls of the forward call and of its
backward (``torch.autograd.grad``: the autograd engine's own cost included). Then every path once more on
``meta`` tensors under ``hostcheck.SyncRecorder``: the operations that would synchronise with a CUDA
device (must be none). The Triton launches themselves are not in these times.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2000)
    args = ap.parse_args(argv)
    import torch

    from sparsebalance.kernels.moba import hostcheck
    from sparsebalance.kernels.moba.triton_impl import moba_attention_triton

    torch.set_num_threads(1)
    cu = [0, 64, 104, 200]
    print("| path | first call (ms) | forward min / median / p95 (us) | backward min / median / p95 (us) "
          "| ops that would sync (meta) |")
    print("|---|---|---|---|---|")
    for path, topk in (("sparse", 3), ("masked", 3), ("dense", 100)):
        mode = "auto" if path == "dense" else path
        q, k, v = (torch.zeros(200, n, 16, requires_grad=True) for n in (2, 1, 1))
        do = torch.zeros(200, 2, 16)
        with hostcheck.stubbed():
            t0 = time.perf_counter()
            moba_attention_triton(q, k, v, cu, 16, topk, path=mode).backward(do)
            first = time.perf_counter() - t0
            fwd, bwd = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = moba_attention_triton(q, k, v, cu, 16, topk, path=mode)
                t1 = time.perf_counter()
                torch.autograd.grad(out, (q, k, v), do)  # no accumulation into .grad (see hostcheck)
                t2 = time.perf_counter()
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
            qm, km, vm = (torch.zeros(4096, n, 128, device="meta", requires_grad=True) for n in (8, 1, 1))
            with hostcheck.SyncRecorder("meta") as rec:
                moba_attention_triton(qm, km, vm, [0, 4096], 256, topk if path != "dense" else 16,
                                      path=mode).backward(torch.zeros(4096, 8, 128, device="meta"))

        def fmt(xs):
            xs = sorted(xs)
            return f"{xs[0] * 1e6:.0f} / {statistics.median(xs) * 1e6:.0f} / {xs[int(0.95 * len(xs))] * 1e6:.0f}"

        print(f"| {path} | {first * 1e3:.1f} | {fmt(fwd)} | {fmt(bwd)} | {len(rec.found)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
