"""A run's sequences from its data config, whatever the source: the front door of data/.

``distribution`` draws seeded lengths (``distributions.py``), ``text_dir`` reads a corpus of one
document per file (``corpus.py``), ``jsonl``, ``parquet`` and ``hf_disk`` read rows of lengths or
texts (``loaders.py``).
"""

from __future__ import annotations

from pathlib import Path

from sparsebalance.data.config import DataConfig
from sparsebalance.data.sequence import Sequence


def load_sequences(cfg: DataConfig, base_dir: str | Path = ".") -> list[Sequence]:
    """The sequences ``cfg`` describes; relative paths are resolved against ``base_dir``."""
    if cfg.source == "distribution":
        from sparsebalance.data.distributions import fixed_sequences, simulated_sequences

        seed = 0 if cfg.seed is None else cfg.seed
        if cfg.distribution == "fixed":
            return fixed_sequences(cfg.length, cfg.num_sequences, seed)
        return simulated_sequences(cfg.distribution, cfg.num_sequences, seed,
                                   min_length=cfg.min_length, max_length=cfg.max_length)
    if cfg.source == "text_dir":
        from sparsebalance.data.corpus import load_text_dir

        return load_text_dir(cfg, base_dir)
    from sparsebalance.data.loaders import load_files

    return load_files(cfg, base_dir)
