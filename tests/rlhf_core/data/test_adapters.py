"""Adapters: verl's preprocessed layout, verl's GSM8K prompt wording and answer extraction, the
generic column map, the reward_fn_key value, layout detection for 'auto', the registry."""

from __future__ import annotations

import pytest

from rlhf_core.config.errors import ConfigError
from rlhf_core.config.schema import DataConfig
from rlhf_core.data.adapters import (
    ADAPTERS, RowRejected, extract_gsm8k_answer, generic_adapter, get_adapter, gsm8k_adapter, matching_layout,
    unknown_layout_error, verl_adapter,
)

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def test_gsm8k_prompt_matches_verl_recipe():
    record = {"question": "How many?", "answer": "2 + 2 = 4\n#### 4", "id": 7}
    ex = gsm8k_adapter(record, DataConfig())
    assert ex.messages == [{"role": "user", "content": "How many? " + INSTRUCTION}]
    assert ex.ground_truth == "4" and ex.extra_info == {"answer": record["answer"], "question": "How many?"}
    assert ex.source_id == "7" and ex.own_extra_info
    assert (ex.data_source, ex.ability, ex.reward_source) == ("openai/gsm8k", "math", "openai/gsm8k")


def test_gsm8k_reads_question_key():
    data = DataConfig(question_key="problem", answer_key="solution")
    ex = gsm8k_adapter({"problem": "Q?", "solution": "#### 3"}, data)
    assert ex.messages[-1]["content"].startswith("Q? ") and ex.ground_truth == "3"
    with pytest.raises(RowRejected, match="no 'problem' field"):
        gsm8k_adapter({"question": "Q?", "solution": "#### 3"}, data)


def test_system_prompt_comes_first_and_empty_instruction_adds_no_space():
    data = DataConfig(system_prompt="Be brief.", instruction="")
    ex = gsm8k_adapter({"question": "Q?", "answer": "#### 1"}, data)
    assert ex.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?"}]


@pytest.mark.parametrize("answer, truth", [
    ("so #### 1,234", "1234"),        # thousands separators stripped, as verl does
    ("#### -5", "-5"),
    ("####3.75", "3.75"),
    ("x\n#### 1,000,000.5\n", "1000000.5"),
    ("no marker 42", None),
    ("#### , .", None),                # '####' without a number
])
def test_extract_gsm8k_answer(answer, truth):
    assert extract_gsm8k_answer(answer) == truth


@pytest.mark.parametrize("record, kind, words", [
    ({"answer": "#### 1"}, "missing question", "no 'question' field"),
    ({"question": None, "answer": "#### 1"}, "missing question", "'question' is null"),
    ({"question": "  \n", "answer": "#### 1"}, "empty question", "'question' is blank"),
    ({"question": 12, "answer": "#### 1"}, "wrong type", "'question' must be a string, got int"),
    ({"question": "Q"}, "missing answer", "no 'answer' field"),
    ({"question": "Q", "answer": ""}, "empty answer", "'answer' is blank"),
    ({"question": "Q", "answer": 4}, "wrong type", "'answer' must be a string, got int"),
    ({"question": "Q", "answer": "it is 4"}, "no #### number", "no '####' number"),
])
def test_gsm8k_rejects_name_the_problem(record, kind, words):
    with pytest.raises(RowRejected) as info:
        gsm8k_adapter(record, DataConfig())
    assert info.value.kind == kind and words in info.value.reason


def test_generic_adapter_maps_columns_and_keeps_answer_verbatim():
    data = DataConfig(adapter="generic", prompt_key="prompt", answer_key="label", id_key="uid", instruction="")
    ex = generic_adapter({"prompt": "Capital of France?", "label": " Paris ", "uid": "u1"}, data)
    assert ex.messages == [{"role": "user", "content": "Capital of France?"}]
    assert ex.ground_truth == " Paris " and ex.source_id == "u1"
    assert generic_adapter({"prompt": "1+1?", "label": 2}, data).ground_truth == "2"
    with pytest.raises(RowRejected, match="no 'prompt' field"):
        generic_adapter({"question": "Q", "label": "x"}, data)
    with pytest.raises(RowRejected, match="'label' must be a string, got bool"):
        generic_adapter({"prompt": "Q", "label": True}, data)


def test_registry_lists_valid_names_on_unknown():
    assert {"gsm8k", "generic", "verl"} <= set(ADAPTERS.names())
    assert get_adapter("gsm8k") is gsm8k_adapter and get_adapter("verl") is verl_adapter
    with pytest.raises(ConfigError, match="valid adapters: auto, generic, gsm8k, verl"):
        get_adapter("alpaca")


# ---------------------------------------------------------------------------------------------
# verl's layout
# ---------------------------------------------------------------------------------------------


