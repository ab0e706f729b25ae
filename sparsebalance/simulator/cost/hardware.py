"""GPUs of the analytical profiles: peak numbers from data sheets and the efficiencies the roofline
applies, each with its source (docs/costmodel.md sections 3 and 10). ``HARDWARE`` names them for
``profile = "analytical-<name>"``. Kept apart from the cost model (``roofline.py``) as Calculon keeps
system, model and plan apart: a new GPU is a preset here, not an edit there."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from sparsebalance.errors import ConfigError, check, check_positive

# FlashAttention-3 paper (Shah et al., arXiv 2407.08608), Figs. 5-6, H100 80GB SXM5, BF16, head dim
# 128, sequence length 16K (batch x length = 16K, hidden 2048): forward without causal mask, Triton
# 395 TFLOP/s; backward, FlashAttention-2 322 TFLOP/s. Our kernels are Triton FA-2-style kernels, and
# the model counts executed (not attended) pairs, so the non-causal figures are the efficiencies.
FA3_TRITON_FWD_TFLOPS = 395.0
FA3_FA2_BWD_TFLOPS = 322.0
H100_PEAK_TFLOPS = 989.0


@dataclass(kw_only=True, slots=True, frozen=True)
class Hardware:
    """Peak numbers of one GPU and the efficiencies of the analytical model (sources: module docstring,
    docs/costmodel.md)."""

    device: str
    """Label written to the sidecar (``h100``, ``h200``, ``h20``)."""
    peak_flops: float
    """Dense bf16 tensor-core FLOP/s (data-sheet figure without structured sparsity)."""
    memory_bandwidth: float
    """HBM bandwidth in bytes/s (data sheet)."""
    tp_bandwidth: float = 370e9
    """Bus bandwidth (bytes/s) of the TP ring all-reduce, as NCCL measures it (busbw: time = 2 (n-1)/n x
    bytes / busbw). Hopper, NVLink 4: 450 GB/s per direction is the line rate; "with the protocol
    overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s" with the ring algorithm
    (NVIDIA's NCCL maintainer, NVIDIA/nccl-tests issue #212)."""
    gemm_efficiency: float = 709.0 / 989.0
    """Share of peak of the layers' GEMMs (without a ``gemm_curve``): what this project's own H100 80GB
    HBM3 ran for bf16 GEMMs of a layer's shapes with ``torch.matmul`` (cuBLAS), the median of its five
    measurements: 709 TFLOP/s (658-725 on a 3B layer's four projections at 16K tokens, 695 at
    8192^3; ``benchmarks/gpu_breakdown.py``, ``docs/gpu/h100-2026-11-26/breakdown.json``). The same
    rule as the A100 preset's measured curve: a layer's GEMMs are not searched shapes, so the best
    shape a search finds (794.5 TFLOP/s, stas00/ml-engineering "Maximum Achievable Matmul FLOPS";
    XLA's sm_90 table 783-794 at 4096^3) is a ceiling, not what a training step runs. Was 794.5 / 989
    (2026-11-27 to 2026-11-29), 957 / 989 before."""
    attention_fwd_efficiency: float = FA3_TRITON_FWD_TFLOPS / H100_PEAK_TFLOPS
    """Share of peak of our forward kernels per executed pair: FA3 paper, Triton forward (FA-2 style)."""
    attention_bwd_efficiency: float = FA3_FA2_BWD_TFLOPS / H100_PEAK_TFLOPS
    """Share of peak of our backward kernels per executed pair: FA3 paper, FlashAttention-2 backward
    (the same five matmuls with atomic dQ; the paper has no Triton backward figure)."""
    memory_efficiency: float = 2.8 / 3.35
    """Share of HBM bandwidth streaming kernels reach: coalesced loads measured at 2.8 TB/s of 3.35 on
    H100 SXM5 with Nsight Compute (https://mikamirai.com/blog/gpu-memory-bandwidth/)."""
    launch_overhead: float = 4e-6
    """Seconds of fixed cost per kernel launch, PyTorch op or host sync. Partly measured: the host
    dispatch floor is 1.44 us (benchmarks/bench_dispatch.py, this project's VM); the CUDA launch
    latency on top is not measured, so the previous 4 us is kept until gpu-check measures real
    launches (docs/costmodel.md, section 7)."""
    gemm_curve: tuple[tuple[float, float], ...] = ()
    """Measured GEMM throughput by size: ``(FLOPs of one GEMM call, share of peak)`` pairs in
    ascending FLOPs. A call's share is interpolated in log FLOPs and held at the ends
    (:meth:`gemm_share`). Empty: every GEMM at ``gemm_efficiency``."""
    tp_busbw_curve: tuple[tuple[float, float], ...] = ()
    """Measured NCCL all-reduce bus bandwidth by message size: ``(bytes, bytes/s)`` pairs in
    ascending bytes, interpolated in log bytes and held at the ends (:meth:`busbw`). Empty:
    ``tp_bandwidth`` at every size."""
    source: str = ""
    """Where the peak numbers come from."""

    def __post_init__(self) -> None:
        for f in ("peak_flops", "memory_bandwidth", "tp_bandwidth", "gemm_efficiency",
                  "attention_fwd_efficiency", "attention_bwd_efficiency", "memory_efficiency"):
            check_positive(getattr(self, f), f)
        for f in ("gemm_efficiency", "attention_fwd_efficiency", "attention_bwd_efficiency", "memory_efficiency"):
            check(getattr(self, f) <= 1, f, f"must be <= 1, got {getattr(self, f)}")
        check_positive(self.launch_overhead, "launch_overhead", allow_zero=True)
        for f, top in (("gemm_curve", 1.0), ("tp_busbw_curve", math.inf)):
            try:  # a sidecar's JSON gives lists: kept as tuples (hashable, the profile cache's key)
                pts = tuple((float(x), float(y)) for x, y in getattr(self, f))
            except (TypeError, ValueError):
                raise ConfigError(f"{f}: must be a list of [size, value] pairs, got {getattr(self, f)!r}") from None
            check(all(x > 0 and 0 < y <= top for x, y in pts), f,
                  f"sizes and values must be > 0{' and shares <= 1' if top == 1.0 else ''}, got {pts}")
            check(all(a[0] < b[0] for a, b in itertools.pairwise(pts)), f, f"sizes must ascend, got {pts}")
            object.__setattr__(self, f, pts)

    def gemm_share(self, flops):
        """Share of peak of GEMM calls of ``flops`` FLOPs each (numpy-broadcastable)."""
        return _log_interp(self.gemm_curve, flops, self.gemm_efficiency)

    def busbw(self, nbytes):
        """NCCL bus bandwidth (bytes/s) of a TP collective on a ``nbytes`` tensor (broadcastable)."""
        return _log_interp(self.tp_busbw_curve, nbytes, self.tp_bandwidth)


def _log_interp(curve: tuple[tuple[float, float], ...], size, constant: float):
    """A measured ``(size, value)`` curve at ``size``, interpolated in log size and held at the ends;
    ``constant`` at every size where the curve is empty."""
    size = np.asarray(size, dtype=float)
    if not curve:
        return constant + 0.0 * size
    xs, ys = zip(*curve)
    return np.interp(np.log(np.maximum(size, 1.0)), np.log(xs), ys)


# NVIDIA H100 Tensor Core GPU data sheet: H100 SXM BF16 Tensor Core 1,979 TFLOPS *with sparsity* ->
# 989 TFLOP/s dense; 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s.
H100 = Hardware(device="h100", peak_flops=989e12, memory_bandwidth=3.35e12,
                source="NVIDIA H100 data sheet (SXM 80 GB): 989 TFLOP/s dense bf16 (1,979 with sparsity), 3.35 TB/s HBM3")
# NVIDIA H200 Tensor Core GPU data sheet: H200 SXM BF16 Tensor Core 1,979 TFLOPS *with sparsity* ->
# 989 TFLOP/s dense; HBM3e 141 GB at 4.8 TB/s; NVLink 900 GB/s. Same GH100 compute as the H100, so the
# H100-measured efficiencies carry over.
H200 = Hardware(device="h200", peak_flops=989e12, memory_bandwidth=4.8e12,
                source="NVIDIA H200 data sheet: 989 TFLOP/s dense bf16 (1,979 with sparsity), 4.8 TB/s HBM3e")
# NVIDIA H20 (China-market Hopper, HGX H20 product brief): 148 TFLOP/s dense FP16/BF16, 96 GB HBM3 at
# 4.0 TB/s, NVLink 900 GB/s. No published attention or GEMM figures on H20 were found: the H100
# efficiencies are applied (an assumption, stated in docs/costmodel.md).
H20 = Hardware(device="h20", peak_flops=148e12, memory_bandwidth=4.0e12,
               source="NVIDIA HGX H20 product brief: 148 TFLOP/s dense bf16, 4.0 TB/s HBM3")
# NVIDIA A100 Tensor Core GPU data sheet: BF16/FP16 Tensor Core 312 TFLOP/s dense (624 with sparsity);
# A100 80GB SXM HBM2e 2,039 GB/s, A100 40GB SXM HBM2 1,555 GB/s; NVLink 3: 12 links x 50 GB/s = 600 GB/s
# bidirectional (NVIDIA Ampere tuning guide), 300 GB/s per direction. Efficiencies measured on A100:
# attention: FlashAttention-2 paper (Dao, arXiv 2307.08691): forward "up to 230 TFLOPs/s, 73% of the
# theoretical maximum", backward up to 63 %; HBM: copy kernel 1,737 of 2,039 GB/s (80 GB) and 1,382 of
# 1,555 GB/s (40 GB), gpu-stream (RRZE-HPC/gpu-benches raw data). Launch overhead as the H100's (no A100
# host-side figure found).
#
# GEMMs by size and TP collectives by message size, both measured on one Azure ND A100 v4 node (8 x
# A100-SXM4-80GB, CUDA 12.5, NCCL 2.18.5; Azure/AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md):
# cuBLASLt FP16 GEMMs with random data after 10,000 warm-up iterations, TFLOP/s at (m, n, k) =
# 1024^3: 119.4, (1024, 2145, 1024): 132.8, 2048^3: 221.8, 4096^3: 228.0, 8192^3: 253.7,
# (6144, 12288, 12288): 250.8, 16384^3: 256.5 -- keyed here by the call's FLOPs 2 m n k. The table's
# skinny (802816, 192, 768) point (157.8) is left out: a FLOP key cannot tell it from a square GEMM,
# and no layer GEMM of a published row is that narrow. The best shape a search finds is higher (271.2,
# stas00/ml-engineering "Maximum Achievable Matmul FLOPS"); layer GEMMs are not searched shapes.
A100_GEMM_TFLOPS = ((1024, 1024, 1024, 119.4), (1024, 2145, 1024, 132.8), (2048, 2048, 2048, 221.8),
                    (4096, 4096, 4096, 228.0), (8192, 8192, 8192, 253.7), (6144, 12288, 12288, 250.8),
                    (16384, 16384, 16384, 256.5))
A100_GEMM_CURVE = tuple(sorted((2.0 * m * n * k, tf / 312.0) for m, n, k, tf in A100_GEMM_TFLOPS))
# nccl-tests all_reduce_perf bus bandwidth (GB/s), in-place, 8 GPUs, at 2^10 .. 2^33 bytes (1 KB .. 8 GB):
# the same file's "NCCL Bandwidth" table (its text says NVLS, which needs Hopper's NVLink switch: on
# A100 NCCL runs ring or tree). A TP collective of a [tokens, hidden] activation is 30-110 MB in the
# published runs, where NCCL reaches 133-174 GB/s, not the 230 of its 1-8 GB plateau. The Hopper
# presets keep one constant each: the same guide's H100 sweep is FP8 GEMMs and an NVLS all-reduce,
# neither what a bf16 Megatron layer runs.
A100_BUSBW_GBS = (0.04, 0.08, 0.17, 0.33, 0.67, 1.37, 2.70, 5.15, 10.11, 19.24, 36.22, 53.54, 71.43, 89.99,
                  109.22, 132.77, 166.63, 174.18, 213.87, 221.58, 228.10, 230.22, 230.48, 231.58)
A100_BUSBW_CURVE = tuple((2.0 ** (10 + i), gb * 1e9) for i, gb in enumerate(A100_BUSBW_GBS))
# TP all-reduce plateau on one 8 x A100 SXM node: busbw 228.1 GB/s at 1 GB and 231.6 at 8 GB (the table
# above); 231.45 at 1 GB (microsoft/mscclpp docs/performance-ndmv4.md): 230 GB/s of NVLink 3's 300.
A100_80GB = Hardware(device="a100-80gb", peak_flops=312e12, memory_bandwidth=2.039e12, tp_bandwidth=230e9,
                     gemm_efficiency=256.5 / 312.0, attention_fwd_efficiency=0.73, attention_bwd_efficiency=0.63,
                     memory_efficiency=1737.0 / 2039.0, gemm_curve=A100_GEMM_CURVE,
                     tp_busbw_curve=A100_BUSBW_CURVE,
                     source="NVIDIA A100 data sheet (SXM 80 GB): 312 TFLOP/s dense bf16, 2,039 GB/s HBM2e, NVLink "
                            "600 GB/s; GEMM and NCCL sweeps of Azure ND A100 v4 (Azure/AI-benchmarking-guide)")
A100_40GB = replace(A100_80GB, device="a100-40gb", memory_bandwidth=1.555e12, memory_efficiency=1382.0 / 1555.0,
                    source="NVIDIA A100 data sheet (SXM 40 GB): 312 TFLOP/s dense bf16, 1,555 GB/s HBM2, NVLink "
                           "600 GB/s; GEMM and NCCL sweeps of Azure ND A100 v4 (80 GB; Azure/AI-benchmarking-guide)")
HARDWARE = {"h100": H100, "h200": H200, "h20": H20, "a100-80gb": A100_80GB, "a100-40gb": A100_40GB}
"""Analytical hardware by name: ``profile = "analytical-<name>"`` builds a profile for the run's model on
the fly where no shipped profile of that name exists (docs/costmodel.md)."""
