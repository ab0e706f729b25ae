"""The split backward (I then W) gives the whole backward's gradients."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sparsebalance.kernels.qwen2 import MobaArgs, build_qwen2, pack, run_layers
from sparsebalance.kernels.split_backward import backward_input, backward_weight
from sparsebalance.simulator.config import tiny


@pytest.mark.parametrize("first", [True, False])
def test_input_then_weight_equals_one_backward(first):
    net = build_qwen2(tiny(), seed=3, dtype="float64")
    gen = torch.Generator().manual_seed(0)
    batch = pack([torch.randint(0, 256, (70,), generator=gen).numpy(),
                  torch.randint(0, 256, (41,), generator=gen).numpy()])
    moba = MobaArgs(cu_seqlens=batch.cu_seqlens, budget=2, block_size=32, backend="naive")
    layers = [p for layer in net.model.layers[:2] for p in layer.parameters()]
    params = [*net.model.embed_tokens.parameters(), *layers] if first else layers
    x0 = torch.randn(1, 111, 64, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(1, 111, 64, generator=gen, dtype=torch.float64)

    def forward():  # (embedding output or None, the stage's input leaf, output)
        if not first:
            return None, x0, run_layers(net, x0, batch, moba, layers=net.model.layers[:2])
        e = net.model.embed_tokens(batch.input_ids)
        x = e.detach().requires_grad_()
        return e, x, run_layers(net, x, batch, moba, layers=net.model.layers[:2])

    # reference: the whole backward in one call, through the embedding on a first stage
    h = net.model.embed_tokens(batch.input_ids) if first else x0
    run_layers(net, h, batch, moba, layers=net.model.layers[:2]).backward(dy)
    want = [p.grad.clone() for p in params]
    want_dx = None if first else x0.grad.clone()
    net.zero_grad(set_to_none=True)
    x0.grad = None

    e, x, y = forward()
    dx, state = backward_input([y], [dy], [x], layers)
    assert all(p.grad is None for p in params)  # I leaves the weights alone ...
    backward_weight(layers, state)  # ... W fills them in
    if first:
        e.backward(x.grad)  # the embedding's backward is weight gradient only
    for p, g in zip(params, want):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-12)
    if not first:
        torch.testing.assert_close(dx[0], want_dx, rtol=1e-10, atol=1e-12)
