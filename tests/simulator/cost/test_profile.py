"""Profile format: round trip, lookup by name/dir/CSV, and every bad-input path."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from sparsebalance.errors import ConfigError
from sparsebalance.simulator.cost.catalog import load_profile, shipped_profiles
from sparsebalance.simulator.cost.profile import OPS, Profile, monotone_violations
from sparsebalance.simulator.cost.profilemeta import REQUIRED_KEYS, ProfileMeta


def small_table() -> pd.DataFrame:
    rows = []
    for op in ("attn_fwd", "attn_bwd"):
        for s in (256, 512, 1024):
            for k in (1, 2, 4):
                rows.append((op, s, k, 1e-6 * s * k))
    for op in ("layer_fwd", "layer_bwd", "embed_fwd", "embed_bwd", "head_fwd", "head_bwd"):
        for t in (256, 1024):
            rows.append((op, t, 0, 1e-7 * t))
    return pd.DataFrame(rows, columns=["op", "seq_len", "budget", "latency_s"])


def small_meta(**over) -> dict:
    meta = {"format_version": 1, "device": "cpu", "dtype": "fp32", "analytical": False,
            "model": {"hidden": 64, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 128,
                      "vocab": 256},
            "block_size": 32, "tp": 1, "how": "measured: median of 5 after 2 warm-up",
            "command": "test", "versions": {"torch": "none"}}
    meta.update(over)
    return meta


def write_profile(table: pd.DataFrame, meta: dict, directory):
    """The sidecar read as a profile's and the whole profile saved, as every producer does."""
    return Profile(table=table, meta=ProfileMeta.from_json(meta, "test"), source="test").save(directory)


def _write_raw(directory, table: pd.DataFrame, meta: dict | None):
    directory.mkdir(parents=True, exist_ok=True)
    table.to_csv(directory / "profile.csv", index=False)
    if meta is not None:
        (directory / "profile.json").write_text(json.dumps(meta))
    return directory


def test_round_trip_is_exact(tmp_path):
    table = small_table()
    table.loc[0, "latency_s"] = 1 / 3  # needs all 17 digits to survive the CSV
    write_profile(table, small_meta(), tmp_path / "p")
    prof = load_profile(tmp_path / "p")
    got = prof.rows("attn_fwd").set_index(["seq_len", "budget"])["latency_s"]
    assert got[(256, 1)] == 1 / 3
    assert got[(1024, 4)] == 1e-6 * 1024 * 4
    assert len(prof.table) == len(table)
    assert prof.meta.to_json() == small_meta()
    assert set(prof.ops) == {"attn_fwd", "attn_bwd", "layer_fwd", "layer_bwd", "embed_fwd",
                             "embed_bwd", "head_fwd", "head_bwd"}


def test_lookup_by_directory_csv_and_relative_base_dir(tmp_path):
    write_profile(small_table(), small_meta(), tmp_path / "p")
    by_dir = load_profile("p", base_dir=tmp_path)
    by_csv = load_profile(tmp_path / "p" / "profile.csv")
    pd.testing.assert_frame_equal(by_dir.table, by_csv.table)
    # a CSV with its own <stem>.json beside it
    other = tmp_path / "q"
    other.mkdir()
    small_table().to_csv(other / "h.csv", index=False)
    (other / "h.json").write_text(json.dumps(small_meta(device="x")))
    assert load_profile(other / "h.csv").meta.device == "x"


def test_shipped_profiles_are_found_by_name():
    names = shipped_profiles()
    assert {"analytical-h200", "analytical-h20"} <= set(names)
    prof = load_profile("analytical-h20")
    assert prof.meta.analytical is True and prof.meta.device == "h20"


def test_unknown_name_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="neither a shipped profile"):
        load_profile("no-such-profile", base_dir=tmp_path)


@pytest.mark.parametrize("mutate, pattern", [
    (lambda t: t.drop(columns=["budget"]), r"missing column\(s\) budget"),
    (lambda t: t.assign(op=t["op"].where(t.index != 3, "attn_fwdd")), r"unknown op 'attn_fwdd'"),
    (lambda t: t.assign(latency_s=t["latency_s"].where(t.index != 5, -1.0)), r"latency_s must be finite and >= 0"),
    (lambda t: t.assign(latency_s=t["latency_s"].where(t.index != 5, np.inf)), r"latency_s must be finite"),
    (lambda t: t.assign(latency_s=t["latency_s"].where(t.index != 5, np.nan)), r"latency_s must be finite"),
    (lambda t: pd.concat([t, t.iloc[[2]]]), r"duplicated grid point op attn_fwd, seq_len 256, budget 4"),
    (lambda t: t.drop(index=4), r"attn_fwd grid is not rectilinear"),
    (lambda t: t[t["op"] != "layer_bwd"], r"layer_bwd have no rows"),
    (lambda t: t.assign(budget=t["budget"].where(t["op"] != "head_fwd", 3)), r"head_fwd rows must have budget 0"),
    (lambda t: t.assign(seq_len=t["seq_len"].astype(float) + 0.5), r"seq_len must hold integers"),
])
def test_bad_table_names_file_and_problem(tmp_path, mutate, pattern):
    d = _write_raw(tmp_path / "bad", mutate(small_table()), small_meta())
    with pytest.raises(ConfigError, match=pattern) as err:
        load_profile(d)
    assert "profile.csv" in str(err.value)


