"""The compiled layer and head (``kernels/fastlayer.py``, ``kernels/lmhead.py``) against the eager
Hugging Face modules on the same weights and inputs: float32 close, bf16 as close to a float64
reference as eager is, packed documents with restarting positions as if run alone, new micro-batch
lengths without recompiling; the chunked linear cross-entropy exact in float64; the option validated.

The compiled tests compile with Inductor on this CPU (C++ through gcc): about a minute cold, seconds
from the on-disk cache, so they are marked ``slow`` (``make test`` runs them; ``make test-fast`` not).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sparsebalance.errors import ConfigError
from sparsebalance.kernels.fastlayer import LAYER_IMPLS, resolve_layer_impl
from sparsebalance.kernels.lmhead import linear_cross_entropy, vocab_chunk
from sparsebalance.kernels.qwen2 import (
    IGNORE_INDEX,
    MobaArgs,
    build_qwen2,
    full_forward_loss,
    lm_loss_sum,
    pack,
)
from sparsebalance.simulator.config import tiny

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_resolve_layer_impl_defaults_and_refusals():
    assert resolve_layer_impl("auto", "cpu") == "eager"
    assert resolve_layer_impl("auto", "cuda") == "compiled"
    assert resolve_layer_impl("auto", "cuda", tp=2) == "eager"
    assert resolve_layer_impl("auto", "cuda", split_backward=True) == "eager"
    assert resolve_layer_impl("compiled", "cpu") == "compiled" and resolve_layer_impl("eager", "cuda") == "eager"
    with pytest.raises(ConfigError, match="layer_impl: 'fused' is not allowed; choose one of auto, eager, compiled"):
        resolve_layer_impl("fused", "cpu")
    with pytest.raises(ConfigError, match=r"realrun\.layer_impl: compiled runs with tp = 1 only"):
        resolve_layer_impl("compiled", "cuda", tp=2, field="realrun.layer_impl")
    with pytest.raises(ConfigError, match="zb-h1"):
        resolve_layer_impl("compiled", "cuda", split_backward=True)
    assert LAYER_IMPLS == ("auto", "eager", "compiled")


def _run_cfg(**cluster):
    from sparsebalance.runconfig import run_config_from_mapping

    return run_config_from_mapping({
        "model": {"preset": "tiny"}, "cluster": {"pp": 2, "dp": 1, "global_batch": 4} | cluster,
        "data": {"source": "text_dir", "path": "stdlib"}, "realrun": {"layer_impl": "compiled"}})


def test_realrun_refuses_compiled_where_it_cannot_run():
    from sparsebalance.realrun.config import layer_impl, realrun_config

    cfg = _run_cfg()
    assert layer_impl(cfg, realrun_config(cfg)) == "compiled"
    with pytest.raises(ConfigError, match=r"^realrun\.layer_impl: compiled cannot split the backward"):
        realrun_config(_run_cfg(schedule="zb-h1"))
    with pytest.raises(ConfigError, match=r"^realrun\.layer_impl: compiled runs with tp = 1 only"):
        realrun_config(_run_cfg(tp=2))


def test_vocab_chunk_closed_form():
    assert vocab_chunk(8192, 151936) == (1 << 28) // 8192  # 32768 columns: 5 chunks
    assert vocab_chunk(1024, 151936) == 151936  # fits whole
    assert vocab_chunk(3000, 151936) == 89472 and 89472 % 128 == 0
    assert vocab_chunk(100, 300, max_elements=7000) == 70  # under 128 columns: as computed


@pytest.mark.parametrize("tokens,vocab,hidden,max_elements,seed", [
    (37, 300, 24, 7000, 0),  # 5 chunks of 70 columns, the last one 20
    (64, 256, 16, 1 << 28, 1),  # one chunk
    (50, 257, 8, 50 * 129, 2),  # 128-column chunks and a 1-column remainder
])
def test_linear_cross_entropy_is_exact_in_float64(tokens, vocab, hidden, max_elements, seed):
    """Loss and both gradients against the whole-logits cross entropy, float64; ignored labels too."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[::7] = IGNORE_INDEX
    dloss = torch.rand((), generator=g, dtype=torch.float64) + 0.5
    got_h, got_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    got = linear_cross_entropy(got_h, got_w, labels, max_elements=max_elements)
    got.backward(dloss)
    ref_h, ref_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = lm_loss_sum((ref_h @ ref_w.t())[None], labels[None])
    ref.backward(dloss)
    assert got.dtype == torch.float64 and got.shape == ()
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(got_h.grad, ref_h.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_w.grad, ref_w.grad, rtol=1e-10, atol=1e-12)
    assert (got_h.grad[::7] == 0).all() and (got_h.grad[1] != 0).any()  # ignored rows: no gradient


