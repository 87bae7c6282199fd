"""Adapters: one decoded raw record → one chat prompt with its ground truth.

An adapter is ``fn(record: dict, data: DataConfig) -> PromptExample`` and raises ``RowRejected``
(a short kind for counting + the full reason) when the record cannot become a prompt. Adapters are
registered by name; ``data.adapter`` picks one, or 'auto' picks one per file (``detect_layout``).

    verl     verl's preprocessed layout, as examples/data_preprocess/gsm8k.py writes it: data.prompt_key
             holds chat messages (a plain string becomes one user turn), reward_model.ground_truth,
             data_source, ability and extra_info come from the row (extra_info kept whole)
    gsm8k    data.question_key → [system?] + user: "<question> <instruction>"; ground truth = the number
             after '####' in data.answer_key with thousands separators removed (as verl's script does)
    generic  data.prompt_key (text) → user message as above; data.answer_key used verbatim as ground truth

Every adapter also reads the row's reward-routing value: the data.reward_fn_key column (verl's
default 'data_source'), looked up in the prompt's own columns first, then in the raw record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from rlhf_core.config.errors import ConfigError
from rlhf_core.config.schema import DataConfig
from rlhf_core.errors import DataError
from rlhf_core.registry import Registry


class RowRejected(Exception):
    """A record that cannot become a prompt; ``kind`` groups the counts, ``reason`` explains it."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


@dataclass(frozen=True)
class PromptExample:
    messages: list[dict[str, str]]
    """Chat messages [{"role", "content"}], verl's ``prompt`` column."""
    ground_truth: str
    data_source: str
    ability: str
    reward_source: str
    """The value of the data.reward_fn_key column: the reward function's route."""
    source_id: Optional[str]
    """The record's id (data.id_key) when it has one."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    """verl rows: their extra_info as given. gsm8k/generic: {"answer", "question"}; the table step
    puts verl's "split" and "index" in front (``own_extra_info``)."""
    style: str = "rule"
    """reward_model.style."""
    own_extra_info: bool = True
    """False for verl rows: their extra_info is the user's and is stored untouched."""


Adapter = Callable[[dict[str, Any], DataConfig], PromptExample]
ADAPTERS: Registry[Adapter] = Registry("dataset adapter")
AUTO = "auto"

# verl's pattern: '#### ' then an optionally negative number that may carry thousands separators;
# ours insists on a digit so '#### ,' or '#### .' is not taken for a number
GSM8K_ANSWER = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def register_adapter(name: str) -> Callable[[Adapter], Adapter]:
    return ADAPTERS.register(name)


def get_adapter(name: str) -> Adapter:
    if name not in ADAPTERS:  # the config key's own error (the table's names a ValueError)
        raise ConfigError(f"data.adapter={name!r}: unknown adapter; valid adapters: "
                          f"{', '.join(sorted([*ADAPTERS.names(), AUTO]))}")
    return ADAPTERS.get(name)


# ---------------------------------------------------------------------------------------------
# field helpers
# ---------------------------------------------------------------------------------------------


def _text_field(record: dict, key: str, role: str, allow_numbers: bool = False) -> str:
    """``record[key]`` as non-blank text; ``role`` ("question", "answer", ...) names the failure."""
    if key not in record:
        raise RowRejected(f"missing {role}", f"missing {role}: no '{key}' field")
    value = record[key]
    if value is None:
        raise RowRejected(f"missing {role}", f"missing {role}: '{key}' is null")
    if allow_numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise RowRejected("wrong type", f"wrong type: '{key}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowRejected(f"empty {role}", f"empty {role}: '{key}' is blank")
    return value


def _source_id(record: dict, key: str) -> Optional[str]:
    value = record.get(key) if key else None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    text = str(value).strip()
    return text or None


def _reward_source(record: Mapping[str, Any], own: Mapping[str, Any], key: str) -> str:
    """The data.reward_fn_key value: the prompt's own column of that name (data_source, ability)
    first, else the raw record's; a number becomes its text."""
    value = own[key] if key in own else record.get(key)
    if value is None:
        raise RowRejected("missing reward_fn_key", f"missing reward_fn_key: no '{key}' value to route the "
                                                   f"reward on (data.reward_fn_key)")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value:
        raise RowRejected("wrong type", f"wrong type: '{key}' (data.reward_fn_key) must be a non-empty "
                                        f"string, got {type(value).__name__}")
    return value


def chat_messages(question: str, data: DataConfig) -> list[dict[str, str]]:
    """[system (when set)] + the user turn: the question, a space, the instruction (verl's wording)."""
    user = f"{question} {data.instruction}" if data.instruction else question
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    return messages + [{"role": "user", "content": user}]


def extract_gsm8k_answer(answer: str) -> Optional[str]:
    """The number after '####' with commas removed ("#### 1,234" → "1234"); None when absent."""
    match = GSM8K_ANSWER.search(answer)
    return match.group(1).replace(",", "") if match else None


def _question_example(record: dict, data: DataConfig, question: str, answer: str, truth: str) -> PromptExample:
    """gsm8k / generic: the configured data_source and ability, the question and answer in extra_info."""
    own = {"data_source": data.data_source, "ability": data.ability}
    return PromptExample(chat_messages(question, data), truth, data.data_source, data.ability,
                         _reward_source(record, own, data.reward_fn_key), _source_id(record, data.id_key),
                         extra_info={"answer": answer, "question": question})


# ---------------------------------------------------------------------------------------------
# verl's layout
# ---------------------------------------------------------------------------------------------


def verl_messages(value: Any, key: str) -> list[dict[str, str]]:
    """data.prompt_key's value as chat messages: a list of {role, content} strings, or a plain string
    (one user turn). Keys beyond role/content must be null (a Parquet struct's union of keys)."""
    if isinstance(value, str):
        if not value.strip():
            raise RowRejected("empty prompt", f"empty prompt: '{key}' is blank")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise RowRejected("wrong type", f"wrong type: '{key}' must be chat messages or a string, "
                                        f"got {type(value).__name__}")
    if not value:
        raise RowRejected("empty prompt", f"empty prompt: '{key}' has no messages")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowRejected("wrong type", f"wrong type: '{key}' message {i} must have string 'role' and "
                                            f"'content' (text-only prompts)")
        others = sorted(k for k, v in m.items() if k not in ("role", "content") and v is not None)
        if others:
            raise RowRejected("wrong type", f"wrong type: '{key}' message {i} has field(s) "
                                            f"{', '.join(others)}; only role and content are supported")
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in messages):
        raise RowRejected("empty prompt", f"empty prompt: every message in '{key}' is blank")
    return messages


