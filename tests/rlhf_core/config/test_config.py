"""Typed config: seed names and defaults, presets + overrides, errors that name the key and rule."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlhf_core.config import (ConfigError, apply_overrides, config_from_dict, config_hash, effective_deepspeed,
                              flatten, load_config, to_dict, valid_keys)

# every parameter the seed design names (its values now live in configs/gsm8k.yaml: test_verl_defaults.py)
SEED_KEYS = [
    "data.train_batch_size", "actor_rollout_ref.model.use_remove_padding", "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_c", "actor_rollout_ref.actor.grad_clip", "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.kl_loss_type", "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.strategy", "actor_rollout_ref.actor.fsdp_config.offload_policy",
    "actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.model.lora_rank", "algorithm.use_kl_in_reward", "algorithm.kl_ctrl.type",
    "algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.target_kl", "trainer.test_freq", "trainer.save_freq",
]


def test_seed_keys_exist():
    flat = flatten(load_config())
    missing = [key for key in SEED_KEYS if key not in flat]
    assert not missing


def test_preset_then_overrides(repo_root):
    cfg = load_config(repo_root / "configs" / "demo.yaml",
                      ["algorithm.kl_ctrl.kl_coef=0.002", "actor_rollout_ref.actor.use_kl_loss=true",
                       "data.train_files=[a.jsonl,b.jsonl]", "actor_rollout_ref.actor.optim.lr=1e-6"])
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.002
    assert cfg.actor_rollout_ref.actor.use_kl_loss is True
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.data.train_batch_size == 64  # from the preset


def test_unknown_key_names_it_and_suggests():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.kl_ctrl.kl_coeff=0.1"])
    assert "algorithm.kl_ctrl.kl_coeff" in str(err.value)
    assert "algorithm.kl_ctrl.kl_coef" in str(err.value)
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.clip_ratio"):
        load_config(None, ["clip_ratio=0.1"])  # right leaf, wrong section


def test_unknown_key_in_preset(tmp_path):
    preset = tmp_path / "bad.yaml"
    preset.write_text("actor_rollout_ref:\n  actor:\n    clip_ratoi: 0.1\n")
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.clip_ratoi.*clip_ratio"):
        load_config(preset)


@pytest.mark.parametrize("override, fragment", [
    ("actor_rollout_ref.actor.clip_ratio=abc", "expected a number"),
    ("actor_rollout_ref.actor.clip_ratio=1.5", "must be in (0, 1)"),
    ("actor_rollout_ref.actor.clip_ratio_c=0.9", "must be > 1"),
    ("actor_rollout_ref.actor.kl_loss_type=k9", "must be one of"),
    ("algorithm.kl_ctrl.type=pid", "one of 'fixed', 'adaptive'"),
    ("data.train_batch_size=2.5", "expected an integer"),
    ("actor_rollout_ref.actor.use_kl_loss=maybe", "expected true/false"),
    ("actor_rollout_ref.actor.deepspeed_config.zero_stage=4", "must be 0, 1, 2 or 3"),
])
def test_bad_values_state_the_rule(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert override.split("=")[0] in str(err.value)
    assert fragment in str(err.value)


@pytest.mark.parametrize("budget_key", ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                                        "critic.ppo_max_token_len_per_gpu",
                                        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"])
def test_token_budget_must_hold_the_longest_sequence_with_dynamic_batching(budget_key):
    with pytest.raises(ConfigError, match=f"{budget_key}=10: must be >= data.max_prompt_length"):
        load_config(None, ["actor_rollout_ref.actor.use_dynamic_bsz=true", f"{budget_key}=10"])
    load_config(None, [f"{budget_key}=10"])  # without dynamic batching no budget is used


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(None, ["algorithm.gamma"])


def test_roundtrip_and_hash_sections():
    cfg = load_config(None, ["algorithm.lam=0.95"])
    again = config_from_dict(to_dict(cfg))
    assert to_dict(again) == to_dict(cfg)
    other = apply_overrides(cfg, ["trainer.total_iterations=3"])
    assert config_hash(cfg, ["data."]) == config_hash(other, ["data."])
    assert config_hash(cfg) != config_hash(other)


def test_fsdp_flags_map_to_deepspeed():
    cfg = load_config(None, ["actor_rollout_ref.actor.strategy=fsdp2",
                             "actor_rollout_ref.actor.fsdp_config.offload_policy=true"])
    ds = effective_deepspeed(cfg)
    assert ds.offload_optimizer and ds.offload_param
    cfg = load_config(None, ["actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"])
    ds = effective_deepspeed(cfg)
    assert ds.offload_optimizer and not ds.offload_param


def test_valid_keys_cover_sections():
    keys = valid_keys()
    assert "actor_rollout_ref.actor.fsdp_config" in keys
    assert "algorithm.kl_ctrl.horizon" in keys


def test_cli_config_show(repo_root):
    out = subprocess.run([sys.executable, "-m", "rlhf_cli.main", "config", "show", "--flat",
                          "-c", str(repo_root / "configs" / "demo.yaml"), "algorithm.kl_ctrl.kl_coef=0.002"],
                         capture_output=True, text=True, check=True).stdout
    assert "algorithm.kl_ctrl.kl_coef=0.002" in out.splitlines()
    bad = subprocess.run([sys.executable, "-m", "rlhf_cli.main", "config", "show", "algorithm.kl_ctrl.kl_coeff=1"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert "unknown config key 'algorithm.kl_ctrl.kl_coeff'" in bad.stderr
    assert "Traceback" not in bad.stderr
