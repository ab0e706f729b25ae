"""A real text corpus that needs no download: one document per file under a directory.

``path = "stdlib"`` means the Python standard library's own source directory (``sysconfig``'s
``stdlib`` path, without any ``site-packages``/``dist-packages`` below it): about 1,800 real
documents whose byte lengths run from a few hundred bytes to several hundred KB (heavy-tailed:
max/median is about 100), identical on every machine with the same Python version. It is the
offline default corpus for real runs.

Documents are read in sorted path order (deterministic); a document's id is its index in that
order, so ids stay stable when filters change. Files are read lazily and reading stops once
``num_sequences`` documents survive the filters.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

from sparsebalance.data.config import DataConfig
from sparsebalance.data.loaders import TEXT_BATCH, finish, resolve_path
from sparsebalance.data.sequence import Sequence
from sparsebalance.data.tokenize import ByteTokenizer, make_tokenizer
from sparsebalance.errors import ConfigError

STDLIB = "stdlib"
"""The special ``path`` value naming the Python standard library's source directory."""
_EXCLUDED_PARTS = {"site-packages", "dist-packages", "__pycache__"}


def corpus_root(path: str | None, base_dir: str | Path = ".") -> Path:
    """The directory ``path`` names (``"stdlib"`` or a path relative to ``base_dir``)."""
    if path == STDLIB:
        return Path(sysconfig.get_paths()["stdlib"])
    root = resolve_path(path, base_dir)
    if not root.is_dir():
        raise ConfigError(f"path: {str(root)!r} is not a directory; give a directory of text files "
                          f"or {STDLIB!r} for the Python standard library")
    return root


def list_documents(root: Path, pattern: str) -> list[Path]:
    """Files under ``root`` matching ``pattern`` (a ``Path.glob`` pattern), sorted by path."""
    try:
        hits = root.glob(pattern)
        files = [f for f in hits if f.is_file()
                 and not _EXCLUDED_PARTS.intersection(f.relative_to(root).parts)]
    except ValueError as e:  # e.g. an empty or absolute pattern
        raise ConfigError(f"glob: bad pattern {pattern!r} ({e}); use a relative pattern such as "
                          "'**/*.py' or '*.txt'") from None
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def _documents(files: list[Path], cfg: DataConfig, base_dir: str | Path, root: Path) -> Iterator[Sequence]:
    tokenizer = make_tokenizer(cfg.tokenizer, base_dir)
    byte_level = isinstance(tokenizer, ByteTokenizer)
    kept = documents = 0
    for start in range(0, len(files), TEXT_BATCH):
        chunk = files[start:start + TEXT_BATCH]
        texts = []
        for f in chunk:
            try:
                texts.append(f.read_bytes())
            except OSError as e:
                raise ConfigError(f"path: cannot read document {f}: {e}") from None
        # Byte-level keeps the raw bytes (any encoding); a real tokenizer gets UTF-8 text.
        encoded = tokenizer.encode_many(texts) if byte_level else tokenizer.encode_many(
            [t.decode("utf-8", errors="replace") for t in texts])
        for i, ids in enumerate(encoded):
            if len(ids) == 0:  # an empty file (e.g. a bare __init__.py) is not a document
                continue
            documents += 1
            if cfg.max_length is not None:
                ids = ids[: cfg.max_length]
            if len(ids) < cfg.min_length:
                continue
            yield Sequence(id=start + i, length=len(ids), tokens=ids)
            kept += 1
            if cfg.num_sequences and kept >= cfg.num_sequences:
                return
    if not documents:  # said as it is, not as "nothing left after the filters"
        raise ConfigError(f"path: every file under {root} matching {cfg.glob!r} is empty ({len(files)} "
                          "file(s)); give documents with text")


def load_text_dir(cfg: DataConfig, base_dir: str | Path = ".") -> list[Sequence]:
    """One tokenized :class:`Sequence` per document of ``cfg.path`` matching ``cfg.glob``."""
    root = corpus_root(cfg.path, base_dir)
    files = list_documents(root, cfg.glob)
    if not files:
        raise ConfigError(f"glob: no file under {root} matches {cfg.glob!r}")
    return finish(_documents(files, cfg, base_dir, root), cfg, where=f"{root} ({cfg.glob})")
