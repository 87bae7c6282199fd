"""Defaults equal to verl's ppo_trainer.yaml where the key is verl's, and every difference documented.

VERL_DEFAULTS is a transcription of verl's generated ppo_trainer.yaml (volcengine/verl,
verl/trainer/config/_generated_ppo_trainer.yaml at b178a3c) for every key the two schemas share,
leaving out paths and the rollout engine name (verl's are placeholders). Interpolated defaults
("${oc.select:...}", e.g. the critic's mini-batch = the actor's) are checked in test_resolve.py.
"""

from __future__ import annotations

import re

from rlhf_core.config import flatten, load_config

VERL_DEFAULTS = {
    'actor_rollout_ref.actor.optim.optimizer': 'AdamW',
    'actor_rollout_ref.actor.optim.lr': 1e-06,
    'actor_rollout_ref.actor.optim.lr_warmup_steps_ratio': 0.0,
    'actor_rollout_ref.actor.optim.total_training_steps': -1,
    'actor_rollout_ref.actor.optim.weight_decay': 0.01,
    'actor_rollout_ref.actor.optim.lr_warmup_steps': -1,
    'actor_rollout_ref.actor.optim.betas': [0.9, 0.999],
    'actor_rollout_ref.actor.optim.min_lr_ratio': 0.0,
    'actor_rollout_ref.actor.optim.num_cycles': 0.5,
    'actor_rollout_ref.actor.optim.lr_scheduler_type': 'constant',
    'actor_rollout_ref.actor.optim.warmup_style': None,
    'actor_rollout_ref.actor.fsdp_config.param_offload': False,
    'actor_rollout_ref.actor.fsdp_config.optimizer_offload': False,
    'actor_rollout_ref.actor.fsdp_config.offload_policy': False,
    'actor_rollout_ref.actor.strategy': 'fsdp',
    'actor_rollout_ref.actor.ppo_mini_batch_size': 256,
    'actor_rollout_ref.actor.ppo_micro_batch_size': None,
    'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu': None,
    'actor_rollout_ref.actor.use_dynamic_bsz': False,
    'actor_rollout_ref.actor.ppo_max_token_len_per_gpu': 16384,
    'actor_rollout_ref.actor.clip_ratio': 0.2,
    'actor_rollout_ref.actor.clip_ratio_low': 0.2,
    'actor_rollout_ref.actor.clip_ratio_high': 0.2,
    'actor_rollout_ref.actor.policy_loss.loss_mode': 'vanilla',
    'actor_rollout_ref.actor.policy_loss.clip_cov_ratio': 0.0002,
    'actor_rollout_ref.actor.policy_loss.clip_cov_lb': 1.0,
    'actor_rollout_ref.actor.policy_loss.clip_cov_ub': 5.0,
    'actor_rollout_ref.actor.policy_loss.kl_cov_ratio': 0.0002,
    'actor_rollout_ref.actor.policy_loss.ppo_kl_coef': 0.1,
    'actor_rollout_ref.actor.clip_ratio_c': 3.0,
    'actor_rollout_ref.actor.loss_agg_mode': 'token-mean',
    'actor_rollout_ref.actor.loss_scale_factor': None,
    'actor_rollout_ref.actor.entropy_coeff': 0,
    'actor_rollout_ref.actor.use_kl_loss': False,
    'actor_rollout_ref.actor.kl_loss_coef': 0.001,
    'actor_rollout_ref.actor.kl_loss_type': 'low_var_kl',
    'actor_rollout_ref.actor.ppo_epochs': 1,
    'actor_rollout_ref.actor.shuffle': False,
    'actor_rollout_ref.actor.grad_clip': 1.0,
    'actor_rollout_ref.ref.log_prob_micro_batch_size': None,
    'actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu': None,
    'actor_rollout_ref.ref.fsdp_config.param_offload': False,
    'actor_rollout_ref.ref.fsdp_config.optimizer_offload': False,
    'actor_rollout_ref.ref.fsdp_config.offload_policy': False,
    'actor_rollout_ref.rollout.temperature': 1.0,
    'actor_rollout_ref.rollout.top_k': -1,
    'actor_rollout_ref.rollout.top_p': 1,
    'actor_rollout_ref.rollout.gpu_memory_utilization': 0.5,
    'actor_rollout_ref.rollout.tensor_model_parallel_size': 2,
    'actor_rollout_ref.rollout.log_prob_micro_batch_size': None,
    'actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu': None,
    'actor_rollout_ref.rollout.do_sample': True,
    'actor_rollout_ref.rollout.n': 1,
    'actor_rollout_ref.rollout.val_kwargs.top_k': -1,
    'actor_rollout_ref.rollout.val_kwargs.top_p': 1.0,
    'actor_rollout_ref.rollout.val_kwargs.temperature': 0,
    'actor_rollout_ref.rollout.val_kwargs.n': 1,
    'actor_rollout_ref.rollout.val_kwargs.do_sample': False,
    'actor_rollout_ref.model.tokenizer_path': None,
    'actor_rollout_ref.model.trust_remote_code': False,
    'actor_rollout_ref.model.enable_gradient_checkpointing': True,
    'actor_rollout_ref.model.use_remove_padding': True,
    'actor_rollout_ref.model.lora_rank': 0,
    'actor_rollout_ref.model.lora_alpha': 16,
    'actor_rollout_ref.model.target_modules': 'all-linear',
    'data.train_max_samples': -1,
    'data.val_max_samples': -1,
    'data.prompt_key': 'prompt',
    'data.reward_fn_key': 'data_source',
    'data.max_prompt_length': 512,
    'data.max_response_length': 512,
    'data.train_batch_size': 1024,
    'data.shuffle': True,
    'data.seed': None,
    'data.filter_overlong_prompts': False,
    'data.truncation': 'error',
    'critic.optim.optimizer': 'AdamW',
    'critic.optim.lr': 1e-05,
    'critic.optim.lr_warmup_steps_ratio': 0.0,
    'critic.optim.total_training_steps': -1,
    'critic.optim.weight_decay': 0.01,
    'critic.optim.lr_warmup_steps': -1,
    'critic.optim.betas': [0.9, 0.999],
    'critic.optim.min_lr_ratio': 0.0,
    'critic.optim.num_cycles': 0.5,
    'critic.optim.lr_scheduler_type': 'constant',
    'critic.optim.warmup_style': None,
    'critic.model.fsdp_config.param_offload': False,
    'critic.model.fsdp_config.optimizer_offload': False,
    'critic.model.fsdp_config.offload_policy': False,
    'critic.model.enable_gradient_checkpointing': True,
    'critic.model.use_remove_padding': False,
    'critic.strategy': 'fsdp',
    'critic.ppo_micro_batch_size': None,
    'critic.ppo_max_token_len_per_gpu': 32768,
    'critic.cliprange_value': 0.5,
    'critic.grad_clip': 1.0,
    'reward_model.enable': False,
    'reward_model.strategy': 'fsdp',
    'reward_model.model.trust_remote_code': False,
    'reward_model.model.fsdp_config.param_offload': False,
    'reward_model.micro_batch_size': None,
    'reward_model.micro_batch_size_per_gpu': None,
    'reward_model.max_length': None,
    'reward_model.reward_manager': 'naive',
    'algorithm.gamma': 1.0,
    'algorithm.lam': 1.0,
    'algorithm.adv_estimator': 'gae',
    'algorithm.norm_adv_by_std_in_grpo': True,
    'algorithm.use_kl_in_reward': False,
    'algorithm.kl_penalty': 'kl',
    'algorithm.kl_ctrl.type': 'fixed',
    'algorithm.kl_ctrl.kl_coef': 0.001,
    'algorithm.kl_ctrl.horizon': 10000,
    'algorithm.kl_ctrl.target_kl': 0.1,
    'custom_reward_function.path': None,
    'custom_reward_function.name': 'compute_score',
    'trainer.total_epochs': 30,
    'trainer.total_training_steps': None,
    'trainer.project_name': 'verl_examples',
    'trainer.experiment_name': 'gsm8k',
    'trainer.logger': ['console', 'wandb'],
    'trainer.nnodes': 1,
    'trainer.n_gpus_per_node': 8,
    'trainer.save_freq': -1,
    'trainer.val_before_train': True,
    'trainer.val_only': False,
    'trainer.test_freq': -1,
    'trainer.critic_warmup': 0,
    'trainer.device': 'cuda',
}


