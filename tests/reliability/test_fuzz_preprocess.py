"""Fuzz the preprocess readers and adapters with hostile files (hypothesis), through the real
``preprocess_files`` and the real stage, with the real tiny tokenizer.

The promise under test: whatever the bytes, preprocessing either finishes with every input row in
exactly one place (a train row, a validation row, or a reject with a non-empty reason and its row
number) or stops with a ``DataError`` naming the file — never another exception.

Hostile inputs: JSONL lines corrupted at random (truncated, bytes inserted, invalid UTF-8, lone
surrogate escapes, non-object JSON, blank), wrong-typed and missing fields (numbers, lists, dicts,
null, booleans where strings are expected), empty and whitespace-only strings, duplicate ids and
duplicate prompts, CSV with repeated or missing columns, quotes and stray bytes, Parquet files whose
schemas differ from file to file (a column a string in one file, a list or a struct in the next;
strings holding invalid UTF-8), damaged Parquet files, 1 MB strings, and verl-layout rows (chat
messages, reward_model, extra_info with any keys) whose every field may be missing or wrong.

A ``DataError`` may also be one of the two whole-run rules: adapter 'auto' meeting a file of no
known layout, and an overlong prompt under data.truncation=error; both must name the file.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import tempfile
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from rlhf_core.config import load_config
from rlhf_core.config.schema import DataConfig
from rlhf_core.data.preprocess import preprocess_files
from rlhf_core.data.readers import RAW_MAX_CHARS
from rlhf_core.data.schemas import PROMPTS, REJECTS, decode_extra_info
from rlhf_core.errors import DataError
from rlhf_core.io.atomic import atomic_write_parquet
from rlhf_core.run.layout import RunDir
from rlhf_core.stages.preprocess import run_preprocess

FUZZ = settings(max_examples=50, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture, HealthCheck.large_base_example])

QUESTIONS = ["Ava has 3 pens and gets 2 more. How many pens?", "What is 7 times 6?",
             "A train goes 60 km in 1 hour. How far in 3 hours?", "¿Cuánto es 2 + 2?", "数一数: 1+1=?"]
ODD_TEXT = ["", " ", "\t\n ", "\x00", "\u200b", "####", "#### ,", "#### -1,234.5", "null", "{}", "\\ud800"]
BAD_BYTES = [b"\xff", b"\xfe\xfe", b"\xc3", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x00", b"\r",
             b'"', b",", b"{", b"}", b"\\", b"\\u", b"\\ud800"]
HUGE = "pens " * 200_000  # 1 MB


def answers() -> st.SearchStrategy[str]:
    return st.integers(-10**7, 10**7).map(lambda n: f"She adds them up.\n#### {n:,}")


def text_values() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(QUESTIONS), answers(), st.sampled_from(ODD_TEXT), st.text(max_size=30))


def wrong_types() -> st.SearchStrategy:
    return st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.lists(st.integers(), max_size=3),
                     st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def column_values(name: str) -> st.SearchStrategy:
    """Mostly the right kind of text for the column, else any text."""
    good = {"question": st.sampled_from(QUESTIONS), "answer": answers()}.get(name, st.text(max_size=10))
    return st.one_of(good, good, text_values())


def ids() -> st.SearchStrategy:
    # a small pool, so duplicate ids (and ids that differ only in type: 1 vs "1") are common
    return st.one_of(st.sampled_from(["a", "b", "1", " ", ""]), st.integers(0, 2), wrong_types())


@st.composite
def records(draw) -> dict:
    """A row dict: the expected fields, each maybe absent, of the right type or not."""
    record = {}
    for key, good in (("question", st.sampled_from(QUESTIONS)), ("answer", answers()), ("id", ids())):
        choice = draw(st.sampled_from(["good", "good", "text", "wrong", "absent"]))
        if choice != "absent":
            record[key] = draw({"good": good, "text": text_values(), "wrong": wrong_types()}[choice])
    if draw(st.booleans()):
        record[draw(st.text(max_size=6))] = draw(st.one_of(text_values(), wrong_types()))
    return record


def extra_infos() -> st.SearchStrategy:
    """verl's free-form extra_info: any keys, nested values, or something that is not a dict."""
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-9, 9), st.text(max_size=6))
    nested = st.recursive(leaves, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                         st.dictionaries(st.text(max_size=4), kids, max_size=3)),
                          max_leaves=6)
    return st.one_of(st.dictionaries(st.text(max_size=8), nested, max_size=4),
                     st.fixed_dictionaries({"split": st.just("train"), "index": st.integers(0, 99)}), wrong_types())


