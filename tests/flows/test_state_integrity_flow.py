"""The seams of the run lifecycle, through the real entry points (`rlhf run`, `rlhf status`, the
pipeline flow), on one tiny two-iteration run copied per case:

- a kill right after the commit's rename (the old commit wrote last_good.json, then the manifest's
  "committed": a kill between left the iteration done but never committed);
- validations a crash skipped are redone on resume, each on its own step's policy; `validate -k 0`
  scores the initial policy, not the current one;
- every state file that can be damaged or deleted gives one clear line and, where one exists, a
  fallback: kl_ctrl.json, last_good.json (garbage, deleted, pointing at a missing iteration), an
  iteration manifest, the last-good checkpoint directory.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.pipeline import PipelineParams, rlhf_pipeline
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import committed_iterations, read_last_good
from rlhf_core.run.manifest import read_manifest

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

CONSOLE_ONLY = "trainer.logger=[console]"


@pytest.fixture
def rlhf(prefect_server, subprocess_env):
    """``rlhf(*args, **env)``: the real command line in a child process, on the test Prefect server."""
    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rlhf_cli.main", *args],
                              env=subprocess_env(PREFECT_API_URL=prefect_server, **env),
                              capture_output=True, text=True, timeout=900)

    return run


@pytest.fixture(scope="module")
def two_iterations(prefect_server, demo_preset, tiny_overrides, tmp_path_factory) -> RunDir:
    """Two committed iterations, validated at 0 and 2 (test_freq=2), every checkpoint kept."""
    root = tmp_path_factory.mktemp("integrity")
    out = rlhf_pipeline(PipelineParams(config=demo_preset, iterations=2, run_name="base",
                                       overrides=tiny_overrides(root / "runs", CONSOLE_ONLY,
                                                                "trainer.val_before_train=true")))
    return RunDir(out["run_dir"])


def _copy(run: RunDir, tmp_path: Path) -> RunDir:
    dst = tmp_path / "runs" / run.root.name
    shutil.copytree(run.root, dst, symlinks=True)
    return RunDir(dst)


# ---------------------------------------------------------------------------------------------
# 1. a kill inside the commit
# ---------------------------------------------------------------------------------------------


def test_a_kill_right_after_the_commit_loses_nothing(rlhf, demo_preset, tiny_overrides, tmp_path):
    """Killed the instant iteration 1's commit is renamed into place: iteration 1 is committed (it is
    never redone), and the resume writes its metrics and continues at 2 from its checkpoint."""
    overrides = tiny_overrides(tmp_path / "runs", CONSOLE_ONLY)
    proc = rlhf("run", "-c", demo_preset, "--run-name", "killed", "--iterations", "2", *overrides,
                 RLHF_FAULT="after_rename:last_good.json")
    assert proc.returncode == 137, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = RunDir(tmp_path / "runs" / "killed")
    assert committed_iterations(run) == [1]
    assert not run.iteration_metrics(1).is_file()  # the kill came before anything that follows a commit

    done = rlhf_pipeline(PipelineParams(resume=str(run.root)))
    assert committed_iterations(run) == [1, 2] and done["last_good"]["iteration"] == 2
    metrics = run.read_json(run.iteration_metrics(1))
    assert metrics["iteration"] == 1.0 and "actor/pg_loss" in metrics
    # iteration 2 started from iteration 1's checkpoint: its update resumed that optimizer state
    assert read_manifest(run, 2)["update"]["status"] == "done"
    assert [e["iteration"] for e in run.events() if e["kind"] == "commit"] == [1, 2]


# ---------------------------------------------------------------------------------------------
# 2. missed validations
# ---------------------------------------------------------------------------------------------


def test_a_resume_redoes_missed_validations_on_their_steps_policy(two_iterations, tmp_path):
    run = _copy(two_iterations, tmp_path)
    before = {k: read_manifest(run, k)["validate"] for k in (0, 2)}
    for k in (0, 2):  # as if the crash came after the commit of 2 and before either validation
        manifest = read_manifest(run, k)
        del manifest["validate"]
        (run.manifest_path(k)).write_text(json.dumps(manifest))
        run.validation(k).unlink()
    rlhf_pipeline(PipelineParams(resume=str(run.root)))
    for k in (0, 2):
        redone = read_manifest(run, k)["validate"]
        assert redone["status"] == "done", k
        assert redone["inputs"] == before[k]["inputs"], k  # the same actor (step k's policy) and prompts
        assert redone["metrics"]["val/accuracy"] == before[k]["metrics"]["val/accuracy"], k
    assert run.read_json(run.iteration_metrics(2))["val/accuracy"] == before[2]["metrics"]["val/accuracy"]


def test_validate_step_zero_scores_the_initial_policy(two_iterations, rlhf, tmp_path):
    run = _copy(two_iterations, tmp_path)
    initial = read_manifest(run, 0)["validate"]
    rows = pq.read_table(run.validation(0)).to_pylist()
    proc = rlhf("stage", "validate", "--local", "--run-dir", str(run.root), "-k", "0", "--force")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = read_manifest(run, 0)["validate"]
    actor_inputs = [key for key in again["inputs"] if "checkpoint" in key]
    assert not actor_inputs, again["inputs"]  # not iteration 2's actor
    assert again["inputs"] == initial["inputs"]
    assert pq.read_table(run.validation(0)).to_pylist() == rows  # the same policy, the same responses


# ---------------------------------------------------------------------------------------------
# 3. state files
# ---------------------------------------------------------------------------------------------


def _status(rlhf, run: RunDir) -> subprocess.CompletedProcess:
    proc = rlhf("status", str(run.root))
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_a_garbage_kl_controller_state_is_one_line_and_falls_back_to_the_checkpoint(two_iterations, rlhf,
                                                                                     tmp_path):
    run = _copy(two_iterations, tmp_path)
    saved = run.read_json(run.checkpoint(2) / "trainer_state.json")["kl_ctrl"]
    run.kl_ctrl_path.write_text("{not json")
    proc = _status(rlhf, run)
    assert proc.returncode == 0 and "kl_ctrl.json is damaged" in proc.stdout, proc.stdout
    proc = rlhf("run", "--resume", str(run.root), "--iterations", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "using the last-good checkpoint's KL controller state" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert run.read_json(run.kl_snapshot(3))["state"] == saved  # iteration 3 started from the recovered state
    assert committed_iterations(run) == [1, 2, 3]


@pytest.mark.parametrize("damage", ["garbage", "deleted"])
def test_a_lost_commit_log_is_rebuilt_from_the_verdicts(two_iterations, rlhf, tmp_path, damage):
    run = _copy(two_iterations, tmp_path)
    if damage == "garbage":
        run.last_good_path.write_text("\x00\x01 not a commit log")
    else:
        run.last_good_path.unlink()
    proc = _status(rlhf, run)
    assert proc.returncode == 0 and "problem:" in proc.stdout and "last_good.json" in proc.stdout, proc.stdout
    rlhf_pipeline(PipelineParams(resume=str(run.root)))  # nothing left to train: iterations 1-2 stay as they are
    record = read_last_good(run)
    assert record["committed"] == [1, 2] and record["iteration"] == 2
    assert [e for e in run.events() if e["kind"] == "commit_log_rebuilt"]
    assert not (run.iter_dir(3)).exists()  # not restarted from iteration 1, nothing trained twice
    assert read_manifest(run, 1)["update"].get("status") == "done"


def test_a_commit_log_naming_a_missing_iteration_falls_back(two_iterations, tmp_path):
    run = _copy(two_iterations, tmp_path)
    record = read_last_good(run)
    json.dumps(record)
    run.last_good_path.write_text(json.dumps({**record, "iteration": 7, "checkpoint": "iter_7/checkpoint",
                                              "committed": [1, 2, 7]}))
    done = rlhf_pipeline(PipelineParams(resume=str(run.root), iterations=2))
    assert done["last_good"]["iteration"] == 2 and committed_iterations(run) == [1, 2]
    assert [e for e in run.events() if e["kind"] == "checkpoint_corrupt_fallback"]


def test_a_deleted_last_good_checkpoint_is_replayed_from_its_record(two_iterations, tmp_path):
    run = _copy(two_iterations, tmp_path)
    before = {p.name: p.read_bytes() for p in (run.checkpoint(2) / "actor").glob("*.safetensors")}
    shutil.rmtree(run.checkpoint(2))
    done = rlhf_pipeline(PipelineParams(resume=str(run.root), iterations=3))
    assert not [e for e in run.events() if e["kind"] == "checkpoint_corrupt_fallback"]
    # nothing is lost: iteration 3 started from iteration 2's state, rebuilt from iteration 1's
    # checkpoint and 2's record, the same bytes
    assert done["last_good"]["iteration"] == 3
    assert {p.name: p.read_bytes() for p in (run.checkpoint(2) / "actor").glob("*.safetensors")} == before


def test_a_deleted_last_good_checkpoint_and_record_fall_back_to_the_previous_intact_one(two_iterations, tmp_path):
    run = _copy(two_iterations, tmp_path)
    shutil.rmtree(run.checkpoint(2))
    run.state_record(2).unlink()  # no way left to rebuild it
    done = rlhf_pipeline(PipelineParams(resume=str(run.root)))
    fallback = [e for e in run.events() if e["kind"] == "checkpoint_corrupt_fallback"]
    assert fallback and fallback[0]["corrupt_iteration"] == 2 and "is missing" in fallback[0]["message"]
    assert not read_manifest(run, 2)["update"].get("checkpoint_pruned")  # not reported as pruned
    # iteration 2 was rerun from iteration 1's checkpoint and committed again
    assert done["last_good"]["iteration"] == 2 and (run.checkpoint(2) / "actor").is_dir()


def test_a_deleted_iteration_manifest_is_shown_not_hidden(two_iterations, rlhf, tmp_path):
    run = _copy(two_iterations, tmp_path)
    run.manifest_path(1).unlink()
    proc = _status(rlhf, run)
    assert proc.returncode == 0
    assert f"{run.manifest_path(1)} is missing" in proc.stdout, proc.stdout
    run.manifest_path(2).write_text("][")
    proc = _status(rlhf, run)
    assert proc.returncode == 0 and "manifest.json is damaged" in proc.stdout, proc.stdout
