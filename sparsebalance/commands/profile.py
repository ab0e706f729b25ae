"""``sparsebalance profile --device cpu|cuda (--model tiny | --config RUN.toml) --out DIR [grid options]``.

Measures the ops of the profile format (see ``sparsebalance.kernels.profiler``) and writes
``DIR/profile.csv`` + ``DIR/profile.json`` (sidecar with device, dtype, model dims, command, versions;
docs/formats.md). ``--config`` takes the model (and its block size) from a run config. The output
directory is checked before measuring: an existing profile is refused unless ``--force``.
On the CPU the measurement judges itself: other processes' load over its window
(``commands/_hostload.py``, ``analysis/disturbance.py``) is recorded in the sidecar's ``host``
(``disturbed``, ``disturbed_reasons``) and printed beside the summary line; a disturbed profile is
kept (the measurement is not lost) but says so.
"""

from __future__ import annotations

import argparse
import shlex
import sys


def _ints(text: str, field: str = "grid") -> tuple[int, ...]:
    from sparsebalance.errors import ConfigError

    try:
        return tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise ConfigError(f"{field}: expected comma-separated integers, got {text!r}") from None


def text_of(vals: tuple[int, ...]) -> str:
    return ",".join(map(str, vals)) or "nothing"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sparsebalance.commands._args import add_config, add_output_flags, nonneg_int, positive_int
    from sparsebalance.kernels.fastlayer import LAYER_IMPLS
    from sparsebalance.simulator.cost.profilemeta import CP_LAYOUTS

    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to measure")
    p.add_argument("--model", default=None, help="model preset (tiny, qwen2.5-0.5b, ...; default tiny, "
                                                 "or the --config run's model)")
    add_config(p, required=False, help="run config whose [model] is measured (instead of --model)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="profile directory to write (refused if it exists, unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing profile in --out")
    p.add_argument("--seq-lens", default=None, help="attention lengths, e.g. 64,256,1024")
    p.add_argument("--budgets", default=None, help="attention top-k values, e.g. 1,2,4,8")
    p.add_argument("--tokens", default=None, help="dense-op token counts, e.g. 64,1024,8192")
    p.add_argument("--params", default=None, help="optimizer parameter counts")
    p.add_argument("--repeats", type=positive_int, default=10, help="timed calls per point")
    p.add_argument("--warmup", type=nonneg_int, default=5, help="untimed calls first")
    p.add_argument("--statistic", default="mean", choices=("mean", "median"),
                   help="what a point records over its repeats (mean: expected values add up)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (realrun uses 1)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--block-size", type=positive_int, default=None, help="override the preset's block size")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel degree: measure one TP rank's shard (heads, kv heads and MLP "
                        "width / tp); the latency model adds the TP all-reduces (default 1)")
    p.add_argument("--cp", type=positive_int, default=1,
                   help="context-parallel degree: also measure attn_fwd_cp / attn_bwd_cp, one sequence's "
                        "attention on a CP group of this many ranks as the real run's all-gather CP "
                        "path computes it, collectives excluded, and (CPU) attn_fwd_cp_step / "
                        "attn_bwd_cp_step, rank 0's ring steps by their pairs (default 1: none)")
    p.add_argument("--cp-layout", default="zigzag", choices=CP_LAYOUTS,
                   help="layout of the --cp group (default zigzag)")
    p.add_argument("--layer-impl", default="auto", choices=LAYER_IMPLS,
                   help="how the layer and head ops run (kernels/fastlayer.py): eager (the Hugging Face "
                        "modules), compiled (torch.compile'd dense parts, chunked loss), auto (compiled "
                        "on CUDA without --tp, else eager; default)")
    p.add_argument("--trainer", default="realrun", choices=("realrun", "torchtitan"),
                   help="whose model pieces to time: realrun's HF Qwen2 (default) or torchtitan's Qwen3 "
                        "(sparsebalance.titan, extra [titan]: no QKV bias, QK norm)")
    p.add_argument("--concurrency", type=positive_int, default=1,
                   help="CPU: run this many copies of the measurement at once (the real run's "
                        "processes per host, pp x dp) and record the median over copies")
    add_output_flags(p)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from sparsebalance.commands._args import progress_enabled, resolve_out
    from sparsebalance.errors import ConfigError, check_choice
    from sparsebalance.simulator.config import MODEL_PRESETS

    if args.model is not None or args.config is None:
        check_choice(args.model or "tiny", "--model", MODEL_PRESETS)
        model = MODEL_PRESETS[args.model or "tiny"]()
    else:
        from sparsebalance.runconfig import load_run_config

        model = load_run_config(args.config).model
    if args.block_size is not None:
        from sparsebalance.data.config import MAX_LENGTH

        if args.block_size > MAX_LENGTH:  # one block longer than any sequence the simulator models
            raise ConfigError(f"--block-size: {args.block_size:,} tokens is above the longest sequence "
                              f"the simulator models ({MAX_LENGTH:,} tokens, data.MAX_LENGTH)")
        model = replace(model, block_size=args.block_size)
    bench, layer_impl = "", getattr(args, "layer_impl", "auto")
    if getattr(args, "trainer", "realrun") == "torchtitan":  # library callers may omit it
        from sparsebalance.errors import check

        check(args.tp == 1 and args.cp == 1, "--trainer", "torchtitan profiles are measured at tp 1, cp 1")
        check(layer_impl != "compiled", "--layer-impl", "torchtitan's block is timed eager (auto or eager; "
              "compile it through torchtitan's own compile option)")
        layer_impl = "eager"
        from sparsebalance.titan.profile import BENCH

        model, bench = replace(model, qkv_bias=False), BENCH  # Qwen3's projections have no bias
    from sparsebalance.kernels.measure import tp_shard

    tp_shard(model, args.tp)  # a --tp that does not divide the model is refused before any work
    import torch

    from sparsebalance.kernels.profiler import ProfileGrid

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device: cuda requested but torch sees no CUDA device")
    kw = {k: _ints(getattr(args, k), "--" + k.replace("_", "-"))
          for k in ("seq_lens", "budgets", "tokens", "params") if getattr(args, k) is not None}
    for k, vals in kw.items():  # the profile format interpolates: one point per axis is too few
        if len(set(vals)) < 2 or min(vals) < 1:
            raise ConfigError(f"--{k.replace('_', '-')}: needs >= 2 distinct integers >= 1 "
                              f"(the latency model interpolates between them), got {text_of(vals)}")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    grid = ProfileGrid(repeats=args.repeats, warmup=args.warmup, threads=args.threads,
                       statistic=args.statistic, tp_plan=args.tp > 1, cp=args.cp, cp_layout=args.cp_layout,
                       device=args.device, dtype=dtype, layer_impl=layer_impl, bench=bench, **kw)
    from sparsebalance.commands._profile_memory import check_memory

    check_memory(tp_shard(model, args.tp), grid, args.concurrency)  # before a tensor is allocated
    # before measuring: a bad --out must not cost the measurement
    out_dir = resolve_out(args.out, args.out, force=args.force, verb="profile",
                          ours=lambda p: {c.name for c in p.iterdir()} <= {"profile.csv", "profile.json"})
    from sparsebalance.commands._hostload import judged_window
    from sparsebalance.kernels.measure import measure_profile

    command = "sparsebalance profile " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else [])
    lines: list[str] = []
    cores = args.concurrency * args.threads  # what the copies run on; the judge caps it at the host's
    with judged_window("the measurement", cores=cores, emit=lines.append) as load:
        prof = measure_profile(model, grid, tp=args.tp, concurrency=args.concurrency, command=command,
                               progress=progress_enabled(args))
    judged = args.device == "cpu"  # a GPU's timings are the device's; the host's load is not judged there
    if judged:
        prof = replace(prof, meta=replace(prof.meta, host={**load.record(), "run_cores": cores,
                                                            **load.verdict.to_dict()}))
    out = prof.save(out_dir)
    print(f"wrote {out}/profile.csv ({len(prof.table)} rows) and profile.json"
          + (f" -- {load.verdict.tag()}: re-measure on a quiet machine" if judged and load.verdict.disturbed
             else ""))
    if judged:
        print(lines[0])
    from sparsebalance.simulator.cost.profile import monotone_violations

    bad = monotone_violations(prof, model.block_size)
    if bad:  # kept (the measurement is not lost) but said: runs refuse it until accepted
        print(f"sparsebalance profile: warning: latency falls as work grows at {len(bad)} point(s): "
              f"{'; '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}. Runs refuse this profile unless "
              "--allow-nonmonotone or a \"nonmonotone\" note in profile.json says why; re-measuring "
              "with more --repeats usually helps", file=sys.stderr)
    return 0
