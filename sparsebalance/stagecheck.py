"""Single-device stage validation: the stages of a PP plan run one after another in one process.

For one global batch of a run config: the batching and tuning policies make the plan and its (DST)
budgets; every micro-batch of DP rank 0 then runs through each stage alone (stage 0 adds the
embedding, the last stage the final norm, LM head and loss): forward, backward with a seeded upstream
gradient, graph freed (:func:`measure_stage`), on one device. Each (stage, micro-batch) F and B is timed (CUDA events on a GPU,
``perf_counter`` on the CPU), median over ``rounds``. Beside each measurement: the latency model's
prediction with every profile given (e.g. the measured one and an analytical one). Finally the
measured per-op times are composed through the simulator's schedule (``engine.simulate``, the
model's P2P times, no all-reduce) and compared with the iteration the predictions give.

Runs on the CPU with the chunked backend and the tiny model (tests), and on a GPU with the Triton
kernel (``sparsebalance gpu-check``). It imports policies, kernels and the simulator, like runner.py.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from sparsebalance.runconfig import RunConfig


@dataclass(slots=True)
class StageCheck:
    """What :func:`run_stage_check` measured and predicted."""

    ops: pd.DataFrame
    """One row per (stage, microbatch, op in F/B): tokens, budget, measured_s, and pred_<profile>_s."""
    iteration: pd.DataFrame
    """One row per source (measured, each profile): iteration_time_s through the schedule."""
    layer_impl: str = "eager"
    """How the layers and head ran (``kernels/fastlayer.py``): eager or compiled."""


def plan_one_batch(cfg: RunConfig, prepared: Any) -> tuple[Any, Any]:
    """The plan and budgets the config's policies give its first global batch."""
    from sparsebalance.loop import global_batches

    batch = next(global_batches(prepared.sequences, cfg.cluster.global_batch, shuffle=cfg.data.shuffle,
                                rng=np.random.default_rng(cfg.data.seed)))
    plan = prepared.batching.plan(batch, prepared.ctx)
    return plan, prepared.tuning.budgets(plan, prepared.ctx)


class _Timer:
    """Seconds of a callable: CUDA events on a GPU (after a synchronize), perf_counter on the CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def __call__(self, fn) -> tuple[Any, float]:
        import torch

        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return out, start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0


def _tokens(seq, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """The sequence's tokens, or seeded random ones when the data source has none (a distribution)."""
    if seq.tokens is not None:
        return np.asarray(seq.tokens) % vocab
    return rng.integers(0, vocab, size=seq.length)


def measure_stage(net, s: int, n_stages: int, n_layers: int, batch, moba, timer: _Timer,
                  gen: Any, impl: str = "eager") -> tuple[float, float]:
    """F and B seconds of stage ``s`` alone for one packed micro-batch, then its graph freed.

    The stage runs the first ``n_layers`` layers built (every stage has the dims of every other).
    Stage 0 starts from the tokens (embedding), a later stage from a seeded random hidden state
    [1, T, hidden] that needs a gradient, as a received activation does; the last stage ends in the
    LM head and summed loss, an earlier one in its output, whose backward gets a seeded random
    upstream gradient. Only one stage's activations exist at a time, so a plan whose whole pipeline
    would not fit one device still validates stage by stage. ``impl``: eager or compiled layers and head.
    """
    import torch

    from sparsebalance.kernels.qwen2 import head_loss, run_layers

    inner = net.model
    T = int(batch.input_ids.shape[-1])
    w = inner.layers[0].input_layernorm.weight
    h_in = None if s == 0 else torch.randn(1, T, w.shape[0], generator=gen, device=w.device,
                                           dtype=w.dtype).requires_grad_()
    layers = [inner.layers[i] for i in range(n_layers)]

    def fwd():
        h = inner.embed_tokens(batch.input_ids) if s == 0 else h_in
        h = run_layers(net, h, batch, moba, layers=layers, impl=impl)
        return head_loss(inner.norm, net.lm_head, h, batch.labels, impl) if s == n_stages - 1 else h

    out, t_f = timer(fwd)
    grad = None if s == n_stages - 1 else torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype)
    _, t_b = timer(lambda: out.backward(grad))
    net.zero_grad(set_to_none=True)
    return t_f, t_b  # the graph, input and gradients go with this frame


