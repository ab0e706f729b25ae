"""Latency profiler behind ``sparsebalance profile``: measures the ops of the profile format.

Every op is timed on the module code the real run executes (``sparsebalance.kernels.qwen2``):

* ``attn_fwd`` / ``attn_bwd``: :func:`moba_attention` on ONE sequence of ``seq_len`` tokens with the
  model preset's heads / kv heads / head dim / block size, budget = top-k;
* ``layer_fwd`` / ``layer_bwd``: one HF ``Qwen2DecoderLayer`` on ``seq_len`` tokens with its attention
  core replaced by :class:`_NullCore` (registered through transformers' ``AttentionInterface`` like
  MoBA): a measurement instrument returning zeros of the output shape (and zero gradients), so the
  layer time is everything except the attention core (norms, QKV/O projections, RoPE, MLP);
* ``layer_bwd_input`` / ``layer_bwd_weight``, ``head_bwd_input`` / ``head_bwd_weight``: the two parts
  of the split backward (:mod:`sparsebalance.kernels.split_backward`, what realrun's zero-bubble
  schedule runs); the weight part's untimed setup runs the forward and the input part. Always of the
  eager layer and head: a compiled region cannot split its backward (``kernels/fastlayer.py``), and
  realrun runs a split-backward schedule (ZB-H1) eager;
* ``layer_impl`` (``kernels/fastlayer.py``): the layer and head run eager (the HF modules) or compiled
  (two compiled regions around the attention; the head's norm compiled and its loss chunked over the
  vocabulary, ``kernels/lmhead.py``), compiled before the first timed call;
* ``embed_*``: the embedding lookup; ``head_*``: final norm + LM head + summed cross entropy;
* ``optim``: one ``torch.optim.AdamW`` step over ``seq_len`` parameters;
* ``attn_fwd_cp`` / ``attn_bwd_cp`` (``cp`` > 1): the same sequence dealt to ``cp`` ranks by
  ``cp_layout``, each rank's share computed in turn by
  :func:`~sparsebalance.kernels.moba.cp.moba_attention_cp_alone` (the real run's all-gather CP path
  with the collectives' results given up front), one timed call running every rank: the group's
  attention work, which the latency model spreads over ranks and ring steps by pair counts;
* ``attn_fwd_cp_step`` / ``attn_bwd_cp_step`` (``cp`` > 1, CPU): rank 0's ring steps on the same
  sequence, on the real run's ring code (``cp_ring.RingRank``, every rank's K/V given, the
  exchanges left to the latency model): each step's forward with its keys placed and its merge into
  the accumulator (step 0 also with the rank's packed buffers, pooled sums and gate, run once before
  the ring), each step's backward with its gradients' accumulation (the forward of every step runs
  untimed before it). A row's
  ``seq_len`` is the pairs the step attends per head; calls of equal pairs and budget average into
  one row. The ring step runs PyTorch's CPU flash-attention parts, so a CUDA profile has no step
  rows.

Timing: mean (or median, ``statistic``) of ``repeats`` after ``warmup`` calls, measured in
interleaved rounds (each round times every op of the grid once, see :func:`_measure`); CPU: ``time.perf_counter`` with
``torch.set_num_threads(threads)`` (1 by default: realrun runs one thread per process); CUDA:
CUDA events around each call after a synchronize. Backward ops time only ``backward()``; the forward
that feeds it runs untimed before each repeat.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sparsebalance.errors import ConfigError, check, check_choice
from sparsebalance.simulator.config import ModelConfig

NULL_CORE = "sparsebalance_null_core"
STEP = "@"
"""Separates a ring-step row's op from its step index until :func:`_step_rows` turns it into pairs."""


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
    """Timed calls per point: one per interleaved round over the whole grid."""
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
    tp_plan: bool = False
    """Time the decoder layer with realrun's DTensor tensor-parallel plan applied (``realrun/tp.py``)
    on a one-rank device mesh: the layer a TP rank runs, wrappers and hooks included, without the
    communication (the latency model adds the all-reduces). Set for ``profile --tp N`` > 1: the
    wrappers cost several ms per layer on a CPU, far more than a shard-sized layer's own work."""
    cp: int = 1
    """Context-parallel degree of the ``attn_*_cp`` rows (1: none measured)."""
    cp_layout: str = "zigzag"
    """Layout of the CP group the ``attn_*_cp`` rows are measured on."""
    cp_steps: bool = True
    """With ``cp`` > 1 on the CPU, also measure rank 0's ring steps (``attn_*_cp_step``). The
    calibration probe leaves them out: their points are keyed by the pairs the gate chose on the
    profile's own inputs, not by a grid it can re-measure."""
    bench: str = ""
    """``"module:Class"`` of a :class:`Bench` subclass that builds the timed pieces instead of HF
    Qwen2's (``sparsebalance.titan.profile:TitanBench``: torchtitan's Qwen3 block, for
    ``profile --trainer torchtitan``); "" = :class:`Bench`. A name, not a class: the profile's copies
    run in spawned processes, and kernels/ imports no trainer of its own."""
    statistic: str = "mean"
    """What a point records over its repeats: mean (default) or median. The simulator adds
    durations, and expected values add; on a shared CPU a few calls in ten take 2-3x longer
    (page faults, kernel threads), which the median hides but every real run pays."""
    layer_impl: str = "auto"
    """How the layer and head run (``kernels/fastlayer.py``): eager, compiled, or auto (compiled on
    CUDA without ``tp_plan``, else eager)."""

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
        check(self.cp >= 1, "cp", f"must be >= 1, got {self.cp}")
        from sparsebalance.simulator.cost.profilemeta import CP_LAYOUTS

        check_choice(self.cp_layout, "cp_layout", CP_LAYOUTS)
        self.resolved_layer_impl()

    def resolved_layer_impl(self) -> str:
        """eager or compiled (ConfigError for compiled with ``tp_plan``)."""
        from sparsebalance.kernels.fastlayer import resolve_layer_impl

        return resolve_layer_impl(self.layer_impl, self.device, tp=2 if self.tp_plan else 1)


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

    def once(self, fn: Callable[[Any], Any], setup: Callable[[], Any] | None = None) -> float:
        """Seconds of one call ``fn(setup())`` (``setup`` untimed)."""
        import torch

        arg = setup() if setup else None
        if self.device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(arg)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn(arg)
        return time.perf_counter() - t0

    def reduce(self, samples: list[float]) -> float:
        return (statistics.fmean if self.statistic == "mean" else statistics.median)(samples)


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


