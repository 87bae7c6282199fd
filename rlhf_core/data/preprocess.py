"""Raw prompt rows → the prompts tables (train, validation) and the rejects table.

    rows ─ adapter (per file with 'auto') ─► examples ─ dedup ─► unique ─ chat template + tokenize
         ─► length rule ─► prompt ids ─► train / validation split ─► sample caps ─► Arrow tables

Every input row ends in exactly one place: a train row, a validation row, or a reject with its
reason (malformed, empty, wrong type, no answer, duplicate, too long, over a cap);
``preprocess_rows`` checks that accepted + rejected = rows in before it returns.

The length rule is verl's: a prompt over data.max_prompt_length tokens is dropped when
data.filter_overlong_prompts (here: rejected with its length), else data.truncation decides —
'error' stops with one line naming the row, 'left' / 'right' / 'middle' cut its tokens
(``truncate_prompt``) and the prompts table says how many (prompt_tokens_cut).

What comes out (``PreprocessResult``, the plan's ``Screening``) and what is said about too few
prompts or none: ``data.outcome``.

The split is decided by hashing (data.seed, prompt_id), so it does not depend on the order of the
input rows: the same prompts land on the same side however the files are shuffled. DuckDB does the
set work (duplicate groups, per-group ranking, length quantiles) over zero-copy Arrow tables.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import pyarrow as pa

from rlhf_core.config.errors import ConfigError
from rlhf_core.config.schema import DataConfig, ModelConfig
from rlhf_core.data.adapters import (
    AUTO, PromptExample, RowRejected, get_adapter, matching_layout, unknown_layout_error,
)
from rlhf_core.data.outcome import PreprocessResult, Reject, Screening
from rlhf_core.data.readers import RawRow, read_rows
from rlhf_core.data.schemas import PROMPTS, REJECTS, encode_extra_info
from rlhf_core.errors import DataError
from rlhf_core.paths import resolve_model_path
from rlhf_core.progress import bar_disabled

TOKENIZE_BATCH = 512
"""Prompts per batched chat-template + tokenizer call (fast tokenizers parallelise inside a batch)."""


@dataclass
class _Candidate:
    """A row that passed its adapter; ``seq`` is its position among all input rows."""

    seq: int
    group: str  # "train" | "val": which file list it came from
    row: RawRow
    example: PromptExample
    dedup_key: str = ""
    prompt_text: str = ""
    token_ids: list[int] = field(default_factory=list)
    tokens_cut: int = 0
    prompt_id: str = ""


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------


def load_tokenizer(model: ModelConfig):
    """The tokenizer of ``model.tokenizer_path`` or else ``model.path`` ('tiny' builds the local one)."""
    from transformers import AutoTokenizer  # heavy: only the stages that tokenize pay for it

    path = resolve_model_path(model.tokenizer_path or model.path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"the tokenizer at {path} has no chat template; point actor_rollout_ref.model.tokenizer_path "
            f"at a chat (instruct) tokenizer"
        )
    return tokenizer


def tokenize_prompts(tokenizer, conversations: Sequence[list[dict[str, str]]], progress: bool = True,
                     batch_size: int = TOKENIZE_BATCH) -> tuple[list[str], list[list[int]]]:
    """Chat template (generation prompt opened) then token ids, in batches, as verl's dataset does:
    the template already holds the special tokens, so none are added again. Returns (texts, ids)."""
    from tqdm.auto import tqdm

    texts: list[str] = []
    ids: list[list[int]] = []
    # shown unless the console is quiet (`rlhf run`) or the caller asks for none
    with tqdm(total=len(conversations), desc="tokenize prompts", unit="prompt",
              disable=bar_disabled() if progress else True) as bar:
        for start in range(0, len(conversations), batch_size):
            batch = [list(c) for c in conversations[start:start + batch_size]]
            batch_texts = tokenizer.apply_chat_template(batch, tokenize=False, add_generation_prompt=True)
            texts.extend(batch_texts)
            ids.extend(tokenizer(batch_texts, add_special_tokens=False)["input_ids"])
            bar.update(len(batch))
    return texts, ids


# ---------------------------------------------------------------------------------------------
# steps
# ---------------------------------------------------------------------------------------------

Tagged = tuple[str, RawRow]  # (group "train" | "val", row)


def _resolve_layouts(stream: Iterable[Tagged], data: DataConfig, layouts: dict[str, str]
                     ) -> Iterator[tuple[str, RawRow, str]]:
    """(group, row, adapter name) for every row. With data.adapter=auto each file gets the layout of
    its first record that fits one (rows before it wait in a buffer, usually none); a file none of
    whose records fits raises the one ``unknown_layout_error``. ``layouts`` records the choice."""
    if data.adapter != AUTO:
        get_adapter(data.adapter)  # an unknown name fails before any row is read
        for group, row in stream:
            layouts.setdefault(row.source_file, data.adapter)
            yield group, row, data.adapter
        return
    pending: list[Tagged] = []

    def flush_unmatched() -> None:
        columns = list(dict.fromkeys(k for _, r in pending if r.record is not None for k in r.record))
        if columns:  # decodable rows and no layout: the file is in a shape we cannot read
            raise unknown_layout_error(pending[0][1].source_file, columns, data)

    for group, row in stream:
        if pending and pending[0][1].source_file != row.source_file:
            flush_unmatched()
            yield from ((g, r, AUTO) for g, r in pending)  # undecodable rows only: rejected as such
            pending = []
        layout = layouts.get(row.source_file)
        if layout is None and row.record is not None:
            layout = matching_layout(row.record, data)
            if layout is not None:
                layouts[row.source_file] = layout
                yield from ((g, r, layout) for g, r in pending)
                pending = []
        if layout is None:
            pending.append((group, row))
        else:
            yield group, row, layout
    flush_unmatched()
    yield from ((g, r, AUTO) for g, r in pending)


def _adapt(rows: Iterable[tuple[str, RawRow, str]], data: DataConfig
           ) -> tuple[list[_Candidate], list[Reject], int]:
    """Run each row's adapter over (group, row, adapter) triples; returns (candidates, rejects, rows seen)."""
    candidates: list[_Candidate] = []
    rejects: list[Reject] = []
    rows_seen = 0
    for seq, (group, row, layout) in enumerate(rows):
        rows_seen = seq + 1
        if row.record is None:
            rejects.append(Reject(seq, row, row.error_kind or "unreadable row", row.error or "unreadable row"))
            continue
        if layout == AUTO:  # a decodable record with no fields: nothing to tell a layout by
            rejects.append(Reject(seq, row, "empty row", "empty row: no fields to read a prompt from"))
            continue
        try:
            example = get_adapter(layout)(row.record, data)
        except RowRejected as exc:
            rejects.append(Reject(seq, row, exc.kind, exc.reason))
            continue
        key = json.dumps(example.messages, ensure_ascii=False, sort_keys=True)
        candidates.append(_Candidate(seq, group, row, example, dedup_key=key))
    return candidates, rejects, rows_seen