def messages() -> st.SearchStrategy:
    good = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                  "content": st.one_of(st.sampled_from(QUESTIONS), text_values())})
    odd = st.one_of(wrong_types(), st.fixed_dictionaries({"role": st.just("user"), "content": wrong_types()}),
                    st.fixed_dictionaries({"role": st.just("user"), "content": st.just("x"),
                                           "name": st.text(max_size=3)}))
    return st.one_of(st.lists(good, min_size=1, max_size=3), st.lists(st.one_of(good, odd), max_size=3),
                     text_values(), wrong_types())


@st.composite
def verl_records(draw) -> dict:
    """A verl-layout row: each of its fields mostly right, else of a drawn shape, or absent."""
    truth = st.one_of(answers().map(lambda a: a.split("#### ")[1]), st.integers(), text_values(), wrong_types())
    good_prompt = st.sampled_from(QUESTIONS).map(lambda q: [{"role": "user", "content": q}])
    number = answers().map(lambda a: a.split("#### ")[1])
    good_truth = st.fixed_dictionaries({"style": st.just("rule"), "ground_truth": number})
    fields = {"data_source": (st.just("openai/gsm8k"), st.one_of(text_values(), wrong_types())),
              "prompt": (good_prompt, messages()), "ability": (st.just("math"), wrong_types()),
              "reward_model": (good_truth, st.one_of(st.fixed_dictionaries({"ground_truth": truth}), wrong_types())),
              "extra_info": (st.fixed_dictionaries({"split": st.just("train"), "index": st.integers(0, 99)}),
                             extra_infos())}
    record = {}
    for key, (good, odd) in fields.items():
        choice = draw(st.sampled_from(["good", "good", "good", "good", "odd", "absent"]))
        if choice != "absent":
            record[key] = draw(good if choice == "good" else odd)
    return record


def corrupt(draw, data: bytes) -> bytes:
    """Insert a hostile byte sequence, or cut the bytes short, at a drawn position."""
    at = draw(st.integers(0, len(data)))
    if draw(st.booleans()):
        return data[:at]
    return data[:at] + draw(st.sampled_from(BAD_BYTES)) + data[at:]


@st.composite
def jsonl_lines(draw) -> bytes:
    kind = draw(st.sampled_from(["record", "record", "record", "corrupt", "not_object", "blank", "garbage",
                                 "surrogate", "huge_number"]))
    if kind == "huge_number":  # JSON allows any number of digits; Python's int() stops at 4,300
        return b'{"question": "What is 7 times 6?", "answer": ' + b"4" * draw(st.integers(4290, 4400)) + b"}"
    if kind == "not_object":
        return json.dumps(draw(wrong_types())).encode()
    if kind == "blank":
        return draw(st.sampled_from([b"", b" ", b"\t", b"\r"]))
    if kind == "garbage":
        return draw(st.binary(max_size=40)).replace(b"\n", b"")
    line = json.dumps(draw(st.one_of(records(), verl_records())), ensure_ascii=draw(st.booleans())).encode()
    if kind == "surrogate":  # valid JSON, but a lone UTF-16 surrogate escape is no Unicode text
        quotes = [i for i, byte in enumerate(line) if byte == ord('"')]
        if quotes:
            at = draw(st.sampled_from(quotes)) + 1
            return line[:at] + draw(st.sampled_from([b"\\ud800", b"\\udfff", b"\\udc80x"])) + line[at:]
        return line
    return corrupt(draw, line).replace(b"\n", b"") if kind == "corrupt" else line


@st.composite
def jsonl_files(draw) -> bytes:
    lines = draw(st.lists(jsonl_lines(), max_size=10))
    if lines and draw(st.booleans()):
        lines.append(draw(st.sampled_from(lines)))  # an exact duplicate row
    ending = draw(st.sampled_from([b"\n", b"\r\n"]))
    return ending.join(lines) + (ending if draw(st.booleans()) else b"")


