"""Attention kernels and the latency profiler. ``moba_attention`` / ``moba_coverage`` are the public ops."""

from sparsebalance.kernels.moba.api import moba_attention, moba_coverage

__all__ = ["moba_attention", "moba_coverage"]
