"""The KL-breach task's policy (retry with smaller steps, or halt) on a rolled-back run directory."""

from __future__ import annotations

import pytest

from rlhf_core.config import apply_overrides, load_config, to_yaml
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.run.manifest import record_stage
from rlhf_core.run.lifecycle import commit_iteration as write_last_good
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.control.plan import resolve_run_config
from tasks.breach import handle_breach_task


def _rolled_back_run(tmp_path, *overrides):
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=1e-3", "trainer.retry_lr_divisor=100",
                             "trainer.retry_kl_coef_multiplier=2", "algorithm.use_kl_in_reward=true", *overrides])
    run = RunDir(tmp_path / "run")
    run.checkpoint(1).joinpath("actor").mkdir(parents=True)
    write_last_good(run, 1)
    write_config(run, to_yaml(cfg))
    record_stage(run, 2, "update", status="rolled_back", inputs={}, outputs={}, config_hash="h")
    atomic_write_json(run.verdict(2), {"kl_mean": 0.7, "threshold": 0.05, "decision": "rollback"})
    return cfg, run


def test_retry_lowers_the_learning_rate_and_raises_the_kl_coefficient(tmp_path):
    cfg, run = _rolled_back_run(tmp_path, "trainer.on_kl_breach=retry", "trainer.max_rollbacks=2")
    outcome = handle_breach_task.fn(cfg, str(run.root), 2, attempt=1)
    assert outcome["action"] == "retry"
    assert outcome["changes"]["actor_rollout_ref.actor.optim.lr"] == pytest.approx((1e-3, 1e-5))
    assert outcome["overrides"] == ["actor_rollout_ref.actor.optim.lr=1e-05"]  # config only: no β in it
    assert outcome["changes"]["iter_2/retry.json kl_coef_scale"] == (1.0, 2.0)
    saved = resolve_run_config(run.root, None, [])  # a resume continues with the smaller step and the larger KL
    assert saved.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-5)
    assert "kl_coef_scale" not in run.config_path.read_text()  # β is not config
    record = run.read_json(run.retry_record(2))
    assert record["kl_coef_scale"] == 2.0 and record["attempt"] == 1
    assert [e["kind"] for e in run.events()] == ["commit", "retry"]  # commit: iteration 1, by the setup
    assert run.events()[-1]["retry_id"] == record["id"]  # the config write is done: the retry is finished
    again = handle_breach_task.fn(apply_overrides(cfg, outcome["overrides"]), str(run.root), 2, attempt=2)
    assert again["changes"]["iter_2/retry.json kl_coef_scale"] == (2.0, 4.0)
    assert run.read_json(run.retry_record(2))["kl_coef_scale"] == 4.0


def test_retries_are_bounded_then_the_run_halts(tmp_path):
    cfg, run = _rolled_back_run(tmp_path, "trainer.on_kl_breach=retry", "trainer.max_rollbacks=2")
    outcome = handle_breach_task.fn(cfg, str(run.root), 2, attempt=3)
    assert outcome["action"] == "halt"
    assert "trainer.max_rollbacks=2" in outcome["message"] and f"rlhf run --resume {run.root}" in outcome["message"]
    assert "last-good is iteration 1" in outcome["message"]


def test_halt_policy_halts_at_once(tmp_path):
    cfg, run = _rolled_back_run(tmp_path, "trainer.on_kl_breach=halt")
    outcome = handle_breach_task.fn(cfg, str(run.root), 2, attempt=1)
    assert outcome["action"] == "halt" and "KL(actor‖ref) = 0.7 > trainer.kl_rollback_threshold = 0.05 (" in outcome["message"]
    assert resolve_run_config(run.root, None, []) == cfg  # nothing changed for a retry
    assert not run.retry_record(2).exists()
