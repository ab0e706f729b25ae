"""MoBA on this CPU: the PyTorch path (kernels/moba/chunked.py) vs dense causal SDPA.

    .venv/bin/python benchmarks/bench_moba_cpu.py [--lengths 1024 4096 16384] [--topks 4 8] [--quarter]
    .venv/bin/python benchmarks/bench_moba_cpu.py --model [--lengths ...] [--quarter]

Attention op (default): one thread (as realrun runs), float32, tiny-preset head shapes (H=4,
H_kv=2, D=16, block 32), one sequence; seconds for forward and backward (medians of --repeats after
one warm-up) and the speedup of forward + backward over dense. ``--quarter`` adds top-k = a quarter
of the sequence's blocks at each length (the hardest budget the acceptance names).
``--model``: a whole training step (forward + backward of the summed LM loss) of the tiny Qwen2
preset (4 layers), MoBA vs the same model with Hugging Face's SDPA attention.

The cases of one length run interleaved (repeat r of every case, then repeat r + 1), so the VM's
drift over minutes hits dense and MoBA alike; the speedup is the median of the per-repeat ratios
dense / MoBA, with their min and max (``lo``, ``hi``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import pandas as pd


def _interleaved(cases: dict, repeats: int) -> dict:
    """{name: [(seconds...) per repeat]}: each case's fn returns a tuple of seconds; one warm-up each,
    then repeat r of every case before repeat r + 1."""
    for fn in cases.values():
        fn()
    out: dict = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            out[name].append(fn())
    return out


def _fwd_bwd(fwd, do) -> tuple[float, float]:
    t0 = time.perf_counter()
    y = fwd()
    t1 = time.perf_counter()
    y.backward(do)
    return t1 - t0, time.perf_counter() - t1


def _speedup(dense: list[float], other: list[float]) -> dict:
    r = [d / o for d, o in zip(dense, other)]
    return {"speedup_vs_dense": statistics.median(r), "lo": min(r), "hi": max(r)}


def main() -> None:
    """The benchmark, then the host's load over it (other processes' cores) and DISTURBED with the
    reason when it was not a quiet machine's (``analysis/disturbance.py``)."""
    from sparsebalance.commands._hostload import judged_window

    with judged_window("the benchmark", cores=1):
        _main()


def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--topks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quarter", action="store_true", help="also top-k = blocks / 4 at each length")
    ap.add_argument("--model", action="store_true", help="time a tiny-model training step instead")
    args = ap.parse_args()
    if args.model:
        return model_steps(args)

    import torch
    import torch.nn.functional as F

    from sparsebalance.kernels import moba_attention

    torch.set_num_threads(1)
    H, HKV, D, B = 4, 2, 16, 32
    rows = []
    for L in args.lengths:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(L, H, D, generator=g, requires_grad=True)
        k = torch.randn(L, HKV, D, generator=g, requires_grad=True)
        v = torch.randn(L, HKV, D, generator=g, requires_grad=True)
        cu = torch.tensor([0, L], dtype=torch.int32)
        do = torch.randn(L, H, D, generator=g)

        def dense_fwd(q=q, k=k, v=v):
            qq, kk, vv = (x.transpose(0, 1)[None] for x in (q, k, v))
            kk, vv = (x.repeat_interleave(H // HKV, dim=1) for x in (kk, vv))
            return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)[0].transpose(0, 1)

        cases = {"dense SDPA": lambda dense_fwd=dense_fwd, do=do: _fwd_bwd(dense_fwd, do)}
        for topk in _topks(args, L, B):
            cases[f"MoBA top-{topk}"] = lambda t=topk, q=q, k=k, v=v, cu=cu, do=do: _fwd_bwd(
                lambda: moba_attention(q, k, v, cu, block_size=B, topk=t, backend="torch"), do)
        res = _interleaved(cases, args.repeats)
        dense_fb = [f + b for f, b in res["dense SDPA"]]
        for name, runs in res.items():
            fb = [f + b for f, b in runs]
            rows.append({"seq_len": L, "impl": name, "fwd_s": statistics.median(f for f, _ in runs),
                         "bwd_s": statistics.median(b for _, b in runs), "fwd_bwd_s": statistics.median(fb),
                         **_speedup(dense_fb, fb)})
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.3f}"))


def _topks(args, L: int, B: int) -> list[int]:
    ks = list(args.topks)
    if args.quarter:
        ks.append(max(1, -(-L // B) // 4))
    return sorted(set(ks))


def model_steps(args) -> None:
    import torch

    from sparsebalance.kernels.qwen2 import MobaArgs, build_qwen2, full_forward_loss, pack
    from sparsebalance.simulator.config import tiny

    torch.set_num_threads(1)
    m = tiny()
    net = build_qwen2(m, seed=0)
    rows = []
    for L in args.lengths:
        tokens = torch.randint(0, m.vocab, (L,), generator=torch.Generator().manual_seed(0)).numpy()
        batch = pack([tokens])

        def step(topk, impl, batch=batch):
            net.set_attn_implementation(impl)
            net.zero_grad(set_to_none=True)
            moba = MobaArgs(cu_seqlens=batch.cu_seqlens, budget=topk, block_size=m.block_size)
            t0 = time.perf_counter()
            full_forward_loss(net, batch, moba).backward()
            return time.perf_counter() - t0

        cases = {"dense SDPA": lambda: step(1, "sdpa"),
                 "MoBA full budget (dense path)": lambda L=L: step(L, "moba")}
        for topk in _topks(args, L, m.block_size):
            cases[f"MoBA top-{topk}"] = lambda k=topk: step(k, "moba")
        res = _interleaved(cases, args.repeats)
        for name, runs in res.items():
            rows.append({"seq_len": L, "impl": name, "step_s": statistics.median(runs),
                         **_speedup(res["dense SDPA"], runs)})
    net.set_attn_implementation("moba")
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.3f}"))


if __name__ == "__main__":
    main()
