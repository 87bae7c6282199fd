"""The stage contract: ``run_<stage>(cfg, run_dir, iteration) -> StageResult``.

``stage_record`` is the block around a stage's work with what every stage needs: the input/config
hash check that skips an unchanged stage, timing, the manifest record, and marking downstream stages
stale after a rerun. The work only computes and writes its outputs atomically; the loads and writes it wraps in
``rlhf_core.io.timing.timed`` are recorded as its ``io_seconds`` (the rest of ``seconds`` is compute).

A stage run with a config that differs from the run's config.yaml (``rlhf stage gae ... algorithm.lam=0.9``)
records the differing keys as ``"overrides"``: config.yaml stays what the run trains with, and
``out_of_date`` lists such reruns and the stale stages after them, which a resume and an export refuse
to build on until ``rlhf rebuild`` reruns them with config.yaml.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from rlhf_core.config import RLHFConfig, config_hash, flatten
from rlhf_core.config.loader import flatten_tree
from rlhf_core.errors import RLHFError
from rlhf_core.io import timing
from rlhf_core.run.layout import RunDir, StateFileError
from rlhf_core.run.saved_config import run_config_tree
from rlhf_core.run.manifest import (hash_paths, is_up_to_date, mark_downstream_stale, read_manifest, record_key,
                                     record_stage)
from rlhf_core.run.stage_order import REPORT_ORDER, REPORT_OUTPUTS, SETUP_STAGES


@dataclass
class StageResult:
    """What a stage hands back: small, JSON-able (paths, counts, metrics) — never tensors."""

    stage: str
    iteration: Optional[int] = None
    outputs: dict[str, str] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    io_seconds: float = 0.0
    """The part of ``seconds`` spent on loads, writes, hashing and memory release (not compute)."""
    skipped: bool = False
    summary: list[str] = field(default_factory=list)
    """Human-readable lines for the CLI and Prefect artifacts."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class StageRecord:
    """A stage's run as ``stage_record`` opens it: ``skipped`` holds the up-to-date result from the
    manifest (None: the stage computes), ``done(result)`` hands back the computed result, which the
    record times and writes to the manifest as the block closes."""

    def __init__(self, skipped: Optional[StageResult]):
        self.skipped = skipped
        self.result: Optional[StageResult] = None

    def done(self, result: StageResult) -> StageResult:
        self.result = result
        return result


@contextlib.contextmanager
def stage_record(*, stage: str, cfg: RLHFConfig, run: RunDir, iteration: Optional[int], inputs: Iterable[Path],
                 config_sections: Iterable[str], force: bool = False) -> Iterator[StageRecord]:
    """The bookkeeping around a stage's work, which the stage writes inline in the block:

        with stage_record(stage="gae", cfg=cfg, run=run, iteration=k, inputs=[...],
                          config_sections=config_sections(cfg), force=force) as record:
            if record.skipped:
                return record.skipped
            ...  # compute and write the outputs atomically
            return record.done(StageResult(...))

    ``record.skipped`` is set unless ``force`` or the manifest shows other input hashes or another
    hash of ``config_sections`` (the dotted prefixes the stage depends on, e.g. ``("data.",)``, so an
    unrelated override does not force a rerun). A block that raises records nothing; one that
    finishes records the outcome (seconds, the ``timed`` I/O inside it, output hashes, overrides)
    and marks the stages computed from changed outputs stale. A context manager, not a callback:
    the stage's own frame calls its math (docs/architecture.md counts the frames).
    """
    with timing.span("stage_call"):
        config_sections = tuple(config_sections)
        input_hashes = hash_paths(run, list(inputs))
        cfg_hash = config_hash(cfg, config_sections)
        if not force and is_up_to_date(run, iteration, stage, input_hashes, cfg_hash):
            yield StageRecord(_skipped(run, iteration, stage))
            return
        record = StageRecord(None)
        previous = read_manifest(run, iteration).get(stage) or {}
        started = time.time()
        with timing.tally() as io_by_kind:
            yield record
        result = record.result
        if result is None:
            raise RLHFError(f"stage {stage} finished without a result: its block must return record.done(...)")
        result.seconds = time.time() - started
        result.io_seconds = min(sum(io_by_kind.values()), result.seconds)
        _record(cfg, run, stage, iteration, result, config_sections, input_hashes, cfg_hash, io_by_kind, started,
                previous)


def _skipped(run: RunDir, iteration: Optional[int], stage: str) -> StageResult:
    """The result of an up-to-date stage, from its manifest record."""
    rec = read_manifest(run, iteration)[stage]
    return StageResult(stage=stage, iteration=iteration, outputs=rec.get("outputs_paths", {}),
                       rows=rec.get("rows", {}), metrics=rec.get("metrics", {}), skipped=True,
                       summary=[f"{stage}: up to date (same inputs and config), skipped"])