def _ground_truth(record: dict) -> tuple[str, str]:
    """(reward_model.ground_truth as text, reward_model.style) of a verl row."""
    rm = record.get("reward_model")
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise RowRejected("missing answer", "missing answer: no 'reward_model.ground_truth'")
    truth = rm["ground_truth"]
    if isinstance(truth, (int, float)) and not isinstance(truth, bool):
        truth = str(truth)
    if not isinstance(truth, str):
        raise RowRejected("wrong type", f"wrong type: 'reward_model.ground_truth' must be a string or a number, "
                                        f"got {type(truth).__name__}")
    if not truth.strip():
        raise RowRejected("empty answer", "empty answer: 'reward_model.ground_truth' is blank")
    style = rm.get("style")
    return truth, style if isinstance(style, str) and style else "rule"


def _optional_text(record: dict, key: str, default: str) -> str:
    """A verl row's data_source / ability: its own when set, else the configured default."""
    value = record.get(key)
    if value is None:
        return default
    if not isinstance(value, str) or not value.strip():
        raise RowRejected("wrong type", f"wrong type: '{key}' must be a non-empty string")
    return value


@register_adapter("verl")
def verl_adapter(record: dict[str, Any], data: DataConfig) -> PromptExample:
    if data.prompt_key not in record or record[data.prompt_key] is None:
        raise RowRejected("missing prompt", f"missing prompt: no '{data.prompt_key}' field (data.prompt_key)")
    messages = verl_messages(record[data.prompt_key], data.prompt_key)
    truth, style = _ground_truth(record)
    info = record.get("extra_info")
    if info is not None and not isinstance(info, dict):
        raise RowRejected("wrong type", f"wrong type: 'extra_info' must be a dict, got {type(info).__name__}")
    data_source = _optional_text(record, "data_source", data.data_source)
    ability = _optional_text(record, "ability", data.ability)
    own = {"data_source": data_source, "ability": ability}
    return PromptExample(messages, truth, data_source, ability, _reward_source(record, own, data.reward_fn_key),
                         _source_id(record, data.id_key), extra_info=dict(info or {}), style=style,
                         own_extra_info=False)


# ---------------------------------------------------------------------------------------------
# our raw layouts
# ---------------------------------------------------------------------------------------------


@register_adapter("gsm8k")
def gsm8k_adapter(record: dict[str, Any], data: DataConfig) -> PromptExample:
    question = _text_field(record, data.question_key, "question")
    answer = _text_field(record, data.answer_key, "answer")
    truth = extract_gsm8k_answer(answer)
    if truth is None:
        raise RowRejected("no #### number", f"no '####' number in '{data.answer_key}'")
    return _question_example(record, data, question, answer, truth)


@register_adapter("generic")
def generic_adapter(record: dict[str, Any], data: DataConfig) -> PromptExample:
    question = _text_field(record, data.prompt_key, "prompt")
    answer = _text_field(record, data.answer_key, "answer", allow_numbers=True)
    return _question_example(record, data, question, answer, answer)


# ---------------------------------------------------------------------------------------------
# auto: one layout per file
# ---------------------------------------------------------------------------------------------


def matching_layout(record: Mapping[str, Any], data: DataConfig) -> Optional[str]:
    """'verl' when the record has data.prompt_key as chat messages (or text) and a reward_model dict
    with ground_truth; 'gsm8k' when it has data.question_key and data.answer_key; else None."""
    prompt = record.get(data.prompt_key)
    rm = record.get("reward_model")
    if isinstance(prompt, (list, str)) and isinstance(rm, dict) and "ground_truth" in rm:
        return "verl"
    if data.question_key in record and data.answer_key in record:
        return "gsm8k"
    return None


def unknown_layout_error(source_file: str, columns: list[str], data: DataConfig) -> DataError:
    """The one error 'auto' gives for a file that fits no layout: its columns and the keys to set."""
    return DataError(
        f"{source_file}: data.adapter=auto cannot tell the layout; its columns are "
        f"{', '.join(map(repr, columns)) or 'none'}. Accepted: verl (data.prompt_key={data.prompt_key!r} "
        f"holding chat messages, plus reward_model.ground_truth), gsm8k (data.question_key="
        f"{data.question_key!r} and data.answer_key={data.answer_key!r}), or set data.adapter=generic "
        f"(data.prompt_key text + data.answer_key)")
