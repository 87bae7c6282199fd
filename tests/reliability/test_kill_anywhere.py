"""Kill anywhere: every stage, killed while it writes (at its output's ``before_rename`` fault point,
or by SIGKILL at a random moment of the update's checkpoint write or of a rollout), leaves no
partial file under a final name, and a rerun finishes with outputs equal to an uninterrupted run's.

One uninterrupted iteration is run once per module (in this process, stage by stage) and the run
directory is copied before and after every stage; each test starts from the copy before its stage,
kills a real ``rlhf stage <name> --local`` process, reruns the stage and compares with the copy after.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlhf_core.io.atomic import TMP_MARK, clean_temporaries
from rlhf_core.run.manifest import read_manifest
from rlhf_core.run.layout import RunDir
from rlhf_core.run.integrity import find_damage
from rlhf_core.run.lifecycle import commit_iteration, committed_iterations, read_last_good
from rlhf_core.run.lock import RunLock

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
ORDER = ("init_critic", "preprocess", "pack", "rollout", "score", "gae", "update", "guard")
PER_ITERATION = {"rollout", "score", "gae", "update", "guard"}
FAULT_OUTPUT = {"init_critic": "critic_init", "preprocess": "val.parquet", "pack": "generation_batches.parquet",
                "rollout": "rollout.parquet", "score": "scored.parquet", "gae": "advantages.parquet",
                "update": "checkpoint", "guard": "guard.json"}
"""The output whose rename each stage is killed before (preprocess: its last file, so rejects and
train are already renamed and the stage is half done on disk)."""


def tiny_overrides(model_dir: Path, runs_root: Path) -> list[str]:
    """configs/demo.yaml shrunk to 4 prompts, 12-token responses, one PPO mini-batch, CPU."""
    return [f"actor_rollout_ref.model.path={model_dir}", f"trainer.runs_root={runs_root}",
            "actor_rollout_ref.model.warm_start.enable=false", "data.train_batch_size=4", "data.max_val_samples=4",
            "data.max_response_length=12", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
            "actor_rollout_ref.rollout.generation_batch_tokens=2048", "trainer.save_freq=1",
            "trainer.max_ckpt_to_keep=3", "trainer.device=cpu", "trainer.kl_guard_val_prompts=0"]


def run_stage_here(run: RunDir, stage: str, k: int | None = None) -> None:
    """Run one stage in this process from the run's saved config, holding the run lock (which clears
    the stale lock a killed process left)."""
    from rlhf_core.control.plan import resolve_run_config
    from rlhf_core.stages.catalog import stage_functions

    cfg = resolve_run_config(run.root, None, [])
    with RunLock(run):
        stage_functions(stage).run(cfg, run, k if stage in PER_ITERATION else None)


def stage_command(run: RunDir, stage: str) -> list[str]:
    cmd = [sys.executable, "-m", "rlhf_cli.main", "stage", stage, "--local", "--run-dir", str(run.root)]
    return cmd + (["--iteration", "1"] if stage in PER_ITERATION else [])


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()  # this process may hold a torch.distributed port
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "RLHF_FAULT")}
    return {**env, **extra}


def output_path(run: RunDir, stage: str) -> Path:
    return {"init_critic": run.critic_init, "preprocess": run.val_prompts, "pack": run.generation_batches,
            "rollout": run.rollout(1), "score": run.scored(1), "gae": run.advantages(1), "update": run.checkpoint(1),
            "guard": run.iter_dir(1) / "guard.json"}[stage]


@dataclass
class Reference:
    """Copies of one uninterrupted run directory: ``before[stage]`` and ``after[stage]``."""

    before: dict[str, Path]
    after: dict[str, Path]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir) -> Reference:
    from rlhf_core.config import load_config, to_yaml
    from rlhf_core.run.layout import write_config

    base = tmp_path_factory.mktemp("kill_ref")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLHF_HOME", str(base / ".rlhf"))
        run = RunDir(base / "run")
        run.root.mkdir()
        write_config(run, to_yaml(load_config(str(DEMO), tiny_overrides(tiny_model_dir, base))))
        ref = Reference({}, {})
        for stage in ORDER:
            ref.before[stage] = shutil.copytree(run.root, base / f"before_{stage}")
            run_stage_here(run, stage, 1)
            ref.after[stage] = shutil.copytree(run.root, base / f"after_{stage}")
    return ref


def copy_run(src: Path, dst: Path) -> RunDir:
    shutil.copytree(src, dst)
    return RunDir(dst)


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------


def assert_everything_readable(root: Path) -> None:
    """Every Parquet table and JSON file under a final name opens completely; checkpoints verify."""
    from rlhf_core.io.checksums import verify_checkpoint

    for p in root.rglob("*"):
        if TMP_MARK in str(p.relative_to(root)) or not p.is_file():
            continue
        if p.suffix == ".parquet":
            pq.read_table(p)
        elif p.suffix == ".json":
            json.loads(p.read_text())
        elif p.name == "events.jsonl":
            [json.loads(line) for line in p.read_text().splitlines()]
    for ckpt in root.glob("iter_*/checkpoint"):
        if TMP_MARK not in ckpt.name:
            verify_checkpoint(ckpt)


def assert_same_outputs(got: Path, want: Path, stage: str) -> None:
    """The stage's outputs in run ``got`` equal those of the uninterrupted run ``want``."""
    a, b = RunDir(got), RunDir(want)
    if stage == "update":
        from safetensors.torch import load_file

        for sub in ("actor", "critic"):
            wa, wb = (load_file(str(r.checkpoint(1) / sub / "model.safetensors")) for r in (a, b))
            assert wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa), f"{sub} weights differ"
        for f in ("deepspeed/actor_shard.rank0-of-1.safetensors", "deepspeed/critic_shard.rank0-of-1.safetensors"):
            oa, ob = load_file(str(a.checkpoint(1) / f)), load_file(str(b.checkpoint(1) / f))
            assert all(oa[k].equal(ob[k]) for k in ob), f"{f} differs"
        return
    if stage == "init_critic":
        from safetensors.torch import load_file

        wa, wb = (load_file(str(r.critic_init / "model.safetensors")) for r in (a, b))
        assert wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa), "initial critic weights differ"
        return
    if stage == "guard":
        va, vb = (json.loads(output_path(r, stage).read_text()) for r in (a, b))
        assert va == vb
        return
    paths = {"preprocess": [a.train_prompts, a.val_prompts, a.rejects]}.get(stage, [output_path(a, stage)])
    for p in paths:
        q = want / p.relative_to(got)
        assert pq.read_table(p).equals(pq.read_table(q)), f"{p.name} differs from the uninterrupted run's"
    if stage == "gae":
        assert a.read_json(a.kl_state(1)) == b.read_json(b.kl_state(1))


