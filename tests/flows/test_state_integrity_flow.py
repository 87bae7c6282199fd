"""The seams of the run lifecycle, through the real entry points (`rlhf run`, `rlhf status`, `rlhf
export`, `rlhf stage`, the pipeline flow), on one tiny three-iteration run copied per case:

- a kill right after the commit's rename (the old commit wrote last_good.json, then the manifest's
  "committed": a kill between left the iteration done but never committed);
- validations a crash skipped are redone on resume, each on its own step's policy; `validate -k 0`
  scores the initial policy, not the current one;
- nothing durable is trusted unverified (issue 28): every committed artifact that is deleted,
  damaged or changed — a table, the KL controller state, a state record, a checkpoint, the commit
  log, a manifest — is named by `rlhf status` with what a resume will do, and the resume (and an
  export) rebuilds it by rerunning the stage that wrote it, checked against the hash recorded when
  it was written, or falls back, in one line; the KL controller's state is an output of gae, so
  deleting or damaging it never resets the coefficient; a retry's changes are one write; a failed
  background checkpoint write stops the run before the next commit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from flows.pipeline import PipelineParams, rlhf_pipeline
from rlhf_cli.main import main
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import committed_iterations, read_last_good
from rlhf_core.run.manifest import read_manifest
from rlhf_core.control.plan import resolve_run_config

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

CONSOLE_ONLY = "trainer.logger=[console]"


@pytest.fixture(scope="module")
def base(prefect_server, demo_preset, tiny_overrides, tmp_path_factory) -> RunDir:
    """Three committed iterations, validated at 0, 2 and 3 (test_freq=2, and the last), every
    checkpoint kept (save_freq=1), so a test makes an iteration live only in its record by deleting
    its checkpoint directory."""
    root = tmp_path_factory.mktemp("integrity")
    out = rlhf_pipeline(PipelineParams(config=demo_preset, iterations=3, run_name="base",
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


def test_a_resume_redoes_missed_validations_on_their_steps_policy(base, tmp_path):
    run = _copy(base, tmp_path)
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


def test_validate_step_zero_scores_the_initial_policy(base, cli, tmp_path):
    run = _copy(base, tmp_path)
    initial = read_manifest(run, 0)["validate"]
    rows = pq.read_table(run.validation(0)).to_pylist()
    proc = cli("stage", "validate", "--local", "--run-dir", str(run.root), "-k", "0", "--force")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = read_manifest(run, 0)["validate"]
    actor_inputs = [key for key in again["inputs"] if "checkpoint" in key]
    assert not actor_inputs, again["inputs"]  # not iteration 2's actor
    assert again["inputs"] == initial["inputs"]
    assert pq.read_table(run.validation(0)).to_pylist() == rows  # the same policy, the same responses


# ---------------------------------------------------------------------------------------------
# 3. nothing durable is trusted unverified
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def cli(prefect_server, capsys):
    """``cli(*args)``: the `rlhf` command line in this process (its ``main``, as the console script
    calls it), on the test Prefect server; returns its exit status and what it printed. A kill needs
    a process of its own: ``rlhf`` (tests/flows/conftest.py)."""
    def run(*args: str) -> SimpleNamespace:
        capsys.readouterr()
        code = main(list(args))
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


def _status(cli, run: RunDir) -> SimpleNamespace:
    proc = cli("status", str(run.root))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    return proc


def _problems(proc) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.startswith("problem:")]


def _resume(cli, run: RunDir, iterations: int, *overrides: str) -> SimpleNamespace:
    proc = cli("run", "--resume", str(run.root), "--iterations", str(iterations), *overrides)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def _warnings(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("rlhf: warning:")]


def _metrics(run: RunDir, k: int) -> dict:
    return run.read_json(run.iteration_metrics(k))


def _flip_byte(path: Path, offset: int = 4000) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _tamper(path: Path, column: str) -> None:
    """Rewrite one float column of a table, as an edit by hand would (a valid Parquet file)."""
    import pyarrow as pa

    table = pq.read_table(path)
    field = table.schema.field(column)
    values = table.column(column).to_pylist()
    changed = [[x * 2 + 1 for x in v] if isinstance(v, list) else v * 2 + 1 for v in values]
    pq.write_table(table.set_column(table.schema.get_field_index(column), field, pa.array(changed, field.type)), path)


def test_a_deleted_kl_controller_state_is_rebuilt_not_reset(base, cli, tmp_path):
    """Issue 28, 1: the KL state iteration 4 starts from is iteration 3's gae output; deleted, `rlhf
    status` names it and the resume reruns that gae to the same bytes, so iteration 4 uses the
    coefficient the controller handed on, not algorithm.kl_ctrl.kl_coef."""
    run = _copy(base, tmp_path)
    kept = run.kl_state(3).read_bytes()
    run.kl_state(3).unlink()
    [problem] = _problems(_status(cli, run))
    assert "iter_3/kl_ctrl.json is missing; a resume reruns gae of iteration 3" in problem
    proc = _resume(cli, run, 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _warnings(proc) == ["rlhf: warning: iter_3/kl_ctrl.json is missing: rebuilt by rerunning gae of "
                               "iteration 3 (the same bytes as recorded)"]
    assert run.kl_state(3).read_bytes() == kept
    assert _metrics(run, 4)["kl/coef"] == _metrics(run, 3)["kl/coef_next"] != 0.2  # not kl_ctrl.kl_coef


def test_a_damaged_kl_controller_state_of_a_replayed_iteration_is_rebuilt(base, cli, tmp_path, same_weights):
    """Issue 28, 5: garbage in the KL state of last-good 3, whose checkpoint is gone (a replay is
    due): status, export and resume say the same thing; the export rebuilds it and replays iteration
    3 (the replay never reads the KL state) to the same weights, and the resume finds nothing left."""
    run = _copy(base, tmp_path)
    run.kl_state(3).write_text("{not json")
    shutil.rmtree(run.checkpoint(3))
    [problem] = _problems(_status(cli, run))
    assert problem.startswith("problem: iter_3/kl_ctrl.json changed since gae wrote it") and \
        "a resume reruns gae of iteration 3" in problem
    proc = cli("export", str(run.root))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "iter_3/kl_ctrl.json changed since gae wrote it" in proc.stderr
    assert run.read_json(run.kl_state(3)) == base.read_json(base.kl_state(3))
    same_weights(run.checkpoint(3), base.checkpoint(3))  # replayed to the same bits, then exported
    proc = _resume(cli, run, 3)
    assert proc.returncode == 0 and not _warnings(proc), proc.stderr[-3000:]
    assert not _problems(_status(cli, run))


def test_a_kill_inside_the_retry_bookkeeping_retries_once(base, rlhf, cli, tmp_path):
    """Issue 28, 2 (issue 40: two writes now): killed after the retry recorded its decision in
    iter_4/retry.json and before its config change was saved, the resume finishes it with the
    recorded values and reruns the iteration once: iteration 4's coefficient is doubled once (not
    twice) and its learning rate divided once."""
    run = _copy(base, tmp_path)
    breach = ["actor_rollout_ref.actor.optim.lr=0.1", "trainer.on_kl_breach=retry", "trainer.retry_lr_divisor=10000",
              "trainer.max_rollbacks=2"]
    proc = rlhf("run", "--resume", str(run.root), "--iterations", "4", *breach, RLHF_FAULT="retry:before_config")
    assert proc.returncode == 137, proc.stderr[-3000:]
    proc = _resume(cli, run, 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert committed_iterations(run) == [1, 2, 3, 4]
    assert _metrics(run, 4)["kl/coef"] == pytest.approx(2 * _metrics(run, 3)["kl/coef_next"])
    saved = run.read_json(run.kl_state(4))
    assert saved["used"] == run.read_json(run.kl_state(3))["next"] and saved["retry_scale"] == 2.0
    assert run.read_json(run.retry_record(4))["kl_coef_scale"] == 2.0
    assert "kl_coef_scale" not in run.config_path.read_text()  # β is not config
    assert [e.get("finished_by") for e in run.events() if e["kind"] == "retry"] == ["resume"]  # recorded, then finished
    assert resolve_run_config(run.root, None, ()).actor_rollout_ref.actor.optim.lr == pytest.approx(1e-5)
    # Issue 49, 9: the committed retry's record edited (scale 2 → 4) and the KL state deleted: the resume
    # fell back to the initial models and retrained every iteration with the edited scale. It refuses now.
    record = run.read_json(run.retry_record(4))
    run.retry_record(4).write_text(json.dumps({**record, "kl_coef_scale": 4.0}))
    run.kl_state(4).unlink()
    events = len(run.events())
    proc = _resume(cli, run, 5)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = ("iter_4/retry.json was edited after iteration 4's gae read it (iteration 4 trained with what it said, and "
            "a retry's record is never edited)")
    errors = [e for e in proc.stderr.splitlines() if e.startswith("rlhf: error:")]
    assert errors == [f"rlhf: error: cannot resume {run.root}: {line}; put the file back as the retry wrote it (or "
                      "start a new run)"], proc.stderr[-3000:]
    assert len(run.events()) == events and committed_iterations(run) == [1, 2, 3, 4]
    assert f"problem: {line}; a resume refuses: put the file back as the retry wrote it" in _problems(_status(cli, run))


def test_a_kill_inside_a_retry_grants_no_more_retries(base, rlhf, cli, tmp_path):
    """Issue 49, 6: killed just after iter_4/retry.json was written, the resume restarted the attempt
    count: 3 retries instead of trainer.max_rollbacks=2, β scaled 8× instead of 4×, and the halt line
    still said "2 retries used". The count lives in the retry record: 2 retries in all, β 4×."""
    run = _copy(base, tmp_path)
    breach = ["trainer.kl_rollback_threshold=1e-12", "trainer.on_kl_breach=retry", "trainer.max_rollbacks=2"]
    proc = rlhf("run", "--resume", str(run.root), "--iterations", "4", *breach, RLHF_FAULT="retry:before_config")
    assert proc.returncode == 137, proc.stderr[-3000:]
    assert run.read_json(run.retry_record(4))["attempt"] == 1
    proc = _resume(cli, run, 4, *breach)
    assert proc.returncode != 0 and "trainer.max_rollbacks=2 retries used" in proc.stderr, proc.stderr[-3000:]
    assert committed_iterations(run) == [1, 2, 3]
    record = run.read_json(run.retry_record(4))
    assert record["attempt"] == 2 and record["kl_coef_scale"] == 4.0
    assert [e["attempt"] for e in run.events() if e["kind"] == "retry"] == [1, 2]
    assert [e.get("attempt") for e in run.events() if e["kind"] == "rollback" and e["iteration"] == 4] == [1, 2, 3]


def test_a_resume_in_another_dtype_than_the_run_trained_in_is_one_line(base, cli, tmp_path):
    """Issue 49, 1: the dtype is part of the run. A resume (or a stage rerun) configured for another
    dtype than the checkpoints recorded refuses in one line naming both, before any work."""
    run = _copy(base, tmp_path)
    events = len(run.events())
    key = "actor_rollout_ref.actor.deepspeed_config.dtype"
    proc = _resume(cli, run, 4, f"{key}=bf16")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert errors == [f"rlhf: error: {key}=bf16, but this run trained in fp32 (recorded with iter_3/checkpoint): "
                      f"resuming would mix dtypes; resume with {key}=fp32 (or auto), or start a new run to train in "
                      "bf16"], proc.stderr[-3000:]
    assert committed_iterations(run) == [1, 2, 3] and not run.iter_dir(4).exists()
    proc = cli("stage", "update", "--local", "--run-dir", str(run.root), "--iteration", "3", "--force", f"{key}=bf16")
    assert proc.returncode == 2 and "this run trained in fp32" in proc.stderr, proc.stderr[-3000:]
    assert [e["kind"] for e in run.events()[events:]] in ([], ["resume"])


def test_a_resume_whose_data_changed_refuses_before_any_work(cli, demo_preset, tiny_overrides, tmp_path):
    """Issue 49, 3: one answer edited in the data file after a run: the resume re-preprocessed without
    a word and trained iteration 2 on the new ground truth. Now it refuses in one line naming the file
    and the commands, before any work; the same for a resume pointed at other data files."""
    data = tmp_path / "train.jsonl"
    shutil.copy(Path(__file__).parents[2] / "data" / "arith" / "demo.jsonl", data)
    proc = cli("run", "-c", demo_preset, "--iterations", "1", "--run-name", "data",
               *tiny_overrides(tmp_path / "runs", f"data.train_files=[{data}]", "trainer.logger=[console]"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunDir(tmp_path / "runs" / "data")
    lines = data.read_text().splitlines()
    row = json.loads(lines[5])
    lines[5] = json.dumps({**row, "answer": row["answer"].replace("####", "#### 1")})
    data.write_text("\n".join(lines) + "\n")
    events = len(run.events())
    proc = _resume(cli, run, 2)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert errors == [f"rlhf: error: cannot resume {run.root}: data file {data} changed since preprocess read it "
                      "(iteration 1 trained on its old rows; resuming would train on new rows after old ones); put "
                      f"the old data back to resume, or retrain on the new data with `rlhf stage preprocess "
                      f"--run-dir {run.root}` then `rlhf rebuild {run.root}`, or start a new run"], proc.stderr[-3000:]
    assert len(run.events()) == events and not run.iter_dir(2).exists()
    assert _problems(_status(cli, run)) == [f"problem: {errors[0].removeprefix('rlhf: error: ')}"]
    other = tmp_path / "other.jsonl"
    shutil.copy(data, other)
    proc = _resume(cli, run, 2, f"data.train_files=[{other}]")
    assert proc.returncode == 2 and f"the data files are now {other}, not {data}" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("how", ["copied", "symlinked"])
