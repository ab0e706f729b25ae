"""The cluster simulator: configs, plans, latency model, schedules and their graphs, the timing core,
the SimPy model, the memory model, executor, trace.

Nothing here imports torch. The heavier names are loaded on first use::

    from sparsebalance.simulator import PipelineInput, simulate, stage_orders, SimulatorExecutor
"""

from __future__ import annotations

import importlib

_LAZY = {
    "PipelineInput": "engine", "PipelineResult": "engine", "simulate": "engine",
    "stage_orders": "schedules", "validate_schedule": "schedules",
    "SimulatorExecutor": "executor",
    "build_graph": "graph", "schedule_graph": "graph", "ActionGraph": "graph",
    "time_graph": "timing", "replica_finish": "timing", "simulate_events": "events",
    "memory_report": "memory", "MemoryReport": "memory",
    "to_chrome_trace": "trace", "write_trace": "trace", "TRACE_COLUMNS": "trace", "TRACE_OPS": "trace",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sparsebalance.simulator' has no attribute {name!r}")
    return getattr(importlib.import_module(f"sparsebalance.simulator.{module}"), name)
