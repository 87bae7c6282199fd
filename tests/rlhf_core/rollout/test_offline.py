"""Offline trajectories: rows validated against a real prompt table (built by the preprocess step),
accepted by prompt id or by prompt text, from JSONL and Parquet; every rejected row named."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rlhf_core.config.schema import DataConfig
from rlhf_core.data.schemas import REJECTS, decode_extra_info
from rlhf_core.errors import DataError
from rlhf_core.rollout.base import FINISH_OFFLINE
from rlhf_core.rollout.offline import import_offline


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def prompt_rows(repo_root, tokenizer, tmp_path_factory):
    """prompts/train rows from the first 12 embedded arithmetic problems, by the real preprocess step."""
    from rlhf_core.data.preprocess import preprocess_files

    raw = tmp_path_factory.mktemp("raw") / "arith.jsonl"
    raw.write_text("".join((repo_root / "data/arith/train.jsonl").read_text().splitlines(True)[:12]))
    result = preprocess_files([raw], [], DataConfig(val_fraction=0.0, data_source="arith"), tokenizer,
                              progress=False)
    rows = result.train.to_pylist()
    assert len(rows) == 12
    return rows


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_accepts_rows_by_prompt_id_and_appends_eos(tmp_path, prompt_rows, tokenizer):
    ids = [r["prompt_id"] for r in prompt_rows]
    src = _write_jsonl(tmp_path / "logged.jsonl", [
        {"prompt_id": ids[0], "response": "10 * 5 = 50\n#### 50"},
        {"prompt_id": ids[0], "response": "#### 49"},
        {"prompt_id": ids[3], "response": "#### 7" + tokenizer.eos_token},  # EOS already there: not doubled
    ])
    result = import_offline(src, prompt_rows, tokenizer, max_response_length=64)
    assert result.rejects == []
    assert [(s.prompt_index, s.sample_index) for s in result.samples] == [(0, 0), (0, 1), (3, 0)]
    for s in result.samples:
        assert s.finish_reason == FINISH_OFFLINE and s.seed == -1
        assert s.token_ids[-1] == tokenizer.eos_token_id and s.token_ids.count(tokenizer.eos_token_id) == 1
        assert tokenizer.decode(s.token_ids, skip_special_tokens=True) == s.text
    assert result.samples[2].text == "#### 7"


def test_unknown_prompt_is_rejected_with_its_row_named(tmp_path, prompt_rows, tokenizer):
    good = prompt_rows[1]["prompt_id"]
    src = _write_jsonl(tmp_path / "logged.jsonl", [
        {"prompt_id": good, "response": "#### 1"},
        {"prompt_id": good, "response": "#### 2"},
        {"prompt_id": "x", "response": "#### 3"},
        {"prompt": "What is the capital of France?", "response": "Paris"},
    ])
    result = import_offline(src, prompt_rows, tokenizer, max_response_length=64)
    assert len(result.samples) == 2
    reasons = [r["reason"] for r in result.rejects]
    assert reasons[0] == "row 2: prompt_id 'x' not in prompts/train.parquet"
    assert reasons[1].startswith("row 3: prompt text 'What is the capital of France?' not in")
    assert [r["source_row"] for r in result.rejects] == [2, 3]
    assert all(r["source_file"] == str(src) for r in result.rejects)
    table = result.rejects_table()
    assert table.schema.equals(REJECTS) and table.num_rows == 2


def test_matches_prompts_by_text_in_every_form(tmp_path, prompt_rows, tokenizer):
    row = prompt_rows[2]
    user = next(m["content"] for m in row["prompt"] if m["role"] == "user")
    src = _write_jsonl(tmp_path / "logged.jsonl", [
        {"prompt": decode_extra_info(row["extra_info"])["question"], "response": "a"},  # the raw question
        {"prompt": user, "response": "b"},                            # the user message as sent
        {"prompt": row["prompt_text"], "response": "c"},              # the templated prompt
        {"prompt": [{"role": "user", "content": user}], "response": "d"},  # chat messages
    ])
    result = import_offline(src, prompt_rows, tokenizer, max_response_length=64)
    assert result.rejects == []
    assert [(s.prompt_index, s.sample_index, s.text) for s in result.samples] == [
        (2, 0, "a"), (2, 1, "b"), (2, 2, "c"), (2, 3, "d")]


def test_reads_parquet_with_explicit_sample_index(tmp_path, prompt_rows, tokenizer):
    ids = [r["prompt_id"] for r in prompt_rows]
    src = tmp_path / "logged.parquet"
    pq.write_table(pa.table({"prompt_id": [ids[4], ids[4], ids[5]], "sample_index": [3, 3, 0],
                             "response": ["#### 1", "#### 2", "#### 3"]}), src)
    result = import_offline(src, prompt_rows, tokenizer, max_response_length=64)
    assert [(s.prompt_index, s.sample_index) for s in result.samples] == [(4, 3), (5, 0)]
    assert [r["reason"] for r in result.rejects] == [f"row 1: duplicate sample_index 3 for prompt_id {ids[4]!r}"]


def test_bad_rows_are_rejected_not_dropped(tmp_path, prompt_rows, tokenizer):
    pid = prompt_rows[0]["prompt_id"]
    src = tmp_path / "logged.jsonl"
    src.write_text("\n".join([
        json.dumps({"prompt_id": pid, "response": "ok"}),
        "{not json",
        json.dumps({"prompt_id": pid}),
        json.dumps({"response": "no prompt"}),
        json.dumps({"prompt_id": pid, "response": "1 + 1 = 2\n" * 30}),
    ]) + "\n")
    result = import_offline(src, prompt_rows, tokenizer, max_response_length=32)
    assert len(result.samples) == 1
    reasons = [r["reason"] for r in result.rejects]
    assert reasons[0].startswith("row 1: malformed JSON: ")
    assert reasons[1] == "row 2: response must be text, got NoneType"
    assert reasons[2] == "row 3: has neither prompt_id nor prompt (text or chat messages)"
    assert reasons[3].startswith("row 4: response is") and "data.max_response_length=32" in reasons[3]


def test_no_accepted_row_is_an_error_naming_the_file(tmp_path, prompt_rows, tokenizer):
    src = _write_jsonl(tmp_path / "logged.jsonl", [{"prompt_id": "nope", "response": "x"}])
    with pytest.raises(DataError, match=r"logged\.jsonl.*row 0: prompt_id 'nope'"):
        import_offline(src, prompt_rows, tokenizer, max_response_length=64)
    csv = tmp_path / "logged.csv"
    csv.write_text("prompt_id,response\n")
    with pytest.raises(DataError, match="must be .jsonl or .parquet"):
        import_offline(csv, prompt_rows, tokenizer, max_response_length=64)