def test_missing_sidecar_file(tmp_path):
    d = _write_raw(tmp_path / "nosidecar", small_table(), None)
    with pytest.raises(ConfigError, match=r"profile\.json: sidecar missing"):
        load_profile(d)


@pytest.mark.parametrize("key", list(REQUIRED_KEYS))
def test_missing_sidecar_key(tmp_path, key):
    meta = small_meta()
    del meta[key]
    d = _write_raw(tmp_path / "m", small_table(), meta)
    with pytest.raises(ConfigError, match=rf"profile\.json: sidecar is missing key\(s\) {key}"):
        load_profile(d)


@pytest.mark.parametrize("over, pattern", [
    ({"format_version": 3}, "format_version: 3 is not supported"),
    ({"analytical": "no"}, "analytical: expected true or false, got 'no'"),
    ({"block_size": 0}, "block_size: must be > 0"),
    ({"tp": True}, "tp: expected an integer, got True"),
    ({"memory_bandwidth": -5}, "memory_bandwidth: must be a positive number"),
    ({"memory_bandwidth": "fast"}, "memory_bandwidth: expected a number, got 'fast'"),
    ({"concurrency": 0}, "concurrency: must be > 0"),
    ({"machine": "laptop"}, "machine: expected a table"),
    ({"nonmonotone": 3}, "nonmonotone: expected a string, got 3"),
    ({"model": {"hidden": -1}}, "model: dims hidden must be positive"),
    ({"cp": 0}, "cp: must be > 0"),
    ({"cp_layout": "best"}, "cp_layout: must be one of contiguous, zigzag, stripe, got 'best'"),
])
def test_bad_sidecar_values(tmp_path, over, pattern):
    """One line naming the file and the field."""
    d = _write_raw(tmp_path / "s", small_table(), small_meta(**over))
    with pytest.raises(ConfigError, match=pattern) as err:
        load_profile(d)
    assert "profile.json: sidecar key " in str(err.value) and "\n" not in str(err.value)


def test_sidecar_round_trip_keeps_unknown_keys(tmp_path):
    """ProfileMeta -> JSON -> ProfileMeta is the identity, and a key this version does not know
    survives a save (today's behaviour: kept, never refused)."""
    raw = small_meta(machine={"device_kind": "cpu", "cores": 2}, concurrency=2, date="2026-01-02",
                     memory_bandwidth=1e11, future_key={"a": [1, 2]})
    meta = ProfileMeta.from_json(raw, "t")
    assert meta.extra == {"future_key": {"a": [1, 2]}} and meta.concurrency == 2
    assert meta.to_json() == raw
    assert ProfileMeta.from_json(json.loads(json.dumps(meta.to_json())), "t") == meta
    write_profile(small_table(), raw, tmp_path / "p")
    assert json.loads((tmp_path / "p" / "profile.json").read_text()) == raw
    assert load_profile(tmp_path / "p").meta == meta


@pytest.mark.parametrize("name", shipped_profiles())
def test_every_shipped_profile_loads_and_saves_unchanged(tmp_path, name):
    """A shipped sidecar (some written by older versions of this tool) loads; saving the loaded
    profile gives back its sidecar and exactly its latencies."""
    from sparsebalance.simulator.cost.catalog import SHIPPED_DIR

    prof = load_profile(name)
    raw = json.loads((SHIPPED_DIR / name / "profile.json").read_text())
    assert prof.meta.to_json() == raw and prof.meta.extra == {}
    again = load_profile(prof.save(tmp_path / name))
    pd.testing.assert_frame_equal(again.table, prof.table, check_exact=True)
    assert again.meta == prof.meta