@st.composite
def csv_files(draw) -> tuple[bytes, int | None]:
    """(file bytes, rows the reader must report or None when corruption makes it unknowable)."""
    names = ["question", "answer", "id", "level", "", "note"]
    header = draw(st.one_of(st.permutations(["question", "answer", "id", "note"]),  # a usable header
                            st.permutations(["question", "answer", "id", "note"]).map(lambda p: p[:2]),
                            st.lists(st.sampled_from(names), min_size=1, max_size=5)))  # may repeat names
    odd = st.sampled_from(['"quoted"', "a,b", "line\nbreak", "cr\rhere"])
    cells = [st.one_of(column_values(h), column_values(h), column_values(h), odd) for h in header]
    rows = draw(st.lists(st.tuples(*cells).map(list), max_size=8))
    if rows and draw(st.booleans()):
        rows[draw(st.integers(0, len(rows) - 1))].append("extra field")  # a wrong field count
    buf = io.StringIO(newline="")
    csv.writer(buf).writerows([header, *rows])
    data = buf.getvalue().encode()
    if draw(st.integers(0, 2)) == 0:
        return corrupt(draw, data), None
    return data, len(rows)


# parquet column kinds: (arrow type, values) — the same column name gets a different kind per file
PARQUET_KINDS = {
    "string": (pa.string(), text_values()),
    "large_string": (pa.large_string(), text_values()),
    "int": (pa.int64(), st.integers(-2**63, 2**63 - 1)),
    "float": (pa.float64(), st.floats()),
    "bool": (pa.bool_(), st.booleans()),
    "list": (pa.list_(pa.int64()), st.lists(st.integers(-9, 9), max_size=3)),
    "struct": (pa.struct([("text", pa.string())]), st.fixed_dictionaries({"text": text_values()})),
    "binary": (pa.binary(), st.binary(max_size=12)),
    "null": (pa.null(), st.none()),
}


def parquet_column(draw, name: str, kind: str, n: int) -> pa.Array:
    if kind == "invalid_utf8":  # a string column whose bytes are not UTF-8 (written by a buggy tool)
        values = draw(st.lists(st.sampled_from([b"\xff", b"ok", b"\xed\xa0\x80", b"#### 1", None]),
                               min_size=n, max_size=n))
        return pa.array(values, pa.binary()).view(pa.string())
    arrow_type, strategy = PARQUET_KINDS[kind]
    if kind in ("string", "large_string"):
        strategy = column_values(name)
    values = draw(st.lists(st.one_of(st.none(), strategy, strategy), min_size=n, max_size=n))
    return pa.array(values, arrow_type)


@st.composite
def parquet_tables(draw) -> pa.Table:
    n = draw(st.integers(0, 6))
    columns = {}
    names = draw(st.one_of(st.just(["question", "answer", "id"]),
                           st.lists(st.sampled_from(["question", "answer", "id", "level"]), unique=True, max_size=4)))
    well_typed = draw(st.booleans())  # else each column's type is drawn: schemas differ across files
    for name in names:
        kind = "string" if well_typed else draw(st.sampled_from(["string", *PARQUET_KINDS, "invalid_utf8"]))
        columns[name] = parquet_column(draw, name, kind, n)
    if not columns:
        columns["other"] = pa.array([0] * n, pa.int64())
    names = list(columns)
    if draw(st.integers(0, 9)) == 0:  # a repeated column name (a whole-file error)
        names[-1] = names[0]
    return pa.Table.from_arrays(list(columns.values()), names=names)


@st.composite
def data_configs(draw) -> DataConfig:
    return DataConfig(adapter=draw(st.sampled_from(["gsm8k", "generic", "verl", "auto"])), dedup=draw(st.booleans()),
                      val_fraction=draw(st.sampled_from([0.0, 0.1, 0.5])),
                      max_val_samples=draw(st.sampled_from([1, 256])),
                      max_prompt_length=draw(st.sampled_from([78, 256])), id_key=draw(st.sampled_from(["id", ""])),
                      filter_overlong_prompts=draw(st.sampled_from([True, True, False])),
                      truncation=draw(st.sampled_from(["error", "left", "right", "middle"])),
                      train_max_samples=draw(st.sampled_from([-1, -1, 2])),
                      val_max_samples=draw(st.sampled_from([-1, 1])), shuffle=draw(st.booleans()))


