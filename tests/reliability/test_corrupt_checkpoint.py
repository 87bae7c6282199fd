"""Corrupt checkpoints: a flipped byte or a truncated file in a committed checkpoint is caught by its
sha256 manifest with a ``CheckpointError`` naming the file. A resume removes it, and when its state
cannot be replayed from its record (none here) falls back to the newest earlier committed checkpoint
that verifies, saying so in one line naming the damaged file's own iteration (event + stderr) and
undoing the later commits so those iterations rerun from the good one. (Replay from the record is
``tests/flows/test_state_integrity_flow.py``'s.)

The checkpoints here are directories of real files with the checkpoint module's own manifest
(``write_manifest``/``verify_checkpoint``); what is under test is the file-level check and the
pointer logic, which do not depend on what the files hold. The soak benchmark (benchmarks/soak.py)
corrupts real update checkpoints of the tiny pipeline and resumes.
"""

from __future__ import annotations

import os
import shutil

import pytest

from rlhf_core.config import load_config, to_yaml
from rlhf_core.errors import CheckpointError
from rlhf_core.run.migrate import stamp
from rlhf_core.run.manifest import read_manifest, write_manifest
from rlhf_core.run.lifecycle import commit_iteration as write_last_good, committed_iterations, read_last_good
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.control.opening import open_run
from rlhf_core.control.plan import plan_run, resume_point
from rlhf_core.stages.repair import repair_run
from rlhf_core.io.checksums import verify_checkpoint
from rlhf_core.io.checksums import write_checksums as write_checkpoint_manifest


