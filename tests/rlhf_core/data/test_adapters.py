"""Adapters: verl's GSM8K prompt wording and answer extraction, the generic column map, the registry."""

from __future__ import annotations

import pytest

from rlhf_core.config.loader import ConfigError
from rlhf_core.config.schema import DataConfig
from rlhf_core.data.adapters import (
    ADAPTERS, RowRejected, extract_gsm8k_answer, generic_adapter, get_adapter, gsm8k_adapter,
)

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def test_gsm8k_prompt_matches_verl_recipe():
    record = {"question": "How many?", "answer": "2 + 2 = 4\n#### 4", "id": 7}
    ex = gsm8k_adapter(record, DataConfig())
    assert ex.messages == [{"role": "user", "content": "How many? " + INSTRUCTION}]
    assert ex.ground_truth == "4" and ex.question == "How many?" and ex.answer == record["answer"]
    assert ex.source_id == "7"


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
    assert {"gsm8k", "generic"} <= set(ADAPTERS)
    assert get_adapter("gsm8k") is gsm8k_adapter
    with pytest.raises(ConfigError, match="valid adapters: generic, gsm8k"):
        get_adapter("alpaca")
