"""Readers: every supported format, deterministic folder walks, and errors that say where."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

from tokenmind.data.readers import (
    SUPPORTED_EXTENSIONS,
    DataReadError,
    Document,
    ReaderConfig,
    list_input_files,
    read_documents,
)


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def test_txt_file_is_one_document(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text("first paragraph\n\nsecond paragraph\n", encoding="utf-8")
    docs = list(read_documents(path))
    assert docs == [Document(text="first paragraph\n\nsecond paragraph\n", source=str(path), id=str(path))]


def test_txt_split_on_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "many.txt"
    path.write_text("one\nstill one\n\n\n  \ntwo\r\n\r\nthree", encoding="utf-8")
    docs = list(read_documents(path, ReaderConfig(split_txt_on_blank_lines=True)))
    assert [doc.text for doc in docs] == ["one\nstill one", "two", "three"]
    assert [doc.id for doc in docs] == [f"{path}#0", f"{path}#1", f"{path}#2"]


def test_empty_txt_yields_nothing(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("  \n\n", encoding="utf-8")
    assert list(read_documents(tmp_path / "empty.txt")) == []


def test_jsonl_default_and_custom_fields(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"text": "alpha", "id": 7, "body": "x"}, {"text": "beta", "body": "y"}]
    )
    docs = list(read_documents(path))
    assert [(doc.text, doc.id) for doc in docs] == [("alpha", "7"), ("beta", f"{path}:2")]
    bodies = list(read_documents(path, ReaderConfig(text_field="body", id_field=None)))
    assert [(doc.text, doc.id) for doc in bodies] == [("x", f"{path}:1"), ("y", f"{path}:2")]


def test_jsonl_skips_blank_lines_but_counts_them(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n', encoding="utf-8")
    assert [doc.id for doc in read_documents(path)] == [f"{path}:1", f"{path}:3"]


def test_jsonl_gz(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write('{"text": "compressed \\u00e9"}\n')
    assert [doc.text for doc in read_documents(path)] == ["compressed \u00e9"]


def test_folder_is_recursive_sorted_and_skips_other_files(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "z").mkdir(parents=True)
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "b" / "1.txt").write_text("b1", encoding="utf-8")
    (tmp_path / "a" / "z" / "2.txt").write_text("az2", encoding="utf-8")
    (tmp_path / "a" / "3.txt").write_text("a3", encoding="utf-8")
    write_jsonl(tmp_path / "c.jsonl", [{"text": "c1"}, {"text": "c2"}])
    (tmp_path / "README.md").write_text("not data", encoding="utf-8")
    (tmp_path / ".hidden" / "x.txt").write_text("hidden", encoding="utf-8")

    docs = list(read_documents(tmp_path))
    assert [doc.text for doc in docs] == ["a3", "az2", "b1", "c1", "c2"]
    assert {doc.source for doc in docs} == {str(tmp_path)}
    assert [doc.text for doc in read_documents(tmp_path)] == [doc.text for doc in docs]


def test_several_inputs_keep_their_order(tmp_path: Path) -> None:
    first = write_jsonl(tmp_path / "z.jsonl", [{"text": "z"}])
    second = write_jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
    assert [doc.text for doc in read_documents([first, second])] == ["z", "a"]


def test_missing_path_is_reported_before_reading(tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "fine"}])
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        next(read_documents([good, tmp_path / "does-not-exist.jsonl"]))


def test_unknown_extension_lists_supported(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("a,b", encoding="utf-8")
    with pytest.raises(DataReadError) as excinfo:
        list(read_documents(path))
    message = str(excinfo.value)
    assert "data.csv" in message
    assert all(ext in message for ext in SUPPORTED_EXTENSIONS)


def test_folder_without_readable_files(tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text("x", encoding="utf-8")
    with pytest.raises(DataReadError, match="No readable files"):
        list_input_files(tmp_path)


def test_bad_json_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "broken\n', encoding="utf-8")
    docs = read_documents(path)
    assert next(docs).text == "ok"
    with pytest.raises(DataReadError, match=r"bad\.jsonl:2: not valid JSON"):
        next(docs)


def test_missing_field_names_file_line_and_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"content": "x", "url": "u"}])
    with pytest.raises(DataReadError, match=r"d\.jsonl:2: record has no 'text' field \(fields: content, url\)"):
        list(read_documents(path))


def test_non_string_field_and_non_object_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": 3}])
    with pytest.raises(DataReadError, match=r"d\.jsonl:1: field 'text' is int, expected a string"):
        list(read_documents(path))
    path = write_jsonl(tmp_path / "e.jsonl", [["a", "list"]])
    with pytest.raises(DataReadError, match=r"e\.jsonl:1: expected a JSON object, got list"):
        list(read_documents(path))


def test_invalid_utf8_names_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(DataReadError, match="latin1.txt"):
        list(read_documents(path))
    assert [doc.text for doc in read_documents(path, ReaderConfig(encoding_errors="replace"))] == [
        "caf\ufffd"
    ]


def test_parquet_without_pyarrow_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        list(read_documents(path))


def test_parquet_round_trip(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["one", "two", "three"], "id": ["a", None, "c"]}), path)
    docs = list(read_documents(path, ReaderConfig(parquet_batch_rows=2)))
    assert [(doc.text, doc.id) for doc in docs] == [("one", "a"), ("two", f"{path}:row 1"), ("three", "c")]
    with pytest.raises(DataReadError, match="no column 'body'"):
        list(read_documents(path, ReaderConfig(text_field="body")))
