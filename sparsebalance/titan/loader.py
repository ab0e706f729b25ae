"""The data loader: the plan's micro-batches, in the order torchtitan's trainer consumes them.

Each step, every DP rank draws the same global batch of documents (seeded, no collective), runs the
same batching and tuning policies on it (``runner.prepare``: SAB, DST, ... with the run's latency
model), so every rank holds the same plan, and yields its own rank's micro-batches, micro-batch 0
first: the trainer takes them in that order into its gradient-accumulation steps and pipeline
micro-batches. A micro-batch is one packed row:

* ``input`` / labels: the documents' token ids side by side, then the pad document (fixed slots);
  labels are the next token inside a document, ``IGNORE_INDEX`` at each document's last token and
  over the whole pad document;
* ``positions``: restarting at 0 for each document (and for the pad document);
* ``moba_cu_seqlens`` (int32 [documents + 1]) and ``moba_topk`` (int64 [layers, documents]): the real
  documents' boundaries and the plan's budget of this micro-batch, per layer and per document, which
  the trainer turns into the attention metadata every stage's MoBA reads.

``state_dict`` holds the steps planned, the position inside the current step's plan, and the policy
state and RNG from *before* that plan, so a restart re-plans the current step exactly and resumes at
the next micro-batch.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np

from sparsebalance.titan.compat import import_torchtitan

import_torchtitan()

import torch
import tyro
from torchtitan.components.dataloader import BaseDataLoader

from sparsebalance.kernels.qwen2 import IGNORE_INDEX, pack
from sparsebalance.simulator.plan import Budgets, MicroBatch, Plan
from sparsebalance.titan.setup import TitanSetup


class StepPlanner:
    """The plan and budgets of each step, the same on every DP rank (``runner.prepare``'s policies)."""

    def __init__(self, setup: TitanSetup) -> None:
        from sparsebalance.runner import prepare

        self.setup = setup
        self.prepared = prepare(setup.run)
        self.steps = 0
        """Global batches drawn (= plans made) so far."""
        self._batches = self._batch_iter()

    def _batch_iter(self):
        from sparsebalance.loop import global_batches

        run = self.setup.run
        return global_batches(self.prepared.sequences, run.cluster.global_batch, shuffle=run.data.shuffle,
                              rng=np.random.default_rng(run.data.seed))

    def policy_state(self) -> dict[str, Any]:
        """What the policies carry from step to step (SAB's EMA of budgets, the context's RNG)."""
        p = self.prepared
        return {"ema": dict(getattr(p.batching, "ema", {})), "rng": p.ctx.rng.bit_generator.state}

    def set_policy_state(self, state: dict[str, Any]) -> None:
        p = self.prepared
        if hasattr(p.batching, "ema"):
            p.batching.ema = dict(state["ema"])
        p.ctx.rng.bit_generator.state = state["rng"]

    def next(self) -> tuple[Plan, Budgets]:
        """The next step's plan and budgets; the policies learn from them at once (SAB's EMA reads
        only the budgets it was given, so this equals learning after the step ran)."""
        p = self.prepared
        batch = next(self._batches)
        plan = p.batching.plan(batch, p.ctx)
        budgets = p.tuning.budgets(plan, p.ctx)
        p.batching.observe(plan, budgets, None)
        p.tuning.observe(plan, budgets, None)
        self.steps += 1
        return plan, budgets

    def skip_to(self, steps: int) -> None:
        """Restart the document draw and skip ``steps`` global batches (no planning)."""
        self._batches = self._batch_iter()
        for _ in range(steps):
            next(self._batches)
        self.steps = steps


def microbatch_tensors(mb: MicroBatch, budget, layers: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(input_dict, labels)`` of one micro-batch (see the module docstring); leading batch dim 1."""
    row = pack([np.asarray(s.tokens, dtype=np.int64) for s in mb.sequences])
    ids, labels, pos, cu = row.input_ids, row.labels, row.position_ids, row.cu_seqlens
    if mb.pad:
        ids = torch.cat([ids, torch.zeros((1, mb.pad), dtype=ids.dtype)], dim=1)
        labels = torch.cat([labels, torch.full((1, mb.pad), IGNORE_INDEX, dtype=labels.dtype)], dim=1)
        pos = torch.cat([pos, torch.arange(mb.pad, dtype=pos.dtype)[None]], dim=1)
    ks = torch.tensor(budget.expand(layers), dtype=torch.int64)
    topk = ks[:, None].expand(layers, len(mb.sequences)).contiguous()
    return {"input": ids, "positions": pos, "moba_cu_seqlens": cu[None], "moba_topk": topk[None]}, labels


class SparseBalanceLoader(BaseDataLoader):
    """SparseBalance's plan as a torchtitan data loader (stateful: resumable at any micro-batch)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        run_config: str = "titan-cpu"
        """SparseBalance run config: a shipped preset (sparsebalance/data/presets/NAME.toml) or a TOML
        path; its [data], [policy], profile, seed, cluster.global_batch (documents per step) and network
        constants. The model, mesh, schedule and slot come from the torchtitan job."""
        setup: Annotated[Any, tyro.conf.Suppress] = None
        """The resolved :class:`TitanSetup` (filled by SparseBalanceTrainer.Config)."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any = None,
                 seq_len: int = 0, local_batch_size: int = 1, snapshot_every_n_steps: int | None = None):
        setup = config.setup
        if setup is None:
            raise ValueError("SparseBalanceLoader needs SparseBalanceTrainer (it resolves the setup)")
        if setup.run.cluster.dp != dp_world_size:
            raise ValueError(f"SparseBalanceLoader: setup for dp = {setup.run.cluster.dp}, trainer has "
                             f"{dp_world_size}")
        self.setup = setup
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.planner = StepPlanner(setup)
        self.layers = setup.run.model.layers
        self._state_before: dict[str, Any] = self.planner.policy_state()
        self._current: tuple[Plan, Budgets] | None = None
        self._pos = 0
        self.plans: list[tuple[Plan, Budgets]] = []
        """Every step's plan and budgets, in order (what a prediction of this run replays)."""

    def _advance(self) -> None:
        self._state_before = self.planner.policy_state()
        self._current = self.planner.next()
        self.plans.append(self._current)
        self._pos = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            if self._current is None or self._pos == self.setup.microbatches:
                self._advance()
            plan, budgets = self._current
            j = self._pos
            self._pos += 1
            yield microbatch_tensors(plan.ranks[self.dp_rank][j], budgets[self.dp_rank][j], self.layers)

    def state_dict(self) -> dict[str, Any]:
        state = {"steps": self.planner.steps, "pos": self._pos, "policy": self._state_before,
                 "planned": self._current is not None}
        # keyed by DP rank as torchtitan's own loaders do (every rank's checkpoint holds its own)
        return {f"dp_rank_{self.dp_rank}": pickle.dumps(state), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        key = f"dp_rank_{self.dp_rank}"
        if key not in state_dict or state_dict["world_size"] != self.dp_world_size:
            raise ValueError(f"SparseBalanceLoader: the checkpoint holds no state for {key} at dp = "
                             f"{self.dp_world_size}")
        state = pickle.loads(state_dict[key])
        if not state["planned"]:
            return
        self.planner.skip_to(state["steps"] - 1)
        self.planner.set_policy_state(state["policy"])
        self.plans = []
        self._advance()  # the current step's plan again, from the state before it
        self._pos = state["pos"]
