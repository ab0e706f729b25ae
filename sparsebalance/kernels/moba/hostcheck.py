"""Host-side checks of the MoBA Triton call: its launches, its host synchronisations, its host time.

* :func:`stubbed` replaces every Triton kernel of the call by a recorder (nothing runs on a
  device; each launch is logged as (kernel, MASKED)), so the PyTorch ops and the Python around the
  kernels run alone -- on any device, ``meta`` included;
* :class:`SyncRecorder` records every operation that would make the host wait for a CUDA device:
  ATen ops with a data-dependent output size or a value read back (``nonzero``, ``item``,
  ``unique``, ``bincount``, ``masked_select``, ``repeat_interleave`` without ``output_size``,
  boolean-mask indexing, ...), copies from the device to the host, and the Tensor methods that read
  device data on the host (``item``, ``tolist``, ``numpy``, ``cpu``, ``bool``/``int``/``float``);
* :func:`host_times`: the host time of a forward call and of its backward, min over many calls.

Used by ``tests/kernels/test_triton_host.py`` (zero synchronisations, host time under 100 us) and
``benchmarks/bench_moba_host.py`` (prints the times). On a GPU, ``gpu-check``'s speed step runs
the real call under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

#: The Triton kernels of one call, by module.
KERNELS = {
    "triton_gate": ("_block_means_kernel", "_gate_kernel"),
    "triton_select": ("_items_kernel",),
    "triton_fwd": ("_fwd_past_kernel", "_fwd_own_merge_kernel"),
    "triton_bwd": ("_bwd_prep_kernel", "_bwd_kv_kernel", "_bwd_dq_own_kernel", "_bwd_dq_past_kernel", "_cast_kernel"),
}
#: ATen ops (overload packets) that synchronise with the device whenever they run on one.
SYNC_OPS = {"nonzero", "_local_scalar_dense", "item", "is_nonzero", "masked_select", "unique", "_unique",
            "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive", "bincount", "equal",
            "allclose", "argwhere", "nonzero_numpy", "histc", "_assert_async"}
#: Tensor methods that read device data on the host.
SYNC_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


class _Recorder:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append((self.name.strip("_").removesuffix("_kernel"), bool(kw.get("MASKED", False))))
        return launch


@contextlib.contextmanager
def stubbed(log: list | None = None):
    """Every Triton kernel of the call replaced by a recorder appending (kernel, MASKED) to ``log``."""
    import importlib

    log = [] if log is None else log
    saved = []
    for mod_name, names in KERNELS.items():
        mod = importlib.import_module(f"sparsebalance.kernels.moba.{mod_name}")
        for n in names:
            saved.append((mod, n, getattr(mod, n)))
            setattr(mod, n, _Recorder(n, log))
    try:
        yield log
    finally:
        for mod, n, fn in saved:
            setattr(mod, n, fn)


class SyncRecorder:
    """``with SyncRecorder(device) as r: ...`` -> ``r.found``: what would have synchronised on
    ``device`` (a list of op / method names; host tensors -- ``cpu`` -- never count)."""

    def __init__(self, device: Any):
        import torch

        self.device = torch.device(device)
        self.found: list[str] = []
        self._stack = contextlib.ExitStack()

    def _on_device(self, x) -> bool:
        import torch

        return isinstance(x, torch.Tensor) and x.device.type == self.device.type

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        rec = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                rec._check(func.overloadpacket.__name__, args, kwargs)
                return func(*args, **kwargs)

        for name in SYNC_METHODS:
            orig = getattr(torch.Tensor, name)

            def wrapped(t, *a, _orig=orig, _name=name, **kw):
                if rec._on_device(t):
                    rec.found.append(f"Tensor.{_name}")
                return _orig(t, *a, **kw)

            self._stack.enter_context(_patched(torch.Tensor, name, wrapped))
        self._stack.enter_context(Mode())
        return self

    def _check(self, name: str, args, kwargs) -> None:
        import torch

        dev = [a for a in args if self._on_device(a)]
        if name in SYNC_OPS and dev:
            self.found.append(name)
        elif name == "repeat_interleave" and dev and isinstance(args[0], torch.Tensor) \
                and kwargs.get("output_size") is None:
            self.found.append("repeat_interleave without output_size")
        elif name in ("index", "index_put", "index_put_") and dev and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            self.found.append(f"{name} with a boolean mask")
        elif (name == "_to_copy" and dev and torch.device(kwargs.get("device") or self.device).type == "cpu") or (
                name == "copy_" and not self._on_device(args[0]) and self._on_device(args[1])):
            self.found.append("copy to the host")

    def __exit__(self, *exc):
        self._stack.close()
        return False


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def host_times(call, backward, *, repeats: int = 200) -> tuple[float, float]:
    """(forward, backward) host seconds, each the min over ``repeats`` calls: ``call()`` returns the
    output, ``backward(out)`` runs its backward (``torch.autograd.grad``, not ``.backward()``: leaf
    inputs would add each call's gradient into ``.grad``, host work a layer's intermediate q, k, v
    never has). Run inside :func:`stubbed` for the host alone."""
    fwd, bwd = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = call()
        t1 = time.perf_counter()
        backward(out)
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return min(fwd), min(bwd)