def test_sidecar_not_json(tmp_path):
    d = _write_raw(tmp_path / "j", small_table(), None)
    (d / "profile.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_profile(d)


def test_a_bad_sidecar_builds_no_profile(tmp_path):
    with pytest.raises(ConfigError, match="missing key"):
        write_profile(small_table(), {"device": "cpu"}, tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_ops_constant_matches_the_contract():
    assert set(OPS) == {"attn_fwd", "attn_bwd", "layer_fwd", "layer_bwd", "embed_fwd", "embed_bwd",
                        "head_fwd", "head_bwd", "optim", "layer_bwd_input", "layer_bwd_weight",
                        "head_bwd_input", "head_bwd_weight", "attn_fwd_cp", "attn_bwd_cp",
                        "attn_fwd_cp_step", "attn_bwd_cp_step"}


def _with_split(ops=("layer_bwd_input", "layer_bwd_weight")) -> pd.DataFrame:
    rows = [(op, t, 0, 5e-8 * t) for op in ops for t in (256, 1024)]
    return pd.concat([small_table(), pd.DataFrame(rows, columns=["op", "seq_len", "budget", "latency_s"])],
                     ignore_index=True)


def test_format_2_carries_the_split_backward_and_format_1_still_loads(tmp_path):
    write_profile(_with_split(), small_meta(format_version=2), tmp_path / "v2")
    assert {"layer_bwd_input", "layer_bwd_weight"} <= set(load_profile(str(tmp_path / "v2")).ops)
    _write_raw(tmp_path / "v1", small_table(), small_meta(format_version=1))
    assert "layer_bwd_input" not in load_profile(str(tmp_path / "v1")).ops
    with pytest.raises(ConfigError, match="format 2 needs op.s. layer_bwd_input, layer_bwd_weight"):
        write_profile(small_table(), small_meta(format_version=2), tmp_path / "bad")
    _write_raw(tmp_path / "half", _with_split(("layer_bwd_input", "layer_bwd_weight", "head_bwd_input")),
               small_meta(format_version=2))
    with pytest.raises(ConfigError, match="head_bwd_input and head_bwd_weight come together"):
        load_profile(str(tmp_path / "half"))


def _with_cp_rows(table: pd.DataFrame, ops=("attn_fwd_cp", "attn_bwd_cp")) -> pd.DataFrame:
    """``table`` plus CP group rows: 1.5 x the one-GPU attention at every point."""
    attn = table[table["op"].isin(["attn_fwd", "attn_bwd"])]
    extra = attn.assign(op=attn["op"] + "_cp", latency_s=1.5 * attn["latency_s"])
    return pd.concat([table, extra[extra["op"].isin(ops)]], ignore_index=True)


def test_cp_rows_load_with_their_group_and_are_refused_without_it(tmp_path):
    """attn_fwd_cp / attn_bwd_cp load with a sidecar naming the group (cp > 1, cp_layout); without
    it, or with one op of the pair, the load is one line naming the file."""
    ok = load_profile(write_profile(_with_cp_rows(small_table()), small_meta(cp=2, cp_layout="zigzag"),
                                    tmp_path / "ok"))
    assert {"attn_fwd_cp", "attn_bwd_cp"} <= set(ok.ops) and (ok.meta.cp, ok.meta.cp_layout) == (2, "zigzag")
    for name, table, meta, pattern in [
        ("nogroup", _with_cp_rows(small_table()), small_meta(), r"need the sidecar's cp \(> 1\) and cp_layout"),
        ("one", _with_cp_rows(small_table(), ("attn_fwd_cp",)), small_meta(cp=2, cp_layout="zigzag"),
         "ops attn_fwd_cp and attn_bwd_cp come together"),
    ]:
        d = _write_raw(tmp_path / name, table, meta)
        with pytest.raises(ConfigError, match=pattern) as err:
            load_profile(d)
        assert "profile.csv" in str(err.value) and "\n" not in str(err.value)


def test_ring_step_rows_are_points_by_pairs_and_come_together(tmp_path):
    """attn_*_cp_step rows key a measured ring step by its pairs (seq_len) and budget: any points load
    (no grid; neither monotone along pairs nor along budget is asked), never as a per-token curve;
    one op of the pair, or a budget below 1, is one line naming the file."""
    steps = pd.DataFrame([(op, p, k, t) for op in ("attn_fwd_cp_step", "attn_bwd_cp_step")
                          for p, k, t in ((1216, 2, 1.2e-3), (8192, 8, 4e-4), (60584, 8, 5.4e-3))],
                         columns=["op", "seq_len", "budget", "latency_s"])
    ok = load_profile(write_profile(pd.concat([small_table(), steps], ignore_index=True), small_meta(), tmp_path / "ok"))
    assert sorted(ok.rows("attn_bwd_cp_step").seq_len) == [1216, 8192, 60584]
    assert monotone_violations(ok) == monotone_violations(load_profile(write_profile(small_table(), small_meta(),
                                                                                        tmp_path / "plain")))
    for name, rows, pattern in [
        ("one", steps[steps.op == "attn_fwd_cp_step"], "ops attn_fwd_cp_step and attn_bwd_cp_step come together"),
        ("zero", steps.assign(budget=0), "attn_(fwd|bwd)_cp_step budget must be >= 1"),
    ]:
        d = _write_raw(tmp_path / name, pd.concat([small_table(), rows], ignore_index=True), small_meta())
        with pytest.raises(ConfigError, match=pattern) as err:
            load_profile(d)
        assert "profile.csv" in str(err.value) and "\n" not in str(err.value)
