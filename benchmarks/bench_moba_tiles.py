"""Cost of one tile row in PyTorch's fused CPU flash kernel by tile size (``tiles.TILE_COST``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_moba_tiles.py [--rows 381000] [--repeats 7]

The CPU MoBA path (``kernels/moba/chunked.py``) runs its past blocks as tiles of ``TILE`` query rows
against one 32-key block (tiny-preset head dim 16, one thread, float32). Small tiles pay the kernel's
per-tile work, large ones are padded more; ``tiles.group`` weighs padded rows by the per-row cost
printed here (forward + backward, relative to a 512-row tile). Minimum of --repeats after a warm-up.
"""

from __future__ import annotations

import argparse
import time

import pandas as pd


def _best(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main() -> None:
    """The benchmark, then the host's load over it (other processes' cores) and DISTURBED with the
    reason when it was not a quiet machine's (``analysis/disturbance.py``)."""
    from sparsebalance.commands._hostload import judged_window

    with judged_window("the benchmark", cores=1):
        _main()


def _main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=381_000, help="tile rows in all (4,096 tokens, top-32)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tiles", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024])
    args = ap.parse_args()
    torch.set_num_threads(1)
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    g = torch.Generator().manual_seed(0)
    rows = []
    for tile in args.tiles:
        nt = args.rows // tile
        q = torch.randn(nt, 1, tile, 16, generator=g)
        k = torch.randn(nt, 1, 32, 16, generator=g)
        v = torch.randn(nt, 1, 32, 16, generator=g)
        o, lse = fwd(q, k, v, 0.0, False, scale=0.25)
        f = _best(lambda: fwd(q, k, v, 0.0, False, scale=0.25), args.repeats)  # noqa: B023
        b = _best(lambda: bwd(o, q, k, v, o, lse, 0.0, False, scale=0.25), args.repeats)  # noqa: B023
        rows.append({"tile": tile, "tiles": nt, "fwd_s": f, "bwd_s": b,
                     "ns_per_row": (f + b) / (nt * tile) * 1e9})
    df = pd.DataFrame(rows)
    ref = df[df.tile == 512].ns_per_row
    df["relative"] = df.ns_per_row / (ref.iloc[0] if len(ref) else df.ns_per_row.iloc[-1])
    print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))


if __name__ == "__main__":
    main()