def bench_class(grid: ProfileGrid) -> type:
    """The :class:`Bench` (sub)class ``grid.bench`` names."""
    if not grid.bench:
        return Bench
    import importlib

    module, _, name = grid.bench.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"bench: cannot load {grid.bench!r} ({e})") from None
    check(isinstance(cls, type) and issubclass(cls, Bench), "bench", f"{grid.bench!r} is not a Bench")
    return cls


class Bench:
    """Builders of each op's timed closures for one model preset on one device."""

    LAYER = "one HF Qwen2DecoderLayer with a zero-cost attention core"
    """What ``layer_*`` rows time (the profile sidecar's ``how``)."""

    def __init__(self, model: ModelConfig, grid: ProfileGrid):
        from transformers import AttentionInterface

        from sparsebalance.kernels.qwen2 import build_qwen2_pieces
        from sparsebalance.kernels.qwen2_init import pieces

        self._common(model, grid)
        AttentionInterface.register(NULL_CORE, _null_core_fn())
        # only what is timed: layer 0, the embedding, final norm and LM head, made on the device (the
        # other layers stay on the meta device: a 3B model's 36 layers would cost ~20 s of CPU init)
        self.net = build_qwen2_pieces(model, pieces([0], embed=True, head=True), seed=grid.seed, dtype=grid.dtype,
                                      device=grid.device)
        self.net.config._attn_implementation = NULL_CORE
        self.layer = self.net.model.layers[0]
        self.own_group = _tp_plan_on_one_rank(self.layer, grid.device) if grid.tp_plan else False
        self.use(grid.resolved_layer_impl())

    def _common(self, model: ModelConfig, grid: ProfileGrid) -> None:
        """What every bench sets up: device, dtype, threads, timer and the seeded generator."""
        import torch

        self.torch = torch
        self.model, self.grid = model, grid
        self.dev = torch.device(grid.device)
        self.dtype = getattr(torch, grid.dtype)
        if grid.device == "cpu":
            torch.set_num_threads(grid.threads)
        self.own_group = False
        self.step_pairs: dict[tuple[int, int, int], float] = {}
        """Pairs per head of each measured ring step, by (seq_len, budget, step) (``_attn_cp_step``)."""
        self.impl = "eager"
        """How the layer and head run (``use``); another trainer's bench times its own eager modules."""
        self.timer = Timer(device=grid.device, repeats=grid.repeats, warmup=grid.warmup,
                           statistic=grid.statistic)
        self.gen = torch.Generator(device=self.dev).manual_seed(grid.seed)

    def use(self, impl: str) -> None:
        """Run the layer and head ``impl`` (eager or compiled) in the closures :meth:`items` makes
        from now on; compiled, its graphs are compiled here, before any timed call (later token
        counts reuse them)."""
        self.impl = impl
        if impl == "compiled":
            from sparsebalance.kernels.qwen2 import warm_up

            warm_up([self.layer], self.pieces()[1:])

    def _randn(self, *shape: int, grad: bool = False) -> Any:
        x = self.torch.randn(*shape, generator=self.gen, device=self.dev, dtype=self.dtype)
        return x.requires_grad_(grad)

    def items(self, op: str, n: int, k: int) -> list[tuple[tuple[str, int, int], Callable, Any]]:
        """Timed closures of one grid point: ``[((row op, n, k), fn, setup), ...]``; one timed call
        is ``fn(setup())`` with ``setup`` (the untimed forward feeding a backward) or None."""
        build = {"attn": self._attn, "layer": self._layer, "embed": self._embed, "head": self._head,
                 "optim": self._optim, "attn_cp": self._attn_cp, "attn_cp_step": self._attn_cp_step}[op]
        closures = build(n, k)
        W = self.grid.cp
        names = (("optim",) if op == "optim" else ("attn_fwd_cp", "attn_bwd_cp") if op == "attn_cp"
                 else tuple(f"attn_{p}_cp_step{STEP}{s}" for p in ("fwd", "bwd") for s in range(W))
                 if op == "attn_cp_step" else (f"{op}_fwd", f"{op}_bwd", f"{op}_bwd_input", f"{op}_bwd_weight"))
        return [((name, n, k), fn, setup) for name, (fn, setup) in zip(names, closures)]

    def _split(self, fwd: Callable, grads: Any, inputs: list, params: list) -> list:
        """(fn, setup) of the input and the weight part of ``fwd``'s backward."""
        from sparsebalance.kernels.split_backward import backward_input, backward_weight

        def inp(out: Any) -> Any:
            return backward_input([out], grads, inputs, params)[1]

        return [(inp, fwd), (lambda state: backward_weight(params, state), lambda: inp(fwd()))]

    def _attn(self, seq_len: int, budget: int) -> list:
        from sparsebalance.kernels import moba_attention

        m = self.model
        q = self._randn(seq_len, m.heads, m.head_dim, grad=True)
        k = self._randn(seq_len, m.kv_heads, m.head_dim, grad=True)
        v = self._randn(seq_len, m.kv_heads, m.head_dim, grad=True)
        cu = [0, seq_len]  # on the host: the Triton backend then never synchronises (kernels/moba/api.py)
        dout = self._randn(seq_len, m.heads, m.head_dim)

        def fwd(_: Any = None) -> Any:
            return moba_attention(q, k, v, cu, block_size=m.block_size, topk=budget)

        return [(fwd, None), (lambda out: out.backward(dout), fwd)]

    def _attn_cp(self, seq_len: int, budget: int) -> list:
        from sparsebalance.kernels.moba.cp import cp_token_index, group_index, moba_attention_cp_alone
        from sparsebalance.kernels.moba.gate import gate_dtype

        torch, m, W = self.torch, self.model, self.grid.cp
        q = self._randn(seq_len, m.heads, m.head_dim)
        k = self._randn(seq_len, m.kv_heads, m.head_dim)
        v = self._randn(seq_len, m.kv_heads, m.head_dim)
        dout = self._randn(seq_len, m.heads, m.head_dim)
        cu = torch.tensor([0, seq_len], dtype=torch.int64, device=self.dev)
        per = [p.to(self.dev) for p in cp_token_index(cu.cpu(), m.block_size, W, self.grid.cp_layout)]
        # what the all-gather would deliver: every rank's K and V rows, in the compute dtype
        kv = torch.cat([k, v], dim=-1).to(gate_dtype(q.dtype))
        rows = [kv[p] for p in per]
        ranks = [(group_index(per, r), *(x[per[r]].clone().requires_grad_(True) for x in (q, k, v)), dout[per[r]])
                 for r in range(W)]

        def fwd(_: Any = None) -> Any:
            return [moba_attention_cp_alone(qr, kr, vr, idx, cu, m.block_size, budget, rows)
                    for idx, qr, kr, vr, _d in ranks]

        def bwd(outs: Any) -> None:
            for o, (*_, d) in zip(outs, ranks):
                o.backward(d)

        return [(fwd, None), (bwd, fwd)]

    def _attn_cp_step(self, seq_len: int, budget: int) -> list:
        """(fn, setup) of rank 0's ring steps, forward then backward (module docstring), on the real
        run's ring code (``cp_ring.RingRank``) with every rank's K/V given; records each step's pairs
        in ``step_pairs[(seq_len, budget, step)]``. The first forward step also times building the
        rank's packed buffers, its pooled block sums and the gate (the sums of the whole group given
        in their all-reduce's place), the last the output's rows; the first backward step the packed
        output gradient, the last dQ's rows."""
        from sparsebalance.kernels.moba.cp import cp_token_index
        from sparsebalance.kernels.moba.cp_ring import RingRank, pooled

        torch, m, W, B = self.torch, self.model, self.grid.cp, self.model.block_size
        q, k, v, dout = (self._randn(seq_len, h, m.head_dim) for h in (m.heads, m.kv_heads, m.kv_heads, m.heads))
        bounds = [0, seq_len]
        per = cp_token_index(torch.tensor(bounds), B, W, self.grid.cp_layout)
        per = [x.to(self.dev) for x in per]
        from sparsebalance.kernels.moba.gate import gate_dtype

        rows = [torch.cat([k[i], v[i]], dim=-1).to(gate_dtype(self.dtype)) for i in per]  # what each hop delivers
        group_sums = pooled(k, torch.arange(seq_len, device=self.dev), bounds, B)  # the all-reduce's result
        mine = [x[per[0]] for x in (q, k, v)]
        state: dict[str, Any] = {}

        def new_rank() -> Any:
            rank = RingRank(*mine, per[0], per, 0, bounds, B, [budget])
            rank.gate_sums()
            rank.begin(*group_sums) if rank.sparse else rank.begin()
            return rank

        def forward_step(s: int) -> Callable:
            def fn(_: Any = None) -> None:
                if s == 0:
                    state["rank"] = new_rank()
                rank = state["rank"]
                rank.forward_step(s, rank.own if s == 0 else rows[(0 - s) % W])
                if s == W - 1:
                    rank.output()
            return fn

        def before(s: int) -> Callable:  # the steps before step s, untimed
            def run() -> None:
                for j in range(s):
                    forward_step(j)()
            return run

        def backward_step(s: int) -> Callable:
            def fn(rank: Any) -> None:
                if s == 0:
                    rank.backward_begin(dout[per[0]])
                rank.backward_step(s, rank.own if s == 0 else rows[(0 - s) % W])
                if s == W - 1:
                    rank.backward_end()
            return fn

        def backward_before(s: int) -> Callable:  # the whole forward and the backward's steps before s
            def run() -> Any:
                before(W)()
                rank = state["rank"]
                for j in range(s):
                    backward_step(j)(rank)
                return rank
            return run

        before(W)()
        self.step_pairs.update({(seq_len, budget, s): state["rank"].steps[s].pairs for s in range(W)})
        return ([(forward_step(s), before(s)) for s in range(W)]
                + [(backward_step(s), backward_before(s)) for s in range(W)])

    def _layer(self, tokens: int, _: int) -> list:
        torch = self.torch
        pos = torch.arange(tokens, device=self.dev)[None]
        x = self._randn(1, tokens, self.model.hidden, grad=True)
        with torch.no_grad():
            pe = self.net.model.rotary_emb(x, pos)
        dy = self._randn(1, tokens, self.model.hidden)

        def fwd_of(impl: str) -> Callable:
            def fwd(_: Any = None) -> Any:
                # with autograd recording, as in training (the graph is built and then dropped)
                if impl == "compiled":
                    from sparsebalance.kernels.fastlayer import layer_forward

                    return layer_forward(self.layer, x, pe)
                out = self.layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
                return out[0] if isinstance(out, tuple) else out

            return fwd

        fwd = fwd_of(self.impl)
        return [(fwd, None), (lambda y: y.backward(dy), fwd),
                *self._split(fwd_of("eager"), [dy], [x], list(self.layer.parameters()))]

    def pieces(self) -> tuple[Any, Any, Any]:
        """(embedding, final norm, LM head) modules of the timed model."""
        return self.net.model.embed_tokens, self.net.model.norm, self.net.lm_head

    def _embed(self, tokens: int, _: int) -> list:
        ids = self.torch.randint(0, self.model.vocab, (1, tokens), generator=self.gen, device=self.dev)
        emb = self.pieces()[0]
        dy = self._randn(1, tokens, self.model.hidden)
        return [(lambda _=None: emb(ids), None), (lambda y: y.backward(dy), lambda: emb(ids))]

    def _head(self, tokens: int, _: int) -> list:
        from sparsebalance.kernels.qwen2 import head_loss

        labels = self.torch.randint(0, self.model.vocab, (1, tokens), generator=self.gen, device=self.dev)
        h = self._randn(1, tokens, self.model.hidden, grad=True)
        _, norm, head = self.pieces()

        def fwd_of(impl: str) -> Callable:
            return lambda _=None: head_loss(norm, head, h, labels, impl)

        fwd = fwd_of(self.impl)
        params = [*norm.parameters(), *head.parameters()]
        return [(fwd, None), (lambda loss: loss.backward(), fwd), *self._split(fwd_of("eager"), None, [h], params)]

    def _optim(self, params: int, _: int) -> list:
        p = self.torch.nn.Parameter(self._randn(params).float())
        p.grad = self._randn(params).float()
        opt = self.torch.optim.AdamW([p], lr=1e-4)
        return [(lambda _=None: opt.step(), None)]


