"""A single-process reference: the same model, batches and budgets without any parallelism.

Used by the tests as the oracle of the pipelined, data-parallel run: same seed, same micro-batches
(from ``plans.json``), same loss normalisation (summed token loss / global batch's label tokens), one
AdamW step per iteration. Pipelining and DP only reorder the same float operations (plus the DP sum),
so losses and post-step weights must agree to float tolerance.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def reference_run(cfg: Any, plans: list, budgets: list, tokens: dict[int, np.ndarray], *,
                  dtype: str = "float32", attention_backend: str = "auto") -> tuple[list[float], dict]:
    """Run the iterations of ``plans``/``budgets`` in one process.

    ``tokens`` maps sequence id -> int token array. Returns (loss per iteration, final state dict
    under Hugging Face names). Uses ``cfg.realrun`` lr / weight decay / grad clip.
    """
    import torch

    from sparsebalance.kernels.qwen2 import MobaArgs, build_qwen2, full_forward_loss, pack
    from sparsebalance.realrun.config import realrun_config

    rr = realrun_config(cfg)
    net = build_qwen2(cfg.model, seed=cfg.seed, dtype=dtype)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=rr.lr,
                            weight_decay=rr.weight_decay)
    losses = []
    for plan, bud in zip(plans, budgets):
        opt.zero_grad(set_to_none=True)
        label_tokens = max(sum(s.length - 1 for s in plan.sequences()), 1)
        total = 0.0
        for r, j, mb in plan.microbatches():
            batch = pack([tokens[s.id] for s in mb.sequences])
            moba = MobaArgs(cu_seqlens=batch.cu_seqlens, budget=bud[r][j], block_size=cfg.model.block_size,
                            backend=attention_backend)
            loss = full_forward_loss(net, batch, moba) / label_tokens
            loss.backward()
            total += float(loss.detach())
        if rr.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), rr.grad_clip)
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}