def finish_and_compare(run: RunDir, stage: str, ref: Reference, killed_pid: int | None) -> None:
    run_stage_here(run, stage, 1)
    assert read_manifest(run, 1 if stage in PER_ITERATION else None)[stage]["status"] == "done"
    assert_same_outputs(run.root, ref.after[stage], stage)
    assert_everything_readable(run.root)
    leftovers = clean_temporaries(run.root)
    if killed_pid is not None:  # only the killed writer's temporaries, nothing of the rerun's
        assert all(f"{TMP_MARK}{killed_pid}-" in p.name or "old-" in p.name for p in leftovers), leftovers


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ORDER)
def test_killed_before_its_output_is_renamed_then_rerun(reference, tmp_path, stage):
    run = copy_run(reference.before[stage], tmp_path / "run")
    proc = subprocess.Popen(stage_command(run, stage), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=clean_env(RLHF_FAULT=f"before_rename:{FAULT_OUTPUT[stage]}"))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 137, out[-3000:]
    final = output_path(run, stage)
    assert not final.exists(), f"{final} visible under its final name after a kill before its rename"
    assert list(final.parent.glob(f"{final.name}{TMP_MARK}{proc.pid}-*")), "the killed write left no temporary"
    scope = 1 if stage in PER_ITERATION else None
    assert read_manifest(run, scope).get(stage, {}).get("status") != "done"
    assert_everything_readable(run.root)
    finish_and_compare(run, stage, reference, proc.pid)


