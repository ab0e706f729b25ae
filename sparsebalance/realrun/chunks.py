"""One device's actions of one iteration: its model chunks (virtual stages), F, B, I and W.

A device (a pipeline stage of one DP replica and one TP rank) holds one chunk per virtual stage the
schedule places on it (``simulator.layout.placement``: vstage ``c * pp + s`` on device ``s``).
It walks its action order (``stage_orders``, the simulator's) and for action ``(kind, vs, j)``:

* **F**: its input is the token ids (vstage 0), the previous vstage's output handed over in
  memory when that vstage lives on this device, else received by P2P; the output goes on the same
  way; the last vstage's output is the micro-batch's loss (divided by the global batch's label
  tokens, see ``worker.py``).
* **B**: the whole backward, ``torch.autograd.backward`` from the output with the gradient that
  came back (none on the last vstage); the input's gradient goes to the previous vstage.
* **I** then, later, **W** (ZB-H1): the backward split as torch.distributed.pipelining splits it
  (``kernels/split_backward.py``): I computes the input's gradient (sent on at once) and keeps
  what W needs; W accumulates the weights' gradients. On vstage 0 the embedding's output is detached
  into the chunk's input leaf, so I stops there and W also runs the embedding's backward.

P2P messages are keyed by (vstage, micro-batch), so chunks sharing a pair of devices never mix.
Every action is timed into trace rows (stage = this device); only TP rank 0 writes rows and the
loss (its TP peers compute the same values; the coverage curves are averaged over them,
``worker.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True, slots=True)
class Route:
    """Where a device's neighbours live."""

    placement: tuple[int, ...]
    """Device of every virtual stage."""
    me: int
    """This device (its pipeline stage index)."""
    rank_of: Callable[[int], int]
    """Device -> global rank of that device in this DP replica and TP rank."""

    @property
    def nv(self) -> int:
        return len(self.placement)

    def local(self, vs: int) -> bool:
        return self.placement[vs] == self.me


@dataclass(kw_only=True, slots=True)
class ChunkState:
    """What an iteration keeps between a device's actions."""

    saved: dict = field(default_factory=dict)
    """(vs, j) -> (input leaf or None, output, embedding output or None) from F to the backward."""
    fwd_in: dict = field(default_factory=dict)
    """(vs, j) -> input handed over in memory by vstage vs - 1 on this device."""
    bwd_in: dict = field(default_factory=dict)
    """(vs, j) -> output gradient handed over in memory by vstage vs + 1 on this device."""
    pending_w: dict = field(default_factory=dict)
    """(vs, j) -> (I's state, embedding output, input leaf) until W."""