RUN_RULES = ("data.adapter=auto cannot tell the layout", "over data.max_prompt_length")
"""The DataErrors that stop a whole run by design (see the module docstring)."""


# ---------------------------------------------------------------------------------------------
# the oracle
# ---------------------------------------------------------------------------------------------


def note(outcome: str) -> None:
    """Count an outcome in hypothesis' statistics (--hypothesis-show-statistics), to see that the
    strategies reach both accepted and rejected rows."""
    if currently_in_test_context():
        event(outcome)


def jsonl_row_count(data: bytes) -> int:
    """Rows in a JSONL file, counted independently of the reader: lines split on b'\\n', a final
    newline not starting a row."""
    lines = data.split(b"\n")
    return len(lines) - 1 if lines[-1] == b"" else len(lines)


def check_preprocess(train: list[Path], val: list[Path], expected: dict[Path, int | None], data: DataConfig,
                     tokenizer, out_dir: Path):
    """Run the real core; assert the row accounting and that the tables write as the stage writes them.
    Returns the result, or the DataError (which names one of the files)."""
    try:
        result = preprocess_files(train, val, data, tokenizer, progress=False)
    except DataError as exc:
        assert any(str(p) in str(exc) for p in train + val), f"DataError does not name the file: {exc}"
        assert "\n" not in str(exc), f"DataError is not one line: {exc}"
        if "over data.max_prompt_length" in str(exc):
            assert data.truncation == "error" and not data.filter_overlong_prompts, exc
        if "cannot tell the layout" in str(exc):
            assert data.adapter == "auto", exc
        note("DataError" + str(exc).split(":", 1)[-1][:40])
        return exc
    note("accepted some" if result.train.num_rows + result.val.num_rows else "accepted none")
    note("rejected some" if result.rejects.num_rows else "rejected none")
    accepted = result.train.to_pylist() + result.val.to_pylist()
    rejects = result.rejects.to_pylist()
    places = [(r["source_file"], r["source_row"]) for r in accepted]
    places += [(r["source_file"], r["source_row"]) for r in rejects]
    assert len(places) == result.rows_in, "accepted + rejected != rows in"
    # every input row of every file is in exactly one place
    assert Counter(places) == Counter((str(p), i) for p in train + val for i in range(result.files[str(p)]))
    for path, n in expected.items():
        if n is not None:
            assert result.files[str(path)] == n, f"{path.name}: reader saw {result.files[str(path)]} rows, not {n}"
    for r in rejects:
        assert isinstance(r["reason"], str) and r["reason"].strip(), r
        assert r["raw"] is not None and len(r["raw"]) <= RAW_MAX_CHARS
    for r in accepted:
        assert r["prompt_length"] == len(r["prompt_token_ids"]) <= data.max_prompt_length
        assert r["prompt_tokens_cut"] == 0 or (r["prompt_length"] == data.max_prompt_length
                                               and data.truncation != "error" and not data.filter_overlong_prompts)
        assert r["reward_model"]["ground_truth"].strip() and r["reward_source"]
        assert isinstance(decode_extra_info(r["extra_info"]), dict)
        assert all(m["role"] is not None and m["content"] is not None for m in r["prompt"])
    if data.train_max_samples > 0:
        assert result.train.num_rows <= data.train_max_samples
    assert len({r["prompt_id"] for r in accepted}) == len(accepted), "prompt ids must be unique"
    # the tables must survive the stage's writer (e.g. no unencodable text in them)
    for name, table, schema in (("train", result.train, PROMPTS), ("val", result.val, PROMPTS),
                                ("rejects", result.rejects, REJECTS)):
        atomic_write_parquet(out_dir / f"{name}.parquet", table, schema=schema)
    return result


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def split_train_val(draw_val: bool, paths: list[Path]) -> tuple[list[Path], list[Path]]:
    return (paths[:-1], paths[-1:]) if draw_val and len(paths) > 1 else (paths, [])


# ---------------------------------------------------------------------------------------------
# fuzz tests
# ---------------------------------------------------------------------------------------------


