"""Export the trained actor in Hugging Face format, gated on its latest validation score.

    rlhf export RUN            → RUN/export/actor/  (config.json, *.safetensors, tokenizer files)

Only the last-good actor is exported (the one the KL guard committed), and only when the latest
validation accuracy is at least ``trainer.export_min_val_score``; otherwise ``ExportRefused`` names
the score. Its checkpoint is verified against its sha256 manifest first: the callers rebuild what
is damaged (``stages.repair.prepare_export``), and what still does not verify is never exported. A LoRA actor (a peft adapter directory) is merged into its base model first, so the
export loads with plain ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.parquet as pq
from typing import Optional

from rlhf_core.config import RLHFConfig
from rlhf_core.errors import CheckpointError, RLHFError
from rlhf_core.io.atomic import atomic_dir, atomic_write_json, clean_leftovers
from rlhf_core.io.checksums import verify_checkpoint
from rlhf_core.run.lifecycle import committed_iterations, last_good_iteration, read_last_good
from rlhf_core.run.manifest import path_digest, read_manifest, record_key
from rlhf_core.run.layout import RunDir
from rlhf_core.scoring.models import is_lora_dir, load_merged_actor
from rlhf_core.stages.base import StagesOutOfDate, refuse_out_of_date

class ExportRefused(RLHFError):
    """The model did not meet the export bar (or has no validation score yet)."""


def latest_val_score(run: RunDir) -> Optional[tuple[int, float]]:
    """(iteration, val/accuracy) of the latest validation of a committed step (0: the initial
    policy), or None. The score is computed from that validation's table, which must match the
    sha256 its stage recorded: the gate never reads a number nothing verifies (iteration_metrics.json
    is a report, rewritten from the records, and anyone may edit it)."""
    for k in reversed([0, *committed_iterations(run)]):
        record = read_manifest(run, k).get("validate") or {}
        if record.get("status") != "done":
            continue
        table = run.validation(k)
        recorded = (record.get("outputs") or {}).get(record_key(run, table))
        if recorded is None or path_digest(run, table) != recorded:
            raise CheckpointError(f"refusing to export {run.root}: {table} no longer matches the sha256 its validation "
                                  f"recorded; `rlhf run --resume {run.root}` reruns that validation")
        correct = pq.read_table(table, columns=["correct"]).column("correct").to_pylist()
        return k, sum(bool(c) for c in correct) / max(len(correct), 1)
    return None


def check_export_allowed(cfg: RLHFConfig, run: RunDir) -> tuple[int, float]:
    """(iteration, score) when the latest validation score clears the bar and no stage at or before
    last-good is out of date (stale, or rerun with overrides: the score and the actor may not be what
    config.yaml trains), else ExportRefused."""
    try:
        refuse_out_of_date(run, last_good_iteration(run), "export")
    except StagesOutOfDate as exc:
        raise ExportRefused(str(exc)) from None
    bar = cfg.trainer.export_min_val_score
    latest = latest_val_score(run)
    if latest is None:
        raise ExportRefused(f"refusing to export {run.root}: no validation score yet (val/accuracy is written "
                            f"every trainer.test_freq iterations and after the last one)")
    k, score = latest
    if score < bar:
        raise ExportRefused(f"refusing to export {run.root}: latest validation accuracy {score:.4f} (iteration {k}) "
                            f"is below trainer.export_min_val_score={bar}; train longer, or lower the bar with "
                            f"`rlhf export {run.root} trainer.export_min_val_score=<value>`")
    return k, score


def export_actor(cfg: RLHFConfig, run: RunDir, out: Optional[Path] = None) -> Path:
    """Merge (if LoRA) and save the last-good actor + tokenizer to ``out`` (default RUN/export/actor),
    atomically, with export.json recording where it came from. Returns ``out``."""
    from transformers import AutoTokenizer

    val_iteration, score = check_export_allowed(cfg, run)
    record = read_last_good(run)
    if record is None:
        raise ExportRefused(f"refusing to export {run.root}: no iteration has been committed (last_good.json "
                            "is absent)")
    source = run.root / record["checkpoint"] / "actor"
    if not source.is_dir():
        raise CheckpointError(f"last-good actor {source} is missing; rerun the run with --resume")
    try:
        verify_checkpoint(source.parent)  # never export what no longer matches its hashes
    except CheckpointError as exc:
        raise CheckpointError(f"refusing to export {run.root}: {exc}") from None
    out = Path(out) if out else run.exported_actor
    clean_leftovers(out)  # a killed export's out.tmp-*: no resume sweeps a run that finished
    model = load_merged_actor(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        atomic_write_json(tmp / "export.json", {
            "source_checkpoint": str(source), "iteration": record["iteration"],
            # a LoRA run's checkpoint actor/ holds the adapters merged already (the adapter is beside it)
            "merged_lora": is_lora_dir(source) or cfg.actor_rollout_ref.model.lora_rank > 0,
            "val_accuracy": score, "val_iteration": val_iteration,
            "export_min_val_score": cfg.trainer.export_min_val_score, "time": time.time()})
    run.append_event("export", record["iteration"], path=str(out), val_accuracy=score)
    return out
