"""Rules sit beside their fields (each section's ``check``) and algorithm names are looked up in the
registries at load, so a variant registered at runtime is a valid config value with no edit here."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.algos.registry import (ADV_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, register_adv_estimator,
                                      register_kl_estimator, register_policy_loss)
from rlhf_core.config import ConfigError, load_config
from rlhf_core.config.schema import ActorConfig, AlgorithmConfig, DataConfig, RolloutConfig, TrainerConfig


def test_runtime_registered_variants_are_valid_config_values():
    @register_adv_estimator("test_rules_outcome")
    def outcome(*, token_level_rewards, response_mask, **_):
        returns = token_level_rewards.sum(-1, keepdim=True) * response_mask
        return returns, returns

    @register_policy_loss("test_rules_plain_pg")
    def plain_pg(*, old_log_prob, log_prob, advantages, response_mask, **_):
        loss = -(advantages * log_prob * response_mask).sum() / response_mask.sum()
        return loss, {}

    @register_kl_estimator("test_rules_half_k1")
    def half_k1(logprob, ref_logprob):
        return 0.5 * (logprob - ref_logprob)

    overrides = ["algorithm.adv_estimator=test_rules_outcome",
                 "actor_rollout_ref.actor.policy_loss.loss_mode=test_rules_plain_pg",
                 "actor_rollout_ref.actor.kl_loss_type=test_rules_half_k1+",
                 "algorithm.kl_penalty=test_rules_half_k1"]
    try:
        cfg = load_config(None, overrides)
        assert cfg.algorithm.adv_estimator == "test_rules_outcome"
        assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "test_rules_plain_pg"
        # the estimator the config names is the one the registry hands to training
        assert ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator) is outcome
        mask = torch.ones(1, 2)
        assert torch.equal(outcome(token_level_rewards=torch.tensor([[0.0, 1.0]]), response_mask=mask)[0], mask)
    finally:
        ADV_ESTIMATORS.unregister("test_rules_outcome")
        POLICY_LOSSES.unregister("test_rules_plain_pg")
        KL_ESTIMATORS.unregister("test_rules_half_k1")
    # once gone from the registry, the same config no longer loads
    with pytest.raises(ConfigError, match="algorithm.adv_estimator='test_rules_outcome': unknown advantage"):
        load_config(None, overrides[:1])
    with pytest.raises(ConfigError, match="policy_loss.loss_mode='test_rules_plain_pg': unknown policy loss"):
        load_config(None, overrides[1:2])


def test_unknown_adv_estimator_fails_at_load_naming_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.adv_estimator=gea"])
    assert str(err.value) == ("algorithm.adv_estimator='gea': unknown advantage estimator; "
                              f"valid: {', '.join(ADV_ESTIMATORS.names())}")
    assert "gae" in ADV_ESTIMATORS.names()


@pytest.mark.parametrize("section, key, message", [
    (DataConfig(train_batch_size=0), "data", "data.train_batch_size=0: must be > 0"),
    (ActorConfig(clip_ratio=1.5), "actor_rollout_ref.actor",
     "actor_rollout_ref.actor.clip_ratio=1.5: must be in (0, 1)"),
    (ActorConfig(loss_agg_mode="token_mean"), "actor_rollout_ref.actor",
     "actor_rollout_ref.actor.loss_agg_mode='token_mean': unknown loss aggregation mode; valid: "),
    (RolloutConfig(name="offline"), "actor_rollout_ref.rollout",
     "actor_rollout_ref.rollout.offline_path=None: must name a JSONL/Parquet file when "
     "actor_rollout_ref.rollout.name=offline"),
    (AlgorithmConfig(adv_estimator="gea"), "algorithm", "algorithm.adv_estimator='gea': unknown advantage estimator"),
    (TrainerConfig(nproc=2, concurrent_critic_actor="always"), "trainer",
     "trainer.concurrent_critic_actor='always': 'always' needs trainer.nproc=1"),
])
def test_each_section_checks_its_own_fields(section, key, message):
    with pytest.raises(ConfigError) as err:
        section.check(key)
    assert str(err.value).startswith(message)
    type(section)().check(key)  # the defaults obey every rule


def test_cross_section_rules_stay_in_validate():
    # a mini-batch of 512 prompts is a valid actor section on its own; only data.train_batch_size refuses it
    ActorConfig(ppo_mini_batch_size=512).check("actor_rollout_ref.actor")
    with pytest.raises(ConfigError, match=r"ppo_mini_batch_size=512: .* <= data.train_batch_size=256"):
        load_config(None, ["data.train_batch_size=256", "actor_rollout_ref.actor.ppo_mini_batch_size=512"])


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.actor.policy_loss.loss_mode=dro"], r"policy_loss\.dro_beta=None: must be set > 0 with loss_mode=dro"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"],
     r"loss_mode=bypass_mode is selected by algorithm\.rollout_correction\.bypass_mode=true"),
    (["algorithm.adv_estimator=gdpo"], r"algorithm\.gdpo_reward_keys=None: gdpo normalises each reward component"),
    (["algorithm.gdpo_reward_keys=[acc]", "algorithm.gdpo_reward_weights=[1.0,2.0]"],
     r"gdpo_reward_weights=.*one weight per gdpo_reward_keys entry"),
    (["algorithm.rollout_correction.rollout_is_threshold=5_2"],
     r"algorithm\.rollout_correction: rollout_is_threshold '5_2': bounds must be positive with lower <= upper"),
    (["algorithm.rollout_correction.rollout_rs=seq_max_k1", "algorithm.rollout_correction.rollout_rs_threshold=2"],
     r"algorithm\.rollout_correction: rollout_rs 'seq_max_k1': unknown criterion \['seq_max_k1'\]; valid: token_k1"),
    (["algorithm.rollout_correction.rollout_rs=token_k2"],
     r"algorithm\.rollout_correction: rollout_rs_threshold must be set when rollout_rs is"),
    (["algorithm.rollout_correction.rollout_rs=token_k3", "algorithm.rollout_correction.rollout_rs_threshold=0.5_2"],
     r"rollout_rs_threshold '0\.5_2' for token_k3: one positive upper bound \(no '_'\)"),
    (["algorithm.rollout_correction.rollout_is=tokens"], r"rollout_is: expected one of 'token', 'sequence' or null"),
    (["data.max_val_samples=-2"], r"data\.max_val_samples=-2: must be -1 \(all\), 0 \(no validation set\)"),
])
def test_verl_0_9_1_keys_are_checked_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_verl_0_9_1_keys_load_with_verls_values():
    cfg = load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=dro",
                             "actor_rollout_ref.actor.policy_loss.dro_beta=0.1", "actor_rollout_ref.actor.tau_pos=1.2",
                             "algorithm.rollout_correction.rollout_is=sequence",
                             "algorithm.rollout_correction.rollout_is_threshold=0.5_5.0",
                             "algorithm.rollout_correction.rollout_rs=token_k1,seq_mean_k3",
                             "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0,0.01",
                             "actor_rollout_ref.actor.loss_agg_mode=token-sum"])
    c = cfg.algorithm.rollout_correction
    assert (c.rollout_is, c.rollout_is_threshold, c.rollout_rs_threshold) == ("sequence", "0.5_5.0", "0.5_2.0,0.01")
    assert c.enabled and cfg.actor_rollout_ref.actor.policy_loss.dro_beta == 0.1
    assert load_config(None, ["algorithm.rollout_correction.rollout_is_threshold=3"]).algorithm.rollout_correction \
        .rollout_is_threshold == 3.0
