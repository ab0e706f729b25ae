"""One seed of the measured accuracy experiment on the real run's PP x DP workers (torchrun program).

``python -m torch.distributed.run --nproc-per-node 2 -m sparsebalance.accuracy.pipeline --config
SPEC.json --output-dir DIR`` (started by ``sparsebalance accuracy`` through ``realrun.launch``; the
spec is written by ``commands/accuracy.py``). Every rank builds its pipeline stage from the
checkpoint (exported as a Hugging Face directory) with realrun's ``init_runtime``; then:

* **arms** (``measured.arms``): each keeps its own copy of every rank's weights and its own AdamW
  state. Before an arm's iteration rank 0 broadcasts ``("arm", index, lr)`` and every rank swaps that
  arm's weights and optimizer in (a copy of the stage's tensors, outside the timed iteration);
* **iterations**: rank 0 runs ``loop.run_loop`` one iteration at a time per arm, with the arm's own
  policies, coverage model and data iterator (the same seeded order for every arm) and
  realrun's :class:`~sparsebalance.realrun.runtime.RealrunExecutor`: the iteration is measured
  exactly as ``sparsebalance train`` measures it. Beside it the simulator replays the same plan and
  budgets on the profile (the simulated time). Iteration ``i`` of every arm runs (in a seeded
  order) before iteration ``i + 1`` of any, so the machine's drift falls on all arms alike;
* **held-out accuracy**: ``("eval", index)``: every rank swaps the arm in, the stages' weights are
  gathered into a whole model on every rank, each rank scores its share of the held-out examples
  per bucket with MoBA at ``k0`` and rank 0 sums the counts.

Rank 0 writes ``iterations.jsonl`` (one row per arm x iteration, as it finishes),
``plans/<arm>.json`` (its plans and budgets, realrun's ``plans.json`` format) and ``heldout.jsonl``
(one row per arm x bucket) under the output directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsebalance.accuracy.pipeline")
    p.add_argument("--config", required=True, help="the seed's spec (JSON, written by `sparsebalance accuracy`)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    from sparsebalance.realrun.launch import worker_done, worker_started

    args = _parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    worker_started(rank)
    try:
        from sparsebalance.accuracy.arms import ArmState, Evaluator, Handler
        from sparsebalance.accuracy.lead import lead, setup

        spec = json.loads(Path(args.config).read_text())
        rt, ckpt, cfg = setup(spec)
        state = ArmState(rt.worker, len(spec["arms"]))
        handler = Handler(state, Evaluator(rt, ckpt, list(cfg.buckets), cfg.heldout, cfg.k0))
        if rt.rank == 0:
            lead(rt, spec, cfg, ckpt, handler, Path(args.output_dir), progress=not (args.quiet or args.no_progress))
        else:
            from sparsebalance.realrun.runtime import follower_loop

            follower_loop(rt, handler)
        import torch.distributed as dist

        dist.destroy_process_group()
        worker_done()
        return 0
    except BaseException as e:
        if isinstance(e, SystemExit) and not e.code:
            raise
        from sparsebalance.realrun.launch import worker_exit

        worker_exit(e, f"rank {rank}", what="accuracy pipeline")


if __name__ == "__main__":
    sys.exit(main())