def run_stage_check(cfg: RunConfig, profiles: dict[str, str], *, device: str = "cpu", dtype: str = "float32",
                    backend: str = "auto", rounds: int = 3, seed: int = 0, layer_impl: str = "auto") -> StageCheck:
    """Measure and predict one global batch of ``cfg`` (DP rank 0) stage by stage on ``device``.

    ``profiles``: label -> profile name or path; each is loaded for ``cfg.model`` and ``cfg.cluster``
    (analytical ones are re-derived for the model). The first one (``cfg.profile`` if none) drives the
    policies. ``layer_impl``: eager, compiled or auto (``kernels/fastlayer.py``; compiled on CUDA);
    the first micro-batch's untimed warm-up run compiles.
    """
    import torch

    from sparsebalance.kernels.fastlayer import resolve_layer_impl

    impl = resolve_layer_impl(layer_impl, device)

    from sparsebalance.kernels.qwen2 import MobaArgs, build_qwen2_pieces, pack
    from sparsebalance.kernels.qwen2_init import pieces
    from sparsebalance.runner import prepare

    prepared = prepare(cfg)
    plan, budgets = plan_one_batch(cfg, prepared)
    lm0 = prepared.latency
    pp = cfg.cluster.pp
    stages = [lm0.layout.stage_layers(s) for s in range(pp)]
    # the largest stage's layers, embedding and head: every stage runs on these (same dims), so a
    # 36-layer model costs 9 layers of memory and initialisation
    n_built = max(len(r) for r in stages)
    net = build_qwen2_pieces(cfg.model, pieces(range(n_built), embed=True, head=True), seed=seed, dtype=dtype,
                             device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    rng = np.random.default_rng(seed)
    timer = _Timer(device)
    rows = []
    for j, mb in enumerate(plan.ranks[0]):
        budget = budgets[0][j]
        batch = pack([_tokens(s, cfg.model.vocab, rng) for s in mb.sequences], device=device)
        for s in range(pp):
            moba = MobaArgs(cu_seqlens=batch.cu_seqlens, budget=budget.restrict(stages[s]),
                            block_size=cfg.model.block_size, backend=backend)
            if j == 0:  # warm-up: kernel compilation and allocator
                measure_stage(net, s, pp, len(stages[s]), batch, moba, timer, gen, impl)
            runs = [measure_stage(net, s, pp, len(stages[s]), batch, moba, timer, gen, impl) for _ in range(rounds)]
            for op, k in (("F", 0), ("B", 1)):
                rows.append({"stage": s, "microbatch": j, "op": op, "tokens": int(sum(mb.lengths)),
                             "sequences": len(mb.lengths), "budget": budget.mean(),
                             "measured_s": statistics.median(r[k] for r in runs)})
    res = predict_stages(cfg, pd.DataFrame(rows), profiles, prepared=prepared, planned=(plan, budgets))
    res.layer_impl = impl
    return res


def predict_stages(cfg: RunConfig, ops: pd.DataFrame, profiles: dict[str, str], *,
                   prepared: Any = None, planned: tuple | None = None) -> StageCheck:
    """Each profile's prediction beside the measured ops of a stage check, and the iterations.

    ``ops``: the ``stage, microbatch, op, measured_s`` rows of a check of ``cfg`` (as
    :func:`run_stage_check` writes them). The plan is made again from ``cfg`` (the policies are
    deterministic for a seed), so a profile measured after the check -- or shipped later -- predicts
    the same micro-batches at the same budgets; ``planned`` (plan, budgets) skips that when the
    caller holds them. Adds (or replaces) a ``pred_<label>_s`` column per profile; the iteration
    table has the measured source first.
    """
    from sparsebalance.runner import prepare
    from sparsebalance.simulator.cost.latency import load_latency_model
    from sparsebalance.simulator.engine import PipelineInput, simulate

    if "measured" in profiles:
        raise ValueError("profiles: the label 'measured' names the measurement itself; choose another")
    prepared = prepared or prepare(cfg)
    plan, budgets = planned or plan_one_batch(cfg, prepared)
    mbs = list(plan.ranks[0])
    pp = cfg.cluster.pp
    ops = ops.sort_values(["microbatch", "stage", "op"], kind="stable").reset_index(drop=True)
    if len(ops) != 2 * pp * len(mbs) or set(ops.microbatch) != set(range(len(mbs))):
        raise ValueError(f"ops: {len(ops)} rows do not match the plan of {cfg.name!r} ({len(mbs)} micro-batches "
                         f"x {pp} stages x F/B)")
    for name, p in profiles.items():
        lm = load_latency_model(p, cfg.model, cfg.cluster, base_dir=cfg.base_dir, extrapolate="clamp",
                                allow_nonmonotone=True)
        ops[f"pred_{name}_s"] = [lm.stage_time(list(mbs[r.microbatch].lengths), budgets[0][r.microbatch],
                                               r.stage, backward=r.op == "B") for r in ops.itertuples()]
    lm0 = prepared.latency
    tokens = np.array([[sum(mb.lengths) for mb in mbs]])
    p2p = np.array([[lm0.p2p_time(int(t)) for t in tokens[0]]] * max(pp - 1, 0)).reshape(1, max(pp - 1, 0), -1)

    def iteration(column: str) -> float:
        f, b = (ops[ops.op == op].pivot(index="stage", columns="microbatch", values=column).to_numpy()
                for op in ("F", "B"))
        inp = PipelineInput(schedule=cfg.cluster.schedule, pp=pp, forward=f[None], backward=b[None], p2p=p2p,
                            tokens=tokens)
        return float(simulate(inp).iteration_time)

    preds = [c.removeprefix("pred_").removesuffix("_s") for c in ops.columns if c.startswith("pred_")]
    it = pd.DataFrame([{"source": "measured", "iteration_time_s": iteration("measured_s")}]
                      + [{"source": n, "iteration_time_s": iteration(f"pred_{n}_s")} for n in preds])
    it["error_vs_measured"] = it.iteration_time_s / it.iteration_time_s.iloc[0] - 1
    return StageCheck(ops=ops.sort_values(["microbatch", "stage", "op"], key=_op_order).reset_index(drop=True),
                      iteration=it)


def _op_order(col: pd.Series) -> pd.Series:
    return col.map({"F": 0, "B": 1}) if col.name == "op" else col


def main(argv: list[str] | None = None) -> int:
    """``python -m sparsebalance.stagecheck STAGES_CSV --profile LABEL=PROFILE ...``: predict a stage
    check measured before (e.g. gpu-check's stages.csv) with other profiles; prints the iterations."""
    import argparse

    from sparsebalance.errors import ConfigError
    from sparsebalance.runconfig import load_run_config

    ap = argparse.ArgumentParser(prog="python -m sparsebalance.stagecheck", description=main.__doc__)
    ap.add_argument("stages", help="stages.csv of a stage check")
    ap.add_argument("--config", default=None, help="its run config (default: gpu-check's preset)")
    ap.add_argument("--profile", action="append", required=True, metavar="LABEL=PROFILE",
                    help="a profile to predict with (shipped name or path), repeatable")
    ap.add_argument("--out", default=None, help="write the ops with the new columns here (CSV)")
    args = ap.parse_args(argv)
    try:
        profiles = dict(p.split("=", 1) for p in args.profile)
    except ValueError:
        ap.error("--profile: must be LABEL=PROFILE, e.g. measured=h100-measured-3b")
    if args.config is None:
        from importlib import resources

        args.config = str(resources.files("sparsebalance.data") / "presets" / "gpu_check_stages.toml")
    try:
        res = predict_stages(load_run_config(args.config), pd.read_csv(args.stages), profiles)
    except (ConfigError, ValueError, OSError) as e:
        print(f"stagecheck: {e}")
        return 2
    if args.out:
        res.ops.to_csv(args.out, index=False)
    print(res.iteration.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