@FUZZ
@given(files=st.lists(jsonl_files(), min_size=1, max_size=3), data=data_configs(), with_val=st.booleans())
def test_fuzz_jsonl(tokenizer, files, data, with_val):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = []
        for i, blob in enumerate(files):
            (tmp / f"in{i}.jsonl").write_bytes(blob)
            paths.append(tmp / f"in{i}.jsonl")
        train, val = split_train_val(with_val, paths)
        check_preprocess(train, val, {p: jsonl_row_count(b) for p, b in zip(paths, files)}, data, tokenizer, tmp)


@FUZZ
@given(files=st.lists(csv_files(), min_size=1, max_size=3), data=data_configs())
def test_fuzz_csv(tokenizer, files, data):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        expected = {}
        for i, (blob, n) in enumerate(files):
            (tmp / f"in{i}.csv").write_bytes(blob)
            expected[tmp / f"in{i}.csv"] = n
        check_preprocess(list(expected), [], expected, data, tokenizer, tmp)


@FUZZ
@given(tables=st.lists(parquet_tables(), min_size=1, max_size=4), data=data_configs(), with_val=st.booleans(),
       damage=st.sampled_from([None, None, "truncate", "garbage", "pages"]), where=st.floats(0.0, 0.5))
def test_fuzz_parquet_mixed_schemas(tokenizer, tables, data, with_val, damage, where):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = []
        for i, table in enumerate(tables):
            pq.write_table(table, tmp / f"in{i}.parquet")
            paths.append(tmp / f"in{i}.parquet")
        expected = {p: t.num_rows for p, t in zip(paths, tables)}
        if damage:  # a damaged file is a whole-file problem: DataError naming it, never a lost row
            blob = paths[0].read_bytes()
            at = 4 + int(where * len(blob))  # inside the data pages, before the footer
            paths[0].write_bytes({"truncate": blob[:at], "garbage": b"PAR1" + blob[8:40],
                                  "pages": blob[:at] + b"\xff" * 24 + blob[at + 24:]}[damage])
        train, val = split_train_val(with_val, paths)
        result = check_preprocess(train, val, expected, data, tokenizer, tmp)
        repeated = any(len(set(t.column_names)) < t.num_columns for t in tables)
        stopped = isinstance(result, DataError)
        assert not stopped or damage or repeated or any(rule in str(result) for rule in RUN_RULES), (
            f"only a damaged or ambiguous file, or a run rule, may stop preprocessing: {result}")
        note(f"damage={damage}: {'DataError' if stopped else 'read'}")


@FUZZ
@given(jsonl=jsonl_files(), csv_file=csv_files(), table=parquet_tables(), data=data_configs())
def test_fuzz_mixed_formats_in_one_run(tokenizer, jsonl, csv_file, table, data):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "a.jsonl").write_bytes(jsonl)
        (tmp / "b.csv").write_bytes(csv_file[0])
        pq.write_table(table, tmp / "c.parquet")
        expected = {tmp / "a.jsonl": jsonl_row_count(jsonl), tmp / "b.csv": csv_file[1],
                    tmp / "c.parquet": table.num_rows}
        check_preprocess(list(expected), [], expected, data, tokenizer, tmp)


def verl_parquet_table(rows: list[dict]) -> pa.Table:
    """The rows as Parquet columns; a column whose values no single Arrow type holds is written as
    JSON text (a prompt column of strings, say), as a tool flattening mixed data would."""
    names = list(dict.fromkeys(k for r in rows for k in r))
    columns = {}
    for name in names:
        values = [r.get(name) for r in rows]
        try:
            columns[name] = pa.array(values)
            pq.write_table(pa.table({name: columns[name]}), io.BytesIO())  # e.g. a struct with no fields cannot
        except (pa.ArrowException, OverflowError, ValueError, TypeError):
            columns[name] = pa.array([None if v is None else json.dumps(v) for v in values], pa.string())
    return pa.table(columns) if columns else pa.table({"other": pa.array([0] * len(rows))})


@FUZZ
@given(tables=st.lists(st.lists(verl_records(), max_size=6), min_size=1, max_size=3),
       data=data_configs().flatmap(lambda d: st.sampled_from(["verl", "auto"]).map(
           lambda adapter: dataclasses.replace(d, adapter=adapter))), with_val=st.booleans())