def test_a_checkpoint_that_is_not_the_runs_own_is_never_trained_on_or_exported(base, cli, tmp_path, same_weights,
                                                                               how):
    """Issue 49, 2: last-good's checkpoint replaced by a copy of another one (whole by its own
    manifest), or by a symbolic link to one: status called it last-good and export exported the other
    weights with exit 0. Now its lineage id (saved in its trainer_state.json) disagrees with the run's
    record: status names it, the export rebuilds the real one by replaying and exports that, and the
    link is removed without touching what it pointed at."""
    run = _copy(base, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run.checkpoint(2), elsewhere)
    shutil.rmtree(run.checkpoint(3))
    if how == "copied":
        shutil.copytree(elsewhere, run.checkpoint(3))
    else:
        run.checkpoint(3).symlink_to(elsewhere, target_is_directory=True)
    proc = _status(cli, run)
    [row] = [line for line in proc.stdout.splitlines() if line.split()[:1] == ["3"]]
    assert row.split()[-1] == "damaged"  # never "last-good"
    [problem] = _problems(proc)
    said = ("is a symbolic link (to " if how == "symlinked" else "is not this run's own: it holds state ")
    assert problem.startswith(f"problem: iter_3/checkpoint {said}"), problem
    assert problem.endswith("a resume rebuilds it by replaying iteration 3's update"), problem
    proc = cli("export", str(run.root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(f"iter_3/checkpoint {said}" in line for line in _warnings(proc)), proc.stderr[-3000:]
    assert not run.checkpoint(3).is_symlink()
    same_weights(run.checkpoint(3), base.checkpoint(3))
    same_weights(elsewhere, base.checkpoint(2))  # what the link pointed at is untouched
    from safetensors.torch import load_file

    exported, real = (load_file(str(d / "model.safetensors")) for d in (run.exported_actor, base.checkpoint(3) / "actor"))
    assert all(exported[k].equal(real[k]) for k in real)
    assert not _problems(_status(cli, run))


def test_a_damaged_last_good_checkpoint_is_rebuilt_never_exported(base, cli, tmp_path, same_weights):
    """Issue 28, 3: a byte flipped in last-good's actor weights and its rank shard truncated: status,
    export and resume agree that the checkpoint is damaged; the export rebuilds it by replaying its
    update (checked against its record) and exports the real weights; a resume then finds nothing
    left to do (it used to rerun the same iteration on every resume)."""
    run = _copy(base, tmp_path)
    _flip_byte(run.checkpoint(3) / "actor" / "model.safetensors")
    shard = run.checkpoint(3) / "deepspeed" / "actor_shard.rank0-of-1.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    proc = _status(cli, run)
    [row] = [line for line in proc.stdout.splitlines() if line.split()[:1] == ["3"]]
    assert row.split()[-1] == "damaged"  # the ckpt column: never "last-good"
    [problem] = _problems(proc)
    assert problem.startswith("problem: iter_3/checkpoint is damaged (checkpoint file ") and \
        problem.endswith("a resume rebuilds it by replaying iteration 3's update")
    proc = cli("export", str(run.root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = _warnings(proc)
    assert "iter_3/checkpoint is damaged" in line and line.endswith("rebuilt by replaying iteration 3's update from "
                                                                     "its record")
    same_weights(run.checkpoint(3), base.checkpoint(3))
    from safetensors.torch import load_file

    exported, real = (load_file(str(d / "model.safetensors")) for d in (run.exported_actor, base.checkpoint(3) / "actor"))
    assert all(exported[k].equal(real[k]) for k in real)
    proc = _resume(cli, run, 3)
    assert proc.returncode == 0 and not _warnings(proc), proc.stderr[-3000:]
    assert not [e for e in run.events() if e["kind"] == "fallback"]


def test_a_failed_background_checkpoint_write_stops_the_run_before_the_next_commit(base, cli, tmp_path, monkeypatch):
    """Issue 28, 4: the disk fills while iteration 4's checkpoint is written in the background:
    iteration 5 is not committed on top of it; one line names the write and the resume, which
    finishes the run from iteration 4's record."""
    run = _copy(base, tmp_path)
    monkeypatch.setenv("RLHF_FAULT", "enospc@before_rename:iter_4/checkpoint")
    proc = _resume(cli, run, 5)
    monkeypatch.delenv("RLHF_FAULT")
    assert proc.returncode == 2, proc.stderr[-3000:]
    [error] = [line for line in proc.stderr.splitlines() if line.startswith("rlhf: error:")]
    assert "iter_4/checkpoint in the background failed" in error and f"rlhf run --resume {run.root}" in error
    assert committed_iterations(run) == [1, 2, 3, 4] and not run.checkpoint(4).exists()
    proc = _resume(cli, run, 5)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert committed_iterations(run) == [1, 2, 3, 4, 5] and run.checkpoint(5).is_dir()


@pytest.mark.parametrize("damage", ["deleted advantages", "tampered advantages", "tampered state record"])
def test_a_damaged_replay_input_is_rebuilt_before_the_replay(base, cli, tmp_path, same_weights, damage):
    """Issue 28, 6 and 7: iterations 2 and 3 live only in their records (checkpoints deleted) and
    iteration 2's replay input is deleted or changed: status names it; the export (which needs
    last-good on disk) reruns the stage that wrote it (the same bytes as recorded), then replays 2
    and 3 from checkpoint 1 to the same weights — never a traceback, a dead end or a replay of a
    changed table — and status finds nothing left."""
    run = _copy(base, tmp_path)
    for k in (2, 3):
        shutil.rmtree(run.checkpoint(k))
    if damage == "deleted advantages":
        run.advantages(2).unlink()
    elif damage == "tampered advantages":
        _tamper(run.advantages(2), "advantages")
    else:
        record = json.loads(run.state_record(2).read_text())
        record["config"]["actor_rollout_ref"]["actor"]["optim"]["lr"] *= 3
        run.state_record(2).write_text(json.dumps(record))
    path, stage = ("iter_2/state.json", "update") if "state" in damage else ("iter_2/advantages.parquet", "gae")
    [problem] = _problems(_status(cli, run))
    assert problem.startswith(f"problem: {path} ") and f"a resume reruns {stage} of iteration 2" in problem
    proc = cli("export", str(run.root))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"{path} " in proc.stderr and f"rebuilt by rerunning {stage} of iteration 2" in proc.stderr
    same_weights(run.checkpoint(3), base.checkpoint(3))
    assert committed_iterations(run) == [1, 2, 3] and not _problems(_status(cli, run))


def test_a_changed_committed_table_is_noticed_and_rebuilt(base, cli, tmp_path):
    """Issue 28, 8: a committed scored table edited after the fact is named by `rlhf status` and
    rebuilt by the resume (score rerun on iteration 1's own inputs: the same bytes as recorded)."""
    run = _copy(base, tmp_path)
    _tamper(run.scored(1), "reward")
    [problem] = _problems(_status(cli, run))
    assert problem.startswith("problem: iter_1/scored.parquet changed since score wrote it")
    proc = _resume(cli, run, 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = _warnings(proc)
    assert "iter_1/scored.parquet changed since score wrote it" in line and \
        line.endswith("rebuilt by rerunning score of iteration 1 (the same bytes as recorded)")
    assert run.scored(1).read_bytes() == base.scored(1).read_bytes()


def test_a_fallback_reruns_to_the_same_numbers_and_chains_the_kl_controller(base, cli, tmp_path):
    """Issue 28, 9: iteration 2's records are gone, so nothing of 2 or 3 can be verified: the resume
    falls back to iteration 1, in one line, and reruns them — each gae starting from its committed
    predecessor's KL state — to the same numbers as before."""
    run = _copy(base, tmp_path)
    run.manifest_path(2).unlink()
    [problem] = _problems(_status(cli, run))
    assert problem == ("problem: iter_2/manifest.json is missing: nothing records what iteration 2's stages wrote; "
                       "a resume falls back to the commit before iteration 2 (iterations 2..3 are rerun)")
    proc = _resume(cli, run, 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [w.endswith("falling back to iteration 1; iterations 2..3 will be rerun") for w in _warnings(proc)] == [True]
    for k in (2, 3):
        assert run.read_json(run.kl_state(k))["used"] == run.read_json(run.kl_state(k - 1))["next"]
        ours, theirs = _metrics(run, k), _metrics(base, k)
        assert {m: v for m, v in ours.items() if not m.startswith(("perf/", "timing_s/"))} == \
            {m: v for m, v in theirs.items() if not m.startswith(("perf/", "timing_s/"))}


def test_a_forced_rerun_that_writes_the_same_bytes_marks_nothing_stale(base, cli, tmp_path):
    """Issue 29's item owned here: `rlhf stage gae --force` on a committed iteration reproduces its
    outputs, so nothing after it is stale and a resume is not refused."""
    run = _copy(base, tmp_path)
    proc = cli("stage", "gae", "--local", "--run-dir", str(run.root), "-k", "2", "--force")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing downstream is stale" in proc.stdout and "marked stale" not in proc.stdout
    assert not [(k, s) for k in run.iterations() for s, r in read_manifest(run, k).items() if r["status"] == "stale"]
    assert "out of date" not in _status(cli, run).stdout


# ---------------------------------------------------------------------------------------------
# 4. the commit log and the manifests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["garbage", "deleted"])
def test_a_lost_commit_log_is_rebuilt_from_the_verdicts(base, cli, tmp_path, damage):
    run = _copy(base, tmp_path)
    if damage == "garbage":
        run.last_good_path.write_text("\x00\x01 not a commit log")
    else:
        run.last_good_path.unlink()
    proc = _status(cli, run)
    assert "problem:" in proc.stdout and "last_good.json" in proc.stdout, proc.stdout
    rlhf_pipeline(PipelineParams(resume=str(run.root)))  # nothing left to train: iterations 1-3 stay as they are
    record = read_last_good(run)
    assert record["committed"] == [1, 2, 3] and record["iteration"] == 3
    assert [e for e in run.events() if e["kind"] == "commit_log_rebuilt"]
    assert not (run.iter_dir(4)).exists()  # not restarted from iteration 1, nothing trained twice
    assert read_manifest(run, 1)["update"].get("status") == "done"


def test_a_commit_log_naming_a_missing_iteration_falls_back(base, tmp_path):
    run = _copy(base, tmp_path)
    record = read_last_good(run)
    run.last_good_path.write_text(json.dumps({**record, "iteration": 7, "checkpoint": "iter_7/checkpoint",
                                              "committed": [1, 2, 3, 7]}))
    done = rlhf_pipeline(PipelineParams(resume=str(run.root), iterations=3))
    assert done["last_good"]["iteration"] == 3 and committed_iterations(run) == [1, 2, 3]
    [event] = [e for e in run.events() if e["kind"] == "fallback"]
    assert event["message"].startswith("iter_7/manifest.json is missing")


def test_a_deleted_last_good_checkpoint_is_replayed_from_its_record(base, tmp_path, same_weights):
    run = _copy(base, tmp_path)
    shutil.rmtree(run.checkpoint(3))
    done = rlhf_pipeline(PipelineParams(resume=str(run.root), iterations=3))
    assert not [e for e in run.events() if e["kind"] in ("fallback", "repaired")]  # not damage: a state in its record
    # nothing is lost: rebuilt from iteration 2's checkpoint and 3's record (for the export), the same bits
    assert done["last_good"]["iteration"] == 3
    same_weights(run.checkpoint(3), base.checkpoint(3))


def test_a_deleted_last_good_checkpoint_and_record_are_rebuilt_by_rerunning_the_update(base, tmp_path, same_weights):
    run = _copy(base, tmp_path)
    shutil.rmtree(run.checkpoint(3))
    run.state_record(3).unlink()  # how to replay it is gone too: the update itself reruns, on its recorded inputs
    done = rlhf_pipeline(PipelineParams(resume=str(run.root), iterations=3))
    [event] = [e for e in run.events() if e["kind"] == "repaired"]
    assert event["message"] == ("iter_3/state.json is missing: rebuilt by rerunning update of iteration 3 (the "
                                "same bytes as recorded)")
    assert not [e for e in run.events() if e["kind"] == "fallback"]
    assert done["last_good"]["iteration"] == 3 and run.state_record(3).read_bytes() == base.state_record(3).read_bytes()
    same_weights(run.checkpoint(3), base.checkpoint(3))


def test_a_deleted_iteration_manifest_is_shown_not_hidden(base, cli, tmp_path):
    run = _copy(base, tmp_path)
    run.manifest_path(1).unlink()
    assert any("iter_1/manifest.json is missing" in line for line in _problems(_status(cli, run)))
    run.manifest_path(2).write_text("][")
    assert any("iter_2/manifest.json is damaged" in line for line in _problems(_status(cli, run)))
    # with the commits before it intact (status read past them to iteration 2's verdict: exit 2, no table)
    shutil.copy(base.manifest_path(1), run.manifest_path(1))
    run.manifest_path(2).write_text("[1, 2]")
    assert any("iter_2/manifest.json is damaged (it holds a list" in line for line in _problems(_status(cli, run)))


# ---------------------------------------------------------------------------------------------
# 4. what every iteration stands on: setup outputs, config.yaml, the export gate's number
# ---------------------------------------------------------------------------------------------


def test_a_damaged_initial_critic_is_rebuilt_before_anything_trains_on_it(base, cli, tmp_path):
    """One byte of models/critic_init flipped: `rlhf status` names it, and the resume (which could
    fall back to the initial models and train every iteration from it) reruns init_critic, which
    writes the recorded bytes again — or stops, when it cannot."""
    run = _copy(base, tmp_path)
    _flip_byte(run.critic_init / "model.safetensors")
    [problem] = _problems(_status(cli, run))
    assert problem.startswith("problem: models/critic_init changed since init_critic wrote it") and \
        "a resume reruns init_critic to rebuild it" in problem
    proc = _resume(cli, run, 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("rlhf: warning: models/critic_init changed since init_critic wrote it" in proc.stderr
            and "rebuilt by rerunning init_critic (the same bytes as recorded)" in proc.stderr)
    assert (run.critic_init / "model.safetensors").read_bytes() == (base.critic_init / "model.safetensors").read_bytes()


def test_damaged_prompts_are_rebuilt_by_preprocess(base, cli, tmp_path):
    run = _copy(base, tmp_path)
    _flip_byte(run.train_prompts, 200)
    assert any("prompts/train.parquet changed since preprocess wrote it" in line for line in _problems(_status(cli, run)))
    proc = _resume(cli, run, 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rebuilt by rerunning preprocess (the same bytes as recorded)" in proc.stderr
    assert run.train_prompts.read_bytes() == base.train_prompts.read_bytes()


def test_a_lost_config_line_is_named_and_the_recorded_config_trains(base, cli, tmp_path):
    """Issue 38, 3: config.yaml loses the actor's lr line. Unsealed, a resume would train at the
    schema's default (1e-6) without a word; now `rlhf status` and the resume name the key, the resume
    trains with the lr iteration 3 recorded, and config.yaml is written sealed again."""
    run = _copy(base, tmp_path)
    recorded_lr = run.read_json(run.state_record(3))["config"]["actor_rollout_ref"]["actor"]["optim"]["lr"]
    lines = run.config_path.read_text().splitlines(keepends=True)
    in_actor_optim = [i for i, line in enumerate(lines) if line.strip() == f"lr: {recorded_lr}"]
    del lines[in_actor_optim[0]]
    run.config_path.write_text("".join(lines))
    [problem] = [p for p in _problems(_status(cli, run)) if "config.yaml" in p]
    assert "was changed since rlhf wrote it" in problem and \
        f"actor_rollout_ref.actor.optim.lr: missing in config.yaml, {recorded_lr} recorded" in problem
    proc = _resume(cli, run, 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "actor_rollout_ref.actor.optim.lr: missing in config.yaml" in proc.stderr
    assert run.read_json(run.state_record(4))["config"]["actor_rollout_ref"]["actor"]["optim"]["lr"] == recorded_lr
    assert not [p for p in _problems(_status(cli, run)) if "config.yaml" in p]  # sealed again


def test_an_explicit_override_changes_a_key_of_a_damaged_config(base, cli, tmp_path):
    run = _copy(base, tmp_path)
    run.config_path.write_text(run.config_path.read_text().replace("save_freq: 1", "save_freq: 2"))
    proc = _resume(cli, run, 4, "actor_rollout_ref.actor.optim.lr=5e-05")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainer.save_freq: 2 in config.yaml, 1 recorded" in proc.stderr
    config = run.read_json(run.state_record(4))["config"]
    assert config["actor_rollout_ref"]["actor"]["optim"]["lr"] == 5e-05 and config["trainer"]["save_freq"] == 1


def test_the_export_gate_never_reads_an_edited_report(base, cli, tmp_path):
    """Issue 38, 4: iteration 3's val/accuracy raised from its measured value to 0.99 in
    iteration_metrics.json does not let an export through that the undamaged run refuses."""
    run = _copy(base, tmp_path)
    shutil.rmtree(run.exported_actor)  # the run's own export, at its bar of 0
    measured = _metrics(run, 3)["val/accuracy"]
    assert measured < 0.5
    metrics = _metrics(run, 3)
    metrics["val/accuracy"] = 0.99
    run.iteration_metrics(3).write_text(json.dumps(metrics))
    proc = cli("export", str(run.root), "trainer.export_min_val_score=0.5")
    assert proc.returncode != 0 and not run.exported_actor.exists()
    assert f"latest validation accuracy {measured:.4f} (iteration 3) is below trainer.export_min_val_score=0.5" in \
        proc.stdout + proc.stderr


def test_a_resume_of_a_finished_run_says_there_was_nothing_left_to_do(base, cli, tmp_path):
    """Issue 50: `rlhf run --resume` of a finished run never said that nothing was left to do."""
    run = _copy(base, tmp_path)
    proc = _resume(cli, run, 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"nothing left to do: iterations 1..3 are committed (trainer.total_iterations=3); `rlhf run --resume "
            f"{run.root} --iterations N` goes on to iteration N") in proc.stdout, proc.stdout[-3000:]
    assert committed_iterations(run) == [1, 2, 3]


def test_the_status_of_a_run_imports_no_torch(base):
    """Issue 50: `rlhf status RUN` answers in about a second because reading a run's records (its
    config's data section, its manifests and lineage records) imports no torch, whose import alone
    takes ~1.7 s here (benchmarks/bench_cli_start.py); the table is the whole status all the same."""
    code = ("import sys, contextlib, io\nfrom rlhf_cli.main import main\nout = io.StringIO()\n"
            f"with contextlib.redirect_stdout(out):\n    assert main(['status', {str(base.root)!r}]) == 0\n"
            "print(out.getvalue())\nprint('torch' in sys.modules, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "False False", proc.stdout
    assert "last-good: iteration 3" in proc.stdout and "problem:" not in proc.stdout, proc.stdout
