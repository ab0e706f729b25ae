"""Latency profiler behind ``sparsebalance profile``: measures the ops of the profile format.

Every op is timed on the module code the real run executes (``sparsebalance.kernels.qwen2``):

* ``attn_fwd`` / ``attn_bwd``: :func:`moba_attention` on ONE sequence of ``seq_len`` tokens with the
  model preset's heads / kv heads / head dim / block size, budget = top-k;
* ``layer_fwd`` / ``layer_bwd``: one HF ``Qwen2DecoderLayer`` on ``seq_len`` tokens with its attention
  core replaced by :class:`_NullCore` (registered through transformers' ``AttentionInterface`` like
  MoBA): a measurement instrument returning zeros of the output shape (and zero gradients), so the
  layer time is everything except the attention core (norms, QKV/O projections, RoPE, MLP);
* ``embed_*``: the embedding lookup; ``head_*``: final norm + LM head + summed cross entropy;
* ``optim``: one ``torch.optim.AdamW`` step over ``seq_len`` parameters.

Timing: mean (or median, ``statistic``) of ``repeats`` after ``warmup`` calls; CPU: ``time.perf_counter`` with
``torch.set_num_threads(threads)`` (1 by default: realrun runs one thread per process); CUDA:
CUDA events around each call after a synchronize. Backward ops time only ``backward()``; the forward
that feeds it runs untimed before each repeat.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sparsebalance.errors import ConfigError, check, check_choice
from sparsebalance.simulator.config import ModelConfig

NULL_CORE = "sparsebalance_null_core"


@dataclass(kw_only=True, slots=True)
class ProfileGrid:
    """What to measure; units are tokens (lengths), blocks (budgets) and parameters."""

    seq_lens: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)
    """Sequence lengths (tokens) of the attention grid."""
    budgets: tuple[int, ...] = (1, 2, 4, 8, 16)
    """MoBA top-k values of the attention grid (own block included)."""
    tokens: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
    """Token counts of the dense ops (layer, embed, head)."""
    params: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    """Parameter counts of the optim op."""
    repeats: int = 5
    """Timed calls per point; the median is recorded."""
    warmup: int = 2
    """Untimed calls before timing."""
    threads: int = 1
    """torch CPU threads while measuring (CPU only)."""
    device: str = "cpu"
    """cpu or cuda."""
    dtype: str = "float32"
    """Activation/weight dtype: float32, bfloat16 or float16."""
    seed: int = 0
    """Seed of the random inputs and weights."""
    statistic: str = "mean"
    """What a point records over its repeats: mean (default) or median. The simulator adds
    durations, and expected values add; on a shared CPU a few calls in ten take 2-3x longer
    (page faults, kernel threads), which the median hides but every real run pays."""

    def __post_init__(self) -> None:
        for f in ("seq_lens", "budgets", "tokens", "params"):
            vals = getattr(self, f)
            check(len(vals) > 0 and all(int(v) >= 1 for v in vals), f, f"must be integers >= 1, got {vals}")
        check(self.repeats >= 1, "repeats", f"must be >= 1, got {self.repeats}")
        check(self.warmup >= 0, "warmup", f"must be >= 0, got {self.warmup}")
        check(self.threads >= 1, "threads", f"must be >= 1, got {self.threads}")
        check_choice(self.device, "device", ("cpu", "cuda"))
        check_choice(self.dtype, "dtype", ("float32", "bfloat16", "float16"))
        check_choice(self.statistic, "statistic", ("mean", "median"))


@dataclass(kw_only=True, slots=True)
class Timer:
    """Mean- or median-of-repeats timing on one device."""

    device: str
    """cpu or cuda."""
    repeats: int
    """Timed calls."""
    warmup: int
    """Untimed calls first."""
    statistic: str = "mean"
    """mean or median of the timed calls."""
    samples: list[float] = field(default_factory=list)
    """Seconds of each timed call of the last :meth:`measure`."""

    def measure(self, fn: Callable[[], Any], setup: Callable[[], Any] | None = None) -> float:
        """Seconds of ``fn(setup())`` (``setup`` untimed, its result passed to ``fn``): the
        ``statistic`` over ``repeats`` timed calls after ``warmup`` untimed ones."""
        import torch

        cuda = self.device == "cuda"
        self.samples = []
        for i in range(self.warmup + self.repeats):
            arg = setup() if setup else None
            if cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(arg)
                end.record()
                torch.cuda.synchronize()
                dt = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                fn(arg)
                dt = time.perf_counter() - t0
            if i >= self.warmup:
                self.samples.append(dt)
        return (statistics.fmean if self.statistic == "mean" else statistics.median)(self.samples)


def _null_core_fn() -> Any:
    import torch

    class _NullCore(torch.autograd.Function):
        """Zeros of the attention output shape; zero gradients for q, k, v (cost ~ one allocation)."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any) -> Any:
            ctx.shapes = (q.shape, k.shape, v.shape)
            b, h, t, d = q.shape
            return q.new_zeros(b, t, h, d)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return tuple(grad.new_zeros(s) for s in ctx.shapes)

    def core(module, query, key, value, attention_mask, **kwargs):  # AttentionInterface signature
        return _NullCore.apply(query, key, value), None

    return core


