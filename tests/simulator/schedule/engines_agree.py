"""``assert_engines_agree(inp)``: the timing core and the SimPy engine give one iteration the same
times and the same trace (to 1e-9). Imported by the schedule tests as ``engines_agree`` (this
directory is on sys.path under pytest's default import mode)."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.simulator.engine import PipelineInput, PipelineResult, simulate


def assert_engines_agree(inp: PipelineInput) -> PipelineResult:
    """Both engines on ``inp``: iteration time, every action's start and end, the all-reduce starts
    and the trace rows equal; returns the core's result."""
    core, events = simulate(inp), simulate(inp, method="simpy")
    assert core.kinds == events.kinds
    assert core.iteration_time == pytest.approx(events.iteration_time, rel=1e-9)
    np.testing.assert_allclose(core.start, events.start, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(core.end, events.end, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(core.allreduce_start, events.allreduce_start, rtol=1e-9, atol=1e-12)
    keys = ["dp_rank", "stage", "op", "microbatch", "start_s"]
    tc, te = (r.trace.sort_values(keys, ignore_index=True) for r in (core, events))
    assert len(tc) == len(te)
    assert (tc[keys[:4]].to_numpy() == te[keys[:4]].to_numpy()).all()
    np.testing.assert_allclose(tc[["start_s", "end_s"]], te[["start_s", "end_s"]], rtol=1e-9, atol=1e-12)
    return core
