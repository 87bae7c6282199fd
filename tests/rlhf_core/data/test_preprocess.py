"""preprocess_rows / preprocess_files on small files built here, with the real tiny tokenizer.

Every input row must end in train, val or rejects (with the right reason and row number), the
tokenized columns must equal what the tokenizer gives, and the split must not depend on row order.
"""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_core.config.schema import DataConfig
from rlhf_core.data.preprocess import content_prompt_id, preprocess_files, preprocess_rows
from rlhf_core.data.readers import read_rows
from rlhf_core.data.schemas import PROMPTS, REJECTS


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def problem(i: int) -> dict:
    return {"question": f"Ava has {i} pens, then gets 2 more pens. How many pens does Ava have now?",
            "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run(files, data, tokenizer, val_files=()):
    result = preprocess_files(files, list(val_files), data, tokenizer, progress=False)
    assert result.train.schema == PROMPTS and result.val.schema == PROMPTS and result.rejects.schema == REJECTS
    assert result.train.num_rows + result.val.num_rows + result.rejects.num_rows == result.rows_in
    return result


def rejects_by_row(result) -> dict[int, str]:
    return {r["source_row"]: r["reason"] for r in result.rejects.to_pylist()}


def test_every_bad_row_is_rejected_with_reason_and_row(tmp_path, tokenizer):
    good = [json.dumps(problem(i)).encode() for i in range(3)]
    lines = [
        good[0],                                                         # 0 ok
        b'{"question": "Ava has',                                        # 1 malformed JSON
        b'{"question": "Ava has \xff pens", "answer": "#### 1"}',       # 2 not UTF-8
        json.dumps({"question": "Q?"}).encode(),                         # 3 missing answer
        json.dumps({"question": "  ", "answer": "#### 1"}).encode(),     # 4 empty question
        json.dumps({"question": "Q?", "answer": "four"}).encode(),       # 5 no '####' number
        json.dumps({"question": "pens " * 400, "answer": "#### 1"}).encode(),  # 6 too long
        good[0],                                                         # 7 duplicate of row 0
        b'"just a string"',                                              # 8 not an object
        good[1],                                                         # 9 ok
    ]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    result = run([path], DataConfig(max_prompt_length=128, filter_overlong_prompts=True, val_fraction=0.0), tokenizer)
    reasons = rejects_by_row(result)
    assert sorted(reasons) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert reasons[1].startswith("malformed JSON")
    assert reasons[2].startswith("not valid UTF-8")
    assert reasons[3].startswith("missing answer")
    assert reasons[4].startswith("empty question")
    assert reasons[5].startswith("no '####' number")
    assert reasons[6].startswith("prompt too long (") and "> 128 tokens" in reasons[6]
    assert reasons[7] == "duplicate of row 0"
    assert reasons[8].startswith("not a JSON object")
    assert {k: v for k, v in result.rows.items() if "/" not in k} == {"input": 10, "train": 2, "val": 0, "rejected": 8}
    assert [r["source_row"] for r in result.train.to_pylist()] == [0, 9]
    raw = {r["source_row"]: r["raw"] for r in result.rejects.to_pylist()}
    assert raw[1] == '{"question": "Ava has' and "\ufffd" in raw[2]
    assert result.reject_counts["duplicate"] == 1 and sum(result.reject_counts.values()) == 8


def test_tokenized_columns_equal_the_tokenizer_and_lengths_respect_the_limit(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [problem(i) for i in range(20)])
    data = DataConfig(system_prompt="You are a careful solver.", val_fraction=0.0)
    rows = run([path], data, tokenizer).train.to_pylist()
    for row in rows:
        expected_text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        assert row["prompt_text"] == expected_text and expected_text.endswith("<|im_start|>assistant\n")
        assert row["prompt_token_ids"] == tokenizer(expected_text, add_special_tokens=False)["input_ids"]
        assert row["prompt_length"] == len(row["prompt_token_ids"])
        assert row["prompt"][0] == {"role": "system", "content": "You are a careful solver."}
        info = json.loads(row["extra_info"])
        assert row["reward_model"] == {"style": "rule", "ground_truth": info["answer"].split("#### ")[1]}
        assert list(info) == ["split", "index", "answer", "question"]  # verl's GSM8K script's keys, in its order
        assert row["reward_source"] == row["data_source"] and row["prompt_tokens_cut"] == 0
        assert row["ability"] == "math" and row["data_source"] == "openai/gsm8k"
    # a limit one token below the shortest prompt rejects everything, each with its exact length
    shortest = min(r["prompt_length"] for r in rows)
    tight = run([path], DataConfig(system_prompt=data.system_prompt, max_prompt_length=shortest - 1,
                                   filter_overlong_prompts=True), tokenizer)
    assert tight.train.num_rows == 0 and tight.rejects.num_rows == 20
    lengths = {r["source_row"]: r["prompt_length"] for r in rows}
    for row, reason in rejects_by_row(tight).items():
        assert reason.startswith(f"prompt too long ({lengths[row]} > {shortest - 1} tokens")


def test_csv_and_mixed_schema_parquet_files(tmp_path, tokenizer):
    a = tmp_path / "a.parquet"
    pq.write_table(pa.table({"question": [problem(0)["question"]], "answer": [problem(0)["answer"]],
                             "id": ["a-0"]}), a)
    b = tmp_path / "b.parquet"  # other column order, an extra int column, a null answer
    pq.write_table(pa.table({"level": [1, 2], "answer": [problem(1)["answer"], None],
                             "question": [problem(1)["question"], problem(2)["question"]]}), b)
    c = tmp_path / "c.csv"
    c.write_text('question,answer\n"{}","{}"\n'.format(problem(3)["question"], problem(3)["answer"]))
    result = run([a, b, c], DataConfig(val_fraction=0.0), tokenizer)
    assert result.files == {str(a): 1, str(b): 2, str(c): 1}
    assert rejects_by_row(result) == {1: "missing answer: 'answer' is null"}
    assert result.rejects.column("source_file").to_pylist() == [str(b)]
    origin = [(r["source_file"], r["source_row"]) for r in result.train.to_pylist()]
    assert result.layouts == {str(a): "gsm8k", str(b): "gsm8k", str(c): "gsm8k"}  # adapter 'auto'
    assert origin == [(str(a), 0), (str(b), 0), (str(c), 0)]
    assert result.train.column("reward_model").to_pylist()[2]["ground_truth"] == "5"
    # not every row has an id, so ids are content hashes
    row0 = result.train.to_pylist()[0]
    assert result.id_source == "content hashes"
    assert row0["prompt_id"] == content_prompt_id("openai/gsm8k", row0["prompt"])


def test_generic_adapter_column_mapping(tmp_path, tokenizer):
    path = tmp_path / "g.parquet"
    pq.write_table(pa.table({"text": ["Name the capital of France.", "Two plus two?", ""],
                             "label": ["Paris", "4", "x"], "uid": ["u0", "u1", "u2"]}), path)
    data = DataConfig(adapter="generic", prompt_key="text", answer_key="label", id_key="uid",
                      instruction="", data_source="qa", ability="qa", val_fraction=0.0)
    result = run([path], data, tokenizer)
    rows = result.train.to_pylist()
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": "Name the capital of France."}],
                                           [{"role": "user", "content": "Two plus two?"}]]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["Paris", "4"]
    assert [r["prompt_id"] for r in rows] == ["u0", "u1"] and result.id_source == "source ids"
    assert rows[0]["data_source"] == "qa" and rows[0]["ability"] == "qa"
    assert rejects_by_row(result) == {2: "empty prompt: 'text' is blank"}