def _documented_keys(repo_root) -> set[str]:
    """Keys named in the first column of docs/verl.md's table of differing defaults."""
    text = (repo_root / "docs" / "verl.md").read_text()
    section = text.split("## Defaults that differ", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_.0-9]+)`", section, flags=re.M))


def test_defaults_equal_verl_or_are_documented(repo_root):
    ours = flatten(load_config())
    documented = _documented_keys(repo_root)
    differing = {k for k, v in VERL_DEFAULTS.items() if ours[k] != v}
    undocumented = sorted(differing - documented)
    assert not undocumented, f"defaults that differ from verl's without a row in docs/verl.md: {undocumented}"
    stale = sorted(k for k in documented & set(VERL_DEFAULTS) if k not in differing)
    assert not stale, f"docs/verl.md lists as different defaults that now equal verl's: {stale}"


def test_most_shared_defaults_are_verl_s():
    ours = flatten(load_config())
    same = sum(ours[k] == v for k, v in VERL_DEFAULTS.items())
    assert same >= len(VERL_DEFAULTS) - 20, same


def test_seed_recipe_lives_in_the_gsm8k_preset(repo_root):
    """The project's seed recipe (adaptive KL in reward, kl_coef 0.001, target 0.02, 'k1+', guard 0.05)."""
    flat = flatten(load_config(repo_root / "configs" / "gsm8k.yaml"))
    assert flat["algorithm.use_kl_in_reward"] is True
    assert flat["algorithm.kl_ctrl.type"] == "adaptive"
    assert flat["algorithm.kl_ctrl.kl_coef"] == 0.001
    assert flat["algorithm.kl_ctrl.target_kl"] == 0.02
    assert flat["actor_rollout_ref.actor.kl_loss_type"] == "k1+"
    assert flat["trainer.kl_rollback_threshold"] == 0.05


def test_the_clip_ratios_fall_back_to_clip_ratio_as_verls_do():
    assert load_config().actor_rollout_ref.actor.clip_ratios == (0.2, 0.2)
    # verl's yaml sets low/high to 0.2, so clip_ratio alone changes nothing ...
    assert load_config(None, ["actor_rollout_ref.actor.clip_ratio=0.3"]).actor_rollout_ref.actor.clip_ratios == (0.2, 0.2)
    # ... until they are null
    cfg = load_config(None, ["actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_low=null",
                             "actor_rollout_ref.actor.clip_ratio_high=0.28"])
    assert cfg.actor_rollout_ref.actor.clip_ratios == (0.3, 0.28)
