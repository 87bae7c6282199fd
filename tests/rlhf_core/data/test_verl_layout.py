"""verl's preprocessed layout read natively: Parquet built the way verl's examples/data_preprocess/gsm8k.py
builds it (from the real GSM8K rows in ../shared, and a small synthetic file that always runs),
adapter 'auto', overlong prompts (filter / error / verl's left-right-middle cut), sample caps, and
extra_info kept whole and queryable with DuckDB."""

from __future__ import annotations

import json
import random
import re

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf_core.config.schema import DataConfig
from rlhf_core.data.preprocess import preprocess_files, truncate_prompt
from rlhf_core.data.schemas import PROMPTS, decode_extra_info
from rlhf_core.errors import DataError

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def verl_gsm8k_rows(raw_rows: list[dict], split: str) -> list[dict]:
    """What verl's GSM8K script makes of raw {question, answer} rows: the question plus a space and
    the instruction as the one user message, the number after '#### ' (commas dropped) as the
    ground truth, and the raw question/answer with split and index in extra_info."""
    out = []
    for index, raw in enumerate(raw_rows):
        number = re.search(r"#### (\-?[0-9\.\,]+)", raw["answer"]).group(0).split("#### ")[1].replace(",", "")
        out.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": raw["question"] + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": number},
            "extra_info": {"split": split, "index": index, "answer": raw["answer"], "question": raw["question"]},
        })
    return out


def write_verl_parquet(path, rows: list[dict]) -> str:
    """As verl writes it (datasets' to_parquet is pyarrow underneath): nested columns become
    list<struct> / struct columns."""
    pd.DataFrame(rows).to_parquet(path, engine="pyarrow")
    return str(path)


def run(train, data, tokenizer, val=()):
    result = preprocess_files(list(train), list(val), data, tokenizer, progress=False)
    assert result.train.schema == PROMPTS and result.val.schema == PROMPTS
    assert result.train.num_rows + result.val.num_rows + result.rejects.num_rows == result.rows_in
    return result


def synthetic_rows(n: int) -> list[dict]:
    raw = [{"question": f"Tom has {i} apples and buys {i + 3} more. How many now?",
            "answer": f"{i} + {i + 3} = {2 * i + 3}\n#### {2 * i + 3:,}"} for i in range(n)]
    return verl_gsm8k_rows(raw, "train")


# ---------------------------------------------------------------------------------------------
# the layout, end to end
# ---------------------------------------------------------------------------------------------


def test_verl_parquet_is_accepted_with_its_own_columns(tmp_path, tokenizer):
    rows = synthetic_rows(30)
    rows[4]["extra_info"]["tools_kwargs"] = {"calculator": {"precision": 2}}  # a key only one row has
    rows[5]["data_source"] = "my/other_source"
    path = write_verl_parquet(tmp_path / "train.parquet", rows)
    assert pa.types.is_list(pq.read_schema(path).field("prompt").type)
    result = run([path], DataConfig(val_fraction=0.0), tokenizer)
    assert result.layouts == {path: "verl"} and result.rows["train"] == 30
    out = result.train.to_pylist()
    for src, row in zip(rows, out):
        assert row["prompt"] == src["prompt"]  # the instruction is already in it: nothing appended
        assert row["data_source"] == row["reward_source"] == src["data_source"]
        assert row["ability"] == "math" and row["reward_model"] == src["reward_model"]
        # Parquet's struct holds the union of keys: rows without tools_kwargs read it back as null
        assert {k: v for k, v in decode_extra_info(row["extra_info"]).items() if v is not None} == src["extra_info"]
        assert row["prompt_text"] == tokenizer.apply_chat_template(src["prompt"], tokenize=False,
                                                                   add_generation_prompt=True)
        assert row["prompt_token_ids"] == tokenizer(row["prompt_text"], add_special_tokens=False)["input_ids"]
    assert decode_extra_info(out[4]["extra_info"])["tools_kwargs"] == {"calculator": {"precision": 2}}
    assert out[0]["reward_model"]["ground_truth"] == "3" and out[29]["reward_model"]["ground_truth"] == "61"


def test_extra_info_is_queryable_with_duckdb(tmp_path, tokenizer):
    rows = synthetic_rows(8)
    rows[2]["extra_info"]["difficulty"] = "hard"
    path = write_verl_parquet(tmp_path / "train.parquet", rows)
    result = run([path], DataConfig(val_fraction=0.0), tokenizer)
    out = tmp_path / "prompts.parquet"
    pq.write_table(result.train, out)
    con = duckdb.connect()
    got = con.execute(f"SELECT extra_info->>'$.index', extra_info->>'$.split', "
                      f"json_extract_string(extra_info, '$.difficulty') FROM '{out}' ORDER BY source_row").fetchall()
    assert [g[0] for g in got] == [str(i) for i in range(8)] and {g[1] for g in got} == {"train"}
    assert [g[2] for g in got].count("hard") == 1 and got[2][2] == "hard"


