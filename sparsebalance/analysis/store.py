"""The sweep's result store: one record per finished run, appended atomically, never rewritten.

Storage is SQLite in WAL mode (``<dir>/runs.sqlite``) with ``synchronous=FULL``: each append is one
transaction, so a process killed at any instant (SIGKILL included) leaves every committed record
intact and no partial one; the next open recovers the write-ahead log. Only the coordinating process
writes (workers return records), which keeps the store independent of how runs are executed (local
processes today, a Ray backend later: both hand records to :meth:`ResultStore.append`).

API::

    store = ResultStore(directory)          # opens <directory>/runs.sqlite (ConfigError if none)
    store = ResultStore(directory, create=True)  # creates it if absent (the sweep)
    store.ids() -> set[str]                 # run ids already stored
    store.append(record) -> bool            # False when the id is already there (idempotent)
    store.records(ids=None) -> list[RunRecord]
    store.close()
    ResultStore.exists(directory) -> bool

A record's ``run_id`` is a hash of everything that determines its numbers (see
``commands/sweep_exec.run_id``), :data:`RESULT_SCHEMA_VERSION` included, so a changed setting is a
new run and an old record is never shown for new settings. Tables (results.csv, ...) are views,
rebuilt from the store atomically (``sparsebalance.fsutil``).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from sparsebalance.errors import ConfigError, HostError

COLUMNS = ("run_id", "schema", "coords", "metrics", "timing", "config", "created", "warnings")
"""The ``runs`` table's columns, in order; a table of other columns is refused, never written (a
table of the columns before ``warnings`` was added is given that column, empty: not recorded)."""
_AWAY = "move it away or pass --force to start the sweep afresh"
#: SQLite result codes that are the machine's fault: PERM, BUSY, LOCKED, NOMEM, READONLY, IOERR,
#: FULL, CANTOPEN (https://sqlite.org/rescode.html); the words are their messages, for errors that
#: carry no code.
_HOST_CODES = {3, 5, 6, 7, 8, 10, 13, 14}
_HOST_WORDS = ("disk is full", "disk I/O error", "unable to open", "readonly", "locked", "out of memory")
RESULT_SCHEMA_VERSION = 2
"""Version of :class:`RunRecord`'s content; part of every run id (bump it when metrics change).
2: records carry their run's warnings."""
FILENAME = "runs.sqlite"
_CREATE = ("CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, schema INTEGER NOT NULL, "
           "coords TEXT NOT NULL, metrics TEXT NOT NULL, timing TEXT NOT NULL, "
           "config TEXT NOT NULL, created REAL NOT NULL, warnings TEXT)")


@dataclass(kw_only=True, slots=True)
class RunRecord:
    """One finished run."""

    run_id: str
    """Hash of the run's full resolved config (see commands/sweep_exec.run_id)."""
    coords: dict[str, Any]
    """The run's grid coordinates (tidy columns: batching, tuning, anchor, p, seed, dp, pp, ...)."""
    metrics: dict[str, float]
    """Deterministic per-run results (means over iterations): same config, same numbers."""
    timing: dict[str, float] = field(default_factory=dict)
    """Wall-clock measurements (decision_ms, wall_s): differ between identical runs."""
    config: str = ""
    """The resolved run config as TOML."""
    schema: int = RESULT_SCHEMA_VERSION
    created: float = 0.0
    """Unix time the record was stored."""
    warnings: list[str] | None = field(default_factory=list)
    """The run's warnings that change what its numbers mean (``errors.MeaningWarning``: extrapolated
    latencies, a plan over the device memory...); None in a record stored before they were kept."""