class Bench:
    """Builders of each op's timed closures for one model preset on one device."""

    def __init__(self, model: ModelConfig, grid: ProfileGrid):
        import torch
        from transformers import AttentionInterface

        from sparsebalance.kernels.qwen2 import build_qwen2

        self.torch = torch
        self.model, self.grid = model, grid
        self.dev = torch.device(grid.device)
        self.dtype = getattr(torch, grid.dtype)
        if grid.device == "cpu":
            torch.set_num_threads(grid.threads)
        AttentionInterface.register(NULL_CORE, _null_core_fn())
        self.net = build_qwen2(model, seed=grid.seed, dtype=grid.dtype).to(self.dev)
        self.net.config._attn_implementation = NULL_CORE
        self.layer = self.net.model.layers[0]
        self.timer = Timer(device=grid.device, repeats=grid.repeats, warmup=grid.warmup,
                           statistic=grid.statistic)
        self.gen = torch.Generator(device=self.dev).manual_seed(grid.seed)

    def _randn(self, *shape: int, grad: bool = False) -> Any:
        x = self.torch.randn(*shape, generator=self.gen, device=self.dev, dtype=self.dtype)
        return x.requires_grad_(grad)

    def attention(self, seq_len: int, budget: int) -> tuple[float, float]:
        """(forward, backward) seconds of MoBA attention on one sequence of ``seq_len`` tokens."""
        from sparsebalance.kernels import moba_attention

        m = self.model
        q = self._randn(seq_len, m.heads, m.head_dim, grad=True)
        k = self._randn(seq_len, m.kv_heads, m.head_dim, grad=True)
        v = self._randn(seq_len, m.kv_heads, m.head_dim, grad=True)
        cu = self.torch.tensor([0, seq_len], dtype=self.torch.int32, device=self.dev)
        dout = self._randn(seq_len, m.heads, m.head_dim)

        def fwd(_: Any = None) -> Any:
            return moba_attention(q, k, v, cu, block_size=m.block_size, topk=budget)

        t_f = self._fwd_time(fwd)
        t_b = self.timer.measure(lambda out: out.backward(dout), setup=fwd)
        return t_f, t_b

    def layer_dense(self, tokens: int) -> tuple[float, float]:
        """(forward, backward) seconds of one decoder layer without its attention core."""
        torch = self.torch
        pos = torch.arange(tokens, device=self.dev)[None]
        x = self._randn(1, tokens, self.model.hidden, grad=True)
        with torch.no_grad():
            pe = self.net.model.rotary_emb(x, pos)
        dy = self._randn(1, tokens, self.model.hidden)

        def fwd(_: Any = None) -> Any:
            out = self.layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
            return out[0] if isinstance(out, tuple) else out

        t_f = self._fwd_time(fwd)
        t_b = self.timer.measure(lambda y: y.backward(dy), setup=fwd)
        return t_f, t_b

    def _fwd_time(self, fwd: Callable[[Any], Any]) -> float:
        # Forward with autograd recording, as in training (the graph is built and then dropped).
        return self.timer.measure(fwd)

    def embed(self, tokens: int) -> tuple[float, float]:
        ids = self.torch.randint(0, self.model.vocab, (1, tokens), generator=self.gen, device=self.dev)
        emb = self.net.model.embed_tokens
        dy = self._randn(1, tokens, self.model.hidden)
        t_f = self._fwd_time(lambda _=None: emb(ids))
        t_b = self.timer.measure(lambda y: y.backward(dy), setup=lambda: emb(ids))
        return t_f, t_b

    def head(self, tokens: int) -> tuple[float, float]:
        from sparsebalance.kernels.qwen2 import lm_loss_sum

        labels = self.torch.randint(0, self.model.vocab, (1, tokens), generator=self.gen, device=self.dev)
        h = self._randn(1, tokens, self.model.hidden, grad=True)

        def fwd(_: Any = None) -> Any:
            return lm_loss_sum(self.net.lm_head(self.net.model.norm(h)), labels)

        return self._fwd_time(fwd), self.timer.measure(lambda loss: loss.backward(), setup=fwd)

    def optim(self, params: int) -> float:
        p = self.torch.nn.Parameter(self._randn(params).float())
        p.grad = self._randn(params).float()
        opt = self.torch.optim.AdamW([p], lr=1e-4)
        return self.timer.measure(lambda _=None: opt.step())


