"""Everything torchtitan 0.3.0 needs that the pinned torch 2.13.0 (CPU build) lacks, in one module.

torchtitan 0.3.0 was written against a newer torch and for accelerators. On torch 2.13.0 and this
CPU five things stand in its way, and this module is the only place that reaches past a public API
to remove them (``tests/titan/test_compat.py`` fails when any of them changes, in torch or in
torchtitan):

1. **The device.** ``torchtitan.tools.utils`` picks its device type once, at import, from torch's
   private ``torch._utils._get_available_device_type`` and falls back to ``"cuda"`` when it finds no
   accelerator; several torchtitan modules copy the value at their own import. :func:`import_torchtitan`
   imports torchtitan with that look-up answering ``"cpu"`` where no accelerator exists (and leaves it
   alone where one does), so every copy says ``"cpu"`` and the process group is gloo; its device
   module (``torch._utils._get_device_module``, also private) is then :class:`CpuDeviceModule`,
   ``torch.cpu`` with the few ``torch.cuda`` calls torchtitan makes of it.
2. **``torch.distributed.set_timeout``** (torch >= 2.14), which the trainer calls after its first
   step to shorten the collectives' timeout: :func:`set_timeout` is installed in its place on 2.13
   and keeps the timeout the groups were created with.
3. **``schedule.step(arg_mbs=..., kwarg_mbs=...)``** (micro-batches handed over already split, torch
   >= 2.14; 2.13's ``step`` only splits a whole batch itself): :func:`step_microbatches` does what
   2.14's ``step`` does with them on 2.13: the per-iteration stage set-up, then
   ``_step_microbatches``, the private method both versions' ``step`` ends in.
4. **FSDP on gloo** (the CPU's process group): :func:`gloo_fsdp`, public FSDP API only.
5. **The stages of a schedule** (to time each stage's forward and backward): :func:`schedule_stages`
   reads the schedules' private ``_stage`` / ``_stages``.

The failure reported on 2.13 as ``fully_shard`` with ``dp_mesh_dims`` is not patched: it
comes from torchtitan's default SPMD back-end (``spmd_types``), and the presets choose
``parallelism.spmd_backend = "partial_dtensor"``, torchtitan's plain-DTensor path, which calls
``fully_shard`` on a one-dimensional data-parallel mesh without ``dp_mesh_dims``.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

TORCHTITAN_VERSION = "0.3.0"
"""The torchtitan release this module is written for (pyproject's ``[titan]`` extra pins it)."""


def accelerator_available() -> bool:
    import torch

    return torch.cuda.is_available()


def import_torchtitan() -> Any:
    """Import torchtitan with its device type right for this machine (point 1); returns the
    ``torchtitan.tools.utils`` module. Idempotent; an import that happened before (with ``cuda`` on a
    CPU-only machine) is refused with one line rather than failing later inside a CUDA call."""
    import importlib.util
    import sys

    import torch._utils as tu

    if "torchtitan" not in sys.modules and importlib.util.find_spec("torchtitan") is None:
        from sparsebalance.errors import ConfigError

        raise ConfigError(f"torchtitan is not installed in this environment: the [titan] extra installs "
                          f"torchtitan {TORCHTITAN_VERSION} (make install does; or pip install -e '.[titan]')")

    loaded = sys.modules.get("torchtitan.tools.utils")
    if loaded is not None:
        want = "cuda" if accelerator_available() else "cpu"
        if loaded.device_type != want:
            from sparsebalance.errors import ConfigError

            raise ConfigError(f"torchtitan was imported before sparsebalance.titan (device "
                              f"{loaded.device_type!r}, this machine has {want!r}): start the job with "
                              "`python -m sparsebalance.titan.train` (or import sparsebalance.titan first)")
        _install_set_timeout()
        return loaded
    original = tu._get_available_device_type, tu._get_device_module
    if not accelerator_available():
        tu._get_available_device_type = lambda: "cpu"
        tu._get_device_module = lambda name: CpuDeviceModule() if name == "cpu" else original[1](name)
    try:
        from torchtitan.tools import utils
    finally:
        tu._get_available_device_type, tu._get_device_module = original
    _install_set_timeout()
    return utils


class CpuDeviceModule:
    """``torch.cpu`` with the ``torch.cuda`` calls torchtitan's device monitor and set-up make
    (device name and capacity, memory statistics): what a CPU can answer, or nothing to report."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        import platform

        return platform.processor() or platform.machine() or "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        import os
        from types import SimpleNamespace

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return SimpleNamespace(name=CpuDeviceModule.get_device_name(), total_memory=total)

    @staticmethod
    def memory_stats(device: Any = None) -> dict:
        return {}  # no allocator statistics on the CPU: torchtitan then reports -1

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0  # an index, as torch.cuda's (torch.cpu's is the string "cpu")


def set_timeout(timeout: timedelta, group: Any = None) -> None:
    """Stands in for torch 2.14's ``torch.distributed.set_timeout`` on 2.13 (point 2). torch 2.13 has
    no public way to change a live group's timeout, so the groups keep the one they were created
    with (``comm.init_timeout_seconds``): the trainer's shorter ``comm.train_timeout_seconds`` would
    only have bounded a hang sooner; no result depends on it."""
    del timeout, group


def _install_set_timeout() -> None:
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = set_timeout


def step_accepts_microbatches(schedule: Any) -> bool:
    """Whether this torch's ``schedule.step`` takes ``arg_mbs`` / ``kwarg_mbs`` itself."""
    return "kwarg_mbs" in inspect.signature(schedule.step).parameters


def step_microbatches(schedule: Any, *, arg_mbs: list | None, kwarg_mbs: list[dict],
                      target_mbs: list | None, losses: list | None, loss_kwargs: dict | None) -> None:
    """``schedule.step(arg_mbs=..., kwarg_mbs=..., ...)`` on any torch (point 3): micro-batches that
    were split by the data loader (a plan's micro-batches, each its own shape and budgets) run in the
    schedule's order as given, never re-split."""
    if step_accepts_microbatches(schedule):
        schedule.step(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs, losses=losses,
                      loss_kwargs=loss_kwargs, return_outputs=False)
        return
    import torch

    if schedule._has_backward and not torch.is_grad_enabled():
        raise RuntimeError("step_microbatches needs gradients enabled (the schedule runs a backward)")
    for stage in schedule_stages(schedule):  # what 2.13's step() does before splitting, then the shared runner
        stage.has_backward = schedule._has_backward
        stage.clear_runtime_states()
    schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, False, loss_kwargs=loss_kwargs)


def schedule_stages(schedule: Any) -> list:
    """The pipeline stages a schedule runs on this rank (``_stage`` of a single-stage schedule,
    ``_stages`` of a multi-stage one: private attributes of torch's schedules, read here only)."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def gloo_fsdp(model_parts: list) -> int:
    """FSDP on gloo: torchtitan turns FSDP's gradient division off (``set_gradient_divide_factor(1)``,
    the loss is already divided by the global token count), which makes FSDP reduce-scatter with
    ``ReduceOp.PREMUL_SUM``; gloo has no such op. Plain SUM with a post-division by 1 is the same
    arithmetic: ``set_force_sum_reduction_for_comms(True)`` (public FSDP API) on every FSDP module
    when the default group is gloo. Returns how many modules were set."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return 0
    n = 0
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
                n += 1
    return n
