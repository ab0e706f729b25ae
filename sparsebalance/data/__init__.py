"""Sequences, dataset loaders, length distributions and shipped profiles/presets (a leaf package)."""

from sparsebalance.data.config import DataConfig
from sparsebalance.data.sequence import Sequence
from sparsebalance.data.sources import load_sequences

__all__ = ["DataConfig", "Sequence", "load_sequences"]