def _val_ids(rows, data, tokenizer, path):
    result = run([write_jsonl(path, rows)], data, tokenizer)
    return result, set(result.val.column("prompt_id").to_pylist())


def test_split_is_seeded_sized_and_independent_of_row_order(tmp_path, tokenizer):
    rows = [problem(i) for i in range(200)]
    data = DataConfig(val_fraction=0.1, max_val_samples=256, seed=3)
    first, val_a = _val_ids(rows, data, tokenizer, tmp_path / "a.jsonl")
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    _, val_b = _val_ids(shuffled, data, tokenizer, tmp_path / "b.jsonl")
    assert len(val_a) == 20 and val_a == val_b
    _, val_other_seed = _val_ids(rows, DataConfig(val_fraction=0.1, seed=4), tokenizer, tmp_path / "c.jsonl")
    assert len(val_other_seed) == 20 and val_other_seed != val_a
    capped, val_capped = _val_ids(rows, DataConfig(val_fraction=0.1, max_val_samples=7, seed=3), tokenizer,
                                  tmp_path / "d.jsonl")
    assert len(val_capped) == 7 and capped.train.num_rows == 193  # held back rows go to train, not lost
    assert set(first.train.column("prompt_id").to_pylist()).isdisjoint(val_a)
    for table, split in ((first.train, "train"), (first.val, "val")):
        extra = [json.loads(e) for e in table.column("extra_info").to_pylist()]
        assert [e["split"] for e in extra] == [split] * table.num_rows
        assert [e["index"] for e in extra] == list(range(table.num_rows))


def test_validation_files_are_capped_and_the_rest_rejected(tmp_path, tokenizer):
    train = write_jsonl(tmp_path / "train.jsonl", [problem(i) for i in range(10)])
    val = write_jsonl(tmp_path / "val.jsonl", [problem(i) for i in range(100, 106)])
    result = run([train], DataConfig(max_val_samples=4), tokenizer, val_files=[val])
    assert {k: v for k, v in result.rows.items() if "/" not in k} == {"input": 16, "train": 10, "val": 4, "rejected": 2}
    assert set(result.rejects.column("reason").to_pylist()) == {
        "over validation cap (data.max_val_samples=4; -1 scores every validation prompt)"}
    assert set(result.val.column("source_file").to_pylist()) == {val}
    assert ("validation: 4 of 6 prompts of data.val_files (data.max_val_samples=4); -1 scores them all, as verl does"
            in result.summary_lines())


