"""What every rank of the measured accuracy experiment holds per arm (``accuracy/pipeline.py`` starts
the workers, ``accuracy/lead.py`` drives rank 0): each arm's weights and optimizer state
(:class:`ArmState`), held-out scoring (:class:`Evaluator`), the control messages rank 0 broadcasts
(:class:`Handler`) and the executor that runs an arm's iteration (:class:`ArmExecutor`)."""

from __future__ import annotations

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
