"""Table sources: a run's sequences from JSONL, Parquet or HF-on-disk rows (``load_files``; the front door,
``load_sequences``, is ``sources.py``).

Table sources (jsonl, parquet, hf_disk) share one column convention:

- ``text`` (str): tokenized (local HF tokenizer when ``DataConfig.tokenizer`` is set, else
  byte-level); the sequence carries the tokens and its length is their count. Wins over ``length``.
- ``length`` (positive int, tokens): used when there is no ``text`` column (simulation only).
- optional ``id`` (unique int; default: the row index), ``coverage`` (list of floats, the measured
  C(k) for k = 1..n_blocks, non-decreasing in [0, 1]), ``sensitivity`` (float > 0 or null).

Then, in file order: sequences are truncated to ``max_length`` (a truncated sequence drops its
measured coverage, which described the full sequence), those under ``min_length`` are dropped, and
the first ``num_sequences`` are kept (0 = all).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sparsebalance.data.config import MAX_LENGTH, DataConfig
from sparsebalance.data.sequence import Sequence
from sparsebalance.data.tokenize import make_tokenizer
from sparsebalance.errors import ConfigError
from sparsebalance.readfile import decode, os_error, parse_json

MAX_ID = 2**53 - 1
"""Largest sequence id (as configs' integers: exact as a float, within int64)."""
TEXT_BATCH = 256
"""Texts tokenized per call (batching amortises the tokenizer's per-call overhead)."""


def load_files(cfg: DataConfig, base_dir: str | Path = ".") -> list[Sequence]:
    """The sequences of a ``jsonl``, ``parquet`` or ``hf_disk`` source (``cfg.path`` resolved
    against ``base_dir``)."""
    path = resolve_path(cfg.path, base_dir)
    if cfg.source == "jsonl":
        rows = _jsonl_rows(path)
    elif cfg.source == "parquet":
        rows = _parquet_rows(path)
    else:
        rows = _hf_disk_rows(path)
    return finish(rows_to_sequences(rows, cfg, base_dir, where=str(path)), cfg, where=str(path))


def resolve_path(path: str | None, base_dir: str | Path) -> Path:
    p = Path(path or "")
    return p if p.is_absolute() else Path(base_dir) / p


def _need_file(path: Path) -> None:
    if not path.is_file():
        raise ConfigError(f"path: file {str(path)!r} not found")


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    _need_file(path)
    lineno, rows = 0, 0
    for lineno, raw in _byte_lines(path):
        line = decode(raw, f"path: {path}:{lineno}")
        if not line.strip():
            continue
        row = parse_json(line, f"path: {path}:{lineno}")
        if not isinstance(row, dict):
            raise ConfigError(f"path: {path}:{lineno} must be a JSON object, got "
                              f"{type(row).__name__}")
        rows += 1
        yield row
    if not rows:  # said as it is, not as "nothing left after the filters"
        what = f"holds only blank lines ({lineno} of them)" if lineno else "is empty"
        raise ConfigError(f"path: {path} {what}; a JSONL data file holds one JSON object per line "
                          "(with a 'length' or 'text')")


def _byte_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Numbered lines as bytes (a line that is not UTF-8 is named by its number); a read the machine
    refuses (permissions, I/O) is one line naming the file."""
    try:
        with path.open("rb") as f:
            yield from enumerate(f, 1)
    except OSError as e:
        raise os_error(e, "path", f"cannot read {path}") from None


def _columns_check(columns: Iterable[str], path: Path) -> None:
    cols = list(columns)
    if "text" not in cols and "length" not in cols:
        raise ConfigError(f"path: {path} has neither a 'length' nor a 'text' column "
                          f"(columns: {', '.join(map(str, cols)) or 'none'}); need one of them")


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    import pandas as pd

    _need_file(path)
    try:
        df = pd.read_parquet(path)
    except ImportError as e:
        raise ConfigError(f"source: parquet needs pyarrow ({e}); pip install pyarrow") from None
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ConfigError(f"path: cannot read {path} as Parquet: {e}") from None
    _columns_check(df.columns, path)
    keep = [c for c in ("id", "text", "length", "coverage", "sensitivity") if c in df.columns]
    yield from df[keep].to_dict(orient="records")


def _hf_disk_rows(path: Path) -> Iterator[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ConfigError("source: hf_disk needs the `datasets` package; install the `hf` extra "
                          "(pip install 'sparsebalance[hf]')") from None
    if not path.is_dir():
        raise ConfigError(f"path: {str(path)!r} is not a directory saved with "
                          "datasets.Dataset.save_to_disk")
    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"path: cannot load {path} with datasets.load_from_disk: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else min(ds)
        ds = ds[split]
    _columns_check(ds.column_names, path)
    keep = [c for c in ("id", "text", "length", "coverage", "sensitivity") if c in ds.column_names]
    yield from ds.select_columns(keep)


def _int_field(value: Any, field: str, where: str, row: int, *, positive: bool) -> int:
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if not ok and isinstance(value, (float, np.floating)) and float(value).is_integer():
        value, ok = int(value), True
    if not ok or (positive and value < 1):
        what = "a positive integer" if positive else "an integer"
        raise ConfigError(f"{field}: row {row} of {where}: expected {what} (tokens), got {value!r}")
    if field == "length" and value > MAX_LENGTH:  # 1e30 tokens would overflow or exhaust memory later
        raise ConfigError(f"length: row {row} of {where}: {_tokens(value)} is above the bound of "
                          f"{MAX_LENGTH:,} tokens per sequence")
    if field == "id" and abs(value) > MAX_ID:  # ids are kept in int64 arrays
        raise ConfigError(f"id: row {row} of {where}: out of range (|id| <= 2^53 - 1)")
    return int(value)


def _tokens(value: int) -> str:
    """A token count for a message, however large (``f"{10**400:.3g}"`` itself overflows)."""
    if value < 10**15:
        return f"{value:,} tokens"
    return f"{value:.3g} tokens" if value < 10**300 else f"a {len(str(value))}-digit number of tokens"


def _coverage(value: Any, where: str, row: int) -> tuple[float, ...] | None:
    if value is None:
        return None
    try:
        curve = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer beyond any float
        raise ConfigError(f"coverage: row {row} of {where}: expected a list of numbers in [0, 1]") from None
    if curve.ndim != 1 or len(curve) == 0:
        raise ConfigError(f"coverage: row {row} of {where}: expected a non-empty list of numbers")
    ok = np.all(np.isfinite(curve)) and curve.min() >= 0.0 and curve.max() <= 1.0 + 1e-6
    if not ok or np.any(np.diff(curve) < -1e-6):
        raise ConfigError(f"coverage: row {row} of {where}: C(k) must be non-decreasing in [0, 1]")
    return tuple(float(c) for c in np.minimum(curve, 1.0))


def _sensitivity(value: Any, where: str, row: int) -> float | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or abs(value) > 1e300 or not math.isfinite(value) or value <= 0:  # 1e300: float() would overflow
        raise ConfigError(f"sensitivity: row {row} of {where}: expected a number > 0, got {value!r}")
    return float(value)


def rows_to_sequences(rows: Iterable[Mapping[str, Any]], cfg: DataConfig,
                      base_dir: str | Path, *, where: str) -> Iterator[Sequence]:
    """Sequences from table rows (column convention in the module docstring), filters applied."""
    tokenizer = None
    pending: list[tuple[int, Mapping[str, Any]]] = []
    seen: set[int] = set()
    kept = 0

    def emit(index: int, row: Mapping[str, Any], length: int, tokens: np.ndarray | None):
        seq_id = _int_field(row["id"], "id", where, index, positive=False) \
            if row.get("id") is not None else index
        if seq_id in seen:
            raise ConfigError(f"id: row {index} of {where}: duplicate id {seq_id}; ids must be unique")
        seen.add(seq_id)
        coverage = _coverage(row.get("coverage"), where, index)
        sens = _sensitivity(row.get("sensitivity"), where, index)
        if cfg.max_length is not None and length > cfg.max_length:
            length, coverage = cfg.max_length, None
            tokens = tokens[:length] if tokens is not None else None
        if length > MAX_LENGTH:  # a text of more tokens than any sequence the simulator models
            raise ConfigError(f"text: row {index} of {where}: {length:,} tokens is above the bound of "
                              f"{MAX_LENGTH:,} tokens per sequence; set data.max_length to truncate")
        if length < cfg.min_length:
            return None
        return Sequence(id=seq_id, length=length, tokens=tokens, coverage=coverage, sensitivity=sens)

    def flush() -> Iterator[Sequence]:
        texts = [r["text"] for _, r in pending]
        for (index, row), ids in zip(pending, tokenizer.encode_many(texts)):
            if len(ids) == 0:  # an empty document is not a sequence
                continue
            seq = emit(index, row, len(ids), ids)
            if seq is not None:
                yield seq
        pending.clear()

    index = -1
    for index, row in enumerate(rows):
        if cfg.num_sequences and kept >= cfg.num_sequences:
            break
        if index == 0:
            _columns_check(row.keys(), Path(where))
        if "text" in row:
            if not isinstance(row["text"], str):
                raise ConfigError(f"text: row {index} of {where}: expected a string, "
                                  f"got {type(row['text']).__name__}")
            if tokenizer is None:
                tokenizer = make_tokenizer(cfg.tokenizer, base_dir)
            pending.append((index, row))
            if len(pending) >= TEXT_BATCH:
                for seq in flush():
                    kept += 1
                    yield seq
            continue
        if pending:  # keep file order when text and length rows are mixed
            for seq in flush():
                kept += 1
                yield seq
        if "length" not in row:
            raise ConfigError(f"length: row {index} of {where} has neither 'length' nor 'text'")
        seq = emit(index, row, _int_field(row["length"], "length", where, index, positive=True), None)
        if seq is not None:
            kept += 1
            yield seq
    if pending:
        yield from flush()
    if index < 0:
        raise ConfigError(f"path: {where} holds no rows (an empty table)")


def finish(seqs: Iterable[Sequence], cfg: DataConfig, *, where: str) -> list[Sequence]:
    """Apply the ``num_sequences`` cap; an empty result is an error naming the filters."""
    out = list(seqs)
    if cfg.num_sequences:
        out = out[: cfg.num_sequences]
    if not out:
        raise ConfigError(f"min_length: no sequence of {where} is left after the filters "
                          f"(min_length = {cfg.min_length}, max_length = {cfg.max_length}); "
                          "allowed min_length is 1..the longest sequence")
    return out
