"""``sparsebalance profile --device cpu|cuda --model tiny --out DIR [grid options]``.

Measures the ops of the profile format (see ``sparsebalance.kernels.profiler``) and writes
``DIR/profile.csv`` + ``DIR/profile.json`` (sidecar with device, dtype, model dims, command, versions).
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys


def _ints(text: str) -> tuple[int, ...]:
    from sparsebalance.errors import ConfigError

    try:
        return tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise ConfigError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to measure")
    p.add_argument("--model", default="tiny", help="model preset (tiny, qwen2.5-0.5b, ...)")
    p.add_argument("--out", required=True, metavar="DIR", help="profile directory to write")
    p.add_argument("--seq-lens", default=None, help="attention lengths, e.g. 64,256,1024")
    p.add_argument("--budgets", default=None, help="attention top-k values, e.g. 1,2,4,8")
    p.add_argument("--tokens", default=None, help="dense-op token counts, e.g. 64,1024,8192")
    p.add_argument("--params", default=None, help="optimizer parameter counts")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per point")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first")
    p.add_argument("--statistic", default="mean", choices=("mean", "median"),
                   help="what a point records over its repeats (mean: expected values add up)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (realrun uses 1)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--block-size", type=int, default=None, help="override the preset's block size")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (only 1 is measured)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="CPU: run this many copies of the measurement at once (the real run's "
                        "processes per host, pp x dp) and record the median over copies")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from sparsebalance.errors import ConfigError, check_choice
    from sparsebalance.simulator.config import MODEL_PRESETS
    from sparsebalance.simulator.profile import FORMAT_VERSION, MODEL_DIMS, write_profile

    check_choice(args.model, "--model", MODEL_PRESETS)
    if args.tp != 1:
        raise ConfigError(f"--tp: only 1 can be measured on one device, got {args.tp}")
    model = MODEL_PRESETS[args.model]()
    if args.block_size is not None:
        model = replace(model, block_size=args.block_size)
    import torch

    from sparsebalance.kernels.profiler import ProfileGrid, run_profile

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device: cuda requested but torch sees no CUDA device")
    kw = {k: _ints(getattr(args, k)) for k in ("seq_lens", "budgets", "tokens", "params")
          if getattr(args, k)}
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    grid = ProfileGrid(repeats=args.repeats, warmup=args.warmup, threads=args.threads,
                       statistic=args.statistic,
                       device=args.device, dtype=dtype, **kw)
    table = run_profile(model, grid, progress=not args.no_progress, concurrency=args.concurrency)
    import transformers

    dev_name = (torch.cuda.get_device_name() if args.device == "cuda"
                else f"cpu {platform.processor() or platform.machine()}, {grid.threads} thread(s)")
    from sparsebalance.kernels.calibrate import machine_fingerprint

    meta = {
        "machine": machine_fingerprint(args.device, threads=grid.threads),
        "format_version": FORMAT_VERSION, "device": dev_name, "dtype": dtype, "analytical": False,
        "model": {d: getattr(model, d) for d in MODEL_DIMS},
        "block_size": model.block_size, "tp": 1, "concurrency": args.concurrency,
        "how": (f"sparsebalance.kernels.profiler: {grid.statistic} of {grid.repeats} after {grid.warmup} "
                "warm-up "
                f"calls ({'CUDA events' if args.device == 'cuda' else 'perf_counter'}) in {grid.repeats} "
                "interleaved rounds (every op timed once per round, seeded order), "
                f"{args.concurrency} concurrent cop{'y' if args.concurrency == 1 else 'ies'} "
                f"({grid.statistic} over copies, one core each, glibc allocator kept steady as in realrun); "
                "layer_* = one HF "
                "Qwen2DecoderLayer with a zero-cost attention core; attn_* = moba_attention (auto backend)"),
        "command": "sparsebalance profile " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else []),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
    }
    out = write_profile(table, meta, args.out)
    print(f"wrote {out}/profile.csv ({len(table)} rows) and profile.json")
    return 0
