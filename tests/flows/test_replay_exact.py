"""A resume replays the updates that lived only in memory, and the replay is the live update bit
for bit in the configurations users run — each killed (as kill -9 would) in iteration 4 of 4 with
save points at 2 and 4, so iteration 3's state exists only as its record, then resumed:

- the demo preset's own batching (64 prompts, two mini-batches, each cut by the 2,048-token budget
  into two micro-batches whose gradients accumulate into one optimizer step);
- bf16 at ZeRO-1, several micro-batches per step;
- a worker group of two ranks, several micro-batches per step on each.

Every metric but timings, every table and every exported tensor must equal the uninterrupted
run's. Before the models held their weights in aligned storage of their own
(``rlhf_core.models.storage``) the first of these refused to resume ("replaying iteration 4's update
did not reproduce its weights"): the critic loaded from its checkpoint summed one gradient in
another order than the critic the live run had loaded from ``models/critic_init``."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.control.status import format_status
from rlhf_core.run.layout import RunDir
from rlhf_core.training import lineage
from rlhf_core.run.lifecycle import read_last_good

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.deepspeed]

TIMING = ("perf/", "timing_s/")
"""Metrics that measure time, memory or the machine: the only ones a resume may change."""

KILL_IN_LAST_ITERATION = "iter_4/scored.parquet"
SAVE_AT_2_AND_4 = ("trainer.save_freq=2", "trainer.test_freq=4", "trainer.val_before_train=false",
                   "trainer.logger=[console]", "trainer.export_min_val_score=0.0")
"""Validated once, after the last iteration: a resume also validates the policy it resumes from when
val_before_train is on, a measurement the uninterrupted run never made."""


def demo_batching(model: Path, runs: Path) -> list[str]:
    """configs/demo.yaml as it is (its batch, mini-batch and token budgets) on the session's tiny
    model, without the SFT warm start (minutes on first use) and with a short validation."""
    return [f"actor_rollout_ref.model.path={model}", f"trainer.runs_root={runs}",
            "actor_rollout_ref.model.warm_start.enable=false", "data.max_val_samples=8", "trainer.device=cpu",
            *SAVE_AT_2_AND_4]


ACCUMULATING = ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=160", "critic.ppo_max_token_len_per_gpu=160")
"""The tiny configuration's 4 prompts in micro-batches of at most 160 tokens: several per step."""


def _numbers(run: RunDir, k: int) -> dict:
    return {key: value for key, value in run.read_json(run.iteration_metrics(k)).items() if not key.startswith(TIMING)}


