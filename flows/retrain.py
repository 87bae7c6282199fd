"""The retraining flow behind the ``rlhf-retrain`` deployment (a cron schedule, deployments/prefect.yaml):

    prepare-retrain  → validate the preset + overrides, resolve the base model ("last-exported": the
                       newest RUN/export/actor under trainer.runs_root), snapshot the prompt files
                       into <runs_root>/snapshots/<run name>/ (copies + sha256)
    rlhf-pipeline    → the usual pipeline as a subflow, into a new run directory
                       <runs_root>/retrain-<UTC time>-<flow run id[:8]> (never shared: the name
                       carries the flow run id, and the run lock refuses a second writer)
    record-retrain   → RUN/retrain.json + MLflow tags: which export and which data bytes it started from

The reference policy defaults to the actor's initial model, so each retrain's KL is measured
against the model it started from. Wiring only: the decisions live in rlhf_core.control.retrain_inputs.

    rlhf_retrain(RetrainParams(base_model="last-exported", iterations=4))       (Python)
"""

from __future__ import annotations

import json
from typing import Optional

from pydantic import Field
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.params import FlowParams
from flows.pipeline import PipelineParams, rlhf_pipeline
from rlhf_core.config import apply_overrides, load_config, valid_keys
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lock import RunLock
from rlhf_core.paths import resolve_path
from rlhf_core.control.retrain_inputs import LAST_EXPORTED, SNAPSHOTS_DIR, resolve_base_model, retrain_run_name, runs_root_of, snapshot_files
from rlhf_core.run.inputs import check_inputs
from tasks import mlflow_tracking, prefect_artifacts
from tasks.prefect_runs import fail_misplaced_parameters, keep_command_sigterm

WARM_START_KEY = "actor_rollout_ref.model.warm_start.enable"


class RetrainParams(FlowParams):
    """What the Prefect UI's Run form (and the schedule's saved parameters) give a retraining run."""

    config: str = Field("configs/demo.yaml", description="YAML preset: defaults ← preset ← overrides")
    data_files: list[str] = Field(default_factory=list, description="Prompt files to snapshot for this run "
                                  "(JSONL, Parquet or CSV); empty: the preset's data.train_files")
    base_model: str = Field(LAST_EXPORTED, min_length=1, description="'last-exported' (the newest "
                            "RUN/export/actor under trainer.runs_root), 'config' (the preset's "
                            "actor_rollout_ref.model.path), 'tiny', or a model directory")
    iterations: Optional[int] = Field(None, ge=1, description="PPO iterations (sets trainer.total_iterations)")
    overrides: list[str] = Field(default_factory=list, description="Dotted overrides, e.g. "
                                 "algorithm.kl_ctrl.kl_coef=0.002")
    run_prefix: str = Field("retrain", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                            description="Run directory name prefix; a UTC timestamp and the flow run id follow")


def _retrain_flow_run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters.get("params") or {}
    get = params.get if isinstance(params, dict) else lambda key: getattr(params, key, None)
    return f"{get('run_prefix') or 'retrain'}-from-{get('base_model') or LAST_EXPORTED}"


@task(name="prepare-retrain", cache_policy=NO_CACHE, persist_result=False)
def prepare_retrain_task(params: RetrainParams, flow_run_id: Optional[str] = None) -> dict:
    """Validate, resolve the base model, snapshot the data; returns the pipeline's run name and
    overrides plus a record of what was chosen. Raises ConfigError before copying anything when
    the preset, an override, the base model or a data path is wrong."""
    cfg = load_config(resolve_path(params.config), params.overrides)
    runs_root = runs_root_of(cfg)
    base, export = resolve_base_model(params.base_model, runs_root, cfg)
    train_sources = list(params.data_files or cfg.data.train_files)
    check_inputs(apply_overrides(cfg, [f"data.train_files={json.dumps(train_sources)}",
                                       f"actor_rollout_ref.model.path={json.dumps(base)}"]))
    run_name = retrain_run_name(params.run_prefix, flow_run_id)
    snapshot_dir = runs_root / SNAPSHOTS_DIR / run_name
    train = snapshot_files(train_sources, snapshot_dir / "train", key="data.train_files")
    val = snapshot_files(cfg.data.val_files, snapshot_dir / "val", key="data.val_files") if cfg.data.val_files else []
    overrides = list(params.overrides) + [
        f"data.train_files={json.dumps([e['path'] for e in train])}",
        f"actor_rollout_ref.model.path={json.dumps(base)}",
    ] + ([f"data.val_files={json.dumps([e['path'] for e in val])}"] if val else [])
    if export is not None and WARM_START_KEY in valid_keys():
        overrides.append(f"{WARM_START_KEY}=false")  # an exported actor is already trained
    check_inputs(load_config(resolve_path(params.config), overrides))
    record = {"run_name": run_name, "run_dir": str(runs_root / run_name), "base_model": base,
              "base_model_spec": params.base_model, "export": export.to_dict() if export else None,
              "snapshot": {"dir": str(snapshot_dir), "train": train, "val": val}, "overrides": overrides,
              "flow_run_id": flow_run_id}
    atomic_write_json(snapshot_dir / "retrain.json", record)
    prefect_artifacts.logger().info("retrain %s: base model %s; %d prompt file(s) snapshotted to %s", run_name, base,
                            len(train) + len(val), snapshot_dir)
    return record


@task(name="record-retrain", cache_policy=NO_CACHE, persist_result=False)
def record_retrain_task(run_dir: str, mlflow_run_id: Optional[str], record: dict) -> None:
    """RUN/retrain.json and MLflow tags: the base model and the data bytes this run started from."""
    run = RunDir(run_dir)
    with RunLock(run):
        atomic_write_json(run.root / "retrain.json", record)
    if mlflow_run_id is None:  # trainer.logger without mlflow
        return
    train_hashes = ",".join(e["sha256"][:12] for e in record["snapshot"]["train"])
    mlflow_tracking.set_tags(mlflow_run_id, {"rlhf.retrain.base_model": record["base_model"],
                                      "rlhf.retrain.base_model_spec": record["base_model_spec"],
                                      "rlhf.retrain.snapshot": record["snapshot"]["dir"],
                                      "rlhf.retrain.train_sha256": train_hashes})


@flow(name="rlhf-retrain", flow_run_name=_retrain_flow_run_name, persist_result=False,
      on_crashed=[fail_misplaced_parameters])
def rlhf_retrain(params: RetrainParams = RetrainParams()) -> dict:
    """Retrain from the latest export (or a given model) on a fresh data snapshot, into a new run
    directory; returns the pipeline's summary plus ``retrain`` (the record above)."""
    from prefect.runtime import flow_run

    keep_command_sigterm()  # SIGTERM stops an `rlhf` command at once (Prefect's handler would report first)
    prefect_artifacts.redact_prefect_logs()
    record = prepare_retrain_task(params, flow_run.id)
    summary = rlhf_pipeline(PipelineParams(config=params.config, overrides=record["overrides"],
                                           iterations=params.iterations, run_name=record["run_name"]))
    record_retrain_task(summary["run_dir"], summary["mlflow_run_id"], record)
    return {**summary, "retrain": record}