# -- compiled (Inductor) --------------------------------------------------------------------------------------
def _loss_and_grads(dtype: str, impl: str, batch, budget: int):
    net = build_qwen2(tiny(), seed=3, dtype=dtype, device=DEVICE)
    loss = full_forward_loss(net, batch, MobaArgs(cu_seqlens=batch.cu_seqlens, budget=budget, block_size=32), impl)
    loss.backward()
    return loss.detach().double(), {n: p.grad.double() for n, p in net.named_parameters()}


def _batch(lens, seed):
    rng = np.random.default_rng(seed)
    return pack([rng.integers(0, tiny().vocab, n) for n in lens], device=DEVICE)


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _assert_grads_close(got: dict, want: dict) -> None:
    """float32 closeness of every gradient; the absolute floor is relative to the largest gradient
    of all (the key projection's bias has an exact gradient of 0: softmax ignores a shift common to a
    row's scores, so both sides hold rounding noise there)."""
    scale = max(float(g.abs().max()) for g in want.values())
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6 * scale, msg=name)


@pytest.mark.slow
def test_compiled_model_matches_eager_in_float32_and_new_lengths_do_not_recompile():
    """Four layers (MoBA, sparse budget) + head, loss and every gradient; the second and third
    packings (other lengths, other document counts) reuse the graphs of the first."""
    graphs = []
    for i, lens in enumerate([(70, 50), (100, 33, 20), (41,)]):
        batch = _batch(lens, seed=i)
        want, want_g = _loss_and_grads("float32", "eager", batch, budget=2)
        got, got_g = _loss_and_grads("float32", "compiled", batch, budget=2)
        graphs.append(_unique_graphs())
        torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
        _assert_grads_close(got_g, want_g)
    assert graphs[1] == graphs[0] and graphs[2] == graphs[0], graphs


@pytest.mark.slow
def test_packed_documents_equal_each_document_alone_compiled():
    """Positions restart per document: the packed row's loss is the sum of each document's alone."""
    lens = (45, 70, 33)
    packed, _ = _loss_and_grads("float32", "compiled", _batch(lens, seed=7), budget=2)
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, tiny().vocab, n) for n in lens]
    alone = sum(_loss_and_grads("float32", "compiled", pack([d], device=DEVICE), budget=2)[0] for d in docs)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=0)


@pytest.mark.slow
def test_compiled_model_in_bf16_is_as_close_to_float64_as_eager():
    """bf16 tolerance, judged against the truth: for the loss and every gradient, the compiled
    model's error against the float64 model is at most twice eager bf16's, + 1e-3 (dense budget:
    no gate decision flips between dtypes)."""
    batch = _batch((70, 50), seed=11)
    ref, ref_g = _loss_and_grads("float64", "eager", batch, budget=64)
    eager, eager_g = _loss_and_grads("bfloat16", "eager", batch, budget=64)
    comp, comp_g = _loss_and_grads("bfloat16", "compiled", batch, budget=64)
    assert abs(float(comp - ref)) <= 2 * abs(float(eager - ref)) + 1e-3 * abs(float(ref))
    for name, g in ref_g.items():
        e, c = (float((x[name] - g).norm() / g.norm()) for x in (eager_g, comp_g))
        assert c <= 2 * e + 1e-3, (name, c, e)


