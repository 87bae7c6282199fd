"""verl's trainer schedule through the real flow: training steps derived after preprocess and saved,
val_before_train / test_freq / save_freq = -1, trainer.logger without mlflow, and val_only."""

from __future__ import annotations

import json

import pytest
import yaml

from flows.pipeline import PipelineParams, rlhf_pipeline
from rlhf_core.run.layout import RunDir
from rlhf_core.control.query import read_iteration_metrics

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]


def test_verls_defaults_never_validate_keep_only_last_good_and_log_to_console_only(
        prefect_server, demo_preset, tiny_overrides, tmp_path, capsys):
    runs = tmp_path / "runs"
    overrides = tiny_overrides(runs, "trainer.total_iterations=null", "trainer.total_training_steps=2",
                               "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
                               "trainer.logger=console", "trainer.max_ckpt_to_keep=2")
    summary = rlhf_pipeline(PipelineParams(config=demo_preset, overrides=overrides, run_name="verl"))
    run = RunDir(summary["run_dir"])
    saved = yaml.safe_load(run.config_path.read_text())
    assert saved["trainer"]["total_iterations"] == 2  # verl's total_training_steps, filled in after preprocess
    assert summary["last_good"]["iteration"] == 2
    assert not run.iter_dir(0).exists()  # no validation before training
    assert not any((run.iter_dir(k) / "validation.parquet").exists() for k in (1, 2))  # test_freq=-1: never
    assert not run.checkpoint(1).exists() and run.checkpoint(2).exists()  # save_freq=-1: last-good only
    assert summary["mlflow_run_id"] is None and not (run.root / "tracking.json").exists()
    metrics = read_iteration_metrics(run, 2)
    assert metrics["training/global_step"] == 2 and "training/epoch" in metrics
    assert {"timing_s/gen", "timing_s/adv", "timing_s/step"} <= set(metrics)
    table = capsys.readouterr().out
    assert "iter  reward" in table  # console: the per-iteration table


def test_val_only_validates_the_initial_policy_then_stops(prefect_server, demo_preset, tiny_overrides, tmp_path):
    runs = tmp_path / "runs"
    summary = rlhf_pipeline(PipelineParams(config=demo_preset, overrides=tiny_overrides(
        runs, "trainer.val_only=true", "trainer.logger=[console,wandb]"), run_name="vo"))
    run = RunDir(summary["run_dir"])
    assert summary["last_good"] is None and summary["export"] is None
    assert (run.iter_dir(0) / "validation.parquet").is_file() and not run.iter_dir(1).exists()
    assert "val/accuracy" in summary["metrics"]
    assert any(k.startswith("val-core/") and k.endswith("/reward/mean@1") for k in summary["metrics"])
    manifest = json.loads((run.iter_dir(0) / "manifest.json").read_text())
    assert manifest["validate"]["status"] == "done"
