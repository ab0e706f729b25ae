"""Loaders round-trip small files written here: JSONL, Parquet, HF save_to_disk, a local tokenizer."""

from __future__ import annotations

import json
import sys

import numpy as np
import pandas as pd
import pytest

from sparsebalance.data import DataConfig, Sequence, load_sequences
from sparsebalance.errors import ConfigError

TEXTS = ["hello world", "the cat sat on the mat", "héllo", "a b a b a"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cfg(source, path, **kw):
    kw.setdefault("num_sequences", 0)
    return DataConfig(source=source, path=str(path), **kw)


def test_jsonl_lengths_with_optional_columns(tmp_path):
    rows = [{"id": 10, "length": 5, "sensitivity": 0.5, "coverage": [0.5, 0.9, 1.0]},
            {"id": 11, "length": 300},
            {"id": 12, "length": 40, "sensitivity": None}]
    write_jsonl(tmp_path / "d.jsonl", rows)
    seqs = load_sequences(cfg("jsonl", "d.jsonl"), base_dir=tmp_path)
    assert [(s.id, s.length, s.sensitivity) for s in seqs] == [(10, 5, 0.5), (11, 300, None), (12, 40, None)]
    assert seqs[0].coverage == (0.5, 0.9, 1.0) and seqs[1].coverage is None
    assert all(s.tokens is None for s in seqs)


def test_jsonl_filters_truncate_and_cap(tmp_path):
    rows = [{"length": n, "coverage": [1.0]} for n in (3, 50, 7, 200, 9)]
    write_jsonl(tmp_path / "d.jsonl", rows)
    seqs = load_sequences(cfg("jsonl", tmp_path / "d.jsonl", min_length=5, max_length=60))
    # ids default to the row index; 3 is dropped; 200 is truncated and loses its coverage curve
    assert [(s.id, s.length) for s in seqs] == [(1, 50), (2, 7), (3, 60), (4, 9)]
    assert seqs[2].coverage is None and seqs[0].coverage == (1.0,)
    capped = load_sequences(cfg("jsonl", tmp_path / "d.jsonl", min_length=5, num_sequences=2))
    assert [s.id for s in capped] == [1, 2]


def test_jsonl_text_is_byte_level_without_tokenizer(tmp_path):
    write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in TEXTS])
    seqs = load_sequences(cfg("jsonl", tmp_path / "t.jsonl", max_length=5))
    for s, t in zip(seqs, TEXTS):
        want = list(t.encode("utf-8"))[:5]
        assert s.tokens.tolist() == want and s.length == len(want)
    assert seqs[2].tokens.tolist() == [104, 195, 169, 108, 108]  # 'é' is two UTF-8 bytes


def test_parquet_round_trip(tmp_path):
    df = pd.DataFrame({"id": [3, 1, 2], "length": [100, 2000, 30],
                       "coverage": [[0.2, 1.0], [0.1, 0.5, 1.0], [1.0]],
                       "sensitivity": [1.5, 0.7, 2.0], "extra": ["x", "y", "z"]})
    df.to_parquet(tmp_path / "d.parquet")
    seqs = load_sequences(cfg("parquet", tmp_path / "d.parquet"))
    assert [(s.id, s.length, s.sensitivity) for s in seqs] == [(3, 100, 1.5), (1, 2000, 0.7), (2, 30, 2.0)]
    assert seqs[1].coverage == (0.1, 0.5, 1.0)
    pd.DataFrame({"text": TEXTS}).to_parquet(tmp_path / "t.parquet")
    texts = load_sequences(cfg("parquet", tmp_path / "t.parquet"))
    assert [s.length for s in texts] == [len(t.encode()) for t in TEXTS]


def test_hf_disk_round_trip(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": TEXTS, "sensitivity": [1.0, 2.0, 3.0, 4.0]})
    ds.save_to_disk(str(tmp_path / "ds"))
    seqs = load_sequences(cfg("hf_disk", tmp_path / "ds", min_length=7))
    # 'héllo' is 6 UTF-8 bytes, under min_length = 7
    assert [(s.id, s.sensitivity) for s in seqs] == [(0, 1.0), (1, 2.0), (3, 4.0)]
    assert bytes(seqs[1].tokens.astype(np.uint8)) == TEXTS[1].encode()
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"length": [4, 8]})}).save_to_disk(
        str(tmp_path / "dd"))
    assert [s.length for s in load_sequences(cfg("hf_disk", tmp_path / "dd"))] == [4, 8]


