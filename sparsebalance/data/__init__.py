"""Sequences, dataset loaders, length distributions and shipped profiles/presets (a leaf package)."""

from sparsebalance.data.config import DataConfig
from sparsebalance.data.loaders import load_sequences
from sparsebalance.data.sequence import Sequence

__all__ = ["DataConfig", "Sequence", "load_sequences"]