def verl_row(**changes) -> dict:
    """A row as verl's examples/data_preprocess/gsm8k.py writes it."""
    row = {"data_source": "openai/gsm8k",
           "prompt": [{"role": "user", "content": "How many? " + INSTRUCTION}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": "4"},
           "extra_info": {"split": "test", "index": 3, "answer": "2 + 2 = 4\n#### 4", "question": "How many?"}}
    row.update(changes)
    return row


def test_verl_row_is_taken_as_it_is():
    row = verl_row(data_source="lighteval/MATH", ability="algebra",
                   extra_info={"split": "test", "index": 3, "tools_kwargs": {"calc": {"x": [1, 2]}}})
    ex = verl_adapter(row, DataConfig(system_prompt="ignored for verl rows", instruction="also ignored"))
    assert ex.messages == row["prompt"] and ex.ground_truth == "4" and ex.style == "rule"
    assert (ex.data_source, ex.ability, ex.reward_source) == ("lighteval/MATH", "algebra", "lighteval/MATH")
    assert ex.extra_info == row["extra_info"] and not ex.own_extra_info  # every key, nested ones too
    assert ex.source_id is None


def test_verl_plain_string_prompt_is_one_user_turn_and_numbers_become_text():
    ex = verl_adapter(verl_row(prompt="What is 2+2?", reward_model={"style": "rule", "ground_truth": 4},
                               extra_info=None), DataConfig())
    assert ex.messages == [{"role": "user", "content": "What is 2+2?"}]
    assert ex.ground_truth == "4" and ex.extra_info == {}


def test_verl_null_struct_fields_of_messages_are_dropped_but_set_ones_rejected():
    ok = verl_adapter(verl_row(prompt=[{"role": "system", "content": "S", "tool_calls": None},
                                       {"role": "user", "content": "U", "tool_calls": None}]), DataConfig())
    assert ok.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    with pytest.raises(RowRejected, match="message 0 has field\\(s\\) tool_calls; only role and content"):
        verl_adapter(verl_row(prompt=[{"role": "user", "content": "U", "tool_calls": [1]}]), DataConfig())


@pytest.mark.parametrize("changes, kind, words", [
    ({"prompt": None}, "missing prompt", "no 'prompt' field (data.prompt_key)"),
    ({"prompt": []}, "empty prompt", "'prompt' has no messages"),
    ({"prompt": " "}, "empty prompt", "'prompt' is blank"),
    ({"prompt": [{"role": "user", "content": ""}]}, "empty prompt", "every message in 'prompt' is blank"),
    ({"prompt": [{"role": "user", "content": [{"type": "image"}]}]}, "wrong type", "message 0 must have string"),
    ({"prompt": 7}, "wrong type", "got int"),
    ({"reward_model": {"style": "rule"}}, "missing answer", "no 'reward_model.ground_truth'"),
    ({"reward_model": None}, "missing answer", "no 'reward_model.ground_truth'"),
    ({"reward_model": {"style": "rule", "ground_truth": ["4", "four"]}}, "wrong type", "got list"),
    ({"reward_model": {"style": "rule", "ground_truth": "  "}}, "empty answer", "is blank"),
    ({"extra_info": "split=train"}, "wrong type", "'extra_info' must be a dict, got str"),
    ({"data_source": ""}, "wrong type", "'data_source' must be a non-empty string"),
])
def test_verl_rejects_name_the_problem(changes, kind, words):
    with pytest.raises(RowRejected) as info:
        verl_adapter(verl_row(**changes), DataConfig())
    assert info.value.kind == kind and words in info.value.reason


def test_verl_missing_data_source_and_ability_fall_back_to_the_configured_ones():
    row = verl_row()
    del row["data_source"], row["ability"]
    ex = verl_adapter(row, DataConfig(data_source="mine", ability="reasoning"))
    assert (ex.data_source, ex.ability, ex.reward_source) == ("mine", "reasoning", "mine")


def test_verl_prompt_key_names_the_column():
    row = verl_row()
    row["chat"] = row.pop("prompt")
    assert verl_adapter(row, DataConfig(prompt_key="chat")).messages == row["chat"]


# ---------------------------------------------------------------------------------------------
# reward_fn_key
# ---------------------------------------------------------------------------------------------


def test_reward_fn_key_picks_the_routing_column():
    assert verl_adapter(verl_row(), DataConfig(reward_fn_key="ability")).reward_source == "math"
    assert verl_adapter(verl_row(task="arith-v2"), DataConfig(reward_fn_key="task")).reward_source == "arith-v2"
    raw = {"question": "Q?", "answer": "#### 1", "task": 12}
    assert gsm8k_adapter(raw, DataConfig(reward_fn_key="task")).reward_source == "12"
    assert gsm8k_adapter(raw, DataConfig(reward_fn_key="ability", ability="arith")).reward_source == "arith"
    with pytest.raises(RowRejected, match="no 'task' value to route the reward on \\(data.reward_fn_key\\)"):
        verl_adapter(verl_row(), DataConfig(reward_fn_key="task"))


# ---------------------------------------------------------------------------------------------
# auto
# ---------------------------------------------------------------------------------------------


def test_matching_layout():
    data = DataConfig()
    assert matching_layout(verl_row(), data) == "verl"
    assert matching_layout(verl_row(prompt="text"), data) == "verl"
    assert matching_layout({"question": "Q", "answer": "A", "id": 1}, data) == "gsm8k"
    assert matching_layout({"prompt": [], "answer": "A"}, data) is None           # no reward_model
    assert matching_layout({"question": "Q"}, data) is None
    assert matching_layout({"problem": "Q", "answer": "A"}, DataConfig(question_key="problem")) == "gsm8k"


def test_unknown_layout_error_is_one_line_naming_file_columns_and_keys():
    message = str(unknown_layout_error("d/x.parquet", ["text", "label"], DataConfig()))
    assert "\n" not in message
    assert message.startswith("d/x.parquet: data.adapter=auto cannot tell the layout; its columns are 'text', 'label'")
    for words in ("verl (data.prompt_key='prompt'", "reward_model.ground_truth", "gsm8k (data.question_key='question'",
                  "data.answer_key='answer'", "data.adapter=generic"):
        assert words in message
