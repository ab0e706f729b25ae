"""MoBA on this CPU: the PyTorch path (kernels/moba/chunked.py) vs dense causal SDPA.

    .venv/bin/python benchmarks/bench_moba_cpu.py [--lengths 1024 4096 16384] [--topks 4 8] [--quarter]
    .venv/bin/python benchmarks/bench_moba_cpu.py --model [--lengths ...] [--quarter]

Attention op (default): one thread (as realrun runs), float32, tiny-preset head shapes (H=4,
H_kv=2, D=16, block 32), one sequence; median of --repeats after one warm-up; seconds for forward
and backward, and the speedup of forward + backward over dense. ``--quarter`` adds top-k = a quarter
of the sequence's blocks at each length (the hardest budget the acceptance names).
``--model``: a whole training step (forward + backward of the summed LM loss) of the tiny Qwen2
preset (4 layers), MoBA vs the same model with Hugging Face's SDPA attention.
"""

from __future__ import annotations

import argparse
import statistics
import time

import pandas as pd


def _time(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _time_backward(fwd, do, repeats: int) -> float:
    """Backward alone: the forward of each repeat runs outside the timed region."""
    fwd().backward(do)
    out = []
    for _ in range(repeats):
        y = fwd()
        t0 = time.perf_counter()
        y.backward(do)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
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

        def cases(L=L, q=q, k=k, v=v, cu=cu, dense_fwd=dense_fwd):
            yield "dense SDPA", dense_fwd
            for topk in _topks(args, L, B):
                yield f"MoBA top-{topk}", lambda t=topk: moba_attention(q, k, v, cu, block_size=B, topk=t,
                                                                       backend="torch")

        for name, fwd in cases():
            f = _time(lambda: fwd().detach(), args.repeats)  # noqa: B023
            b = _time_backward(fwd, do, args.repeats)
            rows.append({"seq_len": L, "impl": name, "fwd_s": f, "bwd_s": b, "fwd_bwd_s": f + b})
    df = pd.DataFrame(rows)
    dense = df[df.impl == "dense SDPA"].set_index("seq_len").fwd_bwd_s
    df["speedup_vs_dense"] = dense.loc[df.seq_len].to_numpy() / df.fwd_bwd_s
    print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))


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
            moba = MobaArgs(cu_seqlens=batch.cu_seqlens, topk=topk, block_size=m.block_size)
            full_forward_loss(net, batch, moba).backward()

        dense = _time(lambda: step(1, "sdpa"), args.repeats)
        rows.append({"seq_len": L, "impl": "dense SDPA", "step_s": dense, "speedup_vs_dense": 1.0})
        full = _time(lambda L=L: step(L, "moba"), args.repeats)
        rows.append({"seq_len": L, "impl": "MoBA full budget (dense path)", "step_s": full,
                     "speedup_vs_dense": dense / full})
        for topk in _topks(args, L, m.block_size):
            t = _time(lambda k=topk: step(k, "moba"), args.repeats)
            rows.append({"seq_len": L, "impl": f"MoBA top-{topk}", "step_s": t, "speedup_vs_dense": dense / t})
    net.set_attn_implementation("moba")
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.3f}"))


if __name__ == "__main__":
    main()
