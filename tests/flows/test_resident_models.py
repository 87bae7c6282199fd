"""Resident models (trainer.resident_models) through the real flow: the engines stay loaded, weights
move to the next rollout in memory, a checkpoint is written only at save points, a rollback puts an
in-memory snapshot back — and every table and weight equals the design that reloads everything from
disk and checkpoints every iteration; a crash between save points replays bit for bit."""

from __future__ import annotations

import pytest

from flows.pipeline import PipelineParams, rlhf_pipeline
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import committed_iterations, read_last_good
from rlhf_core.run.manifest import read_manifest

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

DEMO_LR = 1e-5
TOO_HIGH = 10_000  # breaches the KL guard at once (tests/flows/test_rollback_flow.py)


def test_resident_models_train_exactly_what_reloading_every_stage_trains(prefect_server, flow_run, same_tables,
                                                                         same_weights, tmp_path):
    runs = tmp_path / "runs"
    res = RunDir(flow_run(runs, "res", "trainer.save_freq=2", "trainer.test_freq=-1",
                          iterations=3)["run_dir"])
    leg = RunDir(flow_run(runs, "leg", "trainer.resident_models=false",
                          "trainer.test_freq=-1", iterations=3)["run_dir"])
    assert committed_iterations(res) == committed_iterations(leg) == [1, 2, 3]
    same_tables(res, leg, (1, 2, 3))
    same_weights(res.checkpoint(3), leg.checkpoint(3))
    same_weights(res.checkpoint(2), leg.checkpoint(2))
    # durable state only at the save point and at the end; every state has its record
    assert not res.checkpoint(1).exists() and res.checkpoint(2).is_dir() and res.checkpoint(3).is_dir()
    assert all(res.state_record(k).is_file() for k in (1, 2, 3))
    for k in (2, 3):  # the actor, critic and reference were not loaded again: borrowed from memory
        manifest = read_manifest(res, k)
        for stage in ("rollout", "score", "guard"):
            assert "model_load" not in (manifest[stage].get("io") or {}), (k, stage, manifest[stage]["io"])
        assert "checkpoint_write" not in (manifest["update"].get("io") or {})
        assert manifest["update"]["metrics"]["perf/resident"] == 1.0


def test_a_rollback_puts_the_in_memory_snapshot_back(prefect_server, flow_run, same_tables, same_weights, tmp_path):
    runs = tmp_path / "runs"
    breach = [f"actor_rollout_ref.actor.optim.lr={DEMO_LR * TOO_HIGH}", "trainer.on_kl_breach=retry",
              f"trainer.retry_lr_divisor={TOO_HIGH}", "trainer.max_rollbacks=1"]
    dirs = {}
    for name, design in (("res", "true"), ("leg", "false")):
        first = flow_run(runs, name, f"trainer.resident_models={design}",
                         "trainer.test_freq=-1", iterations=1)
        run = RunDir(first["run_dir"])
        done = flow_run(runs, name, *breach, iterations=2, resume=run.root)
        assert done["last_good"]["iteration"] == 2
        kinds = [e["kind"] for e in run.events() if e["iteration"] == 2]
        assert kinds.count("rollback") == 1 and kinds.count("commit") == 1
        dirs[name] = run
    same_tables(dirs["res"], dirs["leg"], (1, 2))
    same_weights(dirs["res"].checkpoint(2), dirs["leg"].checkpoint(2))


@pytest.fixture(scope="module")
def uninterrupted(prefect_server, flow_run, tmp_path_factory) -> RunDir:
    """Four resident iterations, a save point only at 3 (and the end): 1 and 2 live only in memory."""
    runs = tmp_path_factory.mktemp("resident_ref")
    return RunDir(flow_run(runs, "ref", "trainer.save_freq=3", "trainer.test_freq=-1",
                           iterations=4)["run_dir"])


def test_a_crash_between_save_points_replays_to_the_same_bits(killed_run, tmp_path, uninterrupted, same_tables,
                                                             same_weights):
    run = killed_run(tmp_path / "runs", "ref", "trainer.save_freq=3", "trainer.test_freq=-1", iterations=4,
                     at="iter_3/guard.json")
    assert read_last_good(run)["iteration"] == 2
    assert not any(run.checkpoint(k).exists() for k in (1, 2, 3))  # nothing durable but the initial models

    done = rlhf_pipeline(PipelineParams(resume=str(run.root)))
    assert done["last_good"]["iteration"] == 4
    same_tables(run, uninterrupted, (1, 2, 3, 4))
    same_weights(run.checkpoint(4), uninterrupted.checkpoint(4))
    replayed = [k for k in (3,) if "state_replay" in (read_manifest(run, k)["guard"].get("io") or {})]
    assert replayed == [3]  # the guard of 3 needed its actor: rebuilt from the initial models by replay


def test_a_stage_rerun_rebuilds_a_start_state_that_was_not_kept(uninterrupted, score_rerun_rebuilds):
    score_rerun_rebuilds(uninterrupted)
