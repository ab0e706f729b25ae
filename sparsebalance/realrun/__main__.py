"""``torchrun --nproc-per-node N -m sparsebalance.realrun --config RUN.toml``: one process per
(DP replica, stage); N = cluster.pp x cluster.dp. Global rank r is (dp_rank = r // pp, stage = r % pp).

Rank 0 loads data, latency model and policies, runs ``sparsebalance.loop.run_loop`` with a
RealrunExecutor and writes ``<output_dir>/<name>/``; the other ranks follow its broadcast plans.
A failing rank prints one line naming itself and the error, then exits 1; torchrun then stops the
other workers, and collectives are bounded by ``realrun.timeout_s`` where no launcher does.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsebalance.realrun",
                                description="one worker of a PP x DP real run (start it with torchrun)")
    p.add_argument("--config", required=True, help="run config (TOML or JSON)")
    p.add_argument("--output-dir", default=None, help="write results here instead of <output_dir>/<name>/")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (dotted key, TOML value), e.g. --set iterations=3")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the summary stays)")
    p.add_argument("--dump-state", default=None, metavar="DIR",
                   help="at the end, each rank saves its stage's weights (HF names) to DIR/rank<r>.pt")
    return p


def parse_overrides(items: list[str]) -> dict:
    """``["a.b=3", "name=\\"x\\""]`` -> ``{"a.b": 3, "name": "x"}`` (values parsed as TOML)."""
    import tomllib

    from sparsebalance.errors import ConfigError

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set: expected KEY=VALUE, got {item!r}")
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = value  # a bare word is a string
    return out


def run_leader(rt, prepared, *, output_dir: str | None, progress: bool):
    """Rank 0: the shared iteration loop with the real executor; returns (LoopResult, directory)."""
    import numpy as np

    from sparsebalance.loop import global_batches, run_loop
    from sparsebalance.realrun.results import write_realrun_results
    from sparsebalance.realrun.runtime import RealrunExecutor

    cfg = rt.cfg
    executor = RealrunExecutor(rt, prepared.ctx.coverage)
    batches = global_batches(prepared.sequences, cfg.cluster.global_batch, shuffle=cfg.data.shuffle,
                             rng=np.random.default_rng(cfg.data.seed))
    result = run_loop(batches=batches, batching=prepared.batching, tuning=prepared.tuning,
                      executor=executor, ctx=prepared.ctx, iterations=cfg.iterations, progress=progress)
    executor.close()  # not on failure: followers are then blocked elsewhere; the exit frees them
    out = write_realrun_results(cfg, result, output_dir)
    import json

    (out / "measured_coverage.json").write_text(json.dumps(
        {"layer": rt.rr.coverage_layer, "curves": {str(k): v for k, v in executor.measured_coverage.items()}}))
    return result, out


def main(argv: list[str] | None = None) -> int:
    from sparsebalance.realrun.launch import worker_done, worker_failed, worker_info, worker_started

    args = _parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    # first, before torch starts threads: status file, die with torchrun, SIGTERM recorded as a stop
    worker_started(rank)
    where = f"rank {rank}"
    try:
        from sparsebalance.realrun.config import rank_layout, realrun_config
        from sparsebalance.runconfig import load_run_config

        cfg = load_run_config(args.config, parse_overrides(args.set))
        rr = realrun_config(cfg)
        d, s = rank_layout(rank, cfg.cluster.pp)
        where = f"rank {rank} (dp_rank {d}, stage {s})"
        worker_info(dp_rank=d, stage=s)
        prepared = None
        if rank == 0:  # data, latency model, policies: fail here, before any collective
            from sparsebalance.runner import prepare

            prepared = prepare(cfg)
        from sparsebalance.realrun.runtime import follower_loop, init_runtime

        rt = init_runtime(cfg, rr)
        if rt.rank == 0:
            import contextlib

            # launched by sparsebalance (status dir set): stdout is the console, stderr the log
            to_console = (contextlib.redirect_stderr(sys.stdout) if os.environ.get("SPARSEBALANCE_RANK_DIR")
                          else contextlib.nullcontext())
            with to_console:
                result, out = run_leader(rt, prepared, output_dir=args.output_dir,
                                         progress=not (args.quiet or args.no_progress))
            if not args.quiet:
                m = result.metrics
                print(f"realrun: {len(m)} iterations, loss {m['loss'].iloc[0]:.4f} -> "
                      f"{m['loss'].iloc[-1]:.4f}, mean iteration {m['iteration_time_s'].mean():.3f} s; "
                      f"results in {out}", flush=True)
        else:
            follower_loop(rt)
        if args.dump_state:
            import pathlib

            import torch

            pathlib.Path(args.dump_state).mkdir(parents=True, exist_ok=True)
            torch.save(rt.worker.module.global_state_dict(),
                       pathlib.Path(args.dump_state) / f"rank{rt.rank}.pt")
        import torch.distributed as dist

        dist.destroy_process_group()
        worker_done()
        return 0
    except BaseException as e:
        if isinstance(e, SystemExit) and not e.code:
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        worker_failed(f"{type(e).__name__}: {first}", traceback.format_exc())
        print(f"realrun: {where} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if os.environ.get("SPARSEBALANCE_TRACEBACK"):
            traceback.print_exc()
        sys.stderr.flush()
        # os._exit: a process group with pending sends/receives can block a normal interpreter exit
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
