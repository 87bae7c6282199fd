"""Offline trajectories: import responses generated elsewhere as an iteration's rollout table.

Input: JSONL or Parquet with a ``response`` column (text) and a prompt key per row — ``prompt_id``
(matched against the prompt table's ids) or ``prompt`` (text matched against the prompt table's
user message, its templated ``prompt_text`` or the raw question; a list of chat messages also
works, its last user message is used). An optional ``sample_index`` numbers several responses of
one prompt; without it responses are numbered in file order.

Every row is validated against the prompt table; a row that fails (unreadable: invalid UTF-8,
malformed JSON, not an object; unknown prompt, missing or empty response, a ``sample_index`` that
is not an integer in [0, 2**31), duplicate (prompt, sample_index), response over
``max_response_length`` tokens) is rejected with a reason naming the row, e.g. ``row 17: prompt_id 'x' not in prompts/train.parquet``,
and written to ``iter_<k>/rollout_rejects.parquet``. No accepted row at all is an error.

Tokenization: responses are encoded with the actor's tokenizer and get the EOS token appended
(unless the text already ends with it). Logged responses are complete answers; without the EOS the
update stage would never see "stop here" and the policy would learn to ramble past its answer.
The rows carry ``finish_reason = "offline"`` and ``engine = "offline"``; ``sampling_seed`` is -1
(not sampled here).

The whole file is imported every iteration: it is a fixed data set, not a per-iteration slice.
A ``reward`` or ``score`` column is not used: the score stage scores every response with the run's
reward function (``custom_reward_function.path`` for a logged scorer); the rollout stage says so.
Validation and the KL guard still generate, with the hf engine (``generation_engine``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import pyarrow as pa

from rlhf_core.data.readers import RawRow, read_jsonl, read_parquet
from rlhf_core.data.schemas import REJECTS, decode_extra_info
from rlhf_core.errors import DataError
from rlhf_core.rollout.base import FINISH_OFFLINE, GeneratedSample

OFFLINE_ENGINE = "offline"
RAW_LIMIT = 1000  # characters of an offending row kept in the rejects table
IGNORED_SCORES = frozenset({"reward", "score"})


@dataclass
class OfflineImport:
    """Accepted samples (``prompt_index`` indexes the prompt rows) and rejected rows."""

    samples: list[GeneratedSample] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)
    ignored_columns: set[str] = field(default_factory=set)
    """Columns the file has that carry a score (reward, score): the score stage scores every
    response with the run's reward function, so a logged score never reaches training."""

    def rejects_table(self) -> pa.Table:
        return pa.Table.from_pylist(self.rejects, schema=REJECTS)


def read_offline_rows(path: str | Path) -> Iterator[RawRow]:
    """Every non-blank row of a JSONL/Parquet file, with the preprocess readers' rules: bytes are
    decoded per line (invalid UTF-8, malformed JSON, a non-object or a lone surrogate escape is a
    row with ``error`` set, never an exception), row numbers are 0-based lines split on ``\\n``.
    Blank lines are skipped: a logged file often ends with one. Whole-file problems (missing, wrong
    extension, damaged Parquet) raise ``DataError`` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"offline trajectories file {path} not found; set actor_rollout_ref.rollout.offline_path")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from read_parquet(path)
        return
    if suffix not in (".jsonl", ".json"):
        raise DataError(f"offline trajectories file {path} must be .jsonl or .parquet")
    for row in read_jsonl(path):
        if row.error_kind != "blank line":
            yield row


def _sample_index(value: Any) -> Optional[int]:
    """``sample_index`` as an int in [0, 2**31), an integral float included (Parquet writers turn an
    int column with nulls into floats); None for anything else (text, bool, 1.5, NaN, -1, 2**40)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and 0 <= value < 2**31:
        return value
    return None


