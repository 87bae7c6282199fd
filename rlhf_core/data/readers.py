"""Row readers for raw prompt files: JSONL, Parquet and CSV.

Every reader yields one ``RawRow`` per input row and never raises on a bad row: a line that is not
valid UTF-8, not valid JSON, not a JSON object, or a CSV record with the wrong number of fields comes
back with ``error`` set (and ``record`` None), so the caller can reject it with a reason and the count
of rows in equals accepted + rejected. Only problems with a whole file (missing, unknown format, a
Parquet file that cannot be opened) raise ``DataError``, naming the file and the fix.

Row numbers are 0-based: the line number in a JSONL file, the data-row number (header excluded) in a
CSV file, the row index in a Parquet file.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from rlhf_core.errors import DataError, shown_path

RAW_MAX_CHARS = 1000
"""Rejected rows keep at most this much of their raw text (enough to see what went wrong)."""

SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class RawRow:
    """One input row: a decoded record, or the reason it could not be decoded."""

    source_file: str
    source_row: int
    record: Optional[dict[str, Any]]
    raw: str
    """The row as text (the JSONL line, or the record as JSON), truncated to RAW_MAX_CHARS."""
    error_kind: Optional[str] = None
    """Short category for counting (e.g. "malformed JSON"); None when the row decoded."""
    error: Optional[str] = None
    """The full reason, naming what is wrong (e.g. "malformed JSON: Expecting ',' at column 12")."""


def truncate(text: str, limit: int = RAW_MAX_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def one_line(exc: BaseException) -> str:
    """A library's error text on one line (pyarrow's can span several), so our error stays one line."""
    return " ".join(str(exc).split())


def record_text(record: Any) -> str:
    """A record as one line of JSON (non-JSON values such as dates as strings), truncated."""
    return truncate(json.dumps(record, ensure_ascii=False, default=str))


def _bad(path: Path, row: int, raw: str, kind: str, reason: str) -> RawRow:
    return RawRow(str(path), row, None, truncate(raw), kind, reason)


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_field(record: dict[str, Any]) -> Optional[str]:
    """The top-level key whose name or value (at any depth) holds a UTF-16 surrogate, else None.

    JSON accepts escapes such as ``"\\ud800"`` without their pair, but such a string is not Unicode
    text: the tokenizer and every UTF-8 writer (Parquet included) refuse it, so the row must be
    rejected here rather than crash a later step."""
    for top, value in record.items():
        pending: list[Any] = [top, value]
        while pending:  # iterative: a deeply nested value must not hit the recursion limit
            item = pending.pop()
            if isinstance(item, str):
                if _SURROGATE.search(item):
                    return top
            elif isinstance(item, dict):
                pending.extend(item.keys())
                pending.extend(item.values())
            elif isinstance(item, list):
                pending.extend(item)
    return None


# ---------------------------------------------------------------------------------------------
# JSONL
# ---------------------------------------------------------------------------------------------


def _decode_line(path: Path, row: int, line: bytes) -> RawRow:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        shown = line.decode("utf-8", errors="replace")
        return _bad(path, row, shown, "not valid UTF-8",
                    f"not valid UTF-8: byte 0x{line[exc.start]:02x} at position {exc.start}")
    if not text.strip():
        return _bad(path, row, text, "blank line", "blank line")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        return _bad(path, row, text, "malformed JSON", f"malformed JSON: {exc.msg} at column {exc.colno}")
    except RecursionError:  # absurdly nested input must not take the reader down
        return _bad(path, row, text, "malformed JSON", "malformed JSON: nested too deeply")
    except ValueError as exc:  # e.g. an integer of > 4,300 digits (Python's int-to-str limit)
        return _bad(path, row, text, "malformed JSON", f"malformed JSON: {exc}")
    if not isinstance(record, dict):
        return _bad(path, row, text, "not a JSON object",
                    f"not a JSON object (got a JSON {type(record).__name__})")
    field = lone_surrogate_field(record)
    if field is not None:
        return _bad(path, row, text, "not valid Unicode",
                    f"not valid Unicode: field {field!r} holds a lone surrogate escape (\\ud800-\\udfff "
                    f"without its pair)")
    return RawRow(str(path), row, record, truncate(text))


def read_jsonl(path: Path) -> Iterator[RawRow]:
    """One row per line; a final newline does not start an extra row. Bytes are decoded per line, so
    one bad line never hides the others."""
    lines = path.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for row, line in enumerate(lines):
        yield _decode_line(path, row, line.removesuffix(b"\r"))


# ---------------------------------------------------------------------------------------------
# CSV
# ---------------------------------------------------------------------------------------------


def _has_undecodable(values: list[str]) -> bool:
    # surrogateescape maps each invalid UTF-8 byte to a lone surrogate U+DC80..U+DCFF
    return any("\udc80" <= ch <= "\udcff" for v in values for ch in v)


def _check_csv_header(path: Path, header: list[str]) -> None:
    """Header problems spoil every row, so they are whole-file errors, not per-row rejects."""
    if _has_undecodable(header):
        raise DataError(f"{shown_path(path)}: the CSV header is not valid UTF-8; save the file as UTF-8")
    # blank names repeat in spreadsheet exports with trailing empty columns; no key can name them
    if any("\n" in h or "\r" in h for h in header):  # else the whole file reads as one header, no rows
        raise DataError(f"{shown_path(path)}: the CSV header runs over several lines (a quote left open?); close the "
                        f"quote in the first line")
    repeated = sorted({h for h in header if h and header.count(h) > 1})
    if repeated:
        raise DataError(f"{shown_path(path)}: the CSV header repeats column(s) {', '.join(map(repr, repeated))}; "
                        f"give every column a distinct name")


def read_csv(path: Path) -> Iterator[RawRow]:
    """A header row then one row per CSV record (quoted fields may span lines). All values are
    strings, as CSV has no types."""
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # long solutions must not trip the 128 KiB default
    text = path.read_bytes().decode("utf-8", errors="surrogateescape")
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader)
    except StopIteration:  # an empty file: no rows
        return
    except csv.Error as exc:  # the header swallowed the file (e.g. an open quote): nothing is readable
        raise DataError(f"{shown_path(path)}: cannot read the CSV header ({one_line(exc)}); "
                        "fix the first line") from None
    header = [h.strip().lstrip("\ufeff") for h in header]
    _check_csv_header(path, header)
    row = 0
    while True:
        try:
            values = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            yield _bad(path, row, "", "malformed CSV", f"malformed CSV: {exc}")
            row += 1
            continue
        shown = ",".join(values)
        if _has_undecodable(values):
            yield _bad(path, row, shown.encode("utf-8", "surrogateescape").decode("utf-8", "replace"),
                       "not valid UTF-8", "not valid UTF-8")
        elif not any(v.strip() for v in values):
            yield _bad(path, row, shown, "blank line", "blank line")
        elif len(values) != len(header):
            joined = any("\n" in v for v in values)  # an open quote swallows the lines after it
            yield _bad(path, row, shown, "malformed CSV",
                       f"malformed CSV: expected {len(header)} fields, got {len(values)}"
                       + ("; a quote left open joined the following lines into this record" if joined else ""))
        else:
            record = dict(zip(header, values))
            yield RawRow(str(path), row, record, record_text(record))
        row += 1


# ---------------------------------------------------------------------------------------------
# Parquet
# ---------------------------------------------------------------------------------------------


def _parquet_batches(path: Path, parquet, batch_rows: int) -> Iterator[Any]:
    """Record batches; a file whose footer reads but whose pages do not (truncated, corrupt) is a
    whole-file problem: the rows past the damage cannot be counted, let alone rejected one by one."""
    batches = parquet.iter_batches(batch_size=batch_rows)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as exc:  # pyarrow raises OSError / ArrowInvalid / ArrowException for damage
            raise DataError(f"{shown_path(path)}: cannot read Parquet data ({one_line(exc)}); check or "
                            "regenerate the file") from None
        yield batch


def read_parquet(path: Path, batch_rows: int = 4096) -> Iterator[RawRow]:
    """Rows of one Parquet file as dicts, fields by name (so files with different schemas can be
    read one after another). A row whose values cannot be converted is rejected, not fatal."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a damaged or foreign file
        raise DataError(f"{shown_path(path)}: cannot open as Parquet ({one_line(exc)}); check the file or "
                        "its extension") from None
    names = parquet.schema_arrow.names
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:  # rows as dicts would keep only the last of them, silently
        raise DataError(f"{shown_path(path)}: the Parquet file repeats column(s) {', '.join(map(repr, repeated))}; "
                        f"give every column a distinct name")
    row = 0
    for batch in _parquet_batches(path, parquet, batch_rows):
        try:
            records = batch.to_pylist()
        except Exception:  # e.g. invalid UTF-8 in a string column: find the bad rows one by one
            records = None
        for i in range(batch.num_rows):
            if records is not None:
                record = records[i]
            else:
                try:
                    record = batch.slice(i, 1).to_pylist()[0]
                except Exception as exc:
                    yield _bad(path, row, "", "unreadable row", f"unreadable row: {exc}")
                    row += 1
                    continue
            yield RawRow(str(path), row, record, record_text(record))
            row += 1
    if row != parquet.metadata.num_rows:  # damaged page headers can end the data early, silently
        raise DataError(f"{shown_path(path)}: read {row} rows but its footer declares {parquet.metadata.num_rows}; "
                        f"the file is damaged, regenerate it")


