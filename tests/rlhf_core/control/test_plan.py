"""Run planning: new vs resumed runs, the validation / save schedule, checkpoint pruning, metrics."""

from __future__ import annotations

import pyarrow as pa
import pytest

from rlhf_core.run import report
from rlhf_core.run import schedule
from rlhf_core.control import opening, plan
from rlhf_core.run import lifecycle
from rlhf_core.config import load_config
from rlhf_core.data import schemas
from rlhf_core.errors import RLHFError
from rlhf_core.io.atomic import atomic_write_parquet
from rlhf_core.run.manifest import read_manifest, record_stage
from rlhf_core.run.lifecycle import commit_iteration as write_last_good
from rlhf_core.run.layout import RunDir
from rlhf_core.run.stage_order import ITERATION_STAGES
from rlhf_core.io.checksums import write_checksums as write_checkpoint_manifest


def test_new_run_then_resume(tmp_path):
    p = plan.plan_run(None, [f"trainer.runs_root={tmp_path}"], iterations=3, run_name="a")
    assert p.run.root == tmp_path / "a" and list(p.iterations()) == [1, 2, 3] and not p.resumed
    assert not p.run.root.exists()  # planning writes nothing
    opening.open_run(p)
    assert p.run.config_path.is_file()
    # a run that stopped in its setup (its data refused, say): the same command takes the name over
    (p.run.root / "prompts").mkdir()
    (p.run.root / "prompts" / "rejects.parquet").write_bytes(b"rejects")
    again = plan.plan_run(None, [f"trainer.runs_root={tmp_path}"], iterations=3, run_name="a")
    assert again.run.root == p.run.root and not again.resumed
    opening.open_run(again)
    assert not (p.run.root / "prompts").exists() and p.run.config_path.is_file()
    for k in (1, 2):  # a sealed checkpoint each, so the resume's last-good check passes
        _fake_checkpoint(p.run, k)
    with pytest.raises(RLHFError, match="already exists"):  # a run that trained is never taken over
        plan.plan_run(None, [f"trainer.runs_root={tmp_path}"], run_name="a")
    write_last_good(p.run, 1)
    write_last_good(p.run, 2)
    resumed = plan.plan_run(None, ["trainer.test_freq=5"], resume=p.run.root)
    assert resumed.first_iteration == 3 and resumed.cfg.trainer.total_iterations == 3
    assert resumed.cfg.trainer.test_freq == 5
    opening.open_run(resumed)
    assert p.run.events()[-1]["kind"] == "resume" and resumed.first_iteration == 3
    with pytest.raises(RLHFError, match="no config.yaml"):
        plan.plan_run(resume=tmp_path / "nothing")


def test_schedule():
    cfg = load_config(None, ["trainer.total_iterations=7", "trainer.test_freq=3", "trainer.save_freq=2"])
    assert [k for k in range(1, 8) if schedule.validate_due(cfg.trainer, k)] == [3, 6, 7]
    assert [k for k in range(1, 8) if schedule.save_due(cfg.trainer, k)] == [2, 4, 6, 7]
    never = load_config(None, ["trainer.total_iterations=7"])  # verl's defaults: test_freq = save_freq = -1
    assert not any(schedule.validate_due(never.trainer, k) or schedule.save_due(never.trainer, k) for k in range(1, 8))


def _fake_checkpoint(run: RunDir, k: int) -> None:
    """iter_k/checkpoint with an actor file and its sha256 manifest, and a record of each stage of
    the iteration: what commit and resume check."""
    actor = run.checkpoint(k) / "actor"
    actor.mkdir(parents=True)
    (actor / "model.safetensors").write_bytes(b"weights %d" % k)
    write_checkpoint_manifest(run.checkpoint(k))
    for stage in ITERATION_STAGES:
        record_stage(run, k, stage, status="done", inputs={}, outputs={}, config_hash="h")


def _train_prompts(run: RunDir, n: int) -> None:
    rows = [{"prompt_id": f"p{i}"} for i in range(n)]
    atomic_write_parquet(run.train_prompts, pa.Table.from_pylist(rows))


