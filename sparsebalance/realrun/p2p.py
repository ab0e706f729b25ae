"""Point-to-point transfers of variable-shape activations and gradients between adjacent stages.

Every tensor is preceded by a fixed-size int64 header (ndim, shape padded to 4 dims, dtype code), so
micro-batches of any length flow without a static-shape contract.

Why this cannot deadlock (at 2, 4, 8 or any number of stages):
- sends never block: ``isend`` posts the header and the payload and returns; the sender keeps the
  buffers alive and waits for all its sends only after its last action of the iteration;
- only receives block, and a rank receives exactly what its next action needs, so a rank waits
  only on an action that the schedule orders earlier on another stage: the wait graph is the
  schedule's dependency graph, which is acyclic for every schedule the simulator runs (it checks);
- activations (stage s -> s+1) and gradients (s+1 -> s) travel in two different process groups
  (two communicators), so on NCCL, where sends and receives of one communicator share a stream, a
  gradient send can never queue behind an activation send that waits for its receiver, or vice
  versa. Inside one group and one ordered pair of ranks, messages go one way and in the order the
  receiver asks for them (the (chunk, micro-batch) order of forwards, and of backwards, is the same
  on every stage in GPipe, 1F1B, interleaved 1F1B and ZB-H1), and tags (a key per (vstage,
  micro-batch), :meth:`P2P.send`) make the matching explicit on gloo.
"""

from __future__ import annotations

from typing import Any

_DTYPES = ("float32", "bfloat16", "float16", "float64")
HEADER_LEN = 6  # ndim, 4 dims, dtype code


def _dtype_code(dtype: Any) -> int:
    name = str(dtype).removeprefix("torch.")
    return _DTYPES.index(name)


class P2P:
    """Sends and receives of one rank. ``fwd_group``/``bwd_group`` span all ranks."""

    def __init__(self, *, fwd_group: Any, bwd_group: Any, device: Any) -> None:
        self.fwd_group, self.bwd_group, self.device = fwd_group, bwd_group, device
        self._pending: list[tuple[Any, Any]] = []

    def _group(self, grad: bool) -> Any:
        return self.bwd_group if grad else self.fwd_group

    def send(self, tensor: Any, dst: int, *, key: int, grad: bool) -> None:
        """Post header + payload to global rank ``dst``; returns at once (see module doc).
        ``key`` names the message (vstage x micro-batches + micro-batch); its tags are 2 key, 2 key + 1."""
        import torch
        import torch.distributed as dist

        t = tensor.detach().contiguous()
        if t.dim() > 4:
            raise ValueError(f"p2p: at most 4 dims, got shape {tuple(t.shape)}")
        shape = list(t.shape) + [0] * (4 - t.dim())
        header = torch.tensor([t.dim(), *shape, _dtype_code(t.dtype)], dtype=torch.int64,
                              device=self.device)
        g = self._group(grad)
        tag = 2 * key
        self._pending.append((dist.isend(header, dst, group=g, tag=tag), header))
        self._pending.append((dist.isend(t, dst, group=g, tag=tag + 1), t))

    def recv(self, src: int, *, key: int, grad: bool) -> Any:
        """Block until the tensor ``key`` from global rank ``src`` has arrived; return it."""
        import torch
        import torch.distributed as dist

        g = self._group(grad)
        tag = 2 * key
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        dist.irecv(header, src, group=g, tag=tag).wait()
        h = header.tolist()
        shape = h[1:1 + h[0]]
        out = torch.empty(shape, dtype=getattr(torch, _DTYPES[h[5]]), device=self.device)
        dist.irecv(out, src, group=g, tag=tag + 1).wait()
        return out

    def wait_sends(self) -> None:
        """Wait for every posted send (end of iteration), then free their buffers."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