def test_update_killed_between_optimizer_steps_then_rerun(reference, tmp_path):
    """Killed after the actor's optimizer step (weights changed in memory, nothing saved)."""
    run = copy_run(reference.before["update"], tmp_path / "run")
    proc = subprocess.run(stage_command(run, "update"), cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=clean_env(RLHF_FAULT="update:after_step:actor:1"))
    assert proc.returncode == 137, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not run.checkpoint(1).exists() and not run.metrics(1).exists()
    assert_everything_readable(run.root)
    finish_and_compare(run, "update", reference, None)


def kill_when(proc: subprocess.Popen, ready, rng: random.Random, max_delay: float) -> bool:
    """SIGKILL ``proc`` a random time (≤ max_delay s) after ``ready()`` turns true; False when the
    process ended first."""
    while proc.poll() is None and not ready():
        time.sleep(0.002)
    if proc.poll() is not None:
        return False
    time.sleep(rng.uniform(0, max_delay))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("seed", [0, 1])
def test_update_sigkilled_at_a_random_moment_of_its_checkpoint_write(reference, tmp_path, seed):
    run = copy_run(reference.before["update"], tmp_path / "run")
    proc = subprocess.Popen(stage_command(run, "update"), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=clean_env())
    writing = lambda: any(run.iter_dir(1).glob(f"checkpoint{TMP_MARK}*"))  # noqa: E731
    assert kill_when(proc, writing, random.Random(seed), max_delay=0.05), "the update ended before the kill"
    assert not run.checkpoint(1).exists() or run.checkpoint(1).joinpath("manifest.json").is_file()
    assert_everything_readable(run.root)
    finish_and_compare(run, "update", reference, proc.pid)


def test_rollout_sigkilled_at_a_random_time(reference, tmp_path):
    run = copy_run(reference.before["rollout"], tmp_path / "run")
    proc = subprocess.Popen(stage_command(run, "rollout"), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=clean_env())
    started = time.monotonic()
    killed = kill_when(proc, lambda: time.monotonic() - started > 1.0, random.Random(7), max_delay=6.0)
    if killed:
        assert not run.rollout(1).exists() or pq.read_table(run.rollout(1)).num_rows > 0
    assert_everything_readable(run.root)
    finish_and_compare(run, "rollout", reference, proc.pid)


def test_commit_killed_before_last_good_moves_then_rerun(reference, tmp_path):
    """The commit (lifecycle.commit_iteration) dies before last_good.json is renamed: the commit log
    still says what it said before (nothing committed), and committing again finishes the job once."""
    run = copy_run(reference.after["guard"], tmp_path / "run")
    script = ("import sys; from rlhf_core.run.lifecycle import commit_iteration; "
              "from rlhf_core.run.layout import RunDir; commit_iteration(RunDir(sys.argv[1]), 1)")
    proc = subprocess.run([sys.executable, "-c", script, str(run.root)], cwd=REPO, capture_output=True, text=True,
                          env=clean_env(RLHF_FAULT="before_rename:last_good.json"), timeout=300)
    assert proc.returncode == 137, proc.stderr[-2000:]
    assert not run.last_good_path.exists()
    assert_everything_readable(run.root)
    commit_iteration(run, 1)
    assert read_last_good(run)["iteration"] == 1 and not find_damage(run)
    assert committed_iterations(run) == [1]
    assert [e["kind"] for e in run.events()].count("commit") == 1
