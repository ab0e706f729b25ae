"""Launch configurations of the MoBA Triton kernels: per kernel and head dim, chosen for Hopper.

Each tiled kernel has its own configuration (rows per tile ``block_m``, keys per tile ``block_n``,
warps, pipeline stages) picked from :data:`CANDIDATES` by the sm_90a compile report
(``benchmarks/inspect_triton_sm90.py``: no spills, every ``tl.dot`` on wgmma, the largest tiles
that stay so; tables in ``kernels/moba/README.md``). :data:`CHOSEN_FOR` records what the choice
was made on. On a GPU, ``gpu-check``'s speed step times the candidates (``speed.tune_candidates``)
and records its pick; :func:`override` applies a pick for one process.

A device the table was not chosen for falls back to :data:`FALLBACK` and says so once per kernel:
an architecture older than sm_90 (the table's shared-memory figures are Hopper's), or a device
whose opt-in shared memory per block is below the configuration's (:data:`SMEM`).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

from sparsebalance.errors import NoteWarning


@dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    """One launch configuration."""

    block_m: int
    """Query rows (or gathered entries) per tile."""
    block_n: int
    """Keys per tile (the gate: past blocks scored per step, at least its slot width)."""
    warps: int
    """``num_warps``."""
    stages: int
    """``num_stages`` (software pipelining depth of the loops)."""

    def label(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.warps}x{self.stages}"

    @staticmethod
    def parse(text: str) -> Config:
        m, n, w, s = (int(x) for x in text.split("x"))
        return Config(block_m=m, block_n=n, warps=w, stages=s)


#: The tiled kernels whose configuration is chosen (the small ones -- block means, index tables,
#: backward prologue, casts -- are memory-bound streams with fixed 4-warp launches).
KERNELS = ("gate", "fwd_past", "fwd_own_merge", "bwd_kv", "bwd_dq_own", "bwd_dq_past")

#: The pruned candidate set compiled for sm_90a per kernel (BLOCK_MxBLOCK_Nxwarpsxstages). Pruned by
#: construction: tiles of 32-128 rows/keys (wgmma's M is 64 per warpgroup), 4 or 8 warps, 2 stages;
#: the gate scores on CUDA cores (fp32, exact), so only its row tile and warps vary.
CANDIDATES: dict[str, tuple[str, ...]] = {
    "gate": ("16x16x4x1", "16x16x8x1", "32x16x4x1"),
    "fwd_past": ("64x32x4x2", "64x32x8x2", "64x64x8x2", "128x32x8x2", "64x64x4x2"),
    "fwd_own_merge": ("64x32x8x2", "64x32x4x2", "64x64x8x2", "64x64x4x2"),
    "bwd_kv": ("32x64x8x2", "64x64x8x2", "32x64x4x2", "32x128x8x2"),
    "bwd_dq_own": ("64x32x8x2", "64x64x8x2", "64x32x4x2"),
    "bwd_dq_past": ("64x32x8x2", "64x64x8x2", "64x32x4x2"),
}

#: Chosen per (kernel, head dim) -- README "Hopper compile check" has the reports. The forward
#: kernels' inner loops are the ones an H100 timed on 2026-11-26 (docs/gpu/h100-2026-11-26/
#: tune_launch_before.csv): fwd_past at 64x32x4x2 was the fastest of ten configurations there (1.55 ms
#: at 32K tokens, density 1/8; 8 B spill here); the rest have no GPU timing and are the compile
#: report's picks: no spill (own + merge: 12 B), every product on wgmma. The backward's dQ kernels
#: walk the forward's tables, so they share its row tiles (``triton_impl.configs`` enforces it).
CHOSEN: dict[tuple[str, int], str] = {
    ("gate", 64): "16x16x8x1", ("gate", 128): "16x16x8x1",
    ("fwd_past", 64): "64x32x4x2", ("fwd_past", 128): "64x32x4x2",
    ("fwd_own_merge", 64): "64x32x8x2", ("fwd_own_merge", 128): "64x32x8x2",
    ("bwd_kv", 64): "32x64x8x2", ("bwd_kv", 128): "32x64x8x2",
    ("bwd_dq_own", 64): "64x32x8x2", ("bwd_dq_own", 128): "64x32x8x2",
    ("bwd_dq_past", 64): "64x32x8x2", ("bwd_dq_past", 128): "64x32x8x2",
}
#: Warps of the gate by slot width: 4 up to 32 slots (180 registers, no spill; 8 warps spill at 32),
#: 8 above (4 warps spill from 64 slots on). Compile report, README "Hopper compile check".
GATE_WARPS = {16: 4, 32: 4, 64: 8, 128: 8}
#: Static shared memory (bytes) of each chosen configuration in the compile report (bf16, block 128,
#: the largest variant of the kernel): a device with less opt-in shared memory per block falls back.
SMEM: dict[tuple[str, int], int] = {
    ("gate", 128): 73728, ("fwd_past", 128): 32768, ("fwd_own_merge", 128): 33024, ("bwd_kv", 128): 49536,
    ("bwd_dq_own", 128): 49408, ("bwd_dq_past", 128): 49152,
}
#: What :data:`CHOSEN` was chosen on.
CHOSEN_FOR = {"by": "sm_90a compile report (registers, spills, wgmma) and, for fwd_past, the H100 launch "
                    "sweep of 2026-11-26", "target": "sm_90a (H100 / H200)", "triton": "3.9.0",
              "date": "2026-11-28"}
#: Configuration of a device the table was not chosen for (small tiles, few registers).
FALLBACK = Config(block_m=32, block_n=32, warps=4, stages=1)

_override: dict[str, Config] = {}
_warned: set[tuple[str, str]] = set()


def chosen(kernel: str, head_dim: int) -> Config:
    """The table's configuration of ``kernel`` at ``head_dim`` (the nearest tabulated head dim)."""
    if kernel in _override:
        return _override[kernel]
    dims = sorted({d for k, d in CHOSEN if k == kernel})
    d = min(dims, key=lambda x: (abs(x - head_dim), -x))
    return Config.parse(CHOSEN[(kernel, d)])


def _lacks(kernel: str, head_dim: int, device) -> str | None:
    """Why ``device`` cannot run the chosen configuration, or None."""
    import torch

    if device.type != "cuda":
        return None
    major, _ = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"sm_{major}x is older than the sm_90a the table was chosen for"
    need = SMEM.get((kernel, head_dim))
    have = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    if need is not None and need > have:
        return f"it needs {need} B of shared memory per block, the device has {have} B"
    return None


def config(kernel: str, head_dim: int, device) -> Config:
    """The configuration ``kernel`` launches with on ``device`` (a CPU device: the table's)."""
    why = None if kernel in _override else _lacks(kernel, head_dim, device)
    if why is None:
        return chosen(kernel, head_dim)
    if (kernel, why) not in _warned:
        _warned.add((kernel, why))
        warnings.warn(f"MoBA kernel {kernel}: the chosen launch configuration "
                      f"{chosen(kernel, head_dim).label()} does not fit this device ({why}); "
                      f"falling back to {FALLBACK.label()}", NoteWarning, stacklevel=3)
    return FALLBACK


@contextlib.contextmanager
def override(picks: dict[str, Config | str]):
    """Launch ``kernel`` with ``picks[kernel]`` inside the block (speed tuning); restores after."""
    old = dict(_override)
    _override.update({k: Config.parse(v) if isinstance(v, str) else v for k, v in picks.items()})
    try:
        yield
    finally:
        _override.clear()
        _override.update(old)
