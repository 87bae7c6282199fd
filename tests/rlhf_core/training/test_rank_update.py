"""What an update is built from and what its loop reads, each read from the config once: the engines'
settings and the key a resident trainer keeps its engines by, the training loop's settings."""

from __future__ import annotations

import pytest

from rlhf_core.config import load_config
from rlhf_core.config.reads import build
from rlhf_core.training.rank_update import engine_key
from rlhf_core.training.settings import engine_settings, update_settings


def _key(*overrides: str, world_size: int = 1, total_steps: int = 0) -> str:
    return engine_key(build(engine_settings, load_config(None, list(overrides)), device="cpu", world_size=world_size,
                            total_steps=total_steps))


def test_the_engines_are_kept_across_a_retry_that_only_lowers_the_learning_rate():
    assert _key() == _key("actor_rollout_ref.actor.optim.lr=5e-7", "critic.optim.lr=1e-6")


@pytest.mark.parametrize("change", [
    "actor_rollout_ref.actor.deepspeed_config.zero_stage=2",
    "critic.deepspeed_config.dtype=bf16",
    "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    "actor_rollout_ref.actor.grad_clip=0.5",
    "critic.model.enable_gradient_checkpointing=true",
    "actor_rollout_ref.model.override_config.attn_implementation=eager",
    "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",
    "critic.optim.lr_scheduler_type=cosine",
    "algorithm.adv_estimator=grpo",  # no critic engine
])
def test_any_setting_an_engine_is_built_from_rebuilds_it(change):
    assert _key(change) != _key()


def test_the_world_and_the_schedule_length_rebuild_the_engines():
    assert _key(world_size=2) != _key()
    assert _key("actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", total_steps=10) != \
        _key("actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", total_steps=20)


def test_the_loop_settings_follow_verls_critic_fallbacks():
    cfg = load_config(None, ["actor_rollout_ref.actor.ppo_epochs=3", "actor_rollout_ref.actor.clip_ratio_low=0.3",
                             "actor_rollout_ref.actor.optim.lr=2e-6", "critic.optim.lr=4e-6"])
    settings = build(update_settings, cfg, world_size=2)
    assert settings.critic is not None and settings.critic.epochs == 3  # critic.ppo_epochs null: the actor's
    assert (settings.actor.loss_fn.clip_ratio_low, settings.actor.loss_fn.clip_ratio_high) == (0.3, 0.2)
    assert settings.learning_rates == (2e-6, 4e-6)
    assert settings.lora is None
    assert build(update_settings, load_config(None, ["algorithm.adv_estimator=grpo"]), world_size=1).critic is None


def test_verls_offload_flag_reaches_the_engine_and_its_key():
    zero1 = ("actor_rollout_ref.actor.deepspeed_config.zero_stage=1",)
    offloaded = load_config(None, [*zero1, "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"])
    ds = build(engine_settings, offloaded, device="cpu", world_size=1).actor.ds_config
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert _key(*zero1, "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true") != _key(*zero1)


def test_the_runs_length_is_read_and_its_prompts_counted_only_when_a_schedule_needs_them():
    from rlhf_core.config import ConfigError
    from rlhf_core.training.settings import run_length

    def never() -> int:
        raise AssertionError("prompts counted though the count is not needed")

    assert build(run_length, load_config(None, ["trainer.total_iterations=5"])).steps(never) == 0  # constant lr
    cosine = "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"
    assert build(run_length, load_config(None, [cosine, "trainer.total_training_steps=7"])).steps(never) == 7
    counted = build(run_length, load_config(None, [cosine, "trainer.total_epochs=2", "data.train_batch_size=4",
                                                       "actor_rollout_ref.actor.ppo_mini_batch_size=4"]))
    assert counted.steps(lambda: 10) == 2 * (10 // 4)  # verl's dataloader drops the partial batch
    with pytest.raises(ConfigError, match="trainer.total_iterations"):
        counted.steps(lambda: None)
