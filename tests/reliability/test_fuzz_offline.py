"""Fuzz the offline-trajectory importer (hypothesis) against a real prompt table and the real tiny
tokenizer, and through the rollout stage.

The promise: every non-blank row of a logged JSONL/Parquet file is either imported or rejected with
``row N: <reason>``; nothing else happens except a ``DataError`` naming the file (missing, wrong
extension, damaged Parquet, or no usable row at all). Hostile rows: invalid UTF-8, lone surrogate
escapes, malformed JSON, non-objects, prompt ids of the wrong type or unknown, chat messages of the
wrong shape, responses that are empty, EOS-only, not text or 1 MB long, and sample indices that are
text, negative, fractional, NaN, booleans, out of int32 range or repeated.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from rlhf_core.config import load_config
from rlhf_core.data.schemas import REJECTS, ROLLOUT, decode_extra_info
from rlhf_core.errors import DataError
from rlhf_core.io.atomic import atomic_write_parquet
from rlhf_core.run.layout import RunDir
from rlhf_core.rollout.generate import rollout_table
from rlhf_core.rollout.offline import RAW_LIMIT, import_offline
from rlhf_core.stages.rollout import rollout_rejects_path, run_rollout

FUZZ = settings(max_examples=50, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture, HealthCheck.large_base_example])
MAX_RESPONSE = 48
N_PROMPTS = 6
BAD_BYTES = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00", b"\r", b'"', b"{", b"\\", b"\\ud800"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def prompt_dir(repo_root, tiny_model_dir, tmp_path_factory) -> Path:
    """A run directory holding prompts/train.parquet made by the real preprocess stage."""
    from rlhf_core.stages.preprocess import run_preprocess

    raw = tmp_path_factory.mktemp("raw") / "arith.jsonl"
    raw.write_text("".join((repo_root / "data/arith/train.jsonl").read_text().splitlines(True)[:N_PROMPTS]))
    cfg = load_config(None, [f"data.train_files=[{raw}]", "data.val_fraction=0.0", "data.data_source=arith",
                             f"actor_rollout_ref.model.path={tiny_model_dir}"])
    run = RunDir(tmp_path_factory.mktemp("prompts_run"))
    run_preprocess(cfg, run)
    return run.root


@pytest.fixture(scope="module")
def prompt_rows(prompt_dir) -> list[dict]:
    rows = pq.read_table(RunDir(prompt_dir).train_prompts).to_pylist()
    assert len(rows) == N_PROMPTS
    return rows


# ---------------------------------------------------------------------------------------------
# strategies (prompt rows are not known when strategies are built: rows refer to prompts by index)
# ---------------------------------------------------------------------------------------------


class PromptRef:
    """A reference to prompt i, resolved to its id / question / chat messages when the file is written."""

    def __init__(self, index: int, form: str):
        self.index, self.form = index, form

    def resolve(self, prompt_rows):
        row = prompt_rows[self.index % len(prompt_rows)]
        if self.form == "id":
            return row["prompt_id"]
        if self.form == "text":
            return decode_extra_info(row["extra_info"])["question"]
        return list(row["prompt"])  # chat messages


def wrong_types() -> st.SearchStrategy:
    return st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.lists(st.integers(), max_size=2),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def prompt_refs(form: str) -> st.SearchStrategy:
    return st.integers(0, N_PROMPTS - 1).map(lambda i: PromptRef(i, form))


def text_responses() -> st.SearchStrategy[str]:
    good = st.sampled_from(["3 + 4 = 7\n#### 7", "#### 12", "I think it is 5.", "¿5?", "数 5"])
    return st.one_of(good, good, good, st.sampled_from(["", " ", "\n", "<|im_end|>", "#### 1<|im_end|>",
                                                        "<|endoftext|>", "x" * 400]), st.text(max_size=30))


def responses() -> st.SearchStrategy:
    return st.one_of(text_responses(), wrong_types())


def sample_indices() -> st.SearchStrategy:
    return st.one_of(st.integers(0, 3), st.integers(0, 3), st.sampled_from([-1, 2**31, 10**20, 1.0, 1.5, True]),
                     st.floats(), st.text(max_size=3), st.none())


@st.composite
def offline_records(draw) -> dict:
    """Half well-formed rows (so imports happen and duplicates meet), half hostile ones."""
    if draw(st.booleans()):
        record = {"prompt_id": draw(prompt_refs("id")), "response": draw(st.sampled_from(
            ["3 + 4 = 7\n#### 7", "#### 12", "I think it is 5.", "¿5?", "数 5"]))}
        if draw(st.booleans()):
            record["sample_index"] = draw(st.integers(0, 2))
        return record
    record = {}
    key = draw(st.sampled_from(["prompt_id", "prompt_id", "prompt_text", "prompt_chat", "none", "wrong"]))
    if key == "prompt_id":
        record["prompt_id"] = draw(st.one_of(prompt_refs("id"), prompt_refs("id"), st.sampled_from(["nope", 3])))
    elif key == "prompt_text":
        record["prompt"] = draw(st.one_of(prompt_refs("text"), st.text(max_size=20)))
    elif key == "prompt_chat":
        record["prompt"] = draw(st.one_of(prompt_refs("chat"), st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", 5]), "content": st.one_of(st.text(max_size=5),
                                                                                 wrong_types())}), max_size=2)))
    elif key == "wrong":
        record[draw(st.sampled_from(["prompt_id", "prompt"]))] = draw(wrong_types())
    if draw(st.integers(0, 5)):
        record["response"] = draw(responses())
    if draw(st.booleans()):
        record["sample_index"] = draw(sample_indices())
    return record


def resolve(record: dict, prompt_rows) -> dict:
    return {k: v.resolve(prompt_rows) if isinstance(v, PromptRef) else v for k, v in record.items()}


@st.composite
def jsonl_lines(draw):
    """A line template: ('record', dict) or ('bytes', raw bytes) — resolved against the prompts later."""
    kind = draw(st.sampled_from(["record"] * 5 + ["corrupt", "not_object", "blank", "garbage", "surrogate"]))
    if kind == "not_object":
        return "bytes", json.dumps(draw(wrong_types())).encode()
    if kind == "blank":
        return "bytes", draw(st.sampled_from([b"", b" ", b"\t", b"\r"]))
    if kind == "garbage":
        return "bytes", draw(st.binary(max_size=30)).replace(b"\n", b"")
    return kind, draw(offline_records()), draw(st.integers(0, 10**6)), draw(st.sampled_from(BAD_BYTES))


def render_line(template, prompt_rows) -> bytes:
    if template[0] == "bytes":
        return template[1]
    kind, record, at, bad = template
    line = json.dumps(resolve(record, prompt_rows), ensure_ascii=False).encode()
    at %= len(line) + 1
    if kind == "surrogate":
        quotes = [i for i, byte in enumerate(line) if byte == ord('"')]
        at = quotes[at % len(quotes)] + 1 if quotes else at
        return line[:at] + b"\\udc80" + line[at:]
    if kind == "corrupt":
        return (line[:at] + bad + line[at:]).replace(b"\n", b"")
    return line


def nonblank_row_count(data: bytes) -> int:
    """Rows the importer must account for, counted independently: lines split on b'\\n' (a final
    newline starts no row) that are not blank once decoded."""
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()

    def blank(line: bytes) -> bool:
        try:
            return not line.removesuffix(b"\r").decode("utf-8").strip()
        except UnicodeDecodeError:
            return False

    return sum(not blank(line) for line in lines)


def note(outcome: str) -> None:
    if currently_in_test_context():
        event(outcome)


# ---------------------------------------------------------------------------------------------
# the oracle
# ---------------------------------------------------------------------------------------------


def check_import(path: Path, expected_rows: int, prompt_rows, tokenizer, out_dir: Path):
    """Run the real importer and assert its accounting; write its tables as the rollout stage does.
    Returns the import, or the DataError (already checked to name the file)."""
    try:
        imported = import_offline(path, prompt_rows, tokenizer, max_response_length=MAX_RESPONSE)
    except DataError as exc:
        assert str(path) in str(exc), f"DataError does not name the file: {exc}"
        note("DataError: " + str(exc).replace(str(path), "<file>")[:40] + str(exc).partition("(first:")[2][:40])
        return exc
    rejected_rows = [r["source_row"] for r in imported.rejects]
    assert len(imported.samples) + len(imported.rejects) == expected_rows, "imported + rejected != rows in"
    assert len(set(rejected_rows)) == len(rejected_rows), "a row rejected twice"
    for r in imported.rejects:
        assert r["source_file"] == str(path)
        assert r["source_row"] >= 0 and r["reason"].startswith(f"row {r['source_row']}: ")
        assert r["reason"].split(": ", 1)[1].strip(), r
        assert len(r["raw"]) <= RAW_LIMIT
    keys = [(s.prompt_index, s.sample_index) for s in imported.samples]
    assert len(set(keys)) == len(keys), "duplicate (prompt, sample_index) imported"
    for s in imported.samples:
        assert 0 <= s.prompt_index < len(prompt_rows) and 0 <= s.sample_index < 2**31
        assert s.text.strip() and s.token_ids[-1] == tokenizer.eos_token_id
        assert len(s.token_ids) <= MAX_RESPONSE
    note(f"imported {'some' if imported.samples else 'none'}, rejected {'some' if imported.rejects else 'none'}")
    atomic_write_parquet(out_dir / "rollout.parquet", rollout_table(prompt_rows, imported.samples, 1, "offline"),
                         schema=ROLLOUT)
    atomic_write_parquet(out_dir / "rejects.parquet", imported.rejects_table(), schema=REJECTS)
    return imported


# ---------------------------------------------------------------------------------------------
# fuzz tests
# ---------------------------------------------------------------------------------------------


@FUZZ
@given(lines=st.lists(jsonl_lines(), max_size=12), ending=st.sampled_from([b"\n", b"\r\n"]),
       final_newline=st.booleans(), suffix=st.sampled_from([".jsonl", ".jsonl", ".json", ".csv"]))
def test_fuzz_offline_jsonl(prompt_rows, tokenizer, lines, ending, final_newline, suffix):
    data = ending.join(render_line(t, prompt_rows) for t in lines) + (ending if final_newline and lines else b"")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"logged{suffix}"
        path.write_bytes(data)
        imported = check_import(path, nonblank_row_count(data), prompt_rows, tokenizer, Path(tmp))
        if suffix == ".csv":
            assert "must be .jsonl or .parquet" in str(imported)
        elif isinstance(imported, DataError):  # the only whole-file problem a readable JSONL can have
            assert "no usable response" in str(imported)


RESPONSE_COLUMNS = {
    "string": lambda draw, n: pa.array(draw(st.lists(st.one_of(st.none(), text_responses()), min_size=n,
                                                     max_size=n)), pa.string()),
    "binary": lambda draw, n: pa.array(draw(st.lists(st.binary(max_size=8), min_size=n, max_size=n)), pa.binary()),
    "invalid_utf8": lambda draw, n: pa.array(draw(st.lists(st.sampled_from([b"\xff", b"#### 1", b"\xed\xa0\x80"]),
                                                           min_size=n, max_size=n)), pa.binary()).view(pa.string()),
    "int": lambda draw, n: pa.array(draw(st.lists(st.integers(-5, 5), min_size=n, max_size=n)), pa.int64()),
}
SAMPLE_INDEX_COLUMNS = {
    "int": lambda draw, n: pa.array(draw(st.lists(st.one_of(st.none(), st.integers(-2, 3), st.just(2**40)),
                                                  min_size=n, max_size=n)), pa.int64()),
    "float": lambda draw, n: pa.array(draw(st.lists(st.one_of(st.none(), st.floats()), min_size=n, max_size=n)),
                                      pa.float64()),
    "string": lambda draw, n: pa.array(draw(st.lists(st.text(max_size=3), min_size=n, max_size=n)), pa.string()),
}


@FUZZ
@given(data=st.data(), n=st.integers(0, 8), damage=st.sampled_from([None, None, None, "truncate", "pages"]))
def test_fuzz_offline_parquet(prompt_rows, tokenizer, data, n, damage):
    draw = data.draw
    picks = draw(st.lists(st.integers(0, N_PROMPTS), min_size=n, max_size=n))  # N_PROMPTS: an unknown id
    columns = {"prompt_id": pa.array([prompt_rows[i]["prompt_id"] if i < N_PROMPTS else "nope" for i in picks],
                                     pa.string())}
    if draw(st.integers(0, 3)) == 0:  # the id column as integers instead: none can match the text ids
        columns["prompt_id"] = pa.array(list(range(n)), pa.int64())
    columns["response"] = RESPONSE_COLUMNS[draw(st.sampled_from(["string"] * 4 + [*RESPONSE_COLUMNS]))](draw, n)
    if draw(st.booleans()):
        columns["sample_index"] = SAMPLE_INDEX_COLUMNS[draw(st.sampled_from(list(SAMPLE_INDEX_COLUMNS)))](draw, n)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "logged.parquet"
        pq.write_table(pa.table(columns), path)
        if damage:
            blob = path.read_bytes()
            at = 4 + draw(st.integers(0, len(blob) // 2))
            path.write_bytes(blob[:at] if damage == "truncate" else blob[:at] + b"\xff" * 16 + blob[at + 16:])
        imported = check_import(path, n, prompt_rows, tokenizer, Path(tmp))
        if isinstance(imported, DataError) and not damage:
            assert "no usable response" in str(imported)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(lines=st.lists(jsonl_lines(), min_size=1, max_size=8))
def test_fuzz_offline_through_the_rollout_stage(prompt_dir, prompt_rows, tiny_model_dir, lines):
    """The stage writes rollout.parquet + rollout_rejects.parquet that together account for every
    non-blank row, or stops with a DataError naming the file."""
    data = b"\n".join(render_line(t, prompt_rows) for t in lines) + b"\n"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        logged = tmp / "logged.jsonl"
        logged.write_bytes(data)
        run = RunDir(tmp / "run")
        run.prompts_dir.mkdir(parents=True)
        shutil.copy(RunDir(prompt_dir).train_prompts, run.train_prompts)
        cfg = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir}",
                                 "actor_rollout_ref.rollout.name=offline", f"data.max_response_length={MAX_RESPONSE}",
                                 f"actor_rollout_ref.rollout.offline_path={logged}"])
        try:
            result = run_rollout(cfg, run, 1, force=True)
        except DataError as exc:
            assert str(logged) in str(exc)
            return
        accepted = pq.read_table(run.rollout(1)).num_rows
        rejected = pq.read_table(rollout_rejects_path(run, 1)).num_rows
        assert accepted + rejected == nonblank_row_count(data)
        assert result.rows["responses"] == accepted and result.rows["rejected"] == rejected


# ---------------------------------------------------------------------------------------------
# fixed regressions (each crashed the importer before the fix)
# ---------------------------------------------------------------------------------------------


def reasons(imported) -> list[str]:
    return [r["reason"] for r in imported.rejects]


def test_regressions_rejected_with_reasons_not_raised(tmp_path, prompt_rows, tokenizer):
    pid = prompt_rows[0]["prompt_id"]
    ok = json.dumps({"prompt_id": pid, "response": "#### 1"}).encode()
    lines = [
        ok,
        b'{"prompt_id": "' + pid.encode() + b'", "response": "caf\xe9"}',    # 1 Latin-1, not UTF-8
        b'{"prompt_id": "' + pid.encode() + b'", "response": "\\ud800"}',    # 2 lone surrogate
        json.dumps({"prompt_id": pid, "response": "a", "sample_index": "abc"}).encode(),  # 3
        json.dumps({"prompt_id": pid, "response": "a", "sample_index": [1]}).encode(),    # 4
        b'{"prompt_id": "' + pid.encode() + b'", "response": "a", "sample_index": NaN}',  # 5
        json.dumps({"prompt_id": pid, "response": "a", "sample_index": 2**31}).encode(),  # 6 over int32
        json.dumps({"prompt_id": pid, "response": "a", "sample_index": 1.5}).encode(),    # 7
        json.dumps({"prompt_id": pid, "response": "a", "sample_index": -1}).encode(),     # 8
        json.dumps({"prompt_id": {"x": 1}, "response": "a"}).encode(),                    # 9
        json.dumps({"prompt_id": pid, "response": "<|im_end|>"}).encode(),                # 10 EOS only
        json.dumps({"prompt_id": pid, "response": "  "}).encode(),                        # 11
        ok[:-1] + b'\r' + ok,                                                              # 12 bare CR inside
        ok[:-1] + b', "sample_index": ' + b"7" * 5000 + b"}",                              # 13 > 4,300 digits
    ]
    path = tmp_path / "logged.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    imported = check_import(path, len(lines), prompt_rows, tokenizer, tmp_path)
    got = reasons(imported)
    assert len(imported.samples) == 1 and len(got) == 13
    assert got[0].startswith("row 1: not valid UTF-8")
    assert got[1].startswith("row 2: not valid Unicode: field 'response'")
    for i, shown in zip(range(3, 9), ["'abc'", "[1]", "nan", str(2**31), "1.5", "-1"]):
        assert got[i - 1] == f"row {i}: sample_index must be an integer in [0, 2**31), got {shown}"
    assert got[8] == "row 9: prompt_id must be text or an integer, got dict"
    assert got[9] == "row 10: response is empty" and got[10] == "row 11: response is empty"
    assert got[11].startswith("row 12: malformed JSON")
    assert got[12].startswith("row 13: malformed JSON: Exceeds the limit (4300 digits)")


def test_integral_float_sample_index_from_parquet_is_accepted(tmp_path, prompt_rows, tokenizer):
    """A Parquet int column with nulls is often written as floats: 1.0 means 1, null means 'next'."""
    pid = prompt_rows[0]["prompt_id"]
    path = tmp_path / "logged.parquet"
    pq.write_table(pa.table({"prompt_id": [pid, pid, pid], "response": ["#### 1", "#### 2", "#### 3"],
                             "sample_index": pa.array([1.0, None, math.nan], pa.float64())}), path)
    imported = check_import(path, 3, prompt_rows, tokenizer, tmp_path)
    assert [s.sample_index for s in imported.samples] == [1, 2]
    assert reasons(imported) == ["row 2: sample_index must be an integer in [0, 2**31), got nan"]


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_parquet_is_a_data_error_naming_the_file(tmp_path, prompt_rows, tokenizer, damage):
    path = tmp_path / "logged.parquet"
    pq.write_table(pa.table({"prompt_id": [prompt_rows[0]["prompt_id"]], "response": ["#### 1"]}), path)
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2] if damage == "truncate" else b"PAR1\x00\x00PAR1")
    with pytest.raises(DataError, match=str(path)):
        import_offline(path, prompt_rows, tokenizer, max_response_length=MAX_RESPONSE)


def test_one_megabyte_response_is_rejected_as_too_long(tmp_path, prompt_rows, tokenizer):
    pid = prompt_rows[0]["prompt_id"]
    path = tmp_path / "logged.jsonl"
    path.write_text(json.dumps({"prompt_id": pid, "response": "#### 1"}) + "\n"
                    + json.dumps({"prompt_id": pid, "response": "pens " * 200_000}) + "\n")
    imported = check_import(path, 2, prompt_rows, tokenizer, tmp_path)
    assert len(reasons(imported)) == 1 and "over data.max_response_length" in reasons(imported)[0]
    assert len(imported.rejects[0]["raw"]) <= RAW_LIMIT