def test_plain_string_prompt_column_is_one_user_turn(tmp_path, tokenizer):
    rows = synthetic_rows(3)
    for r in rows:
        r["prompt"] = r["prompt"][0]["content"]
    path = write_verl_parquet(tmp_path / "s.parquet", rows)
    result = run([path], DataConfig(adapter="verl", val_fraction=0.0), tokenizer)
    assert [r["prompt"] for r in result.train.to_pylist()] == [[{"role": "user", "content": r["prompt"]}] for r in rows]


def test_real_gsm8k_as_verl_writes_it_with_val_files(tmp_path, tokenizer, gsm8k_train):
    raw = [json.loads(line) for line in gsm8k_train.read_text().splitlines()[:300]]
    train = write_verl_parquet(tmp_path / "train.parquet", verl_gsm8k_rows(raw[:240], "train"))
    test = write_verl_parquet(tmp_path / "test.parquet", verl_gsm8k_rows(raw[240:], "test"))
    result = run([train], DataConfig(), tokenizer, val=[test])  # every default: auto, truncation=error, 512
    assert result.layouts == {train: "verl", test: "verl"}
    assert result.rows == {"input": 300, "train": 240, "val": 60, "rejected": 0}
    for row, src in zip(result.val.to_pylist(), raw[240:]):
        info = decode_extra_info(row["extra_info"])
        assert info["split"] == "test" and info["question"] == src["question"] and info["answer"] == src["answer"]
        assert row["reward_model"]["ground_truth"] == src["answer"].split("#### ")[1].replace(",", "")
    # the same rows through our raw gsm8k adapter give the same prompts (the instruction is the same)
    jsonl = tmp_path / "raw.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in raw[:240]))
    ours = run([str(jsonl)], DataConfig(val_fraction=0.0), tokenizer)
    assert ours.layouts == {str(jsonl): "gsm8k"}
    assert ours.train.column("prompt_token_ids").to_pylist() == result.train.column("prompt_token_ids").to_pylist()
    assert ours.train.column("reward_model").to_pylist() == result.train.column("reward_model").to_pylist()


# ---------------------------------------------------------------------------------------------
# auto
# ---------------------------------------------------------------------------------------------


def test_auto_picks_per_file_and_waits_for_a_readable_row(tmp_path, tokenizer):
    verl = write_verl_parquet(tmp_path / "v.parquet", synthetic_rows(3))
    raw = tmp_path / "r.jsonl"  # a broken first line and a row missing the answer before the layout shows
    raw.write_text('{"question": "broken\n{"question": "Only a question?"}\n'
                   '{"question": "Sam has 2 and 2. How many?", "answer": "#### 4"}\n')
    result = run([verl, str(raw)], DataConfig(val_fraction=0.0), tokenizer)
    assert result.layouts == {verl: "verl", str(raw): "gsm8k"}
    assert result.rows == {"input": 6, "train": 4, "val": 0, "rejected": 2,
                           "rejected/malformed JSON": 1, "rejected/missing answer": 1}
    reasons = result.rejects.column("reason").to_pylist()
    assert reasons[0].startswith("malformed JSON") and reasons[1] == "missing answer: no 'answer' field"


def test_auto_unknown_layout_is_one_error_naming_file_and_columns(tmp_path, tokenizer):
    path = tmp_path / "odd.parquet"
    pq.write_table(pa.table({"text": ["hi"], "label": ["x"]}), path)
    with pytest.raises(DataError) as info:
        run([str(path)], DataConfig(), tokenizer)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: data.adapter=auto cannot tell the layout")
    assert "its columns are 'text', 'label'" in message and "data.question_key='question'" in message
    csv = tmp_path / "odd.csv"
    csv.write_text("q,a\nx,y\n")
    with pytest.raises(DataError, match=r"odd\.csv: .*its columns are 'q', 'a'"):
        run([str(csv)], DataConfig(), tokenizer)


# ---------------------------------------------------------------------------------------------
# overlong prompts
# ---------------------------------------------------------------------------------------------


def verl_cut(ids: list[int], max_len: int, mode: str) -> list[int]:
    """verl's rule as its postprocess_data writes it, on a (1, L) tensor."""
    t = torch.tensor([ids])
    if t.shape[-1] <= max_len:
        return ids
    if mode == "left":
        t = t[:, -max_len:]
    elif mode == "right":
        t = t[:, :max_len]
    else:
        left_half = max_len // 2
        right_half = max_len - left_half
        t = torch.cat([t[:, :left_half], t[:, -right_half:]], dim=-1)
    return t[0].tolist()


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncate_prompt_matches_verls_rule(mode):
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
        max_len = rng.randrange(1, 45)
        assert truncate_prompt(ids, max_len, mode) == verl_cut(ids, max_len, mode), (ids, max_len)
    assert truncate_prompt([1, 2, 3, 4, 5], 3, "middle") == [1, 4, 5]


