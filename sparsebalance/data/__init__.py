"""Sequences, dataset loaders, length distributions and shipped profiles/presets (a leaf package)."""

from sparsebalance.data.sequence import Sequence

__all__ = ["Sequence"]
