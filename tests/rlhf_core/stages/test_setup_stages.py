"""The setup stages that make the models a run starts from (warm_start, init_critic), and the
lookups that only find them: a lookup never builds or trains, it names the stage to run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForTokenClassification

from rlhf_core.config import load_config
from rlhf_core.errors import CheckpointError, RLHFError
from rlhf_core.paths import ModelNotFoundError, resolve_model_path
from rlhf_core.run.layout import RunDir
from rlhf_core.run.manifest import read_manifest
from rlhf_core.run.models import critic_path, initial_actor_path
from rlhf_core.stages.init_critic import run_init_critic
from rlhf_core.stages.warm_start import run_warm_start


def test_warm_start_builds_the_tiny_model_that_a_lookup_only_finds(tmp_path, monkeypatch):
    home = tmp_path / "home"  # a state directory without the session's tiny model
    monkeypatch.setenv("RLHF_HOME", str(home))
    cfg = load_config(None, ["actor_rollout_ref.model.path=tiny", "actor_rollout_ref.model.warm_start.enable=false"])
    with pytest.raises(ModelNotFoundError, match="not built yet"):
        resolve_model_path("tiny")
    with pytest.raises(ModelNotFoundError):
        initial_actor_path(cfg)
    assert not (home / "models" / "tiny").exists()  # the lookups wrote nothing

    run = RunDir(tmp_path / "run")
    result = run_warm_start(cfg, run)
    assert (home / "models" / "tiny" / "config.json").is_file()
    assert result.outputs["initial_actor"] == str(resolve_model_path("tiny"))
    assert read_manifest(run, None)["warm_start"]["status"] == "done"
    again = run_warm_start(cfg, run)  # a cache hit: nothing rebuilt, nothing marked stale
    assert again.outputs == result.outputs


def test_init_critic_builds_the_runs_critic_once_and_critic_path_only_finds_it(tmp_path, tiny_model_dir):
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir}",
                             "actor_rollout_ref.model.warm_start.enable=false", "trainer.seed=3"])
    run = RunDir(tmp_path / "run")
    with pytest.raises(CheckpointError, match="rlhf stage init_critic"):
        critic_path(cfg, run)
    assert not run.critic_init.exists()

    first = run_init_critic(cfg, run)
    assert critic_path(cfg, run) == run.critic_init
    head = AutoModelForTokenClassification.from_pretrained(run.critic_init).score.weight.detach().clone()
    torch.manual_seed(3)
    expected = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1).score.weight
    assert torch.equal(head, expected)  # seeded by trainer.seed: scoring and the update agree on it
    stamp = os.stat(run.critic_init / "config.json").st_mtime_ns
    second = run_init_critic(cfg, run)
    assert second.skipped and not first.skipped
    assert os.stat(run.critic_init / "config.json").st_mtime_ns == stamp  # built once per run


def test_a_warm_start_that_never_ran_is_named_not_trained(tmp_path, tiny_model_dir):
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir}",
                             "actor_rollout_ref.model.warm_start.enable=true"])
    with pytest.raises(CheckpointError, match="rlhf stage warm_start"):
        initial_actor_path(cfg)
    assert not any(Path(os.environ["RLHF_HOME"], "models").glob("*-sft-*"))


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-8] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_tiny_model_cache_is_built_again_to_the_recorded_bytes(tmp_path, monkeypatch):
    """The initial policy's sha256 is the warm_start stage's output: a damaged cache of a model the
    project builds is built again and must come out as recorded (the tiny model is deterministic)."""
    monkeypatch.setenv("RLHF_HOME", str(tmp_path / "home"))
    cfg = load_config(None, ["actor_rollout_ref.model.path=tiny", "actor_rollout_ref.model.warm_start.enable=false"])
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run_warm_start(cfg, run)
    recorded = read_manifest(run, None)["warm_start"]["outputs"]
    actor = initial_actor_path(cfg)
    assert list(recorded) == [str(actor)]
    _flip_last_byte(actor / "model.safetensors")
    result = run_warm_start(cfg, run)
    assert any("built again, the same bytes" in line for line in result.summary)
    assert read_manifest(run, None)["warm_start"]["outputs"] == recorded


def test_a_changed_user_model_is_refused_in_one_line(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = load_config(None, [f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.warm_start.enable=false"])
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run_warm_start(cfg, run)
    _flip_last_byte(model / "model.safetensors")
    with pytest.raises(RLHFError, match=rf"the initial policy {model} changed since this run recorded it .*: restore it"):
        run_warm_start(cfg, run)


def test_a_changed_shipped_demo_model_names_git_checkout(tmp_path, repo_root, monkeypatch):
    import rlhf_core.stages.warm_start as stage

    model = tmp_path / "data" / "models" / "demo"
    shutil.copytree(repo_root / "data" / "models" / "demo", model)
    monkeypatch.setattr(stage, "project_root", lambda: tmp_path)  # a checkout of its own, to damage
    cfg = load_config(None, [f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.warm_start.enable=false"])
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run_warm_start(cfg, run)
    _flip_last_byte(model / "model.safetensors")
    with pytest.raises(RLHFError, match=r"restore it \(`git checkout data/models/demo` restores the shipped one\)"):
        run_warm_start(cfg, run)