def _jobs(grid: ProfileGrid) -> list[tuple[str, int, int]]:
    return ([("attn", L, k) for L in grid.seq_lens for k in grid.budgets]
            + [(op, n, 0) for op in ("layer", "embed", "head") for n in grid.tokens]
            + [("optim", n, 0) for n in grid.params])


def _measure(model: ModelConfig, grid: ProfileGrid, progress: bool, barrier: Any = None) -> list:
    """Rows ``(op, seq_len, budget, latency_s)``; with a barrier, every point starts in step with
    the other copies of this measurement."""
    from tqdm import tqdm

    bench = Bench(model, grid)
    rows = []
    for op, n, k in tqdm(_jobs(grid), desc="profile", disable=not progress, unit="pt"):
        if barrier is not None:
            barrier.wait()
        if op == "optim":
            rows.append(("optim", n, 0, bench.optim(n)))
            continue
        if op == "attn":
            f, b = bench.attention(n, k)
        else:
            f, b = {"layer": bench.layer_dense, "embed": bench.embed, "head": bench.head}[op](n)
        rows += [(f"{op}_fwd", n, k, f), (f"{op}_bwd", n, k, b)]
    return rows


def _copy(model: ModelConfig, grid: ProfileGrid, barrier: Any, show: bool) -> list:
    return _measure(model, grid, show, barrier)


def run_profile(model: ModelConfig, grid: ProfileGrid, progress: bool = True,
                concurrency: int = 1) -> Any:
    """Measure every op of the grid; returns the profile table (``op, seq_len, budget, latency_s``).

    ``concurrency`` > 1 (CPU): that many copies of the measurement run at once in separate
    processes, stepping through the grid together, and each point records the statistic over copies.
    Why: realrun puts pp x dp worker processes on one host; on a CPU they share caches, memory
    bandwidth and whatever else the host runs, so an op timed alone is faster than the same op in
    the real run. Measure under the run's own concurrency to predict it.
    """
    import pandas as pd

    check(concurrency >= 1, "concurrency", f"must be >= 1, got {concurrency}")
    if not _jobs(grid):
        raise ConfigError("profile: the grid is empty")
    if concurrency == 1:
        rows = _measure(model, grid, progress)
    else:
        check(grid.device == "cpu", "concurrency", "only CPU profiles run several copies at once")
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager:
            barrier = manager.Barrier(concurrency)
            with ProcessPoolExecutor(concurrency, mp_context=ctx) as pool:
                futures = [pool.submit(_copy, model, grid, barrier, progress and i == 0)
                           for i in range(concurrency)]
                copies = [f.result() for f in futures]
        table = pd.concat([pd.DataFrame(c, columns=["op", "seq_len", "budget", "latency_s"])
                           for c in copies])
        per_point = table.groupby(["op", "seq_len", "budget"], sort=False, as_index=False).latency_s
        return per_point.mean() if grid.statistic == "mean" else per_point.median()
    return pd.DataFrame(rows, columns=["op", "seq_len", "budget", "latency_s"])
