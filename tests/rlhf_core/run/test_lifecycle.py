"""The iteration lifecycle (rlhf_core.run.lifecycle): settle a verdict (commit moves the commit log;
rollback discards the checkpoint), retry settings, a fall back, and which checkpoint an iteration
started from."""

from __future__ import annotations

import shutil

import pytest

from rlhf_core.config import apply_overrides, load_config
from rlhf_core.errors import CheckpointError
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.control.opening import finish_retry
from rlhf_core.run import lifecycle
from rlhf_core.run.layout import RunDir, StateFileError
from rlhf_core.run.manifest import read_manifest, record_stage
from rlhf_core.run.models import actor_path


def _trained_iteration(run: RunDir, k: int, decision: str) -> None:
    """What gae, update and guard leave for iteration ``k``: their records, a checkpoint, a verdict."""
    run.checkpoint(k).joinpath("actor").mkdir(parents=True)
    for stage in ("gae", "update", "guard"):
        record_stage(run, k, stage, status="done", inputs={}, outputs={}, config_hash="h")
    atomic_write_json(run.verdict(k), {"iteration": k, "kl_mean": 0.7 if decision == "rollback" else 0.01,
                                       "threshold": 0.05, "decision": decision})


# ---------------------------------------------------------------------------------------------
# settle
# ---------------------------------------------------------------------------------------------


def _scales(retry: lifecycle.RetryRecord) -> tuple[float, float]:
    return retry.scale_before, retry.scale


def test_settle_commit_moves_the_commit_log_once(tmp_path):
    run = RunDir(tmp_path / "run")
    _trained_iteration(run, 1, "commit")
    assert lifecycle.settle(run, 1, policy="halt", attempt=1) == "commit"
    record = lifecycle.read_last_good(run)
    assert record["iteration"] == 1 and record["committed"] == [1]
    assert record["checkpoint"] == "iter_1/checkpoint" and lifecycle.last_good_checkpoint(run) == run.checkpoint(1)
    assert "committed" not in read_manifest(run, 1)["guard"]  # the commit log is its only record
    assert lifecycle.settle(run, 1, policy="halt", attempt=1) == "commit"  # a rerun after a crash: no change
    assert lifecycle.committed_iterations(run) == [1]
    assert [e["kind"] for e in run.events()] == ["commit"]
    _trained_iteration(run, 2, "commit")
    lifecycle.settle(run, 2, policy="halt", attempt=1)
    assert lifecycle.committed_iterations(run) == [1, 2] and lifecycle.last_good_iteration(run) == 2
    assert run.events()[-1]["previous_last_good"] == 1


def test_settle_rollback_discards_the_checkpoint(tmp_path):
    run = RunDir(tmp_path / "run")
    _trained_iteration(run, 1, "commit")
    lifecycle.settle(run, 1, policy="halt", attempt=1)
    _trained_iteration(run, 2, "rollback")
    atomic_write_json(run.kl_state(2), {"iteration": 2, "used": {"type": "fixed", "value": 0.01}, "retry_scale": 2.0,
                                        "next": {"type": "fixed", "value": 0.02}})
    atomic_write_json(run.retry_record(2), {"iteration": 2, "attempt": 1, "kl_coef_scale": 2.0, "changes": {},
                                            "id": "x"})

    assert lifecycle.settle(run, 2, policy="retry", attempt=1) == "rollback"
    assert not run.checkpoint(2).exists() and not list(run.iter_dir(2).glob("checkpoint*"))
    assert {s: (r["status"], r["rollback_attempt"]) for s, r in read_manifest(run, 2).items()} == {
        s: ("rolled_back", 1) for s in ("gae", "update", "guard")}
    assert lifecycle.committed_iterations(run) == [1] and run.checkpoint(1).is_dir()  # last-good untouched
    assert lifecycle.read_retry_scale(run, 2) == 2.0  # the retry's decision stays for the next try
    event = run.events()[-1]
    assert event["kind"] == "rollback" and event["last_good"] == 1 and event["kl"] == 0.7
    assert event["policy"] == "retry" and lifecycle.rollback_count(run, 2) == 1
    # settling again (a crash after the rollback) leaves the same state
    lifecycle.settle(run, 2, policy="retry", attempt=1)
    assert not run.checkpoint(2).exists() and lifecycle.committed_iterations(run) == [1]


def test_settle_without_a_verdict_names_the_guard_stage(tmp_path):
    run = RunDir(tmp_path / "run")
    run.checkpoint(1).joinpath("actor").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="rlhf stage guard"):
        lifecycle.settle(run, 1, policy="halt", attempt=1)
    assert lifecycle.read_last_good(run) is None


def test_a_committed_iteration_is_never_rolled_back_nor_an_older_one_committed(tmp_path):
    run = RunDir(tmp_path / "run")
    for k in (1, 2):
        _trained_iteration(run, k, "commit")
    lifecycle.commit_iteration(run, 2)
    with pytest.raises(CheckpointError, match="already committed after it"):
        lifecycle.commit_iteration(run, 1)
    with pytest.raises(CheckpointError, match="never rolled back"):
        lifecycle.rollback_iteration(run, 2, policy="halt", attempt=1)
    assert run.checkpoint(2).is_dir()
    shutil.rmtree(run.checkpoint(1))
    with pytest.raises(CheckpointError, match="actor is missing"):
        lifecycle.commit_iteration(run, 1)


def test_discard_refuses_the_last_good_checkpoint(tmp_path):
    run = RunDir(tmp_path / "run")
    _trained_iteration(run, 1, "commit")
    lifecycle.commit_iteration(run, 1)
    with pytest.raises(CheckpointError, match="last-good"):
        lifecycle.discard_checkpoint(run, 1)