def test_validation_files_are_scored_whole_by_default(tmp_path, tokenizer):
    """verl scores every prompt of data.val_files: no default cap (300 > the 256 a split may hold)."""
    train = write_jsonl(tmp_path / "train.jsonl", [problem(i) for i in range(10)])
    val = write_jsonl(tmp_path / "val.jsonl", [problem(i) for i in range(100, 400)])
    result = run([train], DataConfig(), tokenizer, val_files=[val])
    assert {k: v for k, v in result.rows.items() if "/" not in k} == {"input": 310, "train": 10, "val": 300, "rejected": 0}
    assert not any(line.startswith("validation:") for line in result.summary_lines())
    capped = run([train], DataConfig(val_max_samples=50), tokenizer, val_files=[val])  # verl's own cap
    assert capped.rows["val"] == 50


def test_a_capped_split_says_so(tmp_path, tokenizer):
    rows = [problem(i) for i in range(3000)]
    result, val = _val_ids(rows, DataConfig(val_fraction=0.1), tokenizer, tmp_path / "a.jsonl")
    assert len(val) == 256 and result.train.num_rows == 3000 - 256
    assert ("validation: 256 held-out prompts instead of data.val_fraction's 300 (a split of the training files "
            "holds at most 256; data.max_val_samples sets it)") in result.summary_lines()


def test_ids_from_source_when_unique_else_hashes_and_dedup_off_keeps_ids_unique(tmp_path, tokenizer):
    with_ids = [dict(problem(i), id=f"p{i}") for i in range(5)]
    result = run([write_jsonl(tmp_path / "ids.jsonl", with_ids)], DataConfig(val_fraction=0.0), tokenizer)
    assert result.train.column("prompt_id").to_pylist() == [f"p{i}" for i in range(5)]
    clash = with_ids + [dict(problem(9), id="p0")]  # a repeated id cannot identify rows
    result = run([write_jsonl(tmp_path / "clash.jsonl", clash)], DataConfig(val_fraction=0.0), tokenizer)
    assert result.id_source == "content hashes"
    repeated = [problem(1), problem(1), problem(1)]
    result = run([write_jsonl(tmp_path / "rep.jsonl", repeated)], DataConfig(dedup=False, val_fraction=0.0),
                 tokenizer)
    ids = result.train.column("prompt_id").to_pylist()
    assert result.rejects.num_rows == 0 and len(set(ids)) == 3 and ids[1] == ids[0] + "-1"


def test_duplicates_across_files_name_the_other_file(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [problem(1), problem(2)])
    b = write_jsonl(tmp_path / "b.jsonl", [problem(3), problem(2)])
    result = run([a, b], DataConfig(val_fraction=0.0), tokenizer)
    assert result.rejects.to_pylist()[0]["reason"] == f"duplicate of row 1 of {a}"
    assert result.rejects.to_pylist()[0]["source_file"] == b


def test_rows_api_without_files(tokenizer, tmp_path):
    """preprocess_rows takes any RawRow iterable (e.g. a reader's output), no run directory needed."""
    path = write_jsonl(tmp_path / "x.jsonl", [problem(i) for i in range(4)])
    result = preprocess_rows(read_rows(path), None, DataConfig(val_fraction=0.25), tokenizer, progress=False)
    assert {k: v for k, v in result.rows.items() if "/" not in k} == {"input": 4, "train": 3, "val": 1, "rejected": 0}
    stats = result.length_stats
    assert stats["min"] <= stats["p50"] <= stats["p95"] <= stats["max"] and stats["min"] <= stats["mean"]
    lines = "\n".join(result.summary_lines())
    assert "rows in: 4 = train 3 + val 1 + rejected 0" in lines and "prompt length (tokens): min" in lines


@pytest.mark.parametrize("name, write, says, never", [
    ("empty.parquet", lambda p: pq.write_table(pa.table({"question": pa.array([], pa.string()),
                                                        "answer": pa.array([], pa.string())}), p),
     "a Parquet table with the columns 'question' (text) and 'answer' (text ending in '#### <number>')", "per line"),
    ("keys.parquet", lambda p: pq.write_table(pa.table({"q": ["1+1"], "a": ["#### 2"]}), p),
     "a Parquet table with the columns 'question'", "per line"),
    ("empty.csv", lambda p: p.write_text("question,answer\n"),
     "a CSV file whose header row names the columns 'question' (text)", "per line"),
    ("empty.jsonl", lambda p: p.write_text(""), 'one JSON object per line, e.g. {"question"', "Parquet"),
])
def test_the_advice_for_a_file_without_prompts_speaks_of_its_format(tmp_path, name, write, says, never):
    """Issue 50: an empty Parquet file was given advice written for JSONL ("one JSON object per line")."""
    from rlhf_core.data.preprocess import screen_files
    from rlhf_core.data.outcome import no_prompts_problem

    path = tmp_path / name
    write(path)
    data = DataConfig(adapter="gsm8k")
    problem = no_prompts_problem(screen_files([path], [], data), data)
    assert str(path) in problem and says in problem and never not in problem, problem
