"""Derived settings against transcriptions of how verl derives them (verl/workers/fsdp_workers.py,
verl/trainer/ppo/ray_trainer.py, the ${oc.select:...} defaults of ppo_trainer.yaml)."""

from __future__ import annotations

import pytest

from rlhf_core.config import load_config
from rlhf_core.config.resolve import (DEFAULT_MICRO_BATCH, critic_epochs, critic_loss_agg_mode,
                                      critic_shuffle, critic_value_batching, loss_scale_factor, micro_batching,
                                      mini_batch_sequences, scheduler_type, steps_per_epoch, total_iterations,
                                      update_world_size, warmup_steps)


def verl_per_rank_mini_batch(ppo_mini_batch_size: int, rollout_n: int, world_size: int) -> int:
    """verl's worker: the mini-batch is multiplied by rollout.n, then divided over the data-parallel ranks."""
    size = ppo_mini_batch_size * rollout_n
    return size // world_size


def verl_total_training_steps(num_prompts: int, train_batch_size: int, total_epochs: int,
                              total_training_steps: int | None) -> int:
    """verl's trainer: len(dataloader) (drop_last=True) × epochs, unless total_training_steps is set."""
    steps = (num_prompts // train_batch_size) * total_epochs
    if num_prompts < train_batch_size:  # verl refuses to start on an empty dataloader; one small step here
        steps = total_epochs
    return total_training_steps if total_training_steps is not None else steps


def verl_warmup(lr_warmup_steps: int, ratio: float, total_steps: int) -> int:
    return int(ratio * total_steps) if lr_warmup_steps < 0 else lr_warmup_steps


@pytest.mark.parametrize("mini, n, world", [(64, 1, 1), (64, 4, 2), (256, 5, 8), (3, 3, 2)])
def test_mini_batch_counts_prompts_times_n(mini, n, world):
    cfg = load_config(None, [f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}", f"actor_rollout_ref.rollout.n={n}"])
    assert mini_batch_sequences(cfg, "actor") // world == verl_per_rank_mini_batch(mini, n, world)
    assert mini_batch_sequences(cfg, "critic") == mini * n  # critic null = the actor's
    cfg = load_config(None, [f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}", f"actor_rollout_ref.rollout.n={n}",
                             "critic.ppo_mini_batch_size=2"])
    assert mini_batch_sequences(cfg, "critic") == 2 * n


@pytest.mark.parametrize("prompts, batch, epochs, steps", [(7473, 256, 15, None), (7473, 256, 15, 1), (100, 64, 3, None),
                                                          (10, 64, 2, None)])
def test_training_steps_as_verl_derives_them(prompts, batch, epochs, steps):
    overrides = [f"data.train_batch_size={batch}", f"trainer.total_epochs={epochs}",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=1"]
    if steps is not None:
        overrides.append(f"trainer.total_training_steps={steps}")
    cfg = load_config(None, overrides)
    assert total_iterations(cfg, prompts) == verl_total_training_steps(prompts, batch, epochs, steps)
    assert steps_per_epoch(cfg.data.train_batch_size, prompts) == max(1, prompts // batch)
    assert total_iterations(load_config(None, overrides + ["trainer.total_iterations=4"]), prompts) == 4


@pytest.mark.parametrize("steps, ratio, total", [(-1, 0.0, 100), (-1, 0.1, 435), (5, 0.5, 100), (0, 0.3, 10)])
def test_warmup_steps(steps, ratio, total):
    cfg = load_config(None, [f"actor_rollout_ref.actor.optim.lr_warmup_steps={steps}",
                             f"actor_rollout_ref.actor.optim.lr_warmup_steps_ratio={ratio}"])
    assert warmup_steps(cfg.actor_rollout_ref.actor.optim, total) == verl_warmup(steps, ratio, total)


def test_warmup_style_wins_over_lr_scheduler_type():
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.warmup_style=cosine"])
    assert scheduler_type(cfg.actor_rollout_ref.actor.optim) == "cosine"
    assert scheduler_type(load_config().actor_rollout_ref.actor.optim) == "constant"


def test_interpolated_defaults_follow_the_actor():
    """verl's ${oc.select:actor_rollout_ref.actor.*} defaults: critic epochs/shuffle/agg mode/dynamic
    batching, and the log-prob budgets, are the actor's unless set."""
    cfg = load_config(None, ["actor_rollout_ref.actor.ppo_epochs=3", "actor_rollout_ref.actor.shuffle=true",
                             "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
                             "actor_rollout_ref.actor.use_dynamic_bsz=true",
                             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096"])
    a, c = cfg.actor_rollout_ref.actor, cfg.critic
    assert critic_epochs(a, c) == 3 and critic_shuffle(a, c) is True
    assert critic_loss_agg_mode(a, c) == "seq-mean-token-mean"
    for role in ("rollout", "ref"):
        mb = micro_batching(cfg, role)
        assert mb.use_dynamic_bsz and mb.token_budget == 4096
    assert micro_batching(cfg, "critic").use_dynamic_bsz
    assert micro_batching(cfg, "critic").token_budget == 32768  # verl's critic has its own budget
    cfg = load_config(None, ["critic.ppo_epochs=2", "critic.shuffle=false", "critic.loss_agg_mode=token-mean",
                             "actor_rollout_ref.actor.ppo_epochs=3", "critic.ppo_max_token_len_per_gpu=2048",
                             "critic.forward_max_token_len_per_gpu=1500", "critic.use_dynamic_bsz=true"])
    a, c = cfg.actor_rollout_ref.actor, cfg.critic
    assert critic_epochs(a, c) == 2 and critic_shuffle(a, c) is False
    assert critic_value_batching(cfg.actor_rollout_ref, cfg.critic).token_budget == 1500
    assert micro_batching(cfg, "critic").token_budget == 2048


def test_micro_batch_sizes_per_gpu_and_deprecated_global():
    cfg = load_config(None, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
                             "actor_rollout_ref.ref.log_prob_micro_batch_size=16", "critic.ppo_micro_batch_size_per_gpu=2"])
    assert micro_batching(cfg, "actor").micro_batch_size == 4
    assert micro_batching(cfg, "rollout").micro_batch_size == 8
    assert micro_batching(cfg, "ref", world_size=4).micro_batch_size == 4  # verl divides the global size
    assert micro_batching(cfg, "critic").micro_batch_size == 2
    assert critic_value_batching(cfg.actor_rollout_ref, cfg.critic).micro_batch_size == 2
    assert micro_batching(load_config(), "actor").micro_batch_size == DEFAULT_MICRO_BATCH


def test_loss_scale_factor_is_the_configured_response_length():
    cfg = load_config(None, ["data.max_response_length=300"])
    assert loss_scale_factor(cfg.actor_rollout_ref.actor, cfg.data.max_response_length) == 300.0
    cfg = load_config(None, ["actor_rollout_ref.actor.loss_scale_factor=7"])
    assert loss_scale_factor(cfg.actor_rollout_ref.actor, cfg.data.max_response_length) == 7.0


def test_update_world_size():
    cfg = load_config(None, ["trainer.n_gpus_per_node=4"])
    assert update_world_size(cfg.trainer, cuda_devices=8) == 4
    assert update_world_size(cfg.trainer, cuda_devices=0) == 1
    assert update_world_size(load_config().trainer, cuda_devices=8) == 8
    assert update_world_size(load_config(None, ["trainer.nproc=2"]).trainer, cuda_devices=0) == 2