def test_fuzz_verl_parquet(tokenizer, tables, data, with_val):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = []
        for i, rows in enumerate(tables):
            pq.write_table(verl_parquet_table(rows), tmp / f"v{i}.parquet")
            paths.append(tmp / f"v{i}.parquet")
        train, val = split_train_val(with_val, paths)
        result = check_preprocess(train, val, {p: len(r) for p, r in zip(paths, tables)}, data, tokenizer, tmp)
        if isinstance(result, DataError):
            assert any(rule in str(result) for rule in RUN_RULES), result
        else:
            note(f"verl rows accepted: {result.train.num_rows + result.val.num_rows > 0}")


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(blob=jsonl_files())
def test_fuzz_through_the_stage(tiny_model_dir, blob):
    """The stage (tokenizer load, atomic writes, manifest) on hostile JSONL: tables on disk account for
    every line, or a DataError names the file and says the problem (pointing at the rejects table when
    the rows were rejected for different reasons)."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.jsonl"
        raw.write_bytes(blob)
        cfg = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir}"])  # every data default
        cfg.data.train_files = [str(raw)]
        run = RunDir(Path(tmp) / "run")
        try:
            result = run_preprocess(cfg, run, force=True)
        except DataError as exc:
            assert str(raw) in str(exc)
            if any(rule in str(exc) for rule in RUN_RULES):  # stopped before writing anything
                assert not run.rejects.exists()
                return
            assert pq.read_table(run.rejects).num_rows == jsonl_row_count(blob)  # every line accounted for
            # one problem shared by every row is said in the line; mixed reasons point at the rejects query
            uniform = ("no rows to read (empty)", "no row could be read as a record", "no row has")
            assert any(u in str(exc) for u in uniform) or f"rlhf query {run.root}" in str(exc), exc
            return
        on_disk = sum(pq.read_table(p).num_rows for p in (run.train_prompts, run.val_prompts, run.rejects))
        assert on_disk == result.rows["input"] == jsonl_row_count(blob)


# ---------------------------------------------------------------------------------------------
# huge strings and fixed regressions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
@pytest.mark.parametrize("field", ["question", "answer", "note"])
def test_one_megabyte_strings(tmp_path, tokenizer, fmt, field):
    rows = [{"question": QUESTIONS[0], "answer": "#### 5", "note": "x"},
            {"question": QUESTIONS[1], "answer": "#### 42", "note": "x"}]
    rows[1][field] = HUGE if field != "answer" else HUGE + "#### 42"
    path = tmp_path / f"in.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "csv":
        buf = io.StringIO(newline="")
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        path.write_text(buf.getvalue())
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    if field == "question":  # verl's default (truncation=error, no filter) stops on it, naming the row
        stopped = check_preprocess([path], [], {path: 2}, DataConfig(val_fraction=0.0), tokenizer, tmp_path)
        assert isinstance(stopped, DataError) and f"{path} row 1: prompt is" in str(stopped)
        cut = check_preprocess([path], [], {path: 2}, DataConfig(val_fraction=0.0, truncation="middle"), tokenizer,
                               tmp_path)
        assert cut.truncated == 1 and cut.train.column("prompt_length").to_pylist()[1] == 512
    result = check_preprocess([path], [], {path: 2}, DataConfig(val_fraction=0.0, filter_overlong_prompts=True),
                              tokenizer, tmp_path)
    reasons = {r["source_row"]: r["reason"] for r in result.rejects.to_pylist()}
    if field == "question":
        assert reasons == {1: reasons[1]} and reasons[1].startswith("prompt too long")
        assert len(result.rejects.column("raw")[0].as_py()) <= RAW_MAX_CHARS
    else:  # a huge answer or unrelated column does not lengthen the prompt
        assert reasons == {} and result.train.num_rows == 2


def test_lone_surrogate_escape_is_a_reject_not_a_crash(tmp_path, tokenizer):
    """Found by the fuzzer: '\\ud800' is valid JSON but no Unicode text; it crashed the tokenizer and
    the Parquet writer (UnicodeEncodeError) after the reader had accepted the row."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"question": "What is 7 times 6?", "answer": "#### 42"}\n'
                     b'{"question": "\\ud800 What is 7 times 7?", "answer": "#### 49"}\n'
                     b'{"question": "Nested?", "answer": "#### 1", "meta": {"k": ["\\udfff"]}}\n'
                     b'{"question": "Paired \\ud83d\\ude00 is fine", "answer": "#### 2"}\n')
    result = check_preprocess([path], [], {path: 4}, DataConfig(val_fraction=0.0), tokenizer, tmp_path)
    reasons = {r["source_row"]: r["reason"] for r in result.rejects.to_pylist()}
    assert reasons == {1: "not valid Unicode: field 'question' holds a lone surrogate escape (\\ud800-\\udfff "
                          "without its pair)",
                       2: "not valid Unicode: field 'meta' holds a lone surrogate escape (\\ud800-\\udfff "
                          "without its pair)"}
    assert "\U0001F600" in result.train.column("prompt_text")[1].as_py()