@pytest.mark.parametrize("overrides, expected", [
    (["trainer.total_epochs=3"], 3 * (10 // 4)),  # verl: epochs × (prompts // train_batch_size)
    (["trainer.total_epochs=3", "trainer.total_training_steps=5"], 5),
    (["trainer.total_training_steps=5", "trainer.total_iterations=2"], 2),  # ours wins
])
def test_training_steps_are_derived_after_preprocess_and_saved(tmp_path, overrides, expected):
    p = plan.plan_run(None, [f"trainer.runs_root={tmp_path}", "data.train_batch_size=4",
                                    "actor_rollout_ref.actor.ppo_mini_batch_size=4", *overrides], run_name="a")
    opening.open_run(p)
    _train_prompts(p.run, 10)
    cfg = plan.resolve_iterations(p)
    assert cfg.trainer.total_iterations == expected and list(p.iterations()) == list(range(1, expected + 1))
    resumed = plan.plan_run(resume=p.run.root)  # the saved number, not derived again
    assert resumed.cfg.trainer.total_iterations == expected
    if "trainer.total_iterations=2" not in overrides:  # a resume that changes the epochs derives it again
        again = plan.plan_run(None, ["trainer.total_epochs=1"], resume=p.run.root)
        assert again.cfg.trainer.total_iterations is None
        steps = 5 if "trainer.total_training_steps=5" in overrides else 1 * (10 // 4)
        assert plan.resolve_iterations(again).trainer.total_iterations == steps


def test_fewer_prompts_than_a_batch_make_one_step_per_epoch_and_val_only_runs_none(tmp_path):
    p = plan.plan_run(None, [f"trainer.runs_root={tmp_path}", "trainer.total_epochs=3"], run_name="a")
    opening.open_run(p)
    _train_prompts(p.run, 10)  # data.train_batch_size is verl's 1024
    assert plan.resolve_iterations(p).trainer.total_iterations == 3  # one smaller step per epoch
    only = plan.plan_run(None, [f"trainer.runs_root={tmp_path}", "trainer.val_only=true"], run_name="b")
    opening.open_run(only)
    _train_prompts(only.run, 10)
    plan.resolve_iterations(only)
    assert list(only.iterations()) == []


def test_val_before_train_and_val_only_follow_verl():
    assert schedule.initial_validation_due(load_config(None).trainer)  # verl's default: validate the initial policy
    assert not schedule.initial_validation_due(load_config(None, ["trainer.val_before_train=false"]).trainer)
    assert plan.stops_after_validation(load_config(None, ["trainer.val_only=true"]).trainer)
    # verl checks val_only only inside the val_before_train branch: without it the run trains
    assert not plan.stops_after_validation(load_config(None, ["trainer.val_only=true",
                                                              "trainer.val_before_train=false"]).trainer)


def test_loggers_say_once_what_is_unavailable(caplog):
    import logging

    cfg = load_config(None, ["trainer.logger=[console,wandb,tensorboard]"])
    with caplog.at_level(logging.WARNING, logger="rlhf.config"):
        plan.note_loggers(cfg)
        plan.note_loggers(cfg)
    lines = [r.getMessage() for r in caplog.records if "wandb" in r.getMessage()]
    assert len(lines) <= 1  # said once per process (an earlier test may have said it already)
    from rlhf_core.notes import said

    assert any("wandb, tensorboard not available here" in line for line in said())
    assert plan.logs_to(cfg, "console") and not plan.logs_to(cfg, "mlflow")


def test_prune_keeps_last_good_and_the_last_save_points(tmp_path):
    cfg = load_config(None, ["trainer.total_iterations=9", "trainer.save_freq=2", "trainer.max_ckpt_to_keep=2"])
    run = RunDir(tmp_path / "run")
    for k in range(1, 8):
        run.checkpoint(k).joinpath("actor").mkdir(parents=True)
        record_stage(run, k, "update", status="done", inputs={}, outputs={}, config_hash="h")
        record_stage(run, k, "guard", status="done", inputs={}, outputs={}, config_hash="h")
    for k in range(1, 7):  # 1..6 committed, 7 not yet
        write_last_good(run, k)
    assert lifecycle.prune_checkpoints(cfg.trainer, run) == [1, 2, 3, 5]
    assert [k for k in range(1, 8) if run.checkpoint(k).exists()] == [4, 6, 7]  # 7: not committed yet
    assert read_manifest(run, 2)["update"]["checkpoint_pruned"] is True


def test_iteration_metrics_merge_stage_metrics_and_timings(tmp_path):
    cfg = load_config(None)
    run = RunDir(tmp_path / "run")
    rows = [{"prompt_id": "p", "sample_index": 0, "iteration": 1, "data_source": "arith", "ground_truth": "1",
             "prompt_token_ids": [1, 2, 3], "response_text": "x", "response_token_ids": [4, 5],
             "response_length": 2, "finish_reason": "stop", "engine": "hf", "sampling_seed": 1}] * 2
    atomic_write_parquet(run.rollout(1), pa.Table.from_pylist(rows, schema=schemas.ROLLOUT), schema=schemas.ROLLOUT)
    record_stage(run, 1, "rollout", status="done", inputs={}, outputs={}, config_hash="h", seconds=2.0,
                 metrics={"response_length/mean": 2.0})
    record_stage(run, 1, "guard", status="done", inputs={}, outputs={}, config_hash="h", seconds=3.0,
                 metrics={"guard/kl_mean": 0.2})
    record_stage(run, 1, "gae", status="rolled_back", inputs={}, outputs={}, config_hash="h", seconds=9.0,
                 metrics={"kl/coef": 5.0})
    record_stage(run, 1, "score", status="done", inputs={}, outputs={}, config_hash="h", seconds=4.0,
                 metrics={"critic/score/mean": 0.75})
    metrics = report.iteration_metrics(cfg.data, run, 1)
    assert metrics["kl/mean"] == 0.2 and "kl/coef" not in metrics  # rolled-back records do not count
    assert metrics["guard/kl_mean"] == 0.2
    assert metrics["reward/mean"] == 0.75  # our name from verl's
    assert metrics["perf/stage_seconds/rollout"] == 2.0 and metrics["perf/iteration_seconds"] == 9.0
    assert metrics["perf/iteration_tokens_per_s"] == pytest.approx(10 / 9.0)
    # verl's timers: the score stage stands in for old_log_prob (it computes old/ref/values at once)
    assert metrics["timing_s/gen"] == 2.0 and metrics["timing_s/old_log_prob"] == 4.0
    assert metrics["timing_s/step"] == 9.0 and "timing_s/ref" not in metrics and "timing_s/adv" not in metrics
    assert metrics["training/global_step"] == 1.0 and metrics["training/epoch"] == 0.0
    assert run.read_json(run.iter_dir(1) / "iteration_metrics.json") == metrics


def test_training_epoch_counts_the_pack_stages_slots(tmp_path):
    cfg = load_config(None)
    run = RunDir(tmp_path / "run")
    record_stage(run, None, "pack", status="done", inputs={}, outputs={}, config_hash="h", rows={"slots": 3})
    for k in (1, 3, 4, 7):
        record_stage(run, k, "rollout", status="done", inputs={}, outputs={}, config_hash="h", seconds=1.0)
    assert [report.iteration_metrics(cfg.data, run, k)["training/epoch"] for k in (1, 3, 4, 7)] == [0, 0, 1, 2]


def test_aliases_fill_either_name():
    assert report.with_aliases({"reward/mean": 0.5})["critic/score/mean"] == 0.5
    both = report.with_aliases({"reward/mean": 0.5, "critic/score/mean": 0.25})
    assert both["reward/mean"] == 0.5 and both["critic/score/mean"] == 0.25  # a stage's own value is kept


def test_alerts_and_table_row():
    cfg = load_config(None, ["trainer.kl_rollback_threshold=0.05"])
    lines = report.alerts(cfg.trainer, {"kl/mean": 0.07, "actor/pg_clipfrac": 0.05}, history=[{"actor/pg_clipfrac": 0.2}])
    assert len(lines) == 2 and "0.0700" in lines[0] and "convergence" in lines[1]
    assert report.alerts(cfg.trainer, {"kl/mean": 0.05, "actor/pg_clipfrac": 0.2}) == []
    header = report.format_iteration_header()
    row = report.format_iteration_row({"iteration": 3, "reward/mean": 0.5, "kl/mean": 0.01})
    assert len(row) == len(header) and row.split()[:2] == ["3", "0.500"] and row.split()[2] == "-"
    # a column that moves in the demo (its clip fraction is 0.000 on every row: issue 29)
    assert header.split() == ["iter", "reward", "acc", "kl", "entropy", "grad_norm", "seconds"]


def test_curve_redrawn_every_curve_freq_after_the_last_and_after_a_rollback(tmp_path):
    from rlhf_core.config import load_config
    from rlhf_core.run.layout import RunDir
    from rlhf_core.run.schedule import curve_due

    cfg = load_config(None, ["trainer.curve_freq=5", "trainer.total_iterations=12"])
    run = RunDir(tmp_path / "run")
    assert [k for k in range(1, 13) if curve_due(cfg.trainer, run, k)] == [5, 10, 12]
    run.append_event("rollback", 3)
    assert curve_due(cfg.trainer, run, 3) and not curve_due(cfg.trainer, run, 4)
    every = load_config(None, ["trainer.total_iterations=3"])
    assert [k for k in range(1, 4) if curve_due(every.trainer, run, k)] == [1, 2, 3]


def test_settle_heap_moves_live_objects_out_of_the_collectors_view():
    import gc

    from flows.pipeline import settle_heap

    try:
        settle_heap()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_stage_reports_one_point_per_metric_in_run_order():
    manifest = {  # dict order is not run order: the order of REPORT_ORDER decides who reports a shared name
        "score": {"status": "done", "metrics": {"response_length/mean": 9.0, "reward/mean": 0.5}, "seconds": 2.0},
        "rollout": {"status": "done", "metrics": {"response_length/mean": 8.0}, "seconds": 1.0},
        "gae": {"status": "rolled_back", "metrics": {"kl/mean": 0.1}, "seconds": 3.0},
    }
    assert report.stage_reports(manifest) == {
        "rollout": {"response_length/mean": 8.0, "perf/stage_seconds/rollout": 1.0},
        "score": {"reward/mean": 0.5, "perf/stage_seconds/score": 2.0},
    }
    with_rolled_back = report.stage_reports(manifest, statuses=("done", "rolled_back"))
    assert with_rolled_back["gae"] == {"kl/mean": 0.1, "perf/stage_seconds/gae": 3.0}