class DeviceActions:
    """Runs one device's actions; see the module docstring. ``chunks``: vstage -> StageModule."""

    def __init__(self, *, chunks: dict[int, Any], route: Route, p2p: Any, m: int, now: Callable[[], float]) -> None:
        self.chunks, self.route, self.p2p, self.m, self.now = chunks, route, p2p, m, now
        self.state = ChunkState()

    def key(self, vs: int, j: int) -> int:
        return vs * self.m + j

    def weight_params(self, vs: int) -> list:
        """Parameters whose gradients W computes (all of the chunk's but the embedding's, whose
        backward W runs separately)."""
        mod = self.chunks[vs]
        skip = {id(p) for p in mod.model.embed_tokens.parameters()} if mod.first else set()
        return [p for p in mod.parameters() if p.requires_grad and id(p) not in skip]

    # -- inputs and outputs across vstages ---------------------------------------------------------
    def _input(self, vs: int, j: int, row: Callable) -> Any:
        st, r = self.state, self.route
        if r.local(vs - 1):
            return st.fwd_in.pop((vs, j)).requires_grad_()
        t0 = self.now()
        x = self.p2p.recv(r.rank_of(r.placement[vs - 1]), key=self.key(vs, j), grad=False)
        row("P2P", t0, self.now())
        return x.requires_grad_()

    def _output(self, vs: int, j: int, out: Any) -> None:
        r = self.route
        if r.local(vs + 1):
            self.state.fwd_in[(vs + 1, j)] = out.detach()
        else:
            self.p2p.send(out, r.rank_of(r.placement[vs + 1]), key=self.key(vs + 1, j), grad=False)

    def _out_grad(self, vs: int, j: int, row: Callable) -> Any:
        r = self.route
        if vs == r.nv - 1:
            return None
        if r.local(vs + 1):
            return self.state.bwd_in.pop((vs, j))
        t0 = self.now()
        g = self.p2p.recv(r.rank_of(r.placement[vs + 1]), key=self.key(vs, j), grad=True)
        row("P2P", t0, self.now())
        return g

    def _in_grad(self, vs: int, j: int, g: Any) -> None:
        r = self.route
        if vs == 0:
            return
        if r.local(vs - 1):
            self.state.bwd_in[(vs - 1, j)] = g
        else:
            self.p2p.send(g, r.rank_of(r.placement[vs - 1]), key=self.key(vs - 1, j), grad=True)

    # -- the actions --------------------------------------------------------------------------------
    def forward(self, vs: int, j: int, make_batch: Callable, moba_for: Callable, label_tokens: int,
                split: bool, row: Callable) -> tuple[Any, Any]:
        """F; returns (the loss, a 0-dim tensor, on the last vstage, else None; the MobaArgs used).
        The micro-batch is packed (``make_batch``) and its MobaArgs built (``moba_for(cu_seqlens=)``)
        inside F's timed span, as the 1F1B path always timed them."""
        from sparsebalance.kernels.cpuclock import thread_usage

        mod = self.chunks[vs]
        x = emb = None
        if vs > 0:
            x = self._input(vs, j, row)
        t0, u0 = self.now(), thread_usage()
        batch = make_batch()
        moba = moba_for(cu_seqlens=batch.cu_seqlens)
        if vs == 0 and split:  # the embedding apart, so that I stops at its output
            emb = mod.model.embed_tokens(batch.input_ids)
            x = emb.detach().requires_grad_()
        out = mod(x, batch, moba)
        last = vs == self.route.nv - 1
        if last:
            out = out / label_tokens
        row("F", t0, self.now(), u0)
        if not last:
            self._output(vs, j, out)
        self.state.saved[(vs, j)] = (x, out, emb)
        return (out.detach() if last else None), moba

    def backward(self, vs: int, j: int, row: Callable) -> None:
        """B: the whole backward."""
        import torch

        from sparsebalance.kernels.cpuclock import thread_usage

        x, out, _ = self.state.saved.pop((vs, j))
        g = self._out_grad(vs, j, row)
        t0, u0 = self.now(), thread_usage()
        torch.autograd.backward(out, grad_tensors=g)
        row("B", t0, self.now(), u0)
        if x is not None:
            self._in_grad(vs, j, x.grad)

    def backward_input(self, vs: int, j: int, row: Callable) -> None:
        """I: the input's gradient, sent on at once; W's state kept."""
        from sparsebalance.kernels.cpuclock import thread_usage
        from sparsebalance.kernels.split_backward import backward_input

        x, out, emb = self.state.saved.pop((vs, j))
        g = self._out_grad(vs, j, row)
        t0, u0 = self.now(), thread_usage()
        dx, state = backward_input([out], None if g is None else [g], [x], self.weight_params(vs))
        row("I", t0, self.now(), u0)
        self.state.pending_w[(vs, j)] = (state, emb, x)
        self._in_grad(vs, j, dx[0])

    def backward_weight(self, vs: int, j: int, row: Callable) -> None:
        """W: the weights' gradients (and the embedding's on vstage 0)."""
        from sparsebalance.kernels.cpuclock import thread_usage
        from sparsebalance.kernels.split_backward import backward_weight

        state, emb, x = self.state.pending_w.pop((vs, j))
        t0, u0 = self.now(), thread_usage()
        backward_weight(self.weight_params(vs), state)
        if emb is not None:
            emb.backward(x.grad)
        row("W", t0, self.now(), u0)

    def check_done(self) -> None:
        st = self.state
        left = [k for k, v in (("saved", st.saved), ("fwd_in", st.fwd_in), ("bwd_in", st.bwd_in),
                               ("pending_w", st.pending_w)) if v]
        if left:
            raise RuntimeError(f"realrun: actions left state behind at the iteration's end: {left}")
