"""``torchrun --nproc-per-node N -m sparsebalance.realrun --config RUN.toml``: one process per
(DP replica, stage, TP rank); N = cluster.pp x cluster.dp x cluster.tp. Global rank
r = (dp_rank x pp + stage) x tp + tp_rank (``config.rank_layout``).

Rank 0 loads data, latency model and policies, runs ``sparsebalance.loop.run_loop`` with a
RealrunExecutor and writes ``<output_dir>/<name>/``; the other ranks follow its broadcast plans.
A bad config is one line and exit code 2 (``ConfigError``, before any collective), and so is a training
loss that turns NaN or infinite (rank 0 stops at that iteration, releases the others and writes the
iterations before it). A failing rank
prints one line naming itself and the error, then exits 1; torchrun then stops the other workers, and collectives are bounded by ``realrun.timeout_s`` where no launcher does.
"""

from __future__ import annotations

import argparse
import os
import sys


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
                   help="at the end, each rank saves its stage's weights (HF names, whole tensors) to "
                        "DIR/rank<r>.pt")
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

    from sparsebalance.loop import NonFiniteLoss, global_batches, run_loop
    from sparsebalance.realrun.runtime import RealrunExecutor

    cfg = rt.cfg
    executor = RealrunExecutor(rt, prepared.ctx.coverage)
    batches = global_batches(prepared.sequences, cfg.cluster.global_batch, shuffle=cfg.data.shuffle,
                             rng=np.random.default_rng(cfg.data.seed))
    try:
        result = run_loop(batches=batches, batching=prepared.batching, tuning=prepared.tuning,
                          executor=executor, ctx=prepared.ctx, iterations=cfg.iterations,
                          progress=progress)
    except NonFiniteLoss as e:
        # a diverged loss is found after the gather: every follower waits for the next plan, so it
        # can be released cleanly, and the iterations before it are written (the launcher marks
        # the directory incomplete)
        executor.close()
        if e.partial is not None and len(e.partial.metrics):
            _write(rt, e.partial, executor, output_dir)
        raise
    executor.close()  # not on other failures: followers are then blocked elsewhere; the exit frees them
    return result, _write(rt, result, executor, output_dir)


def _write(rt, result, executor, output_dir: str | None):
    """The run's files (``realrun/results.py``) and the coverage curves measured so far."""
    import json

    from sparsebalance.realrun.results import write_realrun_results

    out = write_realrun_results(rt.cfg, result, output_dir)
    (out / "measured_coverage.json").write_text(json.dumps(
        {"layer": rt.rr.coverage_layer, "curves": {str(k): v for k, v in executor.measured_coverage.items()}}))
    return out


def main(argv: list[str] | None = None) -> int:
    from sparsebalance.realrun.launch import worker_done, worker_info, worker_started

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
        c = cfg.cluster
        d, s, t = rank_layout(rank, c.pp, c.cp if c.cp > 1 else c.tp)
        lane = f", cp_rank {t})" if c.cp > 1 else (f", tp_rank {t})" if c.tp > 1 else ")")
        where = f"rank {rank} (dp_rank {d}, stage {s}" + lane
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
            torch.save(rt.worker.global_state_dict(),
                       pathlib.Path(args.dump_state) / f"rank{rt.rank}.pt")
        import torch.distributed as dist

        dist.destroy_process_group()
        worker_done()
        return 0
    except BaseException as e:
        if isinstance(e, SystemExit) and not e.code:
            raise
        from sparsebalance.realrun.launch import worker_exit

        worker_exit(e, where)


if __name__ == "__main__":
    sys.exit(main())
