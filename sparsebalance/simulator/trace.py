"""The trace schema shared by the simulator and realrun (one row per action)."""

from __future__ import annotations

#: Column order of every trace table (CSV/Parquet). Times in seconds from the iteration's start
#: (simulator) or from the run's first action (realrun). microbatch is -1 for ALLREDUCE/OPTIM.
TRACE_COLUMNS = (
    "iteration", "dp_rank", "stage", "microbatch", "op", "start_s", "end_s", "tokens", "budget",
)
#: Allowed values of the ``op`` column.
TRACE_OPS = ("F", "B", "P2P", "ALLREDUCE", "OPTIM")