class _PromptIndex:
    """Finds a prompt table row by id or by text."""

    def __init__(self, prompt_rows: Sequence[Mapping[str, Any]]):
        self.by_id = {row["prompt_id"]: i for i, row in enumerate(prompt_rows)}
        self.by_text: dict[str, int] = {}
        for i, row in enumerate(prompt_rows):
            for text in _prompt_texts(row):
                self.by_text.setdefault(text.strip(), i)

    def find(self, row: Mapping[str, Any]) -> tuple[Optional[int], str]:
        """(prompt row position or None, what was looked up — for the reject reason)."""
        if row.get("prompt_id") is not None:
            pid = str(row["prompt_id"])
            return self.by_id.get(pid), f"prompt_id {pid!r}"
        text = _user_text(row.get("prompt"))
        if text is None:
            return None, ""
        short = text if len(text) <= 60 else text[:57] + "..."
        return self.by_text.get(text.strip()), f"prompt text {short!r}"


def _prompt_texts(row: Mapping[str, Any]) -> list[str]:
    texts = [row.get("prompt_text") or ""]
    texts += [m["content"] for m in (row.get("prompt") or []) if m.get("role") == "user"]
    texts.append(decode_extra_info(row.get("extra_info")).get("question") or "")
    return [t for t in texts if t]


def _user_text(prompt: Any) -> Optional[str]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # chat messages: the last user turn is the prompt's text
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return users[-1] if users and isinstance(users[-1], str) else None
    return None


def import_offline(path: str | Path, prompt_rows: Sequence[Mapping[str, Any]], tokenizer, *,
                   max_response_length: int, prompts_name: str = "prompts/train.parquet") -> OfflineImport:
    """Validate and tokenize every row of an offline trajectories file (see the module docstring)."""
    path = Path(path)
    index = _PromptIndex(prompt_rows)
    eos_id = tokenizer.eos_token_id
    eos_text = tokenizer.eos_token or ""
    result = OfflineImport()
    seen: set[tuple[int, int]] = set()
    next_sample: dict[int, int] = {}

    def reject(row_no: int, raw: str, reason: str) -> None:
        result.rejects.append({"source_file": str(path), "source_row": row_no,
                               "reason": f"row {row_no}: {reason}", "raw": raw[:RAW_LIMIT]})

    for raw_row in read_offline_rows(path):
        row_no, row, raw = raw_row.source_row, raw_row.record, raw_row.raw
        if row is None:
            reject(row_no, raw, raw_row.error or "unreadable row")
            continue
        result.ignored_columns.update(IGNORED_SCORES & set(row))
        pid = row.get("prompt_id")
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, (str, int))):
            reject(row_no, raw, f"prompt_id must be text or an integer, got {type(pid).__name__}")
            continue
        position, looked_up = index.find(row)
        if position is None:
            reject(row_no, raw, f"{looked_up} not in {prompts_name}" if looked_up else
                   "has neither prompt_id nor prompt (text or chat messages)")
            continue
        response = row.get("response")
        if not isinstance(response, str):
            reject(row_no, raw, f"response must be text, got {type(response).__name__}")
            continue
        text = response[: -len(eos_text)] if eos_text and response.endswith(eos_text) else response
        if not text.strip():  # an empty log entry, not an answer: it would teach "stop at once"
            reject(row_no, raw, "response is empty")
            continue
        sample_index = row.get("sample_index")
        if sample_index is None:
            sample_index = next_sample.get(position, 0)
        elif _sample_index(sample_index) is None:
            reject(row_no, raw, f"sample_index must be an integer in [0, 2**31), got {sample_index!r}")
            continue
        sample_index = _sample_index(sample_index)
        if (position, sample_index) in seen:
            reject(row_no, raw, f"duplicate sample_index {sample_index} for {looked_up}")
            continue
        token_ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_id]
        if len(token_ids) > max_response_length:
            reject(row_no, raw, f"response is {len(token_ids)} tokens with EOS, over data.max_response_length="
                                f"{max_response_length}; raise it or shorten the response")
            continue
        seen.add((position, sample_index))
        next_sample[position] = max(next_sample.get(position, 0), sample_index + 1)
        result.samples.append(GeneratedSample(prompt_index=position, sample_index=sample_index,
                                              token_ids=[int(t) for t in token_ids], text=text,
                                              finish_reason=FINISH_OFFLINE, seed=-1))
    if not result.samples:
        first = f" (first: {result.rejects[0]['reason']})" if result.rejects else " (the file has no rows)"
        raise DataError(f"no usable response in offline trajectories file {path}: "
                        f"{len(result.rejects)} rows rejected{first}")
    return result
