"""``profile``: the memory a measurement grid needs, checked against this machine's before any tensor.

The profiler builds every grid point's inputs first (each point keeps its tensors for the whole
measurement) and then calls one op at a time, so what it needs is the model's timed pieces, every
point's inputs, and the largest single call (``kernels/profiler.py``). The per-call terms are upper
estimates fitted to the CPU path's peak resident memory on the project's VM (``/proc/self/status``
VmHWM around one attention forward and backward, tiny-, 0.5B- and 3B-shaped heads at 4K-200K
tokens; whole ``profile`` runs: the tiny model's default grid 0.92 GB, estimated 1.0; qwen2.5-0.5b
on lengths 1,024 and 8,192 and tokens 1,024 and 4,096 16.4 GB, estimated 17.3): attention about 48
float32 copies of ``q`` plus the gate's scores (one per token, head and key block) plus the block
layout's tables over the padded length; the decoder layer and the LM head what HF's modules keep
for their backward. They are to refuse sizes that cannot fit (a length of 2^40, a block of 10^9
tokens: before, the allocator's traceback or the OOM killer at 23 GB), not to predict a peak.
"""

from __future__ import annotations

from sparsebalance.data.sequence import blocks
from sparsebalance.errors import ConfigError

GB = 1e9
ATTN_COPIES = 48
"""float32 copies of ``q`` an attention forward and backward keeps at once (fitted: 12-45)."""
LAYOUT_BYTES = 64
"""Bytes per padded token of the block layout's index tables."""
HEAD_COPIES = 6
"""float32 logit tensors (tokens x vocab) the LM head's timed calls hold at once: its forward, the
loss, their gradients and the split backward's kept graph (fitted: 16.4 GB peak for qwen2.5-0.5b at
4,096 tokens)."""
CUDA_MARGIN = 2.0
"""On CUDA the estimate is divided by this: the terms are fitted on the CPU path (float32 compute,
the chunked kernel), unmeasured on a GPU here; the check there refuses only what cannot fit."""
BASE_BYTES = 0.8 * GB
"""The interpreter, torch, transformers and first-call workspaces (0.71 GB measured on the tiny model)."""


def grid_memory(model, grid, concurrency: int = 1) -> tuple[float, str, str]:
    """(bytes the measurement of ``grid`` needs, the flag of its largest part, that part in words)."""
    m = model
    b = {"float32": 4, "float64": 8}.get(grid.dtype, 2)
    qkv = m.heads + 2 * m.kv_heads
    layer_params = m.hidden * m.head_dim * (qkv + m.heads) + 3 * m.hidden * m.ffn
    weights = 2 * b * (layer_params + m.vocab * m.hidden * (1 if m.tie_embeddings else 2))
    parts = []  # (bytes of the call, its inputs kept, flag, words)
    for L in grid.seq_lens:
        padded = blocks(L, m.block_size) * m.block_size
        call = (ATTN_COPIES * L * m.heads * m.head_dim * 4 + 4 * L * m.heads * blocks(L, m.block_size)
                + LAYOUT_BYTES * padded)
        flag = "--block-size" if LAYOUT_BYTES * padded > call / 2 else "--seq-lens"
        parts.append((call, len(grid.budgets) * L * m.head_dim * (2 * qkv + m.heads) * b, flag,
                      f"attention at {L:,} tokens in blocks of {m.block_size:,}"))
    for T in grid.tokens:
        act = T * (24 * m.hidden + 4 * qkv * m.head_dim + 12 * m.ffn) * 4
        parts.append((act, 3 * T * m.hidden * b, "--tokens", f"the decoder layer at {T:,} tokens"))
        parts.append((HEAD_COPIES * T * m.vocab * 4, 3 * T * m.hidden * b, "--tokens",
                      f"the LM head at {T:,} tokens"))
    for P in grid.params:
        parts.append((16 * P, 8 * P, "--params", f"the optimizer step over {P:,} parameters"))
    call, _, flag, what = max(parts, key=lambda p: p[0])
    total = BASE_BYTES + weights + sum(p[1] for p in parts) + call
    return total * concurrency / (CUDA_MARGIN if grid.device == "cuda" else 1.0), flag, what


def available_memory(device: str) -> float | None:
    """Bytes this machine can still give: CUDA's free device memory, else ``MemAvailable`` of
    /proc/meminfo; None where neither is known (the check is then skipped)."""
    if device == "cuda":
        import torch

        return float(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(model, grid, concurrency: int = 1, available: float | None = None) -> None:
    """ConfigError naming the flag when the measurement needs more memory than ``available`` (by
    default :func:`available_memory`)."""
    need, flag, what = grid_memory(model, grid, concurrency)
    have = available_memory(grid.device) if available is None else available
    if have is not None and need > have:
        copies = f" x {concurrency} copies" if concurrency > 1 else ""
        raise ConfigError(f"{flag}: measuring this grid needs about {_gb(need)}{copies} (the largest part: "
                          f"{what}), more than the {_gb(have)} this machine has free for {grid.device}; "
                          f"lower {flag}")


def _gb(n: float) -> str:
    return f"{n / GB:,.1f} GB" if n < 1e18 else f"{n / GB:.2g} GB"
