"""Stage `preprocess`: raw prompt files → prompts/train.parquet, val.parquet, rejects.parquet.

    rlhf stage preprocess --run-dir RUN [-c PRESET] [data.train_files=[a.jsonl,b.parquet] ...]

The work is ``rlhf_core.data.preprocess.preprocess_files``; this wrapper resolves the paths, loads
the tokenizer, writes the three tables atomically and reports counts. It reruns only when a raw
file or a ``data.*`` / ``actor_rollout_ref.model.*`` setting changed (or with ``force``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlhf_core.config import RLHFConfig
from rlhf_core.config.reads import ActorModel, Data, build, config_keys
from rlhf_core.config.schema import DataConfig, ModelConfig
from rlhf_core.data.preprocess import load_tokenizer, preprocess_files
from rlhf_core.data.outcome import NoPromptsError, PreprocessResult, no_prompts_problem
from rlhf_core.data.schemas import PROMPTS, REJECTS
from rlhf_core.errors import DataError
from rlhf_core.io.atomic import atomic_write_parquet
from rlhf_core.run.layout import RunDir
from rlhf_core.run.manifest import hash_paths, read_manifest
from rlhf_core.paths import resolve_path
from rlhf_core.stages.base import StageResult, stage_record


@dataclass(frozen=True)
class PreprocessSettings:
    data: DataConfig
    """The files, their columns and the prompt budget."""
    model: ModelConfig
    """The actor's model section: its tokenizer counts and cuts the prompts."""


def preprocess_settings(data: Data, model: ActorModel) -> PreprocessSettings:
    """Everything the stage reads of the config: its parameters are the keys its config hash covers."""
    return PreprocessSettings(data=data, model=model)


def _resolve_files(paths: list[str], key: str) -> list[Path]:
    resolved = [resolve_path(p) for p in paths]
    missing = [str(p) for p, r in zip(paths, resolved) if not r.is_file()]
    if missing:
        raise DataError(f"{key}: file(s) not found: {', '.join(missing)}; give JSONL, Parquet or CSV paths "
                        f"(absolute, or relative to the current directory or the project root)")
    return resolved


def data_files(data: DataConfig) -> tuple[list[Path], list[Path]]:
    """(train files, validation files) as preprocess reads them; a missing one is refused naming it."""
    return _resolve_files(data.train_files, "data.train_files"), _resolve_files(data.val_files, "data.val_files")


def config_sections(cfg: RLHFConfig) -> tuple[str, ...]:
    """The config this stage's output depends on (its manifest's config hash): what its builder reads."""
    return config_keys(preprocess_settings)


def refuse_changed_data(data: DataConfig, run: RunDir, trained_through: int) -> None:
    """Refuse (``DataError``, one line naming the file and the commands) to continue a run whose
    iterations 1..``trained_through`` trained on data files that have changed since preprocess read
    them: the resume would re-preprocess and train on the new rows after the old ones. Reads the
    recorded digests (``manifest.json``) and hashes the files; writes nothing."""
    if trained_through < 1:
        return
    recorded = (read_manifest(run, None).get("preprocess") or {}).get("inputs")
    if not recorded:
        return  # a run directory whose prompts came by other means
    train_files, val_files = data_files(data)
    files = train_files + val_files
    now = hash_paths(run, files)
    changed = [key for key in now if recorded.get(key) != now[key]]
    if not changed and set(now) == set(recorded):
        return
    what = (f"data file {changed[0]} changed since preprocess read it" if changed and changed[0] in recorded
            else f"the data files are now {', '.join(now)}, not {', '.join(recorded)}")
    trained = "iteration 1" if trained_through == 1 else f"iterations 1..{trained_through}"
    raise DataError(f"cannot resume {run.root}: {what} ({trained} trained on its old rows; resuming would train on "
                    f"new rows after old ones); put the old data back to resume, or retrain on the new data with "
                    f"`rlhf stage preprocess --run-dir {run.root}` then `rlhf rebuild {run.root}`, or start a new run")


def run_preprocess(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None,
                   force: bool = False) -> StageResult:
    """Preprocess ``cfg.data.train_files`` (and ``val_files``) into the run's prompts tables."""
    settings = build(preprocess_settings, cfg)
    train_files, val_files = data_files(settings.data)

    with stage_record(stage="preprocess", cfg=cfg, run=run, iteration=None, inputs=train_files + val_files,
                      config_sections=config_sections(cfg), force=force) as record:
        if record.skipped:
            return record.skipped
        tokenizer = load_tokenizer(settings.model)
        result = preprocess_files(train_files, val_files, settings.data, tokenizer)
        # rejects first: when nothing was accepted they are what the user needs to read
        atomic_write_parquet(run.rejects, result.rejects, schema=REJECTS)
        if result.train.num_rows == 0:  # the file, the problem and the fix (the caller prints the counts first)
            raise NoPromptsError(no_prompts_problem(result, settings.data, rejects_at=f'rlhf query {run.root} '
                                                    f'"SELECT source_file, source_row, reason FROM rejects"'),
                                 rows=result.rows)
        atomic_write_parquet(run.train_prompts, result.train, schema=PROMPTS)
        atomic_write_parquet(run.val_prompts, result.val, schema=PROMPTS)
        metrics = _metrics(result)
        summary = result.summary_lines() + [f"wrote {run.train_prompts.parent}/{{train,val,rejects}}.parquet"]
        return record.done(StageResult(
            stage="preprocess", iteration=None,
            outputs={"train": str(run.train_prompts), "val": str(run.val_prompts), "rejects": str(run.rejects)},
            rows=result.rows, metrics=metrics, summary=summary,
        ))


def _metrics(result: PreprocessResult) -> dict[str, float]:
    """Recorded in the manifest: prompt lengths, the rejected share, how many prompts were cut."""
    metrics = {f"data/prompt_length_{k}": v for k, v in result.length_stats.items()}
    metrics["data/reject_fraction"] = result.rejects.num_rows / max(1, result.rows_in)
    metrics["data/prompts_truncated"] = float(result.truncated)
    return metrics