def _sql_rows(sql: str, name: str, table: pa.Table) -> list[tuple]:
    """Run ``sql`` over ``table`` (registered as ``name``) in a throwaway in-memory DuckDB."""
    import duckdb

    con = duckdb.connect(":memory:")
    try:
        con.register(name, table)
        return con.execute(sql).fetchall()
    finally:
        con.close()


def _drop_duplicates(candidates: list[_Candidate]) -> tuple[list[_Candidate], list[Reject]]:
    """Keep the first occurrence of each exact prompt; reject the others naming the row they repeat."""
    if not candidates:
        return candidates, []
    table = pa.table({"i": list(range(len(candidates))), "dedup_key": [c.dedup_key for c in candidates]})
    firsts = _sql_rows(
        # candidates are in input order, so the smallest index in a group is its first occurrence
        "SELECT i, min(i) OVER (PARTITION BY dedup_key) AS first_i FROM candidates", "candidates", table)
    first_of = dict(firsts)
    kept, rejects = [], []
    for i, c in enumerate(candidates):
        first = candidates[first_of[i]]
        if first_of[i] == i:
            kept.append(c)
            continue
        where = "" if first.row.source_file == c.row.source_file else f" of {first.row.source_file}"
        rejects.append(Reject(c.seq, c.row, "duplicate", f"duplicate of row {first.row.source_row}{where}"))
    return kept, rejects


