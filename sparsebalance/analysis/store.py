"""The sweep's result store: one record per finished run, appended atomically, never rewritten.

Storage is SQLite in WAL mode (``<dir>/runs.sqlite``) with ``synchronous=FULL``: each append is one
transaction, so a process killed at any instant (SIGKILL included) leaves every committed record
intact and no partial one; the next open recovers the write-ahead log. Only the coordinating process
writes (workers return records), which keeps the store independent of how runs are executed (local
processes today, a Ray backend later: both hand records to :meth:`ResultStore.append`).

API::

    store = ResultStore(directory)          # creates or opens <directory>/runs.sqlite
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
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from sparsebalance.errors import ConfigError

RESULT_SCHEMA_VERSION = 1
"""Version of :class:`RunRecord`'s content; part of every run id (bump it when metrics change)."""
FILENAME = "runs.sqlite"


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


class ResultStore:
    """Append-only store of :class:`RunRecord` in ``<directory>/runs.sqlite`` (see module doc)."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / FILENAME
        try:
            self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, schema INTEGER NOT NULL, "
                "coords TEXT NOT NULL, metrics TEXT NOT NULL, timing TEXT NOT NULL, "
                "config TEXT NOT NULL, created REAL NOT NULL)")
        except sqlite3.DatabaseError as e:
            raise ConfigError(f"store: {self.path} is not a readable sweep store ({e}); move it away "
                              "or pass --force to start the sweep afresh") from None

    @staticmethod
    def exists(directory: str | Path) -> bool:
        return (Path(directory) / FILENAME).is_file()

    def ids(self) -> set[str]:
        return {r[0] for r in self._db.execute("SELECT run_id FROM runs")}

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM runs").fetchone()[0])

    def append(self, record: RunRecord) -> bool:
        """Store ``record`` in one transaction; False (nothing written) if its id is stored already.
        Non-finite numbers are refused (ValueError): the store holds valid JSON only."""
        row = (record.run_id, int(record.schema), _dumps(record.coords), _dumps(record.metrics),
               _dumps(record.timing), record.config, record.created or time.time())
        cur = self._db.execute("INSERT OR IGNORE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?)", row)
        return cur.rowcount == 1

    def records(self, ids: Iterable[str] | None = None) -> list[RunRecord]:
        """Stored records (all, or those in ``ids``), in the order they were stored."""
        rows = self._db.execute("SELECT run_id, schema, coords, metrics, timing, config, created "
                                "FROM runs ORDER BY rowid").fetchall()
        keep = None if ids is None else set(ids)
        return [RunRecord(run_id=r[0], schema=r[1], coords=json.loads(r[2]), metrics=json.loads(r[3]),
                          timing=json.loads(r[4]), config=r[5], created=r[6])
                for r in rows if keep is None or r[0] in keep]

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


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, allow_nan=False, default=str)