@pytest.mark.slow
def test_compiled_chunked_head_matches_eager_head():
    """The compiled chunk kernels (several vocabulary chunks) against the whole-logits head, fp32."""
    from sparsebalance.kernels.fastlayer import compiled, rms_norm
    from sparsebalance.kernels.qwen2 import head_loss

    net = build_qwen2(tiny(), seed=4, device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(4)
    labels = torch.randint(0, tiny().vocab, (1, 90), generator=g, device=DEVICE)
    labels[0, ::5] = IGNORE_INDEX
    h = torch.randn(1, 90, tiny().hidden, generator=g, device=DEVICE)
    want = head_loss(net.model.norm, net.lm_head, h, labels, "eager")
    hn = compiled(rms_norm)(h, net.model.norm.weight, net.model.norm.variance_epsilon)
    xs = [x.clone().requires_grad_() for x in (hn[0].detach(), net.lm_head.weight.detach())]
    got = linear_cross_entropy(*xs, labels[0], compile_=True, max_elements=90 * 100)  # 3 chunks
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    got.backward()
    ys = [x.clone().requires_grad_() for x in (hn[0].detach(), net.lm_head.weight.detach())]
    lm_loss_sum((ys[0] @ ys[1].t())[None], labels).backward()
    for a, b in zip(xs, ys):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_compiled_stage_module_equals_eager_stage(tmp_path):
    """realrun's StageModule with ``layer_impl = "compiled"``: its warm-up and its forward (last stage:
    layers, norm, chunked loss) give the eager stage's loss and gradients."""
    from sparsebalance.realrun.config import RealrunConfig
    from sparsebalance.realrun.stage import build_stage_module

    cfg = _run_cfg()
    batch = _batch((60, 40), seed=5)
    out = {}
    for impl in ("eager", "compiled"):
        mod = build_stage_module(cfg, RealrunConfig(layer_impl=impl), 1, 2, torch.device(DEVICE))
        assert mod.layer_impl == impl
        mod.warm_up()
        assert all(p.grad is None for p in mod.parameters())  # the warm-up leaves no gradient behind
        h = torch.randn(1, 100, tiny().hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        h.requires_grad_()
        loss = mod(h, batch, MobaArgs(cu_seqlens=batch.cu_seqlens, budget=2, block_size=32))
        loss.backward()
        out[impl] = (loss.detach(), h.grad, {n: p.grad for n, p in mod.named_parameters()})
    torch.testing.assert_close(out["compiled"][0], out["eager"][0], rtol=2e-6, atol=0)
    torch.testing.assert_close(out["compiled"][1], out["eager"][1], rtol=1e-4, atol=1e-7)
    _assert_grads_close(out["compiled"][2], out["eager"][2])


@pytest.mark.slow
def test_profiler_and_layer_bench_time_the_compiled_layer(tmp_path):
    """The profiler's compiled closures (split rows of the eager layer: realrun's zb-h1 runs eager),
    the eager/compiled table with launch counts, the float64 agreement, and gpu-check's layer step
    on this CPU (its plumbing)."""
    import time

    from sparsebalance.gpucheck import steps
    from sparsebalance.kernels.layerbench import agreement, layer_table
    from sparsebalance.kernels.profiler import Bench, ProfileGrid

    bench = Bench(tiny(), ProfileGrid(layer_impl="compiled", device=DEVICE))
    layer = bench.items("layer", 64, 0)
    assert [name for (name, _, _), _, _ in layer] == ["layer_fwd", "layer_bwd", "layer_bwd_input", "layer_bwd_weight"]
    y_compiled, y_split = layer[0][1](), layer[2][2]()  # the timed forward, the split rows' forward
    assert type(y_compiled.grad_fn).__name__ == "CompiledFunctionBackward"
    assert type(y_split.grad_fn).__name__ == "AddBackward0"  # the eager layer's last residual add
    from sparsebalance.kernels.measure import measure_profile

    grid = ProfileGrid(layer_impl="compiled", device=DEVICE, seq_lens=(64, 96), budgets=(1, 2), tokens=(64, 96),
                       params=(100, 1000), repeats=1, warmup=0)
    prof = measure_profile(tiny(), grid, command="test")
    path = prof.save(tmp_path / "compiled-profile")
    from sparsebalance.simulator.cost.catalog import load_profile

    loaded = load_profile(str(path))  # format 2: the split rows are there (the eager layer's)
    assert {"layer_bwd_input", "head_bwd_weight"} <= set(loaded.ops) and "layer_impl compiled" in loaded.meta.how
    df = layer_table(tiny(), (64, 96), device=DEVICE, repeats=2, warmup=1)
    assert len(df) == 2 * 2 * 2 and (df.fwd_s > 0).all() and (df.bwd_s > 0).all()
    launches = df.set_index(["impl", "op", "tokens"]).launches
    assert launches["compiled", "layer", 64] < launches["eager", "layer", 64]  # fused norms, RoPE, SwiGLU
    acc = agreement(tiny(), 48, device=DEVICE)
    assert acc.ok.all() and len(acc) == 2 + len(list(build_qwen2(tiny()).model.layers[0].parameters()))
    assert (acc.err_compiled < 1e-5).all()  # float32 here
    for d in ("out", "work"):
        (tmp_path / d).mkdir()
    ctx = steps.Step(out=tmp_path / "out", work=tmp_path / "work", deadline=time.monotonic() + 300, device="cpu")
    status, fig, file = steps.layer(ctx)
    assert status == "ok", fig
    assert "layer compiled" in fig and "launches" in fig and "vs float64" in fig and file == "rest.tar.gz: layer.csv"
    assert (tmp_path / "work" / "layer.csv").is_file() and not list((tmp_path / "out").iterdir())