TRUNCATION_MODES = ("error", "left", "right", "middle")


def truncate_prompt(token_ids: Sequence[int], max_len: int, mode: str) -> list[int]:
    """verl's prompt truncation (RLHFDataset / torch_functional.postprocess_data) of one prompt:
    'left' keeps the last max_len tokens, 'right' the first max_len, 'middle' the first max_len // 2
    and the last max_len - max_len // 2. A prompt within max_len comes back unchanged."""
    ids = list(token_ids)
    if len(ids) <= max_len:
        return ids
    if mode == "left":
        return ids[len(ids) - max_len:]
    if mode == "right":
        return ids[:max_len]
    if mode == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head):]
    raise ConfigError(f"data.truncation={mode!r} cannot cut a prompt; valid: {', '.join(TRUNCATION_MODES)}")


def _overlong_error(c: _Candidate, n_over: int, data: DataConfig) -> DataError:
    more = f" ({n_over} prompts are over the limit)" if n_over > 1 else ""
    return DataError(
        f"{c.row.source_file} row {c.row.source_row}: prompt is {len(c.token_ids)} tokens (chat template "
        f"applied), over data.max_prompt_length={data.max_prompt_length}{more}; set "
        f"data.filter_overlong_prompts=true to skip such rows or data.truncation=left|right|middle to cut them")


def _apply_length_rule(candidates: list[_Candidate], data: DataConfig, tokenizer: Any
                       ) -> tuple[list[_Candidate], list[Reject]]:
    """Prompts over data.max_prompt_length: rejected (filter_overlong_prompts), an error
    (truncation=error), or cut (left / right / middle; prompt_text is then the cut tokens' text)."""
    max_len = data.max_prompt_length
    over = [c for c in candidates if len(c.token_ids) > max_len]
    if not over:
        return candidates, []
    if data.filter_overlong_prompts:
        rejects = [Reject(c.seq, c.row, "prompt too long",
                           f"prompt too long ({len(c.token_ids)} > {max_len} tokens, data.max_prompt_length)")
                   for c in over]
        dropped = {id(c) for c in over}
        return [c for c in candidates if id(c) not in dropped], rejects
    if data.truncation == "error":
        raise _overlong_error(over[0], len(over), data)
    for c in over:
        cut = truncate_prompt(c.token_ids, max_len, data.truncation)
        c.tokens_cut = len(c.token_ids) - len(cut)
        c.token_ids = cut
        c.prompt_text = tokenizer.decode(cut, skip_special_tokens=False)
    return candidates, []