# ---------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------

READERS: dict[str, Callable[[Path], Iterator[RawRow]]] = {
    "jsonl": read_jsonl, "csv": read_csv, "parquet": read_parquet,
}


def file_format(path: Path) -> str:
    fmt = SUFFIX_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(
            f"{shown_path(path)}: unknown file type {path.suffix!r}; give JSONL (.jsonl), Parquet (.parquet) or "
            f"CSV (.csv) files"
        )
    return fmt


def data_file_problem(path: str | Path) -> Optional[str]:
    """Why ``path`` cannot be read as a data file, as '<path> <why>; <fix>', or None when it can:
    missing, a directory, a symlink loop (or a link to nothing), unreadable."""
    path = Path(path)
    shown = shown_path(path)
    try:
        mode = path.stat().st_mode  # follows links: ELOOP for a loop, ENOENT for a dangling link
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"{shown} is a symlink loop; point the link (or data.train_files / data.val_files) at a real file"
        if exc.errno == errno.ENOENT and path.is_symlink():
            return f"{shown} is a link to {shown_path(os.readlink(path))}, which does not exist; fix the link"
        if exc.errno == errno.ENOENT:
            return f"{shown} not found; check data.train_files / data.val_files"
        return f"{shown} cannot be read ({exc.strerror}); check its permissions"
    if stat.S_ISDIR(mode):
        return (f"{shown} is a directory, not a data file; list its files instead, "
                f"e.g. data.train_files=[{shown}/train.jsonl]")
    if not stat.S_ISREG(mode):
        return f"{shown} is not a regular file; give a JSONL, Parquet or CSV file"
    if not os.access(path, os.R_OK):
        return f"{shown} cannot be read (permission denied); check its permissions"
    return None


def read_rows(path: str | Path) -> Iterator[RawRow]:
    """Every row of ``path`` (format from the extension), bad rows included with their reason."""
    path = Path(path)
    problem = data_file_problem(path)
    if problem:
        raise DataError(f"data file {problem}")
    return READERS[file_format(path)](path)
