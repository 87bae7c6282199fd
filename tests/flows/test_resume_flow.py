"""A process killed in the middle of iteration 2 (after the update, before the guard's verdict) and
`rlhf run --resume` finish the run with nothing lost: finished stages are reused, not redone (the
update's state, which was only in memory, is rebuilt from its record by replay) — with a critic
(gae) and without one (grpo). And a kill in iteration 5 of 6 at save_freq=3 resumes to every
metric of the uninterrupted run (issue 28, 10)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from flows.pipeline import PipelineParams, rlhf_pipeline
from rlhf_core.run.lifecycle import read_last_good
from rlhf_core.run.layout import RunDir
from rlhf_core.control.status import status_table
from tasks import mlflow_tracking

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]


def digest(path) -> str:
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    return hashlib.sha256(b"".join(hashlib.sha256(p.read_bytes()).digest()
                                   for p in sorted(path.rglob("*")) if p.is_file())).hexdigest()


ESTIMATORS = {"gae": (), "grpo": ("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2")}
"""PPO with its critic, and a critic-free run (no critic anywhere: the resume path is the same)."""


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_kill_during_an_iteration_then_resume(prefect_server, demo_preset, tiny_overrides, tmp_path, subprocess_env,
                                              estimator):
    first = rlhf_pipeline(PipelineParams(config=demo_preset, overrides=tiny_overrides(tmp_path / "runs",
                                                                                      *ESTIMATORS[estimator]),
                                         iterations=1, run_name="crash"))
    run = RunDir(first["run_dir"])

    # a separate process continues to iteration 2 and dies (like SIGKILL) just before the guard's
    # verdict file is renamed into place
    env = subprocess_env(PREFECT_API_URL=prefect_server, RLHF_FAULT="before_rename:guard.json")
    proc = subprocess.run([sys.executable, "-m", "rlhf_cli.main", "run", "--resume", str(run.root), "--iterations", "2"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 137, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert read_last_good(run)["iteration"] == 1
    finished = {s: r for s, r in _row(run, 2).items()}
    assert [finished[s] for s in ("rollout", "score", "gae", "update", "guard")] == ["done"] * 4 + ["-"]
    # resident models: the update's state was only in memory (its record is on disk, no checkpoint)
    assert run.state_record(2).is_file() and not run.checkpoint(2).exists()
    kept = {name: digest(path) for name, path in (("rollout", run.rollout(2)), ("scored", run.scored(2)),
                                                   ("advantages", run.advantages(2)), ("state", run.state_record(2)))}
    assert run.lock_path.exists()  # left behind by the dead process

    done = rlhf_pipeline(PipelineParams(resume=str(run.root)))
    assert done["last_good"]["iteration"] == 2 and done["mlflow_run_id"] == first["mlflow_run_id"]
    row = _row(run, 2)
    assert [row[s] for s in ("rollout", "score", "gae", "update", "guard")] == ["skipped"] * 4 + ["committed"]
    assert {name: digest(path) for name, path in (("rollout", run.rollout(2)), ("scored", run.scored(2)),
                                                  ("advantages", run.advantages(2)),
                                                  ("state", run.state_record(2)))} == kept
    assert run.checkpoint(2).is_dir()  # the guard rebuilt it by replaying the update (checked against the record)
    assert not list(run.root.rglob("*.tmp-*"))
    kinds = [e["kind"] for e in run.events()]
    assert "stale_lock_cleared" in kinds and kinds.count("resume") == 2
    # the KL controller: iteration 2's gae (kept) started from committed iteration 1's state
    assert run.read_json(run.kl_state(2))["used"] == run.read_json(run.kl_state(1))["next"]
    # one MLflow run, each iteration's metrics logged once
    for key in ("reward/mean", "kl/mean", "actor/pg_loss"):
        assert [s for s, _ in mlflow_tracking.metric_history(first["mlflow_run_id"], key)] == [1, 2], key
    if estimator == "grpo":
        # a KL breach without a critic: rolled back from the in-memory snapshot, retried at a smaller lr
        breach = ["actor_rollout_ref.actor.optim.lr=1.0", "trainer.on_kl_breach=retry",
                  "trainer.retry_lr_divisor=100000", "trainer.max_rollbacks=1"]
        assert rlhf_pipeline(PipelineParams(resume=str(run.root), overrides=breach, iterations=3))["last_good"][
            "iteration"] == 3
        kinds = [e["kind"] for e in run.events() if e["iteration"] == 3 and e["kind"] != "resume"]
        assert kinds[:3] == ["rollback", "retry", "commit"], kinds
    critic_files = [p for p in run.root.rglob("*critic*")]
    if estimator == "grpo":  # nothing of a critic was built, scored, trained or saved
        assert critic_files == [] and not mlflow_tracking.metric_history(first["mlflow_run_id"], "critic/vf_loss")
        assert run.read_json(run.checkpoint(2) / "trainer_state.json")["sources"]["critic"] is None
    else:
        assert (run.checkpoint(2) / "critic").is_dir() and critic_files


def _row(run, iteration):
    """The status row of one iteration (iteration 0 holds the initial policy's validation)."""
    return {r["iteration"]: r for r in status_table(run)}[iteration]


TIMING = ("perf/", "timing_s/")
"""Metrics that measure time, memory or the machine: the only ones a resume may change."""


def _numbers(run: RunDir, k: int) -> dict:
    return {key: value for key, value in run.read_json(run.iteration_metrics(k)).items() if not key.startswith(TIMING)}


RESUME_VALIDATION = ("val/", "val-core/")
"""The metrics of the validation a resume runs on the policy it continues from (verl's val_before_train)."""

SAVE_EVERY_3 = ("trainer.save_freq=3", "trainer.test_freq=-1", "trainer.logger=[console]")


@pytest.fixture(scope="module")
def six_iterations(prefect_server, flow_run, tmp_path_factory) -> RunDir:
    """Six uninterrupted iterations with a save point every 3 (and at the end)."""
    return RunDir(flow_run(tmp_path_factory.mktemp("six"), "run", *SAVE_EVERY_3, iterations=6)["run_dir"])


@pytest.mark.parametrize("at", ["iter_5/scored.parquet", "iter_5/guard.json"])
def test_a_kill_in_iteration_5_between_save_points_resumes_to_the_same_numbers(six_iterations, killed_run, rlhf,
                                                                               tmp_path, at):
    """Killed in iteration 5 of 6 with a save point every 3: iteration 4 lived only in memory. The
    resume rebuilds it from checkpoint 3 by replay (and, killed before the verdict, iteration 5's
    update too), and every iteration's numbers (every metric but timings) equal the uninterrupted
    run's, bit for bit."""
    run = killed_run(tmp_path / "runs", "run", *SAVE_EVERY_3, iterations=6, at=at)
    assert read_last_good(run)["iteration"] == 4 and not run.checkpoint(4).exists()
    proc = rlhf("run", "--resume", str(run.root))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for k in range(1, 7):
        got, want = _numbers(run, k), _numbers(six_iterations, k)
        if k == 4:  # the resume validated the policy it continues from (val_before_train), recorded at its iteration
            assert set(got) - set(want) == {key for key in got if key.startswith(RESUME_VALIDATION)}
            got = {key: value for key, value in got.items() if key in want}
        assert got == want, (k, {key: (got.get(key), want.get(key)) for key in set(got) | set(want)
                                 if got.get(key) != want.get(key)})