def content_prompt_id(data_source: str, messages: list[dict[str, str]]) -> str:
    """A stable id from what the prompt says (not from the tokenizer, so it survives a model change)."""
    blob = data_source + "\x00" + json.dumps(messages, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _assign_prompt_ids(candidates: list[_Candidate]) -> str:
    """The source's ids when every row has one and none repeats, else content hashes (a repeated
    prompt, kept when dedup is off, gets '-1', '-2', … so ids stay unique). Returns which was used."""
    source_ids = [c.example.source_id for c in candidates]
    if candidates and all(source_ids) and len(set(source_ids)) == len(source_ids):
        for c, sid in zip(candidates, source_ids):
            c.prompt_id = str(sid)
        return "source ids"
    seen: dict[str, int] = {}
    for c in candidates:
        pid = content_prompt_id(c.example.data_source, c.example.messages)
        k = seen.get(pid, 0)
        seen[pid] = k + 1
        c.prompt_id = pid if k == 0 else f"{pid}-{k}"
    return "content hashes"


def _split_key(seed: int, prompt_id: str) -> str:
    return hashlib.sha256(f"{seed}\x00{prompt_id}".encode("utf-8")).hexdigest()


SPLIT_CAP = 256
"""Most prompts a validation split carved out of the training files holds (data.val_fraction) while
data.max_val_samples is -1: a few hundred are enough signal, and each costs a generation at every
validation. Validation files (data.val_files) are scored whole, as verl scores them."""


def validation_cap(data: DataConfig, separate_val: bool) -> tuple[Optional[int], str]:
    """(most validation prompts or None for all, what sets it): the smaller of data.max_val_samples
    (>= 0) and verl's data.val_max_samples (> 0); with neither set, all prompts of validation files,
    or SPLIT_CAP for a split of the training files."""
    caps = [(n, key) for n, key in ((data.max_val_samples, "data.max_val_samples"),
                                    (data.val_max_samples, "data.val_max_samples"))
            if n > 0 or (n == 0 and key == "data.max_val_samples")]
    if caps:
        return min(caps)
    return (None, "") if separate_val else (SPLIT_CAP, f"a split of the training files holds at most {SPLIT_CAP}")


def _validation_size(n: int, data: DataConfig) -> int:
    """val_fraction of n (rounded half up), capped by validation_cap, leaving at least one train row."""
    wanted = math.floor(data.val_fraction * n + 0.5)
    return max(0, min(wanted, validation_cap(data, separate_val=False)[0], n - 1))


def _ranks(candidates: list[_Candidate], seed: int) -> tuple[dict[int, int], dict[int, int]]:
    """Per file group: (rank by a hash of (seed, prompt_id), rank in input order), 1-based."""
    table = pa.table({"i": list(range(len(candidates))), "grp": [c.group for c in candidates],
                      "split_key": [_split_key(seed, c.prompt_id) for c in candidates]})
    ranked = _sql_rows(
        "SELECT i, row_number() OVER (PARTITION BY grp ORDER BY split_key, i), "
        "row_number() OVER (PARTITION BY grp ORDER BY i) FROM candidates", "candidates", table)
    return {i: h for i, h, _ in ranked}, {i: o for i, _, o in ranked}


def _assign_splits(candidates: list[_Candidate], data: DataConfig, separate_val: bool
                   ) -> tuple[list[_Candidate], list[_Candidate], list[Reject]]:
    """(train, val, over-cap rejects).

    Without validation files the first ``_validation_size`` of the train group's hash ranking become
    validation, so membership does not depend on input order. With them, validation keeps
    ``validation_cap`` prompts (hash-ranked when data.shuffle, else the first in input order, as
    verl's max_samples) and the rest are rejected, named. Then data.train_max_samples caps train
    the same way (> 0; verl's -1 = all)."""
    if not candidates:
        return [], [], []
    hashed, ordered = _ranks(candidates, data.seed)
    chosen = hashed if data.shuffle else ordered
    cap, cap_key = validation_cap(data, separate_val)
    n_val = (len(candidates) if cap is None else cap) if separate_val else _validation_size(len(candidates), data)
    train, val, rejects = [], [], []
    for i, c in enumerate(candidates):
        if c.group == "train" and (separate_val or hashed[i] > n_val):
            train.append(c)
        elif (chosen if separate_val else hashed)[i] <= n_val:
            val.append(c)
        else:
            rejects.append(Reject(c.seq, c.row, "over validation cap",
                                   f"over validation cap ({cap_key}={cap}; -1 scores every validation prompt)"))
    train, over_train = _cap_train(train, {id(c): chosen[i] for i, c in enumerate(candidates)}, data)
    return train, val, rejects + over_train


def _cap_train(train: list[_Candidate], rank: dict[int, int], data: DataConfig
               ) -> tuple[list[_Candidate], list[Reject]]:
    """At most data.train_max_samples train prompts (the best-ranked; input order kept)."""
    cap = data.train_max_samples
    if cap <= 0 or len(train) <= cap:
        return train, []
    keep = {id(c) for c in sorted(train, key=lambda c: rank[id(c)])[:cap]}
    reason = f"over train cap (data.train_max_samples={cap})"
    return ([c for c in train if id(c) in keep],
            [Reject(c.seq, c.row, "over train cap", reason) for c in train if id(c) not in keep])


def prompt_length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """min / mean / p50 / p95 / max of prompt lengths (continuous quantiles); {} when empty."""
    if not len(lengths):
        return {}
    (row,) = _sql_rows(
        "SELECT min(n), avg(n), quantile_cont(n, 0.5), quantile_cont(n, 0.95), max(n) FROM prompts",
        "prompts", pa.table({"n": pa.array(lengths, pa.int64())}))
    return dict(zip(("min", "mean", "p50", "p95", "max"), (float(v) for v in row)))


# ---------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------


def _extra_info(ex: PromptExample, split: str, index: int) -> str:
    """verl rows: their extra_info untouched. Ours: verl's GSM8K script's keys (split, index, answer,
    question), split and index being this table's."""
    info = {"split": split, "index": index, **ex.extra_info} if ex.own_extra_info else ex.extra_info
    return encode_extra_info(info)


def _prompts_table(candidates: list[_Candidate], split: str) -> pa.Table:
    rows = []
    for index, c in enumerate(candidates):
        ex = c.example
        rows.append({
            "prompt_id": c.prompt_id, "data_source": ex.data_source, "reward_source": ex.reward_source,
            "prompt": ex.messages, "ability": ex.ability,
            "reward_model": {"style": ex.style, "ground_truth": ex.ground_truth},
            "extra_info": _extra_info(ex, split, index),
            "source_file": c.row.source_file, "source_row": c.row.source_row,
            "prompt_text": c.prompt_text, "prompt_token_ids": c.token_ids,
            "prompt_length": len(c.token_ids), "prompt_tokens_cut": c.tokens_cut,
        })
    return pa.Table.from_pylist(rows, schema=PROMPTS)


def _rejects_table(rejects: list[Reject]) -> pa.Table:
    rows = [{"source_file": r.row.source_file, "source_row": r.row.source_row, "reason": r.reason,
             "raw": r.row.raw} for r in sorted(rejects, key=lambda r: r.seq)]
    return pa.Table.from_pylist(rows, schema=REJECTS)


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------


def _screen(train_rows: Iterable[RawRow], val_rows: Optional[Iterable[RawRow]], data: DataConfig
            ) -> tuple[list[_Candidate], list[Reject], int, dict[str, int], dict[str, str]]:
    """The tokenizer-free head of preprocess: read, adapt, drop duplicates. Returns (candidates,
    rejects, rows in, source file → rows read, source file → layout)."""
    files: dict[str, int] = {}
    layouts: dict[str, str] = {}

    def tagged(group: str, rows: Iterable[RawRow]) -> Iterator[Tagged]:
        for row in rows:
            files[row.source_file] = files.get(row.source_file, 0) + 1
            yield group, row

    stream = itertools.chain(tagged("train", train_rows), tagged("val", val_rows or []))
    candidates, rejects, rows_in = _adapt(_resolve_layouts(stream, data, layouts), data)
    if data.dedup:
        candidates, duplicates = _drop_duplicates(candidates)
        rejects += duplicates
    return candidates, rejects, rows_in, files, layouts


def preprocess_rows(train_rows: Iterable[RawRow], val_rows: Optional[Iterable[RawRow]], data: DataConfig,
                    tokenizer: Any, progress: bool = True) -> PreprocessResult:
    """Raw rows → train / validation prompts tables (schema PROMPTS) and rejects (schema REJECTS).

    ``val_rows`` None holds out a validation split of the train rows (data.val_fraction, capped at
    ``validation_cap``); given, it is the validation set (capped the same way). Raises
    ``DataError`` for a file that fits no layout (adapter 'auto') and for an overlong prompt with
    data.truncation=error and data.filter_overlong_prompts off.
    """
    candidates, rejects, rows_in, files, layouts = _screen(train_rows, val_rows, data)
    texts, ids = tokenize_prompts(tokenizer, [c.example.messages for c in candidates], progress=progress)
    for c, text, token_ids in zip(candidates, texts, ids):
        c.prompt_text, c.token_ids = text, list(token_ids)
    candidates, too_long = _apply_length_rule(candidates, data, tokenizer)
    rejects += too_long
    id_source = _assign_prompt_ids(candidates)
    train, val, over_cap = _assign_splits(candidates, data, separate_val=val_rows is not None)
    rejects += over_cap
    notes = _cap_notes(candidates, val, over_cap, data, separate_val=val_rows is not None)
    if len(train) + len(val) + len(rejects) != rows_in:  # the promise: no row is ever lost
        raise AssertionError(f"row accounting broken: train {len(train)} + val {len(val)} + rejected "
                             f"{len(rejects)} != rows in {rows_in}")
    return PreprocessResult(
        train=_prompts_table(train, "train"), val=_prompts_table(val, "val"),
        rejects=_rejects_table(rejects), rows_in=rows_in, files=files,
        reject_counts=dict(Counter(r.kind for r in rejects).most_common()),
        length_stats=prompt_length_stats([len(c.token_ids) for c in train + val]),
        id_source=id_source, layouts=layouts, truncated=sum(c.tokens_cut > 0 for c in train + val), notes=notes,
        rejected=sorted(rejects, key=lambda r: r.seq),
    )


def _cap_notes(candidates: list[_Candidate], val: list[_Candidate], over_cap: list[Reject], data: DataConfig,
               separate_val: bool) -> list[str]:
    """One line when a cap kept validation prompts out (validation files), or shrank the split."""
    cap, key = validation_cap(data, separate_val)
    held_back = sum(r.kind == "over validation cap" for r in over_cap)
    if separate_val and held_back:
        return [f"validation: {len(val)} of {len(val) + held_back} prompts of data.val_files ({key}={cap}); "
                "-1 scores them all, as verl does"]
    wanted = math.floor(data.val_fraction * len(candidates) + 0.5)
    if not separate_val and cap is not None and wanted > len(val) and len(val) == cap:
        setting = f"{key}={cap}" if key.startswith("data.") else key
        return [f"validation: {len(val)} held-out prompts instead of data.val_fraction's {wanted} ({setting}; "
                "data.max_val_samples sets it)"]
    return []


def preprocess_files(train_files: Sequence[str | Path], val_files: Sequence[str | Path], data: DataConfig,
                     tokenizer: Any, progress: bool = True) -> PreprocessResult:
    """Read JSONL / Parquet / CSV files (each file on its own, fields by name) and preprocess them.
    Missing files or unknown formats raise ``DataError`` before any work is done."""
    train_iters = [read_rows(p) for p in train_files]
    val_iters = [read_rows(p) for p in val_files]
    result = preprocess_rows(itertools.chain.from_iterable(train_iters),
                             itertools.chain.from_iterable(val_iters) if val_files else None,
                             data, tokenizer, progress=progress)
    result.files = _every_file(result.files, [*train_files, *val_files])
    return result


def _every_file(read: dict[str, int], paths: Sequence[str | Path]) -> dict[str, int]:
    """source file → rows read, listing also a file that held no rows."""
    return {str(Path(p)): read.get(str(Path(p)), 0) for p in paths}


def screen_files(train_files: Sequence[str | Path], val_files: Sequence[str | Path], data: DataConfig) -> Screening:
    """The data mistakes found without a tokenizer, before a run exists (``control.plan``): each file
    read, each row adapted, duplicates dropped and the rest split, as preprocess does. Writes nothing."""
    separate_val = bool(val_files)
    candidates, rejects, rows_in, files, _ = _screen(
        itertools.chain.from_iterable(read_rows(p) for p in train_files),
        itertools.chain.from_iterable(read_rows(p) for p in val_files) if separate_val else None, data)
    _assign_prompt_ids(candidates)
    train, val, over_cap = _assign_splits(candidates, data, separate_val=separate_val)
    return Screening(rows_in=rows_in, files=_every_file(files, [*train_files, *val_files]),
                     rejected=sorted(rejects + over_cap, key=lambda r: r.seq), train=len(train), val=len(val))