def _long_and_short(tmp_path) -> str:
    """Four prompts; row 2 is several times longer than the others (which fit 128 tokens)."""
    rows = synthetic_rows(4)
    rows[2]["prompt"] = [{"role": "user", "content": "apples " * 200 + INSTRUCTION}]
    return write_verl_parquet(tmp_path / "long.parquet", rows)


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_cuts_and_says_how_many(tmp_path, tokenizer, mode):
    path = _long_and_short(tmp_path)
    full = run([path], DataConfig(val_fraction=0.0, max_prompt_length=4096), tokenizer).train.to_pylist()
    limit = max(r["prompt_length"] for i, r in enumerate(full) if i != 2)  # only row 2 is over it
    result = run([path], DataConfig(val_fraction=0.0, max_prompt_length=limit, truncation=mode), tokenizer)
    rows = result.train.to_pylist()
    assert result.truncated == 1 and any("prompts truncated" in line for line in result.summary_lines())
    for before, after in zip(full, rows):
        assert after["prompt_token_ids"] == verl_cut(before["prompt_token_ids"], limit, mode)
        assert after["prompt_length"] == len(after["prompt_token_ids"]) <= limit
        assert after["prompt_tokens_cut"] == before["prompt_length"] - after["prompt_length"]
        assert after["prompt_id"] == before["prompt_id"]  # ids come from the content, not the tokens
    assert rows[2]["prompt_tokens_cut"] > 0 and rows[2]["prompt_length"] == limit
    assert rows[2]["prompt_text"] == tokenizer.decode(rows[2]["prompt_token_ids"], skip_special_tokens=False)


def test_overlong_with_truncation_error_is_one_line_naming_row_length_and_keys(tmp_path, tokenizer):
    path = _long_and_short(tmp_path)
    with pytest.raises(DataError) as info:
        run([path], DataConfig(val_fraction=0.0, max_prompt_length=128), tokenizer)
    message = str(info.value)
    assert "\n" not in message
    assert re.match(rf"{re.escape(path)} row 2: prompt is \d+ tokens .*over data.max_prompt_length=128", message)
    assert "data.filter_overlong_prompts=true" in message and "data.truncation=left|right|middle" in message


def test_filter_overlong_prompts_rejects_with_reason(tmp_path, tokenizer):
    path = _long_and_short(tmp_path)
    result = run([path], DataConfig(val_fraction=0.0, max_prompt_length=128, filter_overlong_prompts=True,
                                    truncation="left"), tokenizer)
    assert result.rows["train"] == 3 and result.truncated == 0
    (reject,) = result.rejects.to_pylist()
    assert reject["source_row"] == 2 and reject["reason"].startswith("prompt too long (")


# ---------------------------------------------------------------------------------------------
# sample caps
# ---------------------------------------------------------------------------------------------


def test_train_and_val_max_samples(tmp_path, tokenizer):
    rows = synthetic_rows(40)
    train = write_verl_parquet(tmp_path / "train.parquet", rows[:30])
    val = write_verl_parquet(tmp_path / "val.parquet", rows[30:])
    first = run([train], DataConfig(train_max_samples=12, val_max_samples=4, shuffle=False), tokenizer, val=[val])
    assert first.rows == {"input": 40, "train": 12, "val": 4, "rejected": 24,
                          "rejected/over train cap": 18, "rejected/over validation cap": 6}
    assert first.train.column("source_row").to_pylist() == list(range(12))  # shuffle off: the first N, as verl
    assert first.val.column("source_row").to_pylist() == list(range(4))
    assert set(first.rejects.column("reason").to_pylist()) == {
        "over train cap (data.train_max_samples=12)",
        "over validation cap (data.val_max_samples=4; -1 scores every validation prompt)"}
    shuffled = run([train], DataConfig(train_max_samples=12, val_max_samples=4, shuffle=True), tokenizer, val=[val])
    picked = shuffled.train.column("source_row").to_pylist()
    assert len(picked) == 12 and picked == sorted(picked) and picked != list(range(12))  # seeded pick, file order
    again = run([train], DataConfig(train_max_samples=12, val_max_samples=4, shuffle=True), tokenizer, val=[val])
    assert again.train.column("prompt_id").to_pylist() == shuffled.train.column("prompt_id").to_pylist()
    everything = run([train], DataConfig(train_max_samples=-1, val_max_samples=-1), tokenizer, val=[val])
    assert everything.rows == {"input": 40, "train": 30, "val": 10, "rejected": 0}


def test_val_max_samples_caps_the_held_out_split(tmp_path, tokenizer):
    path = write_verl_parquet(tmp_path / "train.parquet", synthetic_rows(40))
    result = run([path], DataConfig(val_fraction=0.5, val_max_samples=3), tokenizer)
    assert result.rows == {"input": 40, "train": 37, "val": 3, "rejected": 0}  # held-back rows stay in train
