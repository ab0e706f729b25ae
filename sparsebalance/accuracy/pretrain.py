"""``sparsebalance accuracy pretrain``: the base model every configuration continues from.

Curriculum (each phase a fresh stream of training examples, AdamW, linear warm-up then constant):

1. **dense warm-up on short examples** (``batch`` examples of ``min_length .. warmup_length``
   tokens per step, full attention) until held-out accuracy on the shortest bucket reaches ``target``
   (checked every ``eval_every`` steps), at most ``warmup_steps`` steps: associative recall is learnt
   where it is cheap; the circuit (previous-token head, then a head matching the key) does not
   depend on length (measured: the longer buckets rise with the short one);
2. **MoBA at k0 on the full length mix**, ``moba_steps`` steps of ``moba_batch`` examples, then more
   (at most ``extra_steps``) only while the shortest bucket is below ``target``: the gate learns to
   route queries to the block holding their key.

Given ``init`` (a checkpoint to continue, ``--init``), phase 1 is skipped: the weights are that
checkpoint's (its model config may change the RoPE base and the positions: the tensors are the same)
and phase 2 trains on this call's task; the record keeps the chain of the inits' records.

Then the coverage fit: real gate coverage of held-out examples at every layer (kernel code), the
parametric model fitted per layer (``policies.coverage.fit_rate``), and each layer's **budget
sensitivity** (held-out accuracy at the longest bucket with that layer alone cut to ``k0 / 4``, the
others at k0: which layer's routing the answers depend on). The layer DST watches follows
``coverage_layer_rule``: ``flattest`` (lowest coverage at k0: the most cautious floors) or
``sharpest`` (highest coverage at k0: the only layer under which DST may lower budgets when the
others' gates are flat); it and its rate go into ``checkpoint.json`` with the seed, the command, the
CPU and wall time and the load.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from sparsebalance.accuracy.executor import evaluate, forward, pack_answers, token_batches
from sparsebalance.accuracy.model import NetConfig, build, save
from sparsebalance.data.recall import TRAIN, RecallConfig, RecallTask
from sparsebalance.errors import check, check_choice, check_positive


@dataclass(kw_only=True, slots=True, frozen=True)
class PretrainConfig:
    """How the base model is trained (``accuracy pretrain`` flags)."""

    warmup_steps: int = 8000
    """Most steps of phase 1 (dense, short examples; stops at ``target``)."""
    warmup_length: int = 128
    """Longest example of phase 1."""
    moba_steps: int = 1500
    """Steps of phase 2 (MoBA at k0, full length mix)."""
    extra_steps: int = 1500
    """Most further phase-2 steps while the shortest bucket is below ``target``."""
    batch: int = 32
    """Examples per step of phase 1."""
    moba_batch: int = 16
    """Examples per step of phase 2 (the experiment's global batch)."""
    lr: float = 3e-3
    """AdamW learning rate (after a 100-step linear warm-up)."""
    k0: int = 8
    """MoBA budget of phase 2 (and of the held-out evaluation)."""
    target: float = 0.9
    """Stop phase 2 once the shortest bucket's held-out accuracy reaches this."""
    eval_every: int = 250
    """Steps between held-out evaluations in phase 2."""
    heldout: int = 64
    """Held-out examples per bucket for the stopping rule and the record."""
    coverage_examples: int = 16
    """Held-out examples per bucket whose gate coverage is fitted (and, at the longest bucket, whose
    accuracy measures each layer's budget sensitivity)."""
    lr_warmup: int = 100
    """Steps of linear learning-rate warm-up."""
    coverage_layer_rule: str = "flattest"
    """Which layer DST watches: flattest (lowest coverage at k0) or sharpest (highest)."""

    def __post_init__(self) -> None:
        for f in ("warmup_length", "batch", "moba_batch", "k0", "eval_every", "heldout",
                  "coverage_examples"):
            check_positive(getattr(self, f), f)
        for f in ("warmup_steps", "moba_steps", "extra_steps"):
            check_positive(getattr(self, f), f, allow_zero=True)
        check_positive(self.lr, "lr")
        check(math.isfinite(self.lr), "lr", f"must be a finite number > 0, got {self.lr!r}")
        check(0.0 < self.target <= 1.0, "target", f"must lie in (0, 1], got {self.target}")
        check_positive(self.lr_warmup, "lr_warmup", allow_zero=True)
        check_choice(self.coverage_layer_rule, "coverage_layer_rule", ("flattest", "sharpest"))


def _step(model: Any, opt: Any, examples: list, k: int, block_size: int, max_tokens: int = 8192) -> float:
    """One optimizer step over ``examples`` (packed into micro-batches of <= max_tokens)."""
    import torch

    from sparsebalance.kernels.qwen2 import lm_loss_sum

    answers = sum(len(e.positions) for e in examples)
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for batch in token_batches(examples, max_tokens):
        logits, _ = forward(model, batch, k, block_size)
        loss = lm_loss_sum(logits[None], batch.labels)
        (loss / answers).backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return total / answers


def layer_curves(model: Any, examples: list, block_size: int, k: int,
                 layers: list[int] | None = None) -> dict[int, list[tuple[int, Any]]]:
    """Per layer (default all), ``(length, C(1..n))`` of each example, measured with the kernel's
    coverage code on the q/k of a forward pass at ``k``."""
    import torch

    out = {}
    with torch.no_grad():
        for layer in range(model.config.num_hidden_layers) if layers is None else layers:
            curves = []
            for e in examples:
                _, moba = forward(model, pack_answers([e]), k, block_size, coverage_layer=layer)
                curves.append((len(e.tokens), moba.coverage_curves()[0]))
            out[layer] = curves
    return out


def fit_layers(model: Any, task: RecallTask, buckets: list[int], n: int, block_size: int, k: int):
    """Coverage fit per layer on held-out examples: list of {layer, rate, max_abs_error, ...}."""
    from sparsebalance.policies.coverage import fit_rate

    exs = [e for b in buckets for e in task.heldout(b, n)]
    fits = []
    for layer, curves in layer_curves(model, exs, block_size, k).items():
        rate, err = fit_rate(curves, block_size)
        cov_k0 = float(np.mean([c[min(k, len(c)) - 1] for n_, c in curves if len(c) > 1]))
        fits.append({"layer": layer, "shape": "power", "rate": rate, "max_abs_error": err,
                     "measured_coverage_at_k0": cov_k0})
    return fits


def layer_sensitivity(model: Any, examples: list, block_size: int, k: int, low: int) -> list[dict]:
    """Per layer: held-out accuracy with that layer alone at budget ``low``, the others at ``k``."""
    from sparsebalance.accuracy.executor import evaluate
    from sparsebalance.simulator.budget import Budget

    n = model.config.num_hidden_layers
    return [{"layer": i, "budget": low, "accuracy": evaluate(
        model, examples, Budget.per_layer(tuple(low if j == i else k for j in range(n))), block_size)}
        for i in range(n)]


def pretrain(net: NetConfig, task_cfg: RecallConfig, cfg: PretrainConfig, buckets: list[int],
             out, command: str, log=print, init: Any = None) -> dict[str, Any]:
    """Train, fit coverage, save the checkpoint to ``out``; returns the record written. ``init``: a
    loaded checkpoint whose weights this call continues (phase 1 skipped)."""
    import torch

    from sparsebalance.loop import check_loss

    torch.set_num_threads(1)
    task = RecallTask(task_cfg)
    model = build(net)
    if init is not None:
        model.load_state_dict(init.load_model().state_dict())
    B = net.dims.block_size
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    heldout = {b: task.heldout(b, cfg.heldout) for b in buckets}
    short = task if init is not None else RecallTask(  # phase 1's short examples (skipped after an init)
        RecallConfig(**(asdict(task_cfg) | {"max_length": cfg.warmup_length})))
    cpu0, wall0, load0 = time.process_time(), time.time(), os.getloadavg()[0]
    step, history, dense = 0, [], net.max_positions  # k >= blocks: full attention
    phases = ((1, 0 if init is not None else cfg.warmup_steps, short, dense, cfg.batch, 0),
              (2, cfg.moba_steps + cfg.extra_steps, task, cfg.k0, cfg.moba_batch, cfg.moba_steps))
    for phase, steps, source, k, batch, at_least in phases:
        first = step
        for s in range(steps):
            for g in opt.param_groups:
                g["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.lr_warmup) if cfg.lr_warmup else cfg.lr
            exs = [source.example(TRAIN, i, source.train_length(i))
                   for i in range(first * cfg.batch + s * batch, first * cfg.batch + (s + 1) * batch)]
            loss = _step(model, opt, exs, k, B)
            # nothing is written before the end: a diverged pretraining leaves no checkpoint
            check_loss(loss, step, where=f" (pretraining phase {phase})", hint="lower the learning rate")
            step += 1
            if (s + 1) % cfg.eval_every == 0 or s == steps - 1:
                acc = {b: evaluate(model, ex, cfg.k0, B) for b, ex in heldout.items()}
                history.append({"step": step, "phase": phase, "loss": loss, "accuracy": acc,
                                "cpu_s": round(time.process_time() - cpu0, 1)})
                log(f"pretrain: phase {phase} step {step} loss {loss:.3f} held-out accuracy "
                    + " ".join(f"{b}:{a:.3f}" for b, a in acc.items())
                    + f" cpu {time.process_time() - cpu0:.0f}s wall {time.time() - wall0:.0f}s")
                if s + 1 >= at_least and acc[min(buckets)] >= cfg.target:
                    break
    cpu, wall, load1 = time.process_time() - cpu0, time.time() - wall0, os.getloadavg()[0]
    fits = fit_layers(model, task, buckets, cfg.coverage_examples, B, cfg.k0)
    sens = layer_sensitivity(model, task.heldout(max(buckets), cfg.coverage_examples), B, cfg.k0,
                             max(1, cfg.k0 // 4))
    # flattest: the lowest coverage at k0, so the most cautious floors; sharpest: the highest
    pick = min if cfg.coverage_layer_rule == "flattest" else max
    best = pick(fits, key=lambda f: f["measured_coverage_at_k0"])
    record = {
        "seed": net.seed, "command": command, "pretrain": asdict(cfg), "buckets": buckets,
        "steps": step, "cpu_time_s": round(cpu, 1), "wall_time_s": round(wall, 1),
        "load_average_start_end": [round(load0, 2), round(load1, 2)],
        "heldout_accuracy": history[-1]["accuracy"], "history": history,
        "coverage_fits": fits, "layer_sensitivity": sens, "coverage_layer_rule": cfg.coverage_layer_rule,
        "coverage_layer": best["layer"], "coverage_rate": best["rate"],
        "init": None if init is None else {"path": str(init.path), **{k: init.meta.get(k) for k in (
            "command", "steps", "cpu_time_s", "wall_time_s", "heldout_accuracy", "init")}},
        "machine": "the project's VM: 2 vCPUs AMD EPYC, 24 GiB, no GPU (shared; see load)",
        "versions": {"torch": torch.__version__},
    }
    save(out, model, net, task_cfg, record)
    log(f"pretrain: saved {out} after {step} steps, CPU {cpu:.0f} s, wall {wall:.0f} s")
    return record
