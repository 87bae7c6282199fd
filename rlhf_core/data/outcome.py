"""What preprocess made of the input rows, and what it says about them: its result (the tables and
their counts), the screening a run's plan makes before anything exists, every refused row with its
reason, and the one-line problems and fixes when too few prompts are left (``prompt_supply_problem``)
or none (``no_prompts_problem``). The steps that produce them: ``data.preprocess``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import pyarrow as pa

from rlhf_core.config.schema import DataConfig
from rlhf_core.data.readers import SUFFIX_FORMATS, RawRow
from rlhf_core.errors import DataError

@dataclass
class Reject:
    """An input row preprocess refused: its position among all input rows, the row, the kind of
    refusal (the rejects table's reason) and the full sentence."""

    seq: int
    row: RawRow
    kind: str
    reason: str



@dataclass
class PreprocessResult:
    """The three tables plus the counts the stage prints and records."""

    train: pa.Table
    val: pa.Table
    rejects: pa.Table
    rows_in: int
    files: dict[str, int]
    """source file → rows read from it."""
    reject_counts: dict[str, int]
    """reject kind → count, most frequent first."""
    length_stats: dict[str, float]
    """prompt_length min / mean / p50 / p95 / max over accepted prompts (empty when none)."""
    id_source: str = ""
    """Where prompt_id came from: "source ids" or "content hashes"."""
    layouts: dict[str, str] = field(default_factory=dict)
    """source file → the adapter its rows went through (what 'auto' picked)."""
    truncated: int = 0
    """Accepted prompts whose tokens data.truncation cut to data.max_prompt_length."""
    notes: list[str] = field(default_factory=list)
    """Lines the summary adds (a cap that held validation prompts back)."""
    rejected: list[Reject] = field(default_factory=list, repr=False)
    """The rejects as found, in input order (their kinds: what ``no_prompts_problem`` reads)."""

    @property
    def rows(self) -> dict[str, int]:
        """Rows in, accepted (train, val), rejected, and rejected by reason (``REJECTED_BY``<kind>)."""
        return {"input": self.rows_in, "train": self.train.num_rows, "val": self.val.num_rows,
                "rejected": self.rejects.num_rows,
                **{f"{REJECTED_BY}{kind}": n for kind, n in self.reject_counts.items()}}

    def summary_lines(self) -> list[str]:
        lines = [f"files read: {len(self.files)}"]
        lines += [f"  {path}: {n} rows" + (f" ({self.layouts[path]} layout)" if path in self.layouts else "")
                  for path, n in self.files.items()]
        lines.append(f"rows in: {self.rows_in} = train {self.train.num_rows} + val {self.val.num_rows} "
                     f"+ rejected {self.rejects.num_rows}")
        if self.reject_counts:
            lines.append("rejected by reason: " + ", ".join(f"{k} {n}" for k, n in self.reject_counts.items()))
        if self.truncated:
            lines.append(f"prompts truncated to data.max_prompt_length: {self.truncated} (column prompt_tokens_cut)")
        if self.id_source:
            lines.append(f"prompt_id from {self.id_source}")
        lines += self.notes
        s = self.length_stats
        if s:
            lines.append(f"prompt length (tokens): min {s['min']:.0f} / mean {s['mean']:.1f} / "
                         f"p50 {s['p50']:.0f} / p95 {s['p95']:.0f} / max {s['max']:.0f}")
        return lines



@dataclass
class Screening:
    """What preprocess decides before it tokenizes (``screen_files``): rows read, the rows it rejects
    while reading, adapting and deduplicating, and the train / validation split of the rest.

    Its counts bound the stage's: the length rule only rejects more, and the split's sizes grow with
    the prompts kept, so a run this screening refuses the stage would refuse too."""

    rows_in: int
    files: dict[str, int]
    rejected: list[Reject]
    train: int
    val: int

    @property
    def rows(self) -> dict[str, int]:
        """The keys of ``PreprocessResult.rows``."""
        kinds = Counter(r.kind for r in self.rejected).most_common()
        return {"input": self.rows_in, "train": self.train, "val": self.val, "rejected": len(self.rejected),
                **{f"{REJECTED_BY}{kind}": n for kind, n in kinds}}



# ---------------------------------------------------------------------------------------------
# enough prompts to train on: what the run checks once preprocess has counted them
# ---------------------------------------------------------------------------------------------

REJECTED_BY = "rejected/"
"""Prefix of the per-reason counts among the stage's rows (``rejected/prompt too long``: 196)."""
CAPS = ("over validation cap", "over train cap")
"""Reject kinds that are sampling the user asked for (data.max_val_samples, train_max_samples),
not data lost: left out of the accepted fraction."""
REJECTS_SQL = "SELECT reason, count(*) AS n FROM rejects GROUP BY 1 ORDER BY 2 DESC"
"""The query that lists the rejected rows' reasons (`rlhf query RUN "..."`; the rows themselves:
SELECT source_file, source_row, reason FROM rejects)."""


def rejects_query(run_root: str | Path) -> str:
    """The command that lists a run's rejected rows, as a refusal names it."""
    return f"rlhf query {run_root} \"{REJECTS_SQL}\" lists them"


def first_reject(result: PreprocessResult | Screening) -> str:
    """The first rejected row, as a refusal shows it when there is no run to query: 'e.g. FILE row N: reason'."""
    if not result.rejected:
        return ""
    first = result.rejected[0]
    return f"e.g. {first.row.source_file} row {first.row.source_row}: {first.reason}"


def rejected_by_reason(rows: dict[str, int]) -> dict[str, int]:
    """Reject kind → count, from a preprocess record's rows (most frequent first, then by name)."""
    found = [(key[len(REJECTED_BY):], n) for key, n in rows.items() if key.startswith(REJECTED_BY)]
    return dict(sorted(found, key=lambda item: (-item[1], item[0])))


def accepted_fraction(rows: dict[str, int]) -> float:
    """Accepted (train + val) over the rows read, less those a sample cap left out; 1.0 with no rows."""
    considered = rows.get("input", 0) - sum(rejected_by_reason(rows).get(kind, 0) for kind in CAPS)
    return (rows.get("train", 0) + rows.get("val", 0)) / considered if considered > 0 else 1.0


def preprocess_headline(rows: dict[str, int], run_root: str | Path) -> str:
    """The preprocess stage in one line for the terminal of `rlhf run`: rows read, accepted into
    train and validation, rejected by reason, and the query that lists the rejected rows."""
    line = f"preprocess: {rows.get('input', 0)} rows -> train {rows.get('train', 0)}, validation {rows.get('val', 0)}"
    reasons = rejected_by_reason(rows)
    if not rows.get("rejected"):
        return line + ", none rejected"
    shown = ", ".join(f"{kind} {n}" for kind, n in reasons.items()) or "see the rejects table"
    return (f"{line}, rejected {rows['rejected']} ({shown}); the rejected rows: "
            f"rlhf query {run_root} \"{REJECTS_SQL}\"")


def prompt_supply_problem(rows: dict[str, int], data: DataConfig, *, trains: bool, validates: bool,
                          rejects_at: str) -> Optional[str]:
    """Why a run cannot train on what preprocess accepted (``rows``: its record), else None: less
    than data.min_accepted_fraction of the rows accepted; fewer train prompts than one training
    batch (``trains``: verl's dataloader, which drops the last partial batch, has no step then);
    no validation prompt while the run validates (``validates``; its accuracy would read 0.000).
    ``rejects_at``: where the rejected rows are to be seen (``rejects_query``, or an example row)."""
    counts = f"{rows.get('input', 0)} rows -> train {rows.get('train', 0)}, validation {rows.get('val', 0)}"
    reasons = rejected_by_reason(rows)
    why = (f", rejected {rows['rejected']}: {', '.join(f'{k} {n}' for k, n in reasons.items())}; {rejects_at}"
           if rows.get("rejected") and reasons else "")
    fraction = accepted_fraction(rows)
    broken_down = bool(reasons) or not rows.get("rejected")  # a record of an older version has no reasons
    if broken_down and fraction < data.min_accepted_fraction:
        return (f"preprocess accepted {fraction:.1%} of the rows, under data.min_accepted_fraction="
                f"{data.min_accepted_fraction} ({counts}{why}); fix what rejects them"
                f"{_fix_hint(reasons, data)}, or lower data.min_accepted_fraction (0 = no check)")
    if trains and rows.get("train", 0) < data.train_batch_size:
        return (f"{rows.get('train', 0)} train prompts are fewer than one training batch "
                f"(data.train_batch_size={data.train_batch_size}; {counts}{why}): no training step can run; "
                f"lower data.train_batch_size to at most {rows.get('train', 0)} (and ppo_mini_batch_size with it), "
                f"or add prompts{_fix_hint(reasons, data, ' or keep more of them')}")
    if validates and rows.get("val", 0) == 0:
        return (f"the run validates (trainer.val_before_train, trainer.test_freq or trainer.kl_guard_val_prompts) "
                f"but no validation prompt was accepted ({counts}{why}): its val/accuracy would read 0; give "
                "data.val_files=[...], raise data.val_fraction or data.max_val_samples, or turn validation off "
                "(trainer.val_before_train=false trainer.test_freq=-1)")
    return None


# ---------------------------------------------------------------------------------------------
# no prompt at all: what is wrong with the files, said once
# ---------------------------------------------------------------------------------------------


class NoPromptsError(DataError):
    """Preprocess accepted no train prompt. ``rows`` are its counts (``PreprocessResult.rows``), so
    the caller can print the preprocess line before the refusal."""

    def __init__(self, message: str, rows: dict[str, int]):
        super().__init__(message)
        self.rows = rows


UNREADABLE_KINDS = ("malformed JSON", "not a JSON object", "not valid UTF-8", "not valid Unicode", "blank line",
                    "malformed CSV", "unreadable row")
"""Reject kinds of rows the reader could not turn into a record (``data.readers``)."""


def no_prompts_problem(result: PreprocessResult | Screening, data: DataConfig, rejects_at: Optional[str] = None) -> str:
    """Why ``result`` holds no train prompt, in one line naming the file(s), the problem and the fix:
    no rows at all (empty files), no row a record (not JSON / not the file's format), no row with
    the fields the adapter reads (their own keys named), else the reject counts with one example.
    ``rejects_at``: where the rejected rows can be listed (the run's `rlhf query` command), if anywhere."""
    files = ", ".join(result.files) or "data.train_files"
    if result.rows_in == 0:
        return (f"{files}: no rows to read (empty); give data.train_files rows in the layout data.adapter="
                f"{data.adapter} reads: {layout_hint(data, next(iter(result.files), None))}")
    kinds = Counter(r.kind for r in result.rejected)
    top, n = kinds.most_common(1)[0] if kinds else ("", 0)
    first = next((r for r in result.rejected if r.kind == top), None)
    if first is None:  # rows that were all accepted into validation (data.val_files): no train row
        return (f"no train prompts from {files} (validation {result.rows['val']}); give train rows, or "
                "check data.val_fraction")
    where = first.row.source_file
    example = f"row {first.row.source_row}: {first.reason}: {_excerpt(first.row.raw)}"
    if top in UNREADABLE_KINDS and n == len(result.rejected):
        return (f"{where}: no row could be read as a record ({n} of {result.rows_in} rows: {top}; {example}); "
                f"{_format_hint(first.row.source_file, data)}")
    if top.startswith("missing ") and n == len(result.rejected):
        keys = _record_keys(r for r in result.rejected if r.kind == top)
        lacking = [field for field in adapter_fields(data) if field[0] not in keys]
        return (f"{where}: no row has {'the field' if len(lacking) == 1 else 'the fields'} data.adapter="
                f"{data.adapter} reads ({', '.join(shown for _, _, shown in lacking)}); its rows have "
                f"{', '.join(map(repr, keys)) or 'no fields'}: {_key_hint(keys, lacking, data, where)}")
    counts = ", ".join(f"{kind} {m}" for kind, m in kinds.most_common())
    listed = f"; every rejected row and its reason: {rejects_at}" if rejects_at else ""
    return (f"no train prompts accepted from {files} (rejected {len(result.rejected)}: {counts}; e.g. {where} "
            f"{example}); fix those rows or the data.* keys that read them{listed}")


def layout_hint(data: DataConfig, source_file: Optional[str] = None) -> str:
    """The layout ``data.adapter`` reads, said in the format of ``source_file`` (by its suffix: a
    Parquet file's columns, a CSV file's header, a JSONL file's line; JSONL when there is none)."""
    fmt = SUFFIX_FORMATS.get(Path(source_file).suffix.lower(), "jsonl") if source_file else "jsonl"
    if fmt == "parquet":
        return f"a Parquet table with the columns {_columns(data)}"
    if fmt == "csv":
        return f"a CSV file whose header row names the columns {_columns(data)}"
    if source_file:
        layout = " in verl's layout" if data.adapter == "verl" else ""
        return f"one JSON object per line{layout}, e.g. {example_row(data)}"
    return {"gsm8k": "one JSON object per line, e.g. ", "generic": "one JSON object per line, e.g. ",
            "verl": "verl's Parquet layout, e.g. "}.get(data.adapter, "JSONL, Parquet or CSV rows, e.g. ") + \
        example_row(data)


def _columns(data: DataConfig) -> str:
    """The columns ``data.adapter`` reads, with what each holds."""
    if data.adapter == "verl":
        return (f"'{data.prompt_key}' (a list of {{role, content}} messages) and 'reward_model' (a struct with "
                "'ground_truth')")
    if data.adapter == "generic":
        return f"'{data.prompt_key}' (text) and '{data.answer_key}' (text)"
    return f"'{data.question_key}' (text) and '{data.answer_key}' (text ending in '#### <number>')"  # gsm8k's, auto's example


def example_row(data: DataConfig) -> str:
    """One row in the layout ``data.adapter`` reads (gsm8k's for 'auto')."""
    if data.adapter == "generic":
        return f'{{"{data.prompt_key}": "...", "{data.answer_key}": "42"}}'
    if data.adapter == "verl":
        return f'{{"{data.prompt_key}": [{{"role": "user", "content": "..."}}], "reward_model": {{"ground_truth": "42"}}}}'
    return f'{{"{data.question_key}": "...", "{data.answer_key}": "... #### 42"}}'


def adapter_fields(data: DataConfig) -> list[tuple[str, str, str]]:
    """The fields data.adapter reads: (key, its setting, "'<key>' (<setting>)")."""
    settings = {"gsm8k": ("question_key", "answer_key"), "generic": ("prompt_key", "answer_key")}
    fields = ([(getattr(data, s), f"data.{s}") for s in settings[data.adapter]] if data.adapter in settings else
              [(data.prompt_key, "data.prompt_key"), ("reward_model", "reward_model.ground_truth")])
    return [(key, setting, f"'{key}' ({setting})") for key, setting in fields]


def _key_hint(keys: list[str], lacking: list[tuple[str, str, str]], data: DataConfig, source_file: str) -> str:
    """Which settings to point at the rows' own keys (a guess in the rows' order when it is one to one)."""
    tail = f", or give rows in the layout it reads: {layout_hint(data, source_file)}"
    settings = [setting for _, setting, _ in lacking if setting.startswith("data.")]
    if settings and len(keys) == len(adapter_fields(data)) == len(lacking) == len(settings):
        guess = " ".join(f"{setting}={key}" for setting, key in zip(settings, keys))
        answer = " (the answer must end in '#### <number>')" if data.adapter == "gsm8k" else ""
        return f"name them, e.g. {guess}{answer}{tail}"
    if settings:
        return f"set {' and '.join(settings)} to the key(s) that hold it{tail}"
    return f"give each row those fields{tail}"


def _format_hint(source_file: str, data: DataConfig) -> str:
    suffix = Path(source_file).suffix.lower()
    if suffix in SUFFIX_FORMATS:
        return f"a {suffix} file for data.adapter={data.adapter} holds {layout_hint(data, source_file)}"
    return f"check that the file is {suffix or 'a data file'} in the layout data.adapter={data.adapter} reads"


def _record_keys(rejects: Iterable[Reject], limit: int = 8) -> list[str]:
    """The field names the rejected rows carry (from their raw JSON), first seen first."""
    keys: dict[str, None] = {}
    for r in rejects:
        record = r.row.record if isinstance(r.row.record, dict) else {}
        keys.update(dict.fromkeys(map(str, record)))
        if len(keys) >= limit:
            break
    return list(keys)[:limit]


def _excerpt(text: str, limit: int = 60) -> str:
    text = " ".join(str(text).split())
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _fix_hint(reasons: dict[str, int], data: DataConfig, lead: str = "") -> str:
    """A pointer at the setting behind the most frequent reject kind, when one setting is behind it."""
    top = next(iter(reasons), None)
    if top == "prompt too long":
        return f"{lead} (the most frequent reason is prompt too long: raise data.max_prompt_length={data.max_prompt_length})"
    if top == "duplicate":
        return f"{lead} (the most frequent reason is duplicate: data.dedup=false keeps repeated prompts)"
    return lead