@pytest.mark.parametrize("header, message", [
    (b"qu\xffestion,answer", "the CSV header is not valid UTF-8"),            # found by the fuzzer
    (b"question,answer,question", "the CSV header repeats column(s) 'question'"),
    (b'"question,answer', "the CSV header runs over several lines"),          # rows were silently lost
])
def test_csv_header_problems_are_data_errors_naming_the_file(tmp_path, tokenizer, header, message):
    path = tmp_path / "in.csv"
    path.write_bytes(header + b"\nWhat is 7 times 6?,#### 42\n")
    with pytest.raises(DataError) as err:
        preprocess_files([path], [], DataConfig(val_fraction=0.0), tokenizer, progress=False)
    assert str(path) in str(err.value) and message in str(err.value)


def test_csv_open_quote_in_a_row_is_one_rejected_record_with_a_hint(tmp_path, tokenizer):
    path = tmp_path / "in.csv"
    path.write_bytes(b'question,answer\n"What is 7 times 6?,#### 42\nWhat is 1 + 1?,#### 2\n')
    result = check_preprocess([path], [], {path: 1}, DataConfig(val_fraction=0.0), tokenizer, tmp_path)
    assert result.rejects.column("reason").to_pylist() == [
        "malformed CSV: expected 2 fields, got 1; a quote left open joined the following lines into this record"]


def test_integer_over_python_digit_limit_is_a_reject_not_a_crash(tmp_path, tokenizer):
    """json.loads raises a plain ValueError (not JSONDecodeError) past 4,300 digits: it escaped the reader."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"question": "What is 7 times 6?", "answer": "#### 42"}\n'
                     b'{"question": "Big?", "answer": ' + b"9" * 5000 + b"}\n")
    data = DataConfig(val_fraction=0.0, adapter="generic", prompt_key="question")
    result = check_preprocess([path], [], {path: 2}, data, tokenizer, tmp_path)
    assert result.rejects.column("reason").to_pylist()[0].startswith("malformed JSON: Exceeds the limit")


def test_parquet_with_repeated_column_names_is_a_data_error(tmp_path, tokenizer):
    """Rows as dicts kept only the last of two 'question' columns, silently."""
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["What is 7 times 6?"]), pa.array(["Other?"]), pa.array(["#### 42"])],
                                        names=["question", "question", "answer"]), path)
    with pytest.raises(DataError, match="repeats column.*'question'") as err:
        preprocess_files([path], [], DataConfig(val_fraction=0.0), tokenizer, progress=False)
    assert str(path) in str(err.value)


def test_blank_repeated_csv_columns_are_allowed(tmp_path, tokenizer):
    """Spreadsheet exports end rows with empty columns; their blank names repeat harmlessly."""
    path = tmp_path / "in.csv"
    path.write_bytes(b"question,answer,,\nWhat is 7 times 6?,#### 42,,\n")
    result = check_preprocess([path], [], {path: 1}, DataConfig(val_fraction=0.0), tokenizer, tmp_path)
    assert result.train.num_rows == 1


def test_parquet_with_damaged_pages_is_a_data_error_naming_the_file(tmp_path, tokenizer):
    """Pages damaged behind an intact footer raised pyarrow's OSError from inside the reader."""
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"question": [f"What is {i} + {i}? " * 5 for i in range(50)],
                             "answer": [f"#### {2 * i}" for i in range(50)]}), path, compression="NONE")
    blob = path.read_bytes()
    path.write_bytes(blob[:100] + b"\xff" * 40 + blob[140:])  # inside the first data page's values
    with pytest.raises(DataError, match="cannot read Parquet data") as err:
        preprocess_files([path], [], DataConfig(val_fraction=0.0), tokenizer, progress=False)
    assert str(path) in str(err.value)
