"""Adapters: one decoded raw record → one chat prompt with its ground truth.

An adapter is ``fn(record: dict, data: DataConfig) -> PromptExample`` and raises ``RowRejected``
(a short kind for counting + the full reason) when the record cannot become a prompt. Adapters are
registered by name; ``data.adapter`` picks one.

    gsm8k    question → [system?] + user: "<question> <instruction>"; ground truth = the number after
             '####' in the answer with thousands separators removed (as verl's GSM8K preprocessing)
    generic  data.prompt_key → user message as above; data.answer_key used verbatim as ground truth
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from rlhf_core.config.schema import DataConfig


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
    question: str
    """The question as given (extra_info.question)."""
    answer: str
    """The full answer as given (extra_info.answer)."""
    source_id: Optional[str]
    """The record's id (data.id_key) when it has one."""


Adapter = Callable[[dict[str, Any], DataConfig], PromptExample]
ADAPTERS: dict[str, Adapter] = {}

# verl's pattern: '#### ' then an optionally negative number that may carry thousands separators;
# ours insists on a digit so '#### ,' or '#### .' is not taken for a number
GSM8K_ANSWER = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def register_adapter(name: str) -> Callable[[Adapter], Adapter]:
    def wrap(fn: Adapter) -> Adapter:
        ADAPTERS[name] = fn
        return fn

    return wrap


def get_adapter(name: str) -> Adapter:
    if name not in ADAPTERS:
        from rlhf_core.config.loader import ConfigError

        raise ConfigError(f"data.adapter={name!r}: unknown adapter; valid adapters: {', '.join(sorted(ADAPTERS))}")
    return ADAPTERS[name]


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


def chat_messages(question: str, data: DataConfig) -> list[dict[str, str]]:
    """[system (when set)] + the user turn: the question, a space, the instruction (verl's wording)."""
    user = f"{question} {data.instruction}" if data.instruction else question
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    return messages + [{"role": "user", "content": user}]


def extract_gsm8k_answer(answer: str) -> Optional[str]:
    """The number after '####' with commas removed ("#### 1,234" → "1234"); None when absent."""
    match = GSM8K_ANSWER.search(answer)
    return match.group(1).replace(",", "") if match else None


# ---------------------------------------------------------------------------------------------
# adapters
# ---------------------------------------------------------------------------------------------


@register_adapter("gsm8k")
def gsm8k_adapter(record: dict[str, Any], data: DataConfig) -> PromptExample:
    question = _text_field(record, data.prompt_key, "question")
    answer = _text_field(record, data.answer_key, "answer")
    truth = extract_gsm8k_answer(answer)
    if truth is None:
        raise RowRejected("no #### number", f"no '####' number in '{data.answer_key}'")
    return PromptExample(chat_messages(question, data), truth, question, answer,
                         _source_id(record, data.id_key))


@register_adapter("generic")
def generic_adapter(record: dict[str, Any], data: DataConfig) -> PromptExample:
    question = _text_field(record, data.prompt_key, "prompt")
    answer = _text_field(record, data.answer_key, "answer", allow_numbers=True)
    return PromptExample(chat_messages(question, data), answer, question, answer,
                         _source_id(record, data.id_key))
