"""The private torch and torchtitan things ``sparsebalance.titan.compat`` relies on: each test fails
when torch or torchtitan changes it (then compat.py needs a look, and so may its callers)."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("torchtitan")


def test_the_pinned_versions():
    import torch
    import torchtitan

    from sparsebalance.titan.compat import TORCHTITAN_VERSION

    assert torchtitan.__version__ == TORCHTITAN_VERSION
    assert torch.__version__.startswith("2.13.")


def test_torchtitan_picks_its_device_through_torchs_private_lookups():
    import importlib.util
    from pathlib import Path

    import torch._utils as tu

    src = Path(importlib.util.find_spec("torchtitan.tools.utils").origin).read_text()
    assert "from torch._utils import _get_available_device_type, _get_device_module" in src
    assert '_get_available_device_type() or "cuda"' in src
    assert callable(tu._get_available_device_type) and callable(tu._get_device_module)


def test_on_this_cpu_torchtitan_sees_a_cpu_and_our_device_module():
    import torch

    from sparsebalance.titan.compat import CpuDeviceModule, import_torchtitan

    utils = import_torchtitan()
    if torch.cuda.is_available():
        pytest.skip("an accelerator: compat leaves torchtitan's device alone")
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.components import metrics

    assert utils.device_type == "cpu" and dist_utils.device_type == "cpu"
    assert isinstance(metrics.device_module, CpuDeviceModule)
    dm = metrics.device_module
    assert dm.current_device() == 0 and dm.device_count() == 1 and dm.memory_stats() == {}
    assert dm.get_device_properties().total_memory > 0
    # what the monitor calls exists (the rest forwards to torch.cpu)
    for name in ("get_device_name", "reset_peak_memory_stats", "empty_cache", "synchronize", "set_device"):
        assert callable(getattr(dm, name))
    import torch._utils as tu

    assert tu._get_available_device_type() is None  # torch's look-ups restored after the import
    assert tu._get_device_module("cpu") is torch.cpu


def test_set_timeout_is_missing_in_torch_and_stands_in():
    import torch.distributed as dist

    from sparsebalance.titan import compat

    compat.import_torchtitan()
    assert dist.set_timeout is compat.set_timeout, "torch has its own set_timeout now: drop compat's"


def test_schedules_step_and_private_runner():
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
        Schedule1F1B,
        ScheduleGPipe,
    )

    from sparsebalance.titan.compat import step_accepts_microbatches

    for cls in (Schedule1F1B, ScheduleGPipe, PipelineScheduleMulti):
        params = list(inspect.signature(cls._step_microbatches).parameters)
        assert params[:7] == ["self", "arg_mbs", "kwarg_mbs", "target_mbs", "losses", "return_outputs",
                              "loss_kwargs"], cls
    obj = object.__new__(Schedule1F1B)
    assert not step_accepts_microbatches(obj), "torch takes arg_mbs in step() now: compat's path is unused"
    for cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        src = inspect.getsource(cls.step)
        assert "clear_runtime_states()" in src and "has_backward = self._has_backward" in src
    assert "self._stage = stage" in inspect.getsource(PipelineScheduleSingle.__init__)
    assert "self._stages = stages" in inspect.getsource(PipelineScheduleMulti.__init__)


def test_fsdp_reduction_switch_exists():
    from torch.distributed.fsdp import FSDPModule

    assert callable(FSDPModule.set_force_sum_reduction_for_comms)
    import torchtitan.distributed.fsdp as f

    assert "set_gradient_divide_factor(1.0)" in inspect.getsource(f)


def test_without_torchtitan_the_import_is_refused_in_one_line(monkeypatch):
    """An environment without the [titan] extra gets one line naming the extra, not a traceback from
    torchtitan's first import (the CLI turns the ConfigError into exit 2)."""
    import importlib.util
    import sys

    from sparsebalance.errors import ConfigError
    from sparsebalance.titan import compat

    real = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "torchtitan")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchtitan" else real(name, *a))
    with pytest.raises(ConfigError, match=r"torchtitan is not installed.*\[titan\] extra installs torchtitan 0\.3\.0"):
        compat.import_torchtitan()
