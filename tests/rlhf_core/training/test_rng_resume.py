"""The update's RNG on every path: an iteration trained after a resume that found its rollout and
score already on disk (a new process, those stages skipped) ends with the same checkpoint, saved
RNG state included, as the same iteration trained in one uninterrupted process. Real stages:
the tiny model, DeepSpeed on CPU; each process is a fresh interpreter (numpy and python seed
themselves from the OS at start, so nothing the process did before may reach a checkpoint)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import committed_iterations

pytestmark = pytest.mark.deepspeed

WORKER = Path(__file__).with_name("rng_resume_worker.py")
DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"


def _overrides(tiny_model_dir: Path, runs_root: Path) -> list[str]:
    return [f"actor_rollout_ref.model.path={tiny_model_dir}", f"trainer.runs_root={runs_root}",
            "actor_rollout_ref.model.warm_start.enable=false", "data.train_batch_size=4", "data.max_val_samples=4",
            "data.max_response_length=12", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
            "actor_rollout_ref.rollout.generation_batch_tokens=2048", "trainer.device=cpu",
            "trainer.max_ckpt_to_keep=5", "trainer.total_iterations=2"]


def _worker(run: RunDir, first: int, last: int, until: str, overrides: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, str(WORKER), str(run.root), str(first), str(last), until, str(DEMO),
                           *overrides], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def _same_tensors(a: Path, b: Path) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_update_after_a_skipped_rollout_and_score_in_a_new_process_matches_the_uninterrupted_run(
        tiny_model_dir, tmp_path, subprocess_env):
    overrides = _overrides(tiny_model_dir, tmp_path / "runs")
    env = subprocess_env(OMP_NUM_THREADS="1")
    straight, resumed = RunDir(tmp_path / "straight"), RunDir(tmp_path / "resumed")
    _worker(straight, 1, 2, "guard", overrides, env)
    _worker(resumed, 1, 2, "score", overrides, env)  # iteration 1, then iteration 2's rollout and score
    out = _worker(resumed, 2, 2, "guard", overrides, env)  # a new process: rollout and score found done on disk

    assert "iteration 2 rollout: skipped" in out and "iteration 2 score: skipped" in out, out
    assert "iteration 2 update: ran" in out, out
    assert committed_iterations(straight) == committed_iterations(resumed) == [1, 2]
    for k in (1, 2):
        a, b = straight.checkpoint(k), resumed.checkpoint(k)
        for sub in ("actor", "critic"):
            assert _same_tensors(a / sub / "model.safetensors", b / sub / "model.safetensors"), (k, sub)
        assert _same_tensors(a / "rng.safetensors", b / "rng.safetensors"), k
        rng_a, rng_b = (json.loads((c / "trainer_state.json").read_text())["rng"] for c in (a, b))
        assert rng_a == rng_b, k
