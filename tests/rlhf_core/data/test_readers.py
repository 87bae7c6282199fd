"""Readers never crash on a bad row: each bad row comes back with its reason and 0-based row number."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_core.data.readers import RAW_MAX_CHARS, read_rows
from rlhf_core.errors import DataError


def _by_row(rows):
    return {r.source_row: r for r in rows}


def test_jsonl_bad_lines_are_rows_with_reasons(tmp_path):
    good = json.dumps({"question": "q", "answer": "#### 1"}).encode()
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join([
        good,                                  # 0 fine
        b'{"question": "q", "answer": ',       # 1 truncated JSON
        b'{"question": "caf\xe9"}',            # 2 latin-1 byte, not UTF-8
        b"[1, 2, 3]",                          # 3 valid JSON, not an object
        b"   ",                                # 4 blank
        good + b"\r",                          # 5 CRLF line ending is tolerated
    ]) + b"\n")
    rows = list(read_rows(path))
    assert [r.source_row for r in rows] == [0, 1, 2, 3, 4, 5]  # the final newline adds no row
    by = _by_row(rows)
    assert by[0].record == {"question": "q", "answer": "#### 1"} and by[0].error is None
    assert by[1].record is None and by[1].error_kind == "malformed JSON"
    assert by[1].error.startswith("malformed JSON:") and by[1].raw == '{"question": "q", "answer": '
    assert by[2].error_kind == "not valid UTF-8" and "0xe9" in by[2].error
    assert by[2].raw == '{"question": "caf\ufffd"}'  # shown with a replacement character
    assert by[3].error_kind == "not a JSON object" and "list" in by[3].error
    assert by[4].error_kind == "blank line"
    assert by[5].record == by[0].record
    assert all(r.source_file == str(path) for r in rows)


def test_raw_text_is_truncated(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text("{" + "x" * 5000 + "\n")
    (row,) = read_rows(path)
    assert row.error_kind == "malformed JSON" and len(row.raw) == RAW_MAX_CHARS


def test_csv_quoted_newlines_field_counts_and_bad_bytes(tmp_path):
    path = tmp_path / "data.csv"
    path.write_bytes(
        b'id,question,answer\n'
        b'a1,"two\nlines","x\n#### 3"\n'          # row 0: a quoted field spans lines
        b'a2,only two fields\n'                    # row 1: wrong field count
        b'a3,"caf\xe9",#### 4\n'                   # row 2: not UTF-8
        b'a4,"a, b",#### 5\n'                      # row 3: quoted comma
    )
    rows = list(read_rows(path))
    by = _by_row(rows)
    assert len(rows) == 4
    assert by[0].record == {"id": "a1", "question": "two\nlines", "answer": "x\n#### 3"}
    assert by[1].error_kind == "malformed CSV" and "expected 3 fields, got 2" in by[1].error
    assert by[2].error_kind == "not valid UTF-8" and "\ufffd" in by[2].raw
    assert by[3].record["question"] == "a, b"


def test_parquet_rows_by_name_and_types_kept(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"answer": ["#### 1", None], "question": ["q0", "q1"], "n": [1, 2]}), path)
    rows = list(read_rows(path))
    assert [r.record for r in rows] == [{"answer": "#### 1", "question": "q0", "n": 1},
                                        {"answer": None, "question": "q1", "n": 2}]
    assert json.loads(rows[1].raw) == rows[1].record


def test_whole_file_problems_raise_data_error_naming_the_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_rows(tmp_path / "absent.jsonl")
    (tmp_path / "x.txt").write_text("hello\n")
    with pytest.raises(DataError, match=r"unknown file type '\.txt'"):
        read_rows(tmp_path / "x.txt")
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    with pytest.raises(DataError, match="fake.parquet: cannot open as Parquet"):
        list(read_rows(fake))


def test_empty_files_yield_no_rows(tmp_path):
    (tmp_path / "e.jsonl").write_bytes(b"")
    (tmp_path / "e.csv").write_bytes(b"")
    assert list(read_rows(tmp_path / "e.jsonl")) == []
    assert list(read_rows(tmp_path / "e.csv")) == []