def _record(cfg: RLHFConfig, run: RunDir, stage: str, iteration: Optional[int], result: StageResult,
            config_sections: tuple[str, ...], input_hashes: dict[str, str], cfg_hash: str,
            io_by_kind: dict[str, float], started: float, previous: dict) -> None:
    """The stage's manifest record (its outputs hashed), its overrides said, and — for a rerun whose
    outputs changed — the stages computed from them marked stale."""
    overrides = config_overrides(cfg, run, config_sections)
    recorded = hash_paths(run, [Path(p) for p in result.outputs.values()])
    record_stage(
        run, iteration, stage,
        status="done", inputs=input_hashes, outputs=recorded,
        outputs_paths=result.outputs, config_hash=cfg_hash, rows=result.rows,
        metrics=result.metrics, seconds=result.seconds, io_seconds=result.io_seconds,
        io={kind: round(s, 6) for kind, s in sorted(io_by_kind.items())}, started_at=started,
        **({"overrides": overrides} if overrides else {}),
    )
    if overrides:
        result.summary.append(f"with overrides {' '.join(overrides)} (config.yaml unchanged)")
    if previous.get("status") in ("done", "stale"):
        changed = changed_outputs(run, stage, previous.get("outputs") or {}, recorded, result.outputs)
        stale = mark_downstream_stale(run, iteration, stage) if changed else []
        if stale:
            result.summary.append(f"marked stale: {', '.join(stale)} ({', '.join(changed)} changed)")
        elif not changed:
            result.summary.append("its outputs are the same bytes as before: nothing downstream is stale")


def changed_outputs(run: RunDir, stage: str, before: dict[str, str], after: dict[str, str],
                    paths: dict[str, str]) -> list[str]:
    """The outputs of a rerun whose digest differs from the previous run's (missing ones included),
    leaving out the stage's report outputs (``run.stage_order.REPORT_OUTPUTS``): what makes the stages
    computed from them stale."""
    reports = {record_key(run, paths[key]) for key in REPORT_OUTPUTS.get(stage, ()) if key in paths}
    return [rel for rel in sorted(set(before) | set(after)) if before.get(rel) != after.get(rel) and rel not in reports]


# ---------------------------------------------------------------------------------------------
# stage reruns with overrides, and what they leave out of date
# ---------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def config_overrides(cfg: RLHFConfig, run: RunDir, sections: Iterable[str]) -> list[str]:
    """``key=value`` for each setting under ``sections`` (the keys the stage depends on) where ``cfg``
    differs from the run's config.yaml: what a stage rerun was given on top of it. [] without a
    config.yaml, and in a run's own flow (it saves its config, a resume's or a retry's changes
    included, before any stage runs)."""
    if not run.config_path.is_file():
        return []
    saved = flatten_tree(run_config_tree(run)[0])
    used = flatten(cfg)
    prefixes = tuple(sections)
    return [f"{key}={_show(used[key])}" for key in used
            if key.startswith(prefixes) and key in saved and _plain(saved[key]) != _plain(used[key])]


class StagesOutOfDate(RLHFError):
    """Stages at or before last-good were rerun with overrides or are stale: what follows would be built on
    outputs config.yaml did not produce."""


def out_of_date(run: RunDir, through: int) -> list[tuple[Optional[int], str, str]]:
    """``(iteration, stage, why)`` for every record of the setup and of iterations 0..``through`` that
    is stale or ran with overrides, in the order a run runs them (setup first; None = setup)."""
    found = []
    for k in [None, *(k for k in run.iterations() if k <= through)]:
        try:
            manifest = read_manifest(run, k)
        except StateFileError:
            continue  # damaged: `rlhf status` names it, and a resume falls back from it (stages.repair)
        for stage in (SETUP_STAGES if k is None else REPORT_ORDER):
            record = manifest.get(stage) or {}
            if record.get("status") == "stale":
                found.append((k, stage, "stale"))
            elif record.get("overrides"):
                found.append((k, stage, f"rerun with overrides {' '.join(record['overrides'])}"))
    return found


def stage_label(iteration: Optional[int], stage: str) -> str:
    return stage if iteration is None else f"iter_{iteration}/{stage}"


def refuse_out_of_date(run: RunDir, through: int, doing: str) -> None:
    """Raise ``StagesOutOfDate`` naming what ``out_of_date`` found and the command that rebuilds it.
    Nothing to refuse before the first commit (``through`` 0): a resume then redoes every stage anyway."""
    found = out_of_date(run, through) if through >= 1 else []
    if not found:
        return
    shown = ", ".join(f"{stage_label(k, stage)} ({why})" for k, stage, why in found[:6])
    more = f" and {len(found) - 6} more" if len(found) > 6 else ""
    raise StagesOutOfDate(f"cannot {doing} {run.root}: {shown}{more} no longer follow its config.yaml; rerun them "
                          f"with `rlhf rebuild {run.root}`")