def _tp_plan_on_one_rank(layer: Any, device: str) -> bool:
    """Apply realrun's TP plan to ``layer`` on a one-rank mesh (a process group of this process
    alone, in-memory store: no port, nothing shared with other copies). Returns whether it created
    that group (then the caller destroys it when done)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from sparsebalance.kernels.tp_plan import parallelize_layers

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    parallelize_layers([layer], init_device_mesh(device, (1,)))
    return created


def _jobs(grid: ProfileGrid, block_size: int) -> list[tuple[str, int, int]]:
    from sparsebalance.data.sequence import blocks
    from sparsebalance.simulator.cost.cp.shards import min_blocks

    split = [L for L in grid.seq_lens if grid.cp > 1 and blocks(L, block_size) >= min_blocks(grid.cp_layout, grid.cp)]
    return ([("attn", L, k) for L in grid.seq_lens for k in grid.budgets]
            + [(op, n, 0) for op in ("layer", "embed", "head") for n in grid.tokens]
            + [("optim", n, 0) for n in grid.params]
            + [("attn_cp", L, k) for L in split for k in grid.budgets]
            + [("attn_cp_step", L, k) for L in split for k in grid.budgets if grid.device == "cpu" and grid.cp_steps])


def _step_rows(rows: list, pairs: dict[tuple[int, int, int], float]) -> list:
    """Rows with ring-step ops (``attn_*_cp_step@s`` at (seq_len, budget)) keyed by the step's
    pairs instead (``profile.py``: their ``seq_len``), equal (op, pairs, budget) averaged; steps
    that attend no pair are left out."""
    out, steps = [], {}
    for op, n, k, t in rows:
        if STEP not in op:
            out.append((op, n, k, t))
            continue
        name, s = op.split(STEP)
        attended = round(pairs[(n, k, int(s))])
        if attended:  # a step that attends nothing runs no call (as the latency model prices it)
            steps.setdefault((name, attended, k), []).append(t)
    return out + [(name, n, k, statistics.fmean(ts)) for (name, n, k), ts in steps.items()]


def _measure(model: ModelConfig, grid: ProfileGrid, progress: bool, barrier: Any = None) -> list:
    """Rows ``(op, seq_len, budget, latency_s)``, measured in interleaved rounds: ``warmup`` untimed
    calls of every op first, then ``repeats`` rounds, each timing every op of the grid once in a
    fresh seeded order. Why rounds: on a shared machine the load of other jobs comes in bursts of
    seconds; timing one point's repeats back to back puts a whole burst on one or two grid points
    (a profile that is not even monotone in length), whereas rounds spread it over all points
    alike, so the profile keeps the true shape and records the machine's mean state over the
    profiling window. With a barrier, the copies start every round together."""
    import numpy as np
    from tqdm import tqdm

    from sparsebalance.kernels.cpuclock import manual_gc, steady_allocator

    if grid.device == "cpu":
        steady_allocator()  # the allocator state realrun's CPU workers run in
    bench = bench_class(grid)(model, grid)
    items = [it for job in _jobs(grid, model.block_size) for it in bench.items(*job)]
    for _, fn, setup in items:
        for _ in range(grid.warmup):
            bench.timer.once(fn, setup)
    samples: list[list[float]] = [[] for _ in items]
    rng = np.random.default_rng(grid.seed)  # same seed in every copy: the copies stay in step
    bar = tqdm(total=grid.repeats * len(items), desc="profile", disable=not progress, unit="call")
    import gc

    gc_was_on = gc.isenabled()
    manual_gc()  # collections between rounds, never inside a timed call (as realrun does)
    for _ in range(grid.repeats):
        gc.collect()
        # one barrier per round, not per call: waking from it costs the copies and the barrier's
        # manager process up to a millisecond of CPU on this 2-core host, which would land inside
        # a sub-millisecond timed call; in one shared order the copies stay close to in step
        if barrier is not None:
            barrier.wait()
        for i in rng.permutation(len(items)):
            _, fn, setup = items[i]
            samples[i].append(bench.timer.once(fn, setup))
            bar.update()
    bar.close()
    gc.unfreeze()
    if gc_was_on:
        gc.enable()
    if bench.own_group:
        import torch.distributed as dist

        dist.destroy_process_group()
    return _step_rows([(*key, bench.timer.reduce(ts)) for (key, _, _), ts in zip(items, samples)], bench.step_pairs)


def _copy(model: ModelConfig, grid: ProfileGrid, barrier: Any, show: bool, index: int = 0) -> list:
    # one core per copy, as realrun pins one worker per core (kernels/cpuclock.py)
    from sparsebalance.kernels.cpuclock import pin_to_core

    pin_to_core(index)
    return _measure(model, grid, show, barrier)


def run_profile(model: ModelConfig, grid: ProfileGrid, progress: bool = True,
                concurrency: int = 1) -> Any:
    """Measure every op of the grid; returns the profile table (``op, seq_len, budget, latency_s``).

    ``concurrency`` > 1 (CPU): that many copies of the measurement run at once in separate
    processes, stepping through the grid together, and each point records the statistic over copies.
    Why: realrun puts pp x dp worker processes on one host; on a CPU they share caches, memory
    bandwidth and whatever else the host runs, so an op timed alone is faster than the same op in
    the real run. Measure under the run's own concurrency to predict it. Copy i is pinned to the
    i-th usable core, as realrun pins its workers (kernels/cpuclock.py).
    """
    import pandas as pd

    check(concurrency >= 1, "concurrency", f"must be >= 1, got {concurrency}")
    jobs = _jobs(grid, model.block_size)
    if not jobs:
        raise ConfigError("profile: the grid is empty")
    if grid.cp > 1 and not any(j[0] == "attn_cp" for j in jobs):
        from sparsebalance.simulator.cost.cp.shards import min_blocks

        raise ConfigError(f"cp: no seq_len of the grid is split by {grid.cp_layout} over {grid.cp} ranks "
                          f"(needs >= {min_blocks(grid.cp_layout, grid.cp)} blocks of {model.block_size} "
                          f"tokens, got seq_lens {list(grid.seq_lens)})")
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
                futures = [pool.submit(_copy, model, grid, barrier, progress and i == 0, i)
                           for i in range(concurrency)]
                copies = [f.result() for f in futures]
        table = pd.concat([pd.DataFrame(c, columns=["op", "seq_len", "budget", "latency_s"])
                           for c in copies])
        per_point = table.groupby(["op", "seq_len", "budget"], sort=False, as_index=False).latency_s
        return per_point.mean() if grid.statistic == "mean" else per_point.median()
    return pd.DataFrame(rows, columns=["op", "seq_len", "budget", "latency_s"])
