"""A short subclass of torchtitan's ``Trainer`` that routes the plan's budgets into the attention.

What it changes, and nothing else:

* ``__init__`` resolves the SparseBalance side of the job (:func:`setup.resolve`: model, mesh,
  slots, policies) and hands it to the loader before torchtitan builds it.
* ``post_dataloading_process`` turns the loader's ``moba_cu_seqlens`` / ``moba_topk`` into the
  micro-batch's :class:`~sparsebalance.titan.attention.MobaMetadata` (its ``attention_masks``), which
  torchtitan forwards with the micro-batch's other keyword arguments, to every pipeline stage.
* ``pp_forward_backward_step`` runs the already split micro-batches through the schedule with
  :func:`compat.step_microbatches` (torch 2.13's ``step`` cannot take them as they are).
* On a CPU, each worker is pinned to its own core with glibc's freed memory kept (realrun's and the
  profiler's hygiene, ``kernels/cpuclock.py``).
* With ``sparsebalance.measure``, a measured trace in the simulator's schema: each step starts after
  a barrier; every F and B of a (stage, micro-batch) is timed by wrapping the stage's
  ``forward_one_chunk`` / ``backward_one_chunk`` (without PP: the model's forward, then the loss
  and its backward, around torchtitan's ``fwd_bwd_fn``), and the optimizer step is an OPTIM row.
  Each rank writes ``trace_rank<R>.csv`` to the dump folder; rank 0 writes ``losses.json`` (the
  global token-mean loss of every step).

torchtitan's public methods and attributes only (``post_dataloading_process``,
``pp_forward_backward_step``, ``fwd_bwd_fn``, a PipelineStage's ``forward_one_chunk``); what is private
lives in :mod:`sparsebalance.titan.compat`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparsebalance.titan.compat import gloo_fsdp, import_torchtitan, schedule_stages, step_microbatches

import_torchtitan()

import torch
import torch.distributed as dist
from torchtitan.trainer import Trainer

from sparsebalance.titan.attention import BUDGET_LOG, moba_metadata

TRACE_COLUMNS = ("iteration", "dp_rank", "stage", "microbatch", "op", "start_s", "end_s", "tokens", "budget")


@dataclass(kw_only=True, slots=True)
class SparseBalanceOptions:
    measure: bool = False
    """Write a measured trace (``trace_rank<R>.csv``) to the dump folder."""
    record_budgets: bool = False
    """Write what every MoBA layer ran at, per (step, stage, micro-batch) (``budgets_rank<R>.json``)."""


class SparseBalanceTrainer(Trainer):
    """torchtitan's trainer with SparseBalance's plan and budgets (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        sparsebalance: SparseBalanceOptions = field(default_factory=SparseBalanceOptions)

    def __init__(self, config: Config) -> None:
        from sparsebalance.titan.compat import accelerator_available
        from sparsebalance.titan.setup import resolve

        if not accelerator_available():  # CPU measurement hygiene, as realrun's workers and the profiler
            import os

            from sparsebalance.kernels.cpuclock import pin_to_core, steady_allocator

            pin_to_core(int(os.environ.get("LOCAL_RANK", "0")))
            steady_allocator()

        # the job as parsed (command-line overrides included), on this world: what the loader plans
        config.dataloader.setup = resolve(config, check_data=False)
        super().__init__(config)
        gloo_fsdp(self.model_parts)
        self.sb_losses: list[float] = []
        self.sb_rows: list[dict] = []
        self._step_losses: list[torch.Tensor] = []
        self._t0 = 0.0
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._measure = config.sparsebalance.measure
        self._dp_rank = self.dataloader.dp_rank
        self._pp_rank = self.parallel_dims.get_mesh("pp").get_local_rank() if self.parallel_dims.pp_enabled else 0
        self._mb_info: list[tuple[int, float]] = []
        self._record = config.sparsebalance.record_budgets
        if self._record:
            BUDGET_LOG.rows = []
        if self.parallel_dims.pp_enabled:
            if self._measure or self._record:
                for stage in schedule_stages(self.pp_schedule):
                    self._time_stage(stage)
        else:
            self._time_body()
        if self._measure:
            step = self.optimizers.step

            def timed_step(*a, **k):
                t = time.perf_counter()
                out = step(*a, **k)
                self._row(-1, "OPTIM", t, stage=self._pp_rank)
                return out

            self.optimizers.step = timed_step

    # -- budgets into the attention ---------------------------------------------------------------
    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor):
        cu = input_dict.pop("moba_cu_seqlens")
        topk = input_dict.pop("moba_topk")
        positions = input_dict.pop("positions")  # torchtitan would build varlen metadata from them
        inputs, labels, extra = super().post_dataloading_process(input_dict, labels)
        extra["positions"] = positions
        extra["attention_masks"] = moba_metadata(cu, topk)
        self._mb_info.append((int(labels.shape[-1]), float(topk.float().mean())))
        return inputs, labels, extra

    def pp_forward_backward_step(self, *, input_dict_mbs, label_mbs, global_valid_tokens):
        arg_mbs, kwarg_mbs = [], []
        target_mbs: list | None = [] if self.pp_has_last_stage else None
        for input_dict, labels in zip(input_dict_mbs, label_mbs, strict=True):
            inputs, labels, extra = self.post_dataloading_process(input_dict, labels)
            if self.pp_has_first_stage:
                arg_mbs.append((inputs,))
            kwarg_mbs.append(extra)
            if target_mbs is not None:
                target_mbs.append(labels)
        losses: list | None = [] if self.pp_has_last_stage else None
        with self.train_context():
            step_microbatches(self.pp_schedule, arg_mbs=arg_mbs if self.pp_has_first_stage else None,
                              kwarg_mbs=kwarg_mbs, target_mbs=target_mbs, losses=losses,
                              loss_kwargs={"global_valid_tokens": global_valid_tokens})
        if losses is not None:
            loss = torch.sum(torch.stack(losses)).to(self.device)
            self._step_losses.append(loss.detach())
            return loss
        return torch.tensor([-1.0], device=self.device)

    # -- one step, measured -----------------------------------------------------------------------
    def train_step(self, data_iterator) -> None:
        self._step_losses, self._mb_info = [], []
        if self._measure:
            dist.barrier()
            self._t0 = time.perf_counter()
        super().train_step(data_iterator)
        if self._measure:  # collections between steps only (torchtitan's gc_freq collects at a step's start)
            import gc

            gc.collect()
        local = torch.stack(self._step_losses).sum() if self._step_losses else torch.zeros(())
        total = local.detach().to(torch.float64).cpu()
        if dist.is_initialized():  # non-last stages add 0; DP ranks add their shares
            dist.all_reduce(total)
        self.sb_losses.append(float(total))

    def _time_body(self) -> None:
        """Without PP: wrap torchtitan's forward-backward of one micro-batch (``fwd_bwd_fn``) to tag
        the budget log, keep the loss and, when measuring, time F (the model's forward, ended by a
        forward hook) and B (the loss and its backward)."""
        body, marks = self.fwd_bwd_fn, {}

        def forward_done(*_: Any) -> None:
            marks["F"] = time.perf_counter()

        self.model_parts[0].register_forward_hook(forward_done)

        def fwd_bwd(inputs, labels, global_valid_tokens, extra_kwargs):
            j = len(self._mb_info) - 1
            BUDGET_LOG.context = {"step": self.step, "stage": 0, "microbatch": j}
            t = time.perf_counter()
            loss = body(inputs, labels, global_valid_tokens, extra_kwargs)
            if self._measure:
                self._row(j, "F", t, end=marks["F"])
                self._row(j, "B", marks["F"])
            self._step_losses.append(loss.detach())
            return loss

        self.fwd_bwd_fn = fwd_bwd

    def _time_stage(self, stage: Any) -> None:
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

        def forward_one_chunk(fwd_chunk_id, *a, **k):
            BUDGET_LOG.context = {"step": self.step, "stage": stage.stage_index, "microbatch": fwd_chunk_id}
            t = time.perf_counter()
            out = fwd(fwd_chunk_id, *a, **k)
            self._row(fwd_chunk_id, "F", t, stage=stage.stage_index)
            return out

        def backward_one_chunk(bwd_chunk_id, *a, **k):
            t = time.perf_counter()
            out = bwd(bwd_chunk_id, *a, **k)
            self._row(bwd_chunk_id, "B", t, stage=stage.stage_index)
            return out

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk

    def _row(self, mb: int, op: str, start: float, *, stage: int = 0, end: float | None = None) -> None:
        end = time.perf_counter() if end is None else end
        if not self._measure:
            return
        tokens, budget = self._mb_info[mb] if 0 <= mb < len(self._mb_info) else (0, float("nan"))
        self.sb_rows.append({"iteration": self.step - 1, "dp_rank": self._dp_rank, "stage": stage,
                             "microbatch": mb, "op": op, "start_s": start - self._t0,
                             "end_s": end - self._t0, "tokens": tokens, "budget": budget})

    def close(self) -> None:
        if self._measure and self.sb_rows:
            import pandas as pd

            out = Path(self.config.dump_folder)
            out.mkdir(parents=True, exist_ok=True)
            pd.DataFrame(self.sb_rows, columns=list(TRACE_COLUMNS)).to_csv(
                out / f"trace_rank{self._rank}.csv", index=False)
        if self._record and BUDGET_LOG.rows:
            out = Path(self.config.dump_folder)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"budgets_rank{self._rank}.json").write_text(json.dumps(BUDGET_LOG.rows))
        if self._rank == 0 and self.sb_losses:
            out = Path(self.config.dump_folder)
            out.mkdir(parents=True, exist_ok=True)
            (out / "losses.json").write_text(json.dumps(
                {"first_step": self.step - len(self.sb_losses) + 1, "losses": self.sb_losses}))
        super().close()