def _exported(run: RunDir, rlhf) -> dict[str, torch.Tensor]:
    proc = rlhf("export", str(run.root), "trainer.export_min_val_score=0.0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    files = sorted((run.root / "export" / "actor").glob("*.safetensors"))
    assert files
    return {f"{f.name}/{k}": v for f in files for k, v in load_file(str(f)).items()}


def _cli_run(rlhf, *args: str, fault: str | None = None):
    env = {"RLHF_FAULT": f"before_rename:{fault}"} if fault else {}
    return rlhf("run", *args, **env)


def _kill_resume_and_compare(rlhf, same_tables, args: Callable[[Path], list[str]], tmp_path: Path,
                             *, preset: str) -> RunDir:
    """``args(runs_root)``: the run's overrides. Runs it uninterrupted, and again killed in its last
    iteration and resumed; asserts every non-timing number, table and exported tensor equal. Returns the
    resumed run."""
    whole = _cli_run(rlhf, "-c", preset, *args(tmp_path / "a"), "--iterations", "4", "--run-name", "whole")
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    killed = _cli_run(rlhf, "-c", preset, *args(tmp_path / "b"), "--iterations", "4", "--run-name", "killed",
                      fault=KILL_IN_LAST_ITERATION)
    assert killed.returncode == 137, killed.stdout[-3000:] + killed.stderr[-3000:]
    a, b = RunDir(tmp_path / "a" / "whole"), RunDir(tmp_path / "b" / "killed")
    assert read_last_good(b)["iteration"] == 3 and not b.checkpoint(3).exists()  # 3 lived only in memory
    resumed = rlhf("run", "--resume", str(b.root))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    for k in range(1, 5):
        got, want = _numbers(b, k), _numbers(a, k)
        assert got == want, (k, {key: (got.get(key), want.get(key)) for key in set(got) | set(want)
                                 if got.get(key) != want.get(key)})
    same_tables(a, b, range(1, 5))
    mine, theirs = _exported(b, rlhf), _exported(a, rlhf)
    assert sorted(mine) == sorted(theirs)
    assert [k for k in mine if not torch.equal(mine[k], theirs[k])] == []
    return b


def _steps_accumulated(run: RunDir, k: int, *, at_least: int = 2) -> None:
    metrics = run.read_json(run.iteration_metrics(k))
    for role in ("actor", "critic"):
        assert metrics[f"{role}/micro_batches"] >= at_least, (role, metrics[f"{role}/micro_batches"])


def test_the_demo_presets_own_batching_killed_between_saves_resumes_to_the_same_numbers(
        rlhf, demo_preset, tiny_model_dir, same_tables, tmp_path):
    run = _kill_resume_and_compare(rlhf, same_tables, lambda runs: demo_batching(tiny_model_dir, runs), tmp_path,
                                   preset=demo_preset)
    _steps_accumulated(run, 3)
    assert run.read_json(run.iteration_metrics(4))["actor/num_steps"] == 2  # two mini-batches


def test_bf16_with_accumulation_killed_between_saves_resumes_to_the_same_numbers(
        rlhf, demo_preset, tiny_overrides, same_tables, tmp_path):
    bf16 = ("actor_rollout_ref.actor.deepspeed_config.dtype=bf16", "actor_rollout_ref.actor.deepspeed_config.zero_stage=1",
            "critic.deepspeed_config.dtype=bf16", "critic.deepspeed_config.zero_stage=1")
    args = [*ACCUMULATING, *bf16, *SAVE_AT_2_AND_4]
    run = _kill_resume_and_compare(rlhf, same_tables, lambda runs: tiny_overrides(runs, *args), tmp_path,
                                   preset=demo_preset)
    _steps_accumulated(run, 3)


def test_a_worker_group_with_accumulation_killed_between_saves_resumes_to_the_same_numbers(
        rlhf, demo_preset, tiny_overrides, same_tables, tmp_path):
    args = ["trainer.nproc=2", *ACCUMULATING, *SAVE_AT_2_AND_4]
    run = _kill_resume_and_compare(rlhf, same_tables, lambda runs: tiny_overrides(runs, *args), tmp_path,
                                   preset=demo_preset)
    _steps_accumulated(run, 3, at_least=1)  # per rank: each takes its half of the step's rows
    assert run.read_json(run.iteration_metrics(4))["perf/world_size"] == 2


def test_a_replay_that_does_not_reproduce_falls_back_instead_of_stranding_the_run(
        rlhf, demo_preset, tiny_overrides, tmp_path, monkeypatch):
    """Resumed where the arithmetic differs from the run's (MKL told to take another code path, as
    another processor or library would), iteration 3's replay cannot reproduce its record. `rlhf
    status` says beforehand what a resume will do; the resume then falls back to checkpoint 2, reruns
    iterations 3-4 and finishes, instead of stopping with no way on."""
    args = [*ACCUMULATING, *SAVE_AT_2_AND_4]
    killed = _cli_run(rlhf, "-c", demo_preset, *tiny_overrides(tmp_path, *args), "--iterations", "4",
                      "--run-name", "killed", fault=KILL_IN_LAST_ITERATION)
    assert killed.returncode == 137, killed.stdout[-3000:] + killed.stderr[-3000:]
    run = RunDir(tmp_path / "killed")
    status = rlhf("status", str(run.root))
    assert status.returncode == 0, status.stderr[-2000:]
    assert ("iteration 3's state is only in its record (between save points): a resume rebuilds it by replaying "
            "iteration 3's update from checkpoint 2") in status.stdout
    # on a machine with another torch, status says the replay may not reproduce and what follows
    here = lineage.environment()
    monkeypatch.setattr(lineage, "environment", lambda: {**here, "torch": "0.0.0-elsewhere"})
    assert ("iteration 3 was trained elsewhere (torch " in format_status(run)
            and "a resume falls back to iteration 2 and reruns iteration 3" in format_status(run))
    monkeypatch.undo()
    resumed = rlhf("run", "--resume", str(run.root), MKL_CBWR="COMPATIBLE")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "replaying iteration 3's update did not reproduce its weights" in resumed.stderr
    assert "falling back to iteration 2; iteration 3 will be rerun" in resumed.stderr
    assert read_last_good(run)["iteration"] == 4
    assert [e["iteration"] for e in run.events() if e.get("kind") == "fallback"] == [2]


@pytest.mark.parametrize("knobs", [
    ("actor_rollout_ref.actor.deepspeed_config.zero_stage=2", "critic.deepspeed_config.zero_stage=2",
     "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
     "trainer.concurrent_critic_actor=never", *ACCUMULATING),
    ("actor_rollout_ref.actor.deepspeed_config.zero_stage=3", "critic.deepspeed_config.zero_stage=3",
     "actor_rollout_ref.actor.use_dynamic_bsz=false", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
     "critic.use_dynamic_bsz=false", "critic.ppo_micro_batch_size_per_gpu=1", "trainer.concurrent_critic_actor=always"),
], ids=["zero2-epochs2-minibatches-sequential", "zero3-fixed-micro-batches-concurrent"])
def test_a_replay_rebuilds_the_exported_weights_in_every_update_layout(rlhf, demo_preset, tiny_overrides, tmp_path,
                                                                         knobs):
    """The other update layouts, more cheaply: three iterations saved at 2 and at the end; the last
    checkpoint deleted, `rlhf export` rebuilds it by replaying iteration 3 from checkpoint 2, and the
    export equals the one made from the checkpoint the live run wrote."""
    args = [*knobs, "trainer.save_freq=2", "trainer.test_freq=-1", "trainer.logger=[console]",
            "trainer.export_min_val_score=0.0"]
    live = _cli_run(rlhf, "-c", demo_preset, *tiny_overrides(tmp_path, *args), "--iterations", "3", "--run-name", "live")
    assert live.returncode == 0, live.stdout[-3000:] + live.stderr[-3000:]
    run = RunDir(tmp_path / "live")
    _steps_accumulated(run, 3, at_least=2 if "use_dynamic_bsz=false" not in " ".join(knobs) else 4)
    want = _exported(run, rlhf)
    shutil.rmtree(run.checkpoint(3))
    shutil.rmtree(run.exported_actor)
    got = _exported(run, rlhf)
    assert (run.checkpoint(3) / "actor").is_dir()  # rebuilt by replay, kept
    assert sorted(got) == sorted(want) and [k for k in got if not torch.equal(got[k], want[k])] == []