def make_tokenizer_dir(path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return tok.get_vocab()


def test_local_tokenizer_directory(tmp_path):
    vocab = make_tokenizer_dir(tmp_path / "tok")
    write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in TEXTS + ["unseen dog"]])
    seqs = load_sequences(cfg("jsonl", "t.jsonl", tokenizer="tok"), base_dir=tmp_path)
    for s, t in zip(seqs, TEXTS + ["unseen dog"]):
        assert s.tokens.tolist() == [vocab.get(w, vocab["[UNK]"]) for w in t.split()]
        assert s.tokens.dtype == np.int32


def test_text_dir_documents_sorted(tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "b.txt").write_text("bbbb")
    (tmp_path / "docs" / "a.txt").write_text("aa")
    (tmp_path / "docs" / "sub" / "c.txt").write_text("c")
    (tmp_path / "docs" / "empty.txt").write_text("")
    (tmp_path / "docs" / "skip.md").write_text("not matched")
    seqs = load_sequences(cfg("text_dir", "docs", glob="**/*.txt"), base_dir=tmp_path)
    # sorted: a.txt, b.txt, empty.txt (dropped), sub/c.txt -> ids are positions in that order
    assert [(s.id, s.length, bytes(s.tokens.astype(np.uint8))) for s in seqs] == [
        (0, 2, b"aa"), (1, 4, b"bbbb"), (3, 1, b"c")]
    vocab = make_tokenizer_dir(tmp_path / "tok")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "x.txt").write_text("the cat sat")
    tok = load_sequences(cfg("text_dir", tmp_path / "w", glob="*.txt", tokenizer=str(tmp_path / "tok")))
    assert tok[0].tokens.tolist() == [vocab[w] for w in ("the", "cat", "sat")]


@pytest.mark.parametrize("rows, match", [
    ([{"foo": 1}], r"neither a 'length' nor a 'text' column"),
    ([{"length": 2.5}], r"length: row 0 .*positive integer.*2\.5"),
    ([{"length": 0}], r"length: row 0 .*positive integer"),
    ([{"length": "7"}], r"length: row 0"),
    ([{"length": 3}, {"length": -1}], r"length: row 1"),
    ([{"length": 3, "id": 1}, {"length": 4, "id": 1}], r"id: row 1 .*duplicate"),
    ([{"length": 3, "coverage": [0.9, 0.5]}], r"coverage: row 0 .*non-decreasing"),
    ([{"length": 3, "sensitivity": -1}], r"sensitivity: row 0"),
    ([{"text": 5}], r"text: row 0 .*string"),
    ([{"length": 3}], r"min_length: no sequence .* left"),
])
def test_bad_rows_name_the_field(tmp_path, rows, match):
    write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ConfigError, match=match):
        load_sequences(cfg("jsonl", tmp_path / "d.jsonl", min_length=3 if "min_length" not in match
                           else 10))


def test_bad_sources(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="path: file .*missing.jsonl.* not found"):
        load_sequences(cfg("jsonl", tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="path: file .* not found"):
        load_sequences(cfg("parquet", tmp_path / "missing.parquet"))
    (tmp_path / "bad.jsonl").write_text('{"length": 3}\nnot json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2 is not valid JSON"):
        load_sequences(cfg("jsonl", tmp_path / "bad.jsonl"))
    write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}])
    with pytest.raises(ConfigError, match="tokenizer: .* is not a directory"):
        load_sequences(cfg("jsonl", tmp_path / "t.jsonl", tokenizer="nowhere"), base_dir=tmp_path)
    with pytest.raises(ConfigError, match="path: .* is not a directory"):
        load_sequences(cfg("text_dir", tmp_path / "nodir"))
    with pytest.raises(ConfigError, match="glob: no file .* matches"):
        load_sequences(cfg("text_dir", tmp_path, glob="*.nothing"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if the `hf` extra were not installed
    with pytest.raises(ConfigError, match=r"hf_disk needs the `datasets` package; install the `hf` extra"):
        load_sequences(cfg("hf_disk", tmp_path))


def test_sequence_contract_holds():
    s = load_sequences(DataConfig(num_sequences=2))[0]
    assert isinstance(s, Sequence) and s.length >= 1


def test_tokenizer_directory_without_tokenizer_json_uses_transformers(tmp_path):
    pytest.importorskip("transformers")
    d = tmp_path / "bert"
    d.mkdir()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "sat", "hello", "world"]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (d / "tokenizer_config.json").write_text('{"tokenizer_class": "BertTokenizer", "do_lower_case": true}')
    write_jsonl(tmp_path / "t.jsonl", [{"text": "The cat sat on"}, {"text": "hello world"}])
    seqs = load_sequences(cfg("jsonl", tmp_path / "t.jsonl", tokenizer=str(d)))
    # lower-cased WordPiece over whole words; 'on' is unknown; no [CLS]/[SEP] added
    assert [s.tokens.tolist() for s in seqs] == [[4, 5, 6, 1], [7, 8]]
