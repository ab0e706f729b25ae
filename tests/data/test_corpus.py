"""The offline corpus: the Python standard library's sources, one document per file."""

from __future__ import annotations

import os
import sysconfig

import numpy as np

from sparsebalance.data import DataConfig, load_sequences


def stdlib_sizes() -> list[int]:
    """Byte sizes of the non-empty .py files under the stdlib, walked independently of the loader."""
    root = sysconfig.get_paths()["stdlib"]
    sizes = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        for name in filenames:
            full = os.path.join(dirpath, name)
            if name.endswith(".py") and os.path.isfile(full) and os.path.getsize(full) > 0:
                sizes.append(os.path.getsize(full))
    return sizes


def test_stdlib_corpus_is_real_and_heavy_tailed():
    seqs = load_sequences(DataConfig(source="text_dir", path="stdlib", num_sequences=0))
    sizes = stdlib_sizes()
    lengths = np.array([s.length for s in seqs])
    assert len(seqs) == len(sizes) > 500
    assert lengths.sum() == sum(sizes)  # byte-level: one token per byte of every document
    assert lengths.max() / np.median(lengths) > 20  # heavy tail
    assert len({s.id for s in seqs}) == len(seqs)
    assert all(s.tokens is not None and s.tokens.max() < 256 for s in seqs[:50])


def test_stdlib_cap_and_determinism():
    a = load_sequences(DataConfig(source="text_dir", path="stdlib", num_sequences=40, max_length=4096))
    b = load_sequences(DataConfig(source="text_dir", path="stdlib", num_sequences=40, max_length=4096))
    assert len(a) == 40 and max(s.length for s in a) <= 4096
    assert [(s.id, s.length) for s in a] == [(s.id, s.length) for s in b]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
    text = bytes(a[0].tokens.astype(np.uint8)).decode("utf-8", errors="replace")
    assert text.strip()  # real source text
