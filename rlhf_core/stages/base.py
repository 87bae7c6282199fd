"""The stage contract: ``run_<stage>(cfg, run_dir, iteration) -> StageResult``.

``execute_stage`` wraps a stage body with what every stage needs: the input/config hash check that
skips an unchanged stage, timing, the manifest record, and marking downstream stages stale after a
rerun. The body only computes and writes its outputs atomically; the loads and writes it wraps in
``rlhf_core.io.timing.timed`` are recorded as its ``io_seconds`` (the rest of ``seconds`` is compute).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from rlhf_core.config import RLHFConfig, config_hash
from rlhf_core.run.manifest import hash_paths, is_up_to_date, mark_downstream_stale, read_manifest, record_stage
from rlhf_core.run.layout import RunDir
from rlhf_core.io import timing


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


def execute_stage(
    *,
    stage: str,
    cfg: RLHFConfig,
    run: RunDir,
    iteration: Optional[int],
    inputs: Iterable[Path],
    config_sections: Iterable[str],
    body: Callable[[], StageResult],
    force: bool = False,
) -> StageResult:
    """Run ``body`` unless the manifest shows the same inputs and config; record the outcome.

    ``config_sections`` are the dotted prefixes the stage depends on (e.g. ``("data.",)``), so an
    unrelated override does not force a rerun. ``force`` reruns regardless.
    """
    with timing.span("stage_call"):
        return _execute(stage, cfg, run, iteration, inputs, config_sections, body, force)


def _execute(stage: str, cfg: RLHFConfig, run: RunDir, iteration: Optional[int], inputs: Iterable[Path],
             config_sections: Iterable[str], body: Callable[[], StageResult], force: bool) -> StageResult:
    input_hashes = hash_paths(run, list(inputs))
    cfg_hash = config_hash(cfg, config_sections)
    if not force and is_up_to_date(run, iteration, stage, input_hashes, cfg_hash):
        rec = read_manifest(run, iteration)[stage]
        return StageResult(stage=stage, iteration=iteration, outputs=rec.get("outputs_paths", {}),
                           rows=rec.get("rows", {}), metrics=rec.get("metrics", {}), skipped=True,
                           summary=[f"{stage}: up to date (same inputs and config), skipped"])
    previously_done = read_manifest(run, iteration).get(stage, {}).get("status") in ("done", "stale")
    started = time.time()
    with timing.tally() as io_by_kind:
        result = body()
    result.seconds = time.time() - started
    result.io_seconds = min(sum(io_by_kind.values()), result.seconds)
    output_paths = [Path(p) for p in result.outputs.values()]
    record_stage(
        run, iteration, stage,
        status="done", inputs=input_hashes, outputs=hash_paths(run, output_paths),
        outputs_paths=result.outputs, config_hash=cfg_hash, rows=result.rows,
        metrics=result.metrics, seconds=result.seconds, io_seconds=result.io_seconds,
        io={kind: round(s, 6) for kind, s in sorted(io_by_kind.items())}, started_at=started,
    )
    if previously_done:
        stale = mark_downstream_stale(run, iteration, stage)
        if stale:
            result.summary.append(f"marked stale: {', '.join(stale)}")
    return result
