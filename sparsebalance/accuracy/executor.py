"""Training and evaluating the recall model: the ``loop.Executor`` of the accuracy experiment.

:class:`TrainExecutor` is a real run on one process: ``execute(plan, budgets)`` trains the tiny model
on every micro-batch of the plan with *its* budget (gradient accumulation over the micro-batches, one
optimizer step per global batch: the gradient of a DP x PP run of the same plan, summed in another
order), measures real gate coverage of every sequence at ``coverage_layer`` (after the step, as
realrun does) and reports the iteration as the simulator predicts it on the virtual cluster the
policies plan for. ``loop.run_loop`` drives it with the same policy objects as the simulator and
realrun, so budgets are chosen exactly as in a real run.

**Scale.** The tiny model's block is 32 tokens; the virtual cluster's model (Qwen2.5-3B, analytical
H200) has 256. A recall example of ``L`` tokens is planned as a sequence of ``L * scale`` tokens
(``scale = 256 / 32 = 8``): the block count ``n`` and so budgets (in blocks) and coverage curves
(``C(1..n)``) carry over unchanged between the two.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from sparsebalance.data.recall import TRAIN, Example, RecallTask
from sparsebalance.simulator.plan import Budget, Budgets, Plan


def pack_answers(examples: list[Example]) -> Any:
    """A packed micro-batch whose labels are the answers only (loss and accuracy count nothing else)."""
    from sparsebalance.kernels.qwen2 import pack

    return pack([e.tokens for e in examples], labels=[e.labels for e in examples])


def token_batches(examples: list[Example], max_tokens: int) -> Iterator[Any]:
    """``examples`` in order, packed (:func:`pack_answers`) into runs of at most ``max_tokens``
    tokens each (an example longer than that alone)."""
    i = 0
    while i < len(examples):
        j, toks = i, 0
        while j < len(examples) and (j == i or toks + len(examples[j].tokens) <= max_tokens):
            toks += len(examples[j].tokens)
            j += 1
        yield pack_answers(examples[i:j])
        i = j


def forward(model: Any, batch: Any, budget: Budget | int, block_size: int, coverage_layer: int | None = None):
    """Logits ``[T, vocab]`` and the MobaArgs (holding the coverage layer's q/k when asked)."""
    from sparsebalance.kernels.qwen2 import MobaArgs, run_layers

    moba = MobaArgs(cu_seqlens=batch.cu_seqlens, budget=Budget.of(budget), block_size=block_size,
                    coverage_layer=coverage_layer)
    h = run_layers(model, model.model.embed_tokens(batch.input_ids), batch, moba)
    return model.lm_head(model.model.norm(h))[0], moba


def evaluate(model: Any, examples: list[Example], k: int, block_size: int,
             tokens_per_batch: int = 8192) -> float:
    """Share of answers predicted exactly (argmax) with MoBA at budget ``k`` in every layer."""
    right, total = count_right(model, examples, k, block_size, tokens_per_batch)
    return right / max(total, 1)


def count_right(model: Any, examples: list[Example], k: int, block_size: int,
                tokens_per_batch: int = 8192) -> tuple[int, int]:
    """(answers predicted exactly (argmax), answers) with MoBA at budget ``k`` in every layer;
    examples packed up to ``tokens_per_batch`` tokens per forward."""
    import torch

    from sparsebalance.kernels.qwen2 import IGNORE_INDEX

    was = model.training
    model.eval()
    right = total = 0
    with torch.no_grad():
        for batch in token_batches(examples, tokens_per_batch):
            logits, _ = forward(model, batch, k, block_size)
            m = batch.labels[0] != IGNORE_INDEX
            right += int((logits[m].argmax(-1) == batch.labels[0][m]).sum())
            total += int(m.sum())
    model.train(was)
    return right, total


class TrainExecutor:
    """See the module docstring. ``sim`` is a ``SimulatorExecutor`` of the virtual cluster."""

    name = "accuracy"

    def __init__(self, model: Any, optimizer: Any, task: RecallTask, sim: Any, *, scale: int,
                 block_size: int, coverage_layer: int, clip: float = 1.0, step_hook: Any = None) -> None:
        self.model, self.opt, self.task, self.sim = model, optimizer, task, sim
        self.scale, self.block_size, self.coverage_layer, self.clip = scale, block_size, coverage_layer, clip
        self.step_hook = step_hook
        """Called after each optimizer step (a learning-rate scheduler's ``step``)."""
        self.cpu_time_s = 0.0
        """Process CPU time of the training steps so far (forward, backward, optimizer)."""

    def example(self, seq) -> Example:
        return self.task.example(TRAIN, seq.id, seq.length // self.scale)

    def execute(self, iteration: int, plan: Plan, budgets: Budgets):
        import torch

        from sparsebalance.kernels.qwen2 import lm_loss_sum
        from sparsebalance.loop import check_loss

        t0 = time.process_time()
        mbs = list(plan.microbatches())
        exs = {s.id: self.example(s) for _, _, mb in mbs for s in mb.sequences}
        answers = sum(len(e.positions) for e in exs.values())
        self.opt.zero_grad(set_to_none=True)
        loss_sum, gated = 0.0, []
        for r, j, mb in mbs:
            batch = pack_answers([exs[s.id] for s in mb.sequences])
            logits, moba = forward(self.model, batch, budgets[r][j], self.block_size,
                                   self.coverage_layer)
            loss = lm_loss_sum(logits[None], batch.labels)
            value = float(loss.detach())
            # stop before the step: a NaN step would only poison the weights further
            check_loss(value, iteration, where=f" (dp_rank {r}, micro-batch {j})", hint="lower lr")
            (loss / answers).backward()
            loss_sum += value
            gated.append((mb.sequences, moba))
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        if self.step_hook is not None:
            self.step_hook()
        step_s = time.process_time() - t0
        self.cpu_time_s += step_s
        coverage = {}
        for seqs, moba in gated:  # measurement, after the step (as realrun)
            for s, curve in zip(seqs, moba.coverage_curves(), strict=True):
                coverage[s.id] = tuple(float(c) for c in curve)
        res = self.sim.execute(iteration, plan, budgets)
        res.coverage = coverage
        res.extra = {**res.extra, "loss": loss_sum / max(answers, 1), "cpu_time_s": step_s}
        return res