class ResultStore:
    """Append-only store of :class:`RunRecord` in ``<directory>/runs.sqlite`` (see module doc)."""

    def __init__(self, directory: str | Path, *, create: bool = False):
        directory = Path(directory)
        self.path = directory / FILENAME
        if not directory.is_dir():
            what = "is not a directory" if directory.exists() else "no such directory"
            raise ConfigError(f"store: {directory}: {what} (a sweep's --out holds its {FILENAME})")
        ResultStore.check_not_other(directory)
        if not create and not self.path.exists():
            raise ConfigError(f"store: {directory} holds no sweep store ({FILENAME}); a sweep's --out does")
        with self._guard("open"):
            if create and not self.path.exists():
                self._create_whole()
            self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            if create:
                self._db.execute(_CREATE)
            cols = [r[1] for r in self._db.execute("PRAGMA table_info(runs)")]
            if create and cols == list(COLUMNS[:-1]):  # a store of version 1: its records keep None
                self._db.execute("ALTER TABLE runs ADD COLUMN warnings TEXT")
                cols.append("warnings")
        if cols != list(COLUMNS):  # a `runs` table some other tool made (or none): never written into
            self._db.close()
            what = (f"a runs table of another schema (columns {', '.join(cols)}; a sweep store has "
                    f"{', '.join(COLUMNS)})" if cols else "no runs table")
            raise ConfigError(f"store: {self.path} has {what}; {_AWAY}")

    def _create_whole(self) -> None:
        """Create the store with its table in a side file and link it into place: a reader that
        polls the directory (``sweep --watch``, a script, a test) never sees a ``runs.sqlite``
        without its ``runs`` table. ``os.link`` refuses to replace a store that appeared meanwhile."""
        side = self.path.with_name(f".{FILENAME}.{os.getpid()}.new")
        side.unlink(missing_ok=True)
        try:
            db = sqlite3.connect(side, isolation_level=None)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute(_CREATE)
            finally:
                db.close()  # the last connection checkpoints the log into the file
            try:
                os.link(side, self.path)
            except FileExistsError:
                pass
        finally:
            side.unlink(missing_ok=True)

    @contextmanager
    def _guard(self, doing: str):
        """SQLite errors as one line naming the store: the disk's (full, I/O, permissions, locked)
        are the machine's (HostError, exit 1); a file that is no store or is corrupt is bad input."""
        try:
            yield
        except sqlite3.DatabaseError as e:
            code = getattr(e, "sqlite_errorcode", None)  # extended: the primary code is its low byte
            text = str(e)
            if (isinstance(code, int) and code & 0xFF in _HOST_CODES) or any(w in text for w in _HOST_WORDS):
                raise HostError(f"store: {self.path}: cannot {doing}: {text}") from None
            raise ConfigError(f"store: {self.path} is not a readable sweep store ({text}); {_AWAY}") from None

    @staticmethod
    def exists(directory: str | Path) -> bool:
        return (Path(directory) / FILENAME).is_file()

    @staticmethod
    def check_not_other(directory: str | Path) -> None:
        """ConfigError when ``<directory>/runs.sqlite`` exists but is no file (a directory, a socket):
        what no sweep wrote, refused before anything is touched."""
        path = Path(directory) / FILENAME
        if (path.exists() or path.is_symlink()) and not path.is_file():
            raise ConfigError(f"store: {path} is not a file, so not a sweep store; {_AWAY}")

    def ids(self) -> set[str]:
        with self._guard("read run ids"):
            return {r[0] for r in self._db.execute("SELECT run_id FROM runs")}

    def __len__(self) -> int:
        with self._guard("count runs"):
            return int(self._db.execute("SELECT COUNT(*) FROM runs").fetchone()[0])

    def append(self, record: RunRecord) -> bool:
        """Store ``record`` in one transaction; False (nothing written) if its id is stored already.
        Non-finite numbers are refused (ValueError): the store holds valid JSON only. A full disk is
        a HostError naming the store; the transaction is not committed, earlier records stay."""
        row = (record.run_id, int(record.schema), _dumps(record.coords), _dumps(record.metrics),
               _dumps(record.timing), record.config, record.created or time.time(),
               None if record.warnings is None else _dumps(list(record.warnings)))
        with self._guard(f"store run {record.run_id}"):
            cur = self._db.execute("INSERT OR IGNORE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?)", row)
        return cur.rowcount == 1

    def records(self, ids: Iterable[str] | None = None) -> list[RunRecord]:
        """Stored records (all, or those in ``ids``), in the order they were stored. A row whose JSON
        does not parse (edited by hand, another tool) is one line naming the store and the row."""
        with self._guard("read runs"):
            rows = self._db.execute("SELECT rowid, run_id, schema, coords, metrics, timing, config, "
                                    "created, warnings FROM runs ORDER BY rowid").fetchall()
        keep = None if ids is None else set(ids)
        return [_record(r, self.path) for r in rows if keep is None or r[1] in keep]

    def close(self) -> None:
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.DatabaseError:
            pass
        self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _record(row: tuple, path: Path) -> RunRecord:
    rowid, run_id, schema, *texts = row[:6]
    parsed = []
    for name, text in zip(("coords", "metrics", "timing"), texts):
        value = _loads(text)
        if not isinstance(value, dict):
            raise ConfigError(f"store: {path}: row {rowid} (run {run_id}) has no JSON object in "
                              f"column {name}; {_AWAY}")
        parsed.append(value)
    warned = None if row[8] is None else _loads(row[8])
    if warned is not None and not (isinstance(warned, list) and all(isinstance(w, str) for w in warned)):
        raise ConfigError(f"store: {path}: row {rowid} (run {run_id}) has no JSON list of texts in column "
                          f"warnings; {_AWAY}")
    return RunRecord(run_id=run_id, schema=schema, coords=parsed[0], metrics=parsed[1], timing=parsed[2],
                     config=row[6], created=row[7], warnings=warned)


def _loads(text: Any) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, allow_nan=False, default=str)