def committed_run(root, iterations: int = 3) -> RunDir:
    """A run whose iterations 1..n are committed, each with a checkpoint (and no state record: none
    can be replayed, so what is damaged is fallen back from)."""
    run = RunDir(root)
    run.root.mkdir(parents=True)
    stamp(run)
    write_config(run, to_yaml(load_config(None, [])))
    for k in range(1, iterations + 1):
        ckpt = run.checkpoint(k)
        for rel, size in (("actor/model.safetensors", 4096), ("critic/model.safetensors", 2048),
                          ("deepspeed/actor_optim.safetensors", 8192)):
            (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
            (ckpt / rel).write_bytes(os.urandom(size))
        (ckpt / "trainer_state.json").write_text('{"iteration": %d}\n' % k)
        write_checkpoint_manifest(ckpt)
        write_manifest(run, k, {s: {"status": "done"} for s in ("rollout", "score", "gae", "update")}
                       | {"guard": {"status": "done"}})
        write_last_good(run, k)
    return run


def flip_byte(path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage, words", [(flip_byte, "sha256 does not match"), (truncate, "truncated")])
def test_damaged_file_is_named_at_load(tmp_path, damage, words):
    run = committed_run(tmp_path / "run")
    bad = run.checkpoint(3) / "actor" / "model.safetensors"
    damage(bad)
    with pytest.raises(CheckpointError, match=words) as info:
        verify_checkpoint(run.checkpoint(3))
    assert str(bad) in str(info.value)


def repair(run: RunDir) -> list[str]:
    return repair_run(run, load_config(None, []))


@pytest.mark.parametrize("damage", [flip_byte, truncate])
def test_resume_falls_back_from_a_damaged_checkpoint_it_cannot_replay(tmp_path, capsys, damage):
    run = committed_run(tmp_path / "run")
    damage(run.checkpoint(3) / "deepspeed" / "actor_optim.safetensors")

    [line] = repair(run)

    assert line.startswith("iter_3/checkpoint is damaged (checkpoint file ") and "actor_optim.safetensors" in line
    assert line.endswith("falling back to iteration 2; iteration 3 will be rerun")
    assert read_last_good(run)["iteration"] == 2 and resume_point(run) == 3
    assert capsys.readouterr().err.strip() == f"rlhf: warning: {line}"
    assert not run.checkpoint(3).exists()  # the damaged files are gone, never loaded or exported again
    event = [e for e in run.events() if e["kind"] == "fallback"]
    assert len(event) == 1 and event[0]["last_good_before"] == 3 and event[0]["message"] == line
    manifest = read_manifest(run, 3)  # iteration 3 reruns from gae on; rollout/score stay valid
    assert committed_iterations(run) == [1, 2]
    assert [manifest[s]["status"] for s in ("rollout", "score", "gae", "update", "guard")] == \
        ["done", "done", "stale", "stale", "stale"]
    # a second call finds the pointer on a good checkpoint and changes nothing
    assert repair(run) == [] and sum(e["kind"] == "fallback" for e in run.events()) == 1


def test_fallback_skips_every_damaged_checkpoint(tmp_path):
    run = committed_run(tmp_path / "run")
    flip_byte(run.checkpoint(3) / "actor" / "model.safetensors")
    truncate(run.checkpoint(2) / "critic" / "model.safetensors")
    lines = repair(run)
    assert len(lines) == 1 and lines[0].startswith("iter_2/checkpoint is damaged")  # the earliest first
    assert committed_iterations(run) == [1]
    assert not run.checkpoint(2).exists() and not run.checkpoint(3).exists()


def test_the_fallback_line_names_the_iteration_whose_checkpoint_is_damaged(tmp_path, capsys):
    """Last-good 5 and 4 live only in their records (between save points), 3's checkpoint is damaged
    and cannot be replayed: the line names iteration 3's file as iteration 3's, not last-good's."""
    run = committed_run(tmp_path / "run", iterations=5)
    for k in (4, 5):
        shutil.rmtree(run.checkpoint(k))
        run.state_record(k).write_text('{"iteration": %d, "id": "x", "config": {}}' % k)
        run.advantages(k).write_bytes(b"table")
    flip_byte(run.checkpoint(3) / "actor" / "model.safetensors")
    open_run(plan_run(resume=run.root))
    [line] = [e["message"] for e in run.events() if e["kind"] == "fallback"]
    assert line.startswith("iter_3/checkpoint is damaged (checkpoint file ") and "iteration 5" not in line
    assert line.endswith("falling back to iteration 2; iterations 3..5 will be rerun")
    assert f"rlhf: warning: {line}" in capsys.readouterr().err
    assert committed_iterations(run) == [1, 2]


def test_every_commit_damaged_falls_back_to_the_initial_models(tmp_path, capsys):
    run = committed_run(tmp_path / "run", iterations=3)
    manifest = read_manifest(run, 1)  # pruned as prune_checkpoints prunes (flag first, then the directory)
    manifest["update"]["checkpoint_pruned"] = True
    write_manifest(run, 1, manifest)
    shutil.rmtree(run.checkpoint(1))
    (run.checkpoint(3) / "manifest.json").unlink()
    flip_byte(run.checkpoint(2) / "actor" / "model.safetensors")
    lines = repair(run)
    assert lines[-1].startswith("iter_1/checkpoint is missing, and so is the record to replay its update from")
    assert lines[-1].endswith("falling back to the initial models; iterations 1..3 will be rerun")
    assert read_last_good(run) is None and resume_point(run) == 1
    assert "falling back to the initial models" in capsys.readouterr().err


def test_intact_last_good_is_kept_silently(tmp_path, capsys):
    run = committed_run(tmp_path / "run")
    assert repair(run) == []
    assert not capsys.readouterr().err and not any(e["kind"] == "fallback" for e in run.events())


def test_resume_plan_starts_after_the_fallback(tmp_path):
    """`rlhf run --resume` (plan_run + open_run, what the flow calls under the run lock)."""
    run = committed_run(tmp_path / "run")
    truncate(run.checkpoint(3) / "trainer_state.json")
    plan = plan_run(resume=run.root)
    assert plan.first_iteration == 4  # planning writes nothing and checks nothing yet
    open_run(plan)
    assert plan.first_iteration == 3 and read_last_good(run)["iteration"] == 2
    resume = [e for e in run.events() if e["kind"] == "resume"][-1]
    assert resume["iteration"] == 3 and "falling back to iteration 2" in resume["repairs"][0]