# ---------------------------------------------------------------------------------------------
# retries and falling back
# ---------------------------------------------------------------------------------------------


def test_retry_overrides_divide_lr_and_multiply_the_kl_coefficients(tmp_path):
    """The config changes of a retry (lr, the loss's KL coefficient) are overrides for config.yaml; the
    reward's KL coefficient is scaled in the iteration's retry.json, each retry multiplying the last."""
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=1e-4", "trainer.retry_lr_divisor=10",
                             "trainer.retry_kl_coef_multiplier=4", "algorithm.use_kl_in_reward=true",
                             "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.01"])
    overrides, changes = lifecycle.retry_overrides(cfg)
    assert overrides == ["actor_rollout_ref.actor.optim.lr=1e-05", "actor_rollout_ref.actor.kl_loss_coef=0.04"]
    assert changes["actor_rollout_ref.actor.kl_loss_coef"] == (0.01, 0.04)
    # nothing is written: the caller saves them in one write of config.yaml
    assert not list(tmp_path.iterdir())
    run = RunDir(tmp_path / "run")
    assert lifecycle.read_retry_scale(run, 2) == 1.0
    assert _scales(lifecycle.record_retry(run, 2, 1, changes, 4.0)) == (1.0, 4.0)
    assert _scales(lifecycle.record_retry(run, 2, 2, {}, 4.0)) == (4.0, 16.0)  # again
    record = run.read_json(run.retry_record(2))
    assert record["attempt"] == 2 and record["kl_coef_scale"] == 16.0
    assert _scales(lifecycle.record_retry(run, 3, 1, changes, 1.0)) == (1.0, 1.0)  # no KL in the reward: it stays
    for bad in ('{"kl_coef_scale": 0}', '{"kl_coef_scale": "2"}', "[]"):
        run.retry_record(2).write_text(bad)
        with pytest.raises(StateFileError, match="retry.json is damaged"):
            lifecycle.read_retry_scale(run, 2)


def test_an_unfinished_retry_is_finished_with_its_recorded_values(tmp_path):
    """A kill after retry.json and before the config write and its "retry" event: the resume applies
    the recorded values (where its own command line did not set the key), once."""
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=1e-4", "trainer.retry_lr_divisor=10"])
    run = RunDir(tmp_path / "run")
    _, changes = lifecycle.retry_overrides(cfg)
    retry_id = lifecycle.record_retry(run, 2, 1, changes, 4.0).id
    record = lifecycle.unfinished_retry(run, 2)
    assert record is not None and lifecycle.unfinished_retry(run, 3) is None
    finished, applied = finish_retry(cfg, record)
    assert applied == ["actor_rollout_ref.actor.optim.lr=1e-05"]
    assert finished.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-5)
    assert finish_retry(finished, record)[1] == []  # values, not multiplications: twice is once
    chosen = apply_overrides(cfg, ["actor_rollout_ref.actor.optim.lr=3e-4"])  # the resume's own command line
    assert finish_retry(chosen, record)[1] == []
    run.append_event("retry", 2, attempt=1, changes=changes, retry_id=retry_id)
    assert lifecycle.unfinished_retry(run, 2) is None


def test_fall_back_cuts_the_log_marks_the_later_updates_stale_and_names_what_broke(tmp_path, capsys):
    run = RunDir(tmp_path / "run")
    for k in (1, 2, 3):
        _trained_iteration(run, k, "commit")
        lifecycle.commit_iteration(run, k)
    line = lifecycle.fall_back(run, 1, "iter_2/state.json is missing and cannot be rebuilt (x)")
    assert line == ("iter_2/state.json is missing and cannot be rebuilt (x): falling back to iteration 1; "
                    "iterations 2..3 will be rerun")
    assert capsys.readouterr().err.strip() == f"rlhf: warning: {line}"
    assert lifecycle.committed_iterations(run) == [1]
    for k in (2, 3):
        assert {s: r["status"] for s, r in read_manifest(run, k).items()} == {s: "stale" for s in ("gae", "update",
                                                                                                   "guard")}
    assert run.events()[-1]["kind"] == "fallback" and run.events()[-1]["last_good_before"] == 3


# ---------------------------------------------------------------------------------------------
# which checkpoint an iteration started from / what validation after step k measures
# ---------------------------------------------------------------------------------------------


def test_checkpoint_before_is_the_one_an_iteration_started_from(tmp_path, tiny_model_dir):
    run = RunDir(tmp_path / "run")
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir}"])
    for k in (1, 2, 3):
        run.checkpoint(k).joinpath("actor").mkdir(parents=True)
    lifecycle.commit_iteration(run, 1)
    lifecycle.commit_iteration(run, 3)  # iteration 2 was rolled back: never committed
    assert lifecycle.checkpoint_before(run, 1) is None and actor_path(cfg, run, 1) == tiny_model_dir
    assert lifecycle.checkpoint_before(run, 2) == run.checkpoint(1)
    assert lifecycle.checkpoint_before(run, 3) == run.checkpoint(1)
    assert lifecycle.checkpoint_before(run, 4) == run.checkpoint(3) == actor_path(cfg, run).parent  # = last-good
    # validation after step k measures the policy as it was after k: the latest commit at or before k
    assert [lifecycle.policy_after(run, k) for k in (0, 1, 2, 3)] == [
        None, run.checkpoint(1), run.checkpoint(1), run.checkpoint(3)]
    shutil.rmtree(run.checkpoint(1))  # pruned
    with pytest.raises(CheckpointError, match="pruned"):
        lifecycle.checkpoint_before(run, 2)
