"""Corrupt checkpoints: a flipped byte or a truncated file in a committed checkpoint is caught by its
sha256 manifest with a ``CheckpointError`` naming the file, and resume falls back to the newest
earlier committed checkpoint that verifies, saying so (event + stderr line) and undoing the later
commits so those iterations rerun from the good one.

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
from rlhf_core.io.atomic import atomic_write_json
from rlhf_core.run.manifest import read_manifest, write_manifest
from rlhf_core.run.lifecycle import (
    commit_iteration as write_last_good, committed_iterations, read_last_good, verified_last_good,
)
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.run.plan import open_run, plan_run, resume_point
from rlhf_core.io.checksums import verify_checkpoint
from rlhf_core.io.checksums import write_checksums as write_checkpoint_manifest


def committed_run(root, iterations: int = 3) -> RunDir:
    """A run whose iterations 1..n are committed, each with a checkpoint and a KL snapshot
    (state before iteration k: value k/10); kl_ctrl.json holds the state after n."""
    run = RunDir(root)
    run.root.mkdir(parents=True)
    write_config(run, to_yaml(load_config(None, [])))
    for k in range(1, iterations + 1):
        ckpt = run.checkpoint(k)
        for rel, size in (("actor/model.safetensors", 4096), ("critic/model.safetensors", 2048),
                          ("deepspeed/actor_optim.safetensors", 8192)):
            (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
            (ckpt / rel).write_bytes(os.urandom(size))
        (ckpt / "trainer_state.json").write_text('{"iteration": %d}\n' % k)
        write_checkpoint_manifest(ckpt)
        atomic_write_json(run.iter_dir(k) / "kl_ctrl_before.json", {"state": {"type": "fixed", "value": k / 10}})
        write_manifest(run, k, {s: {"status": "done"} for s in ("rollout", "score", "gae", "update")}
                       | {"guard": {"status": "done"}})
        write_last_good(run, k)
    atomic_write_json(run.kl_ctrl_path, {"type": "fixed", "value": (iterations + 1) / 10})
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


@pytest.mark.parametrize("damage", [flip_byte, truncate])
def test_resume_falls_back_to_the_previous_good_checkpoint(tmp_path, capsys, damage):
    run = committed_run(tmp_path / "run")
    damage(run.checkpoint(3) / "deepspeed" / "actor_optim.safetensors")

    record = verified_last_good(run)

    assert record["iteration"] == 2 and record["fell_back_from"] == 3
    assert read_last_good(run)["iteration"] == 2 and resume_point(run) == 3
    assert "falling back to the checkpoint of iteration 2" in capsys.readouterr().err
    event = [e for e in run.events() if e["kind"] == "checkpoint_corrupt_fallback"]
    assert len(event) == 1 and event[0]["corrupt_iteration"] == 3
    assert "actor_optim.safetensors" in event[0]["errors"][0]
    manifest = read_manifest(run, 3)  # iteration 3 reruns from gae on; rollout/score stay valid
    assert manifest["guard"]["checkpoint_corrupt"] is True and committed_iterations(run) == [1, 2]
    assert [manifest[s]["status"] for s in ("rollout", "score", "gae", "update", "guard")] == \
        ["done", "done", "stale", "stale", "stale"]
    assert run.read_json(run.kl_ctrl_path) == {"type": "fixed", "value": 0.3}  # the state before iteration 3
    # a second call finds the pointer on a good checkpoint and changes nothing
    assert verified_last_good(run)["iteration"] == 2
    assert sum(e["kind"] == "checkpoint_corrupt_fallback" for e in run.events()) == 1


def test_fallback_skips_every_damaged_checkpoint(tmp_path):
    run = committed_run(tmp_path / "run")
    flip_byte(run.checkpoint(3) / "actor" / "model.safetensors")
    truncate(run.checkpoint(2) / "critic" / "model.safetensors")
    assert verified_last_good(run)["iteration"] == 1
    assert committed_iterations(run) == [1]
    assert run.read_json(run.kl_ctrl_path)["value"] == 0.2


def test_no_checkpoint_verifies_is_an_error_naming_each(tmp_path):
    run = committed_run(tmp_path / "run", iterations=3)
    manifest = read_manifest(run, 1)  # pruned as prune_checkpoints prunes (flag first, then the directory):
    manifest["update"]["checkpoint_pruned"] = True  # the run cannot go back to the initial models
    write_manifest(run, 1, manifest)
    shutil.rmtree(run.checkpoint(1))
    (run.checkpoint(3) / "manifest.json").unlink()
    flip_byte(run.checkpoint(2) / "actor" / "model.safetensors")
    with pytest.raises(CheckpointError, match="no committed checkpoint") as info:
        verified_last_good(run)
    assert "iteration 3" in str(info.value) and "iteration 2" in str(info.value)
    assert read_last_good(run)["iteration"] == 3  # nothing moved


def test_every_commit_damaged_and_none_pruned_restarts_from_the_initial_models(tmp_path, capsys):
    run = committed_run(tmp_path / "run", iterations=2)
    truncate(run.checkpoint(2) / "trainer_state.json")
    flip_byte(run.checkpoint(1) / "actor" / "model.safetensors")
    assert verified_last_good(run)["fell_back_from"] == 2
    assert read_last_good(run) is None and resume_point(run) == 1
    assert "falling back to the initial models" in capsys.readouterr().err
    assert run.read_json(run.kl_ctrl_path) == {"type": "fixed", "value": 0.1}


def test_intact_last_good_is_kept_silently(tmp_path, capsys):
    run = committed_run(tmp_path / "run")
    assert verified_last_good(run)["iteration"] == 3
    assert not capsys.readouterr().err and not any(e["kind"] == "checkpoint_corrupt_fallback" for e in run.events())


def test_resume_plan_starts_after_the_fallback(tmp_path):
    """`rlhf run --resume` (plan_run + open_run, what the flow calls under the run lock)."""
    run = committed_run(tmp_path / "run")
    truncate(run.checkpoint(3) / "trainer_state.json")
    plan = plan_run(resume=run.root)
    assert plan.first_iteration == 4  # planning writes nothing and checks nothing yet
    open_run(plan)
    assert plan.first_iteration == 3 and read_last_good(run)["iteration"] == 2
    resume = [e for e in run.events() if e["kind"] == "resume"][-1]
    assert resume["fell_back_from"] == 3 and resume["iteration"] == 3
