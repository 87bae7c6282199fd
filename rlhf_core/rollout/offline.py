"""Offline trajectories: import responses generated elsewhere as an iteration's rollout table.

Input: JSONL or Parquet with a ``response`` column (text) and a prompt key per row — ``prompt_id``
(matched against the prompt table's ids) or ``prompt`` (text matched against the prompt table's
user message, its templated ``prompt_text`` or the raw question; a list of chat messages also
works, its last user message is used). An optional ``sample_index`` numbers several responses of
one prompt; without it responses are numbered in file order.

Every row is validated against the prompt table; a row that fails (unknown prompt, missing
response, duplicate (prompt, sample_index), response over ``max_response_length`` tokens) is
rejected with a reason naming the row, e.g. ``row 17: prompt_id 'x' not in prompts/train.parquet``,
and written to ``iter_<k>/rollout_rejects.parquet``. No accepted row at all is an error.

Tokenization: responses are encoded with the actor's tokenizer and get the EOS token appended
(unless the text already ends with it). Logged responses are complete answers; without the EOS the
update stage would never see "stop here" and the policy would learn to ramble past its answer.
The rows carry ``finish_reason = "offline"`` and ``engine = "offline"``; ``sampling_seed`` is -1
(not sampled here).

The whole file is imported every iteration: it is a fixed data set, not a per-iteration slice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core.data.schemas import REJECTS
from rlhf_core.errors import DataError
from rlhf_core.rollout.base import FINISH_OFFLINE, GeneratedSample

OFFLINE_ENGINE = "offline"
RAW_LIMIT = 1000  # characters of an offending row kept in the rejects table


@dataclass
class OfflineImport:
    """Accepted samples (``prompt_index`` indexes the prompt rows) and rejected rows."""

    samples: list[GeneratedSample] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)

    def rejects_table(self) -> pa.Table:
        return pa.Table.from_pylist(self.rejects, schema=REJECTS)


def read_offline_rows(path: str | Path) -> Iterator[tuple[int, Optional[dict], str]]:
    """(0-based row number, parsed row or None, raw text) for every non-blank row of JSONL/Parquet."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"offline trajectories file {path} not found; set actor_rollout_ref.rollout.offline_path")
    if path.suffix.lower() == ".parquet":
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield i, row, json.dumps(row, default=str)
        return
    if path.suffix.lower() not in (".jsonl", ".json"):
        raise DataError(f"offline trajectories file {path} must be .jsonl or .parquet")
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                yield i, None, line
                continue
            yield i, row if isinstance(row, dict) else None, line


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
    texts.append((row.get("extra_info") or {}).get("question") or "")
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

    for row_no, row, raw in read_offline_rows(path):
        if row is None:
            reject(row_no, raw, "not a JSON object")
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
        sample_index = row.get("sample_index")
        if sample_index is None:
            sample_index = next_sample.get(position, 0)
        sample_index = int(sample_index)
        if (position, sample_index) in seen:
            reject(row_no, raw, f"duplicate sample_index {sample_index} for {looked_up}")
            continue
        text = response[: -len(eos_text)] if eos_text and response.endswith(eos_text) else response
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
