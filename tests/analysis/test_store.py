"""The sweep store: append-only, idempotent per run id, ordered, valid JSON only, reopenable."""

from __future__ import annotations

import math

import pytest

from sparsebalance.analysis.store import RESULT_SCHEMA_VERSION, ResultStore, RunRecord


def rec(i: int, **metrics) -> RunRecord:
    return RunRecord(run_id=f"r{i}", coords={"seed": i, "batching": "sab"},
                     metrics=metrics or {"iteration_time_s": 1.0 + i}, timing={"decision_ms": 0.5},
                     config=f'name = "r{i}"\n')


def test_append_is_idempotent_and_ordered(tmp_path):
    with ResultStore(tmp_path, create=True) as st:
        assert st.append(rec(2)) and st.append(rec(1))
        assert not st.append(rec(2, iteration_time_s=99.0))  # the first record of an id stays
        assert st.ids() == {"r1", "r2"} and len(st) == 2
        got = st.records()
    assert [r.run_id for r in got] == ["r2", "r1"]
    assert got[0].metrics == {"iteration_time_s": 3.0} and got[0].schema == RESULT_SCHEMA_VERSION
    assert got[0].coords == {"seed": 2, "batching": "sab"} and got[0].config == 'name = "r2"\n'


def test_reopen_sees_every_committed_record(tmp_path):
    st = ResultStore(tmp_path, create=True)
    for i in range(5):
        st.append(rec(i))
    st._db.close()  # no checkpoint, as after a kill: the WAL is recovered on open
    with ResultStore(tmp_path) as again:
        assert again.ids() == {f"r{i}" for i in range(5)}
        assert [r.run_id for r in again.records(["r3", "r0"])] == ["r0", "r3"]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_metric_is_refused(tmp_path, bad):
    with ResultStore(tmp_path, create=True) as st:
        with pytest.raises(ValueError):
            st.append(rec(0, iteration_time_s=bad))
        assert len(st) == 0


def test_not_a_store_is_one_line(tmp_path):
    (tmp_path / "runs.sqlite").write_bytes(b"this is not sqlite" * 100)
    from sparsebalance.errors import ConfigError

    with pytest.raises(ConfigError, match="not a readable sweep store"):
        ResultStore(tmp_path).ids()


def test_a_new_store_appears_with_its_table(tmp_path, monkeypatch):
    """A reader polling the directory while a sweep creates its store (the race a killed-coordinator
    test once lost) sees either no runs.sqlite or one with its runs table, never a bare file."""
    import os
    import sqlite3

    from sparsebalance.analysis import store as store_mod

    seen = []
    real_link = os.link

    def link(src, dst):
        assert not (tmp_path / "runs.sqlite").exists()  # nothing under the store's name before the link
        db = sqlite3.connect(src)
        seen.append([r[1] for r in db.execute("PRAGMA table_info(runs)")])
        db.close()
        real_link(src, dst)

    monkeypatch.setattr(store_mod.os, "link", link)
    with ResultStore(tmp_path, create=True) as st:
        assert st.append(rec(1))
    assert seen == [list(store_mod.COLUMNS)]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(("-wal", "-shm"))) == ["runs.sqlite"]
    with ResultStore(tmp_path) as st:  # a reader opens it as any store
        assert st.ids() == {"r1"}
