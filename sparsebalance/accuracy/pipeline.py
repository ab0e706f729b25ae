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
from typing import Any


class ArmState:
    """Every rank: each arm's copy of this rank's weights and its optimizer; which arm is loaded."""

    def __init__(self, worker: Any, n_arms: int) -> None:
        import torch

        self.worker = worker
        self.weights = [[p.detach().clone() for p in worker.params] for _ in range(n_arms)]
        self.opts = [torch.optim.AdamW(worker.params, lr=worker.rr.lr, betas=(0.9, 0.98), weight_decay=0.0)
                     for _ in range(n_arms)]
        self.current: int | None = None

    def select(self, arm: int, lr: float | None = None) -> None:
        import torch

        with torch.no_grad():
            if self.current is not None and self.current != arm:
                for keep, p in zip(self.weights[self.current], self.worker.params, strict=True):
                    keep.copy_(p)
            if self.current != arm:
                for keep, p in zip(self.weights[arm], self.worker.params, strict=True):
                    p.copy_(keep)
        self.current = arm
        self.worker.opt = self.opts[arm]
        if lr is not None:
            for g in self.opts[arm].param_groups:
                g["lr"] = lr


class Evaluator:
    """Every rank: the whole model (weights gathered from the stages) scored on this rank's share of
    the held-out examples, per bucket."""

    def __init__(self, rt: Any, ckpt: Any, buckets: list[int], heldout: int, k0: int) -> None:
        from sparsebalance.accuracy.model import build
        from sparsebalance.data.recall import RecallTask

        self.rt, self.k0, self.block = rt, k0, ckpt.net.dims.block_size
        self.model = build(ckpt.net)
        task = RecallTask(ckpt.task)
        self.share = {b: task.heldout(b, heldout)[rt.rank::rt.world] for b in buckets}

    def __call__(self) -> list | None:
        """Per bucket (right, total) of this rank's share; the list of every rank's on rank 0."""
        import torch.distributed as dist

        from sparsebalance.accuracy.executor import count_right
        from sparsebalance.realrun.runtime import gather_control

        parts: list = [None] * self.rt.world
        dist.all_gather_object(parts, self.rt.worker.global_state_dict(), group=self.rt.groups["control"])
        state = {k: v for part in parts for k, v in part.items()}
        self.model.load_state_dict(state)
        counts = {b: count_right(self.model, ex, self.k0, self.block) for b, ex in self.share.items()}
        return gather_control(self.rt, counts)


class Handler:
    """The non-iteration messages, on every rank (rank 0 calls it after broadcasting)."""

    def __init__(self, state: ArmState, evaluator: Evaluator) -> None:
        self.state, self.evaluator = state, evaluator
        self.last: list | None = None

    def __call__(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "arm":
            self.state.select(msg[1], msg[2])
        elif kind == "eval":
            self.state.select(msg[1])
            self.last = self.evaluator()
        else:
            raise RuntimeError(f"accuracy pipeline: unknown control message {kind!r}")


class ArmExecutor:
    """Rank 0: one arm's executor: switches every rank to the arm, runs the iteration on realrun and
    replays it on the simulator (``extra["predicted_s"]``)."""

    name = "realrun"

    def __init__(self, index: int, control: Any, real: Any, sim: Any, lr_at: Any) -> None:
        self.index, self.control, self.real, self.sim, self.lr_at = index, control, real, sim, lr_at
        self.count = 0

    def execute(self, iteration: int, plan: Any, budgets: Any):
        self.control(("arm", self.index, self.lr_at(self.count)))
        res = self.real.execute(self.count, plan, budgets)
        res.extra = {**res.extra, "predicted_s": self.sim.execute(self.count, plan, budgets).iteration_time_s}
        self.count += 1
        return res


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
