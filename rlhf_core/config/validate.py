"""Check a whole config: each section's own rules (``check`` beside its fields in ``schema.py``),
then the rules that compare sections, plus the FSDP → DeepSpeed mapping.

A rule about one section's fields belongs in that section's ``check``; only a rule that reads two
sections (a mini-batch against data.train_batch_size, micro-batching resolved across actor, critic,
rollout and ref) lives here.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from rlhf_core.algos.registry import estimator_takes
from rlhf_core.config.errors import ConfigError
from rlhf_core.notes import say_once
from rlhf_core.config.resolve import micro_batching, needs_baseline_rollout, uses_critic
from rlhf_core.config.schema import LOGGERS_HERE, DeepSpeedConfig, FSDPConfig, RLHFConfig, Section, require

__all__ = ["LOGGERS_HERE", "effective_deepspeed", "role_deepspeed", "validate"]  # control/plan.py reads LOGGERS_HERE here


def validate(cfg: RLHFConfig) -> None:
    _check_sections(cfg, "")
    d, a = cfg.data, cfg.actor_rollout_ref.actor
    require(a.ppo_mini_batch_size <= d.train_batch_size, "actor_rollout_ref.actor.ppo_mini_batch_size",
            f"counts prompts, as in verl, and must be <= data.train_batch_size={d.train_batch_size}",
            a.ppo_mini_batch_size)
    cm = cfg.critic.ppo_mini_batch_size
    require(cm is None or 0 < cm <= d.train_batch_size, "critic.ppo_mini_batch_size",
            f"counts prompts, as in verl, and must be in [1, data.train_batch_size={d.train_batch_size}]", cm)
    _validate_estimator(cfg)
    check_overlong_buffer(cfg)
    check_filter_groups(cfg)
    _validate_batching(cfg)


def _validate_estimator(cfg: RLHFConfig) -> None:
    """A critic exactly when the estimator reads values (or critic.enable says so), and the
    rollout.n and reward inputs the chosen estimator groups over."""
    alg = cfg.algorithm
    if cfg.critic.enable is False:
        require(not uses_estimator_values(cfg), "critic.enable",
                f"must not be false with algorithm.adv_estimator={alg.adv_estimator}, which reads the critic's "
                "values; choose a critic-free estimator (grpo, rloo, reinforce_plus_plus, ...) or drop the key",
                cfg.critic.enable)
    if not uses_critic(cfg):
        say_once(f"config: algorithm.adv_estimator={alg.adv_estimator} uses no critic: none is built, scored, trained "
                 "or checkpointed, and critic.* settings are ignored (critic.enable=true trains one anyway)")
    n = cfg.actor_rollout_ref.rollout.n
    if alg.adv_estimator == "grpo_passk":
        require(n >= 2, "actor_rollout_ref.rollout.n", "must be >= 2 for algorithm.adv_estimator=grpo_passk "
                "(it compares the best response of a group with the second best)", n)
    elif n == 1 and alg.adv_estimator in ("grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"):
        say_once(f"config: algorithm.adv_estimator={alg.adv_estimator} normalises within each prompt's "
                 "actor_rollout_ref.rollout.n responses, and n=1 leaves one per group; set rollout.n >= 2 "
                 "(verl's GRPO examples use 5)")
    if needs_baseline_rollout(cfg) and cfg.actor_rollout_ref.rollout.name == "offline":
        require(False, "actor_rollout_ref.rollout.name", f"cannot be offline with algorithm.adv_estimator="
                f"{alg.adv_estimator}: its greedy baseline responses must be generated; use hf or vllm", "offline")


OVERLONG = "reward_model.overlong_buffer"
FILTER_GROUPS = "algorithm.filter_groups"
FILTER_METRICS = ("reward", "acc", "score", "seq_reward", "seq_final_reward")  # schema.FilterGroupsConfig checks it

def check_overlong_buffer(cfg: RLHFConfig) -> None:
    """Refuse a buffer the formula cannot use: not shorter than the response budget (verl asserts
    it), or enabled together with a reward model (whose scores verl never shapes)."""
    buffer = cfg.reward_model.overlong_buffer
    if not buffer.enable:
        return
    if buffer.len >= cfg.data.max_response_length:
        raise ConfigError(f"{OVERLONG}.len={buffer.len} must be < data.max_response_length="
                          f"{cfg.data.max_response_length}: the penalty starts at max_response_length − len "
                          "tokens; shorten the buffer or raise the budget")
    if cfg.reward_model.enable:
        raise ConfigError(f"{OVERLONG}.enable=true shapes the rule-based reward only (verl's DAPO reward "
                          "manager returns reward-model scores unchanged); set reward_model.enable=false "
                          f"or {OVERLONG}.enable=false")


def check_filter_groups(cfg: RLHFConfig) -> None:
    """Refuse settings dynamic sampling cannot honour before anything is generated."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        return
    check_filter_metric(fg.metric, cfg.algorithm.use_kl_in_reward)
    if cfg.actor_rollout_ref.rollout.name == "offline":
        raise ConfigError(f"{FILTER_GROUPS}.enable=true needs a generating engine to draw more prompts; "
                          "actor_rollout_ref.rollout.name=offline imports a fixed set of responses: use hf or "
                          f"vllm, or set {FILTER_GROUPS}.enable=false")


def check_filter_metric(metric: str, use_kl_in_reward: bool) -> None:
    """The filter's metric cannot include the KL penalty: the rollout filters before the passes that give it."""
    if metric == "seq_final_reward" and use_kl_in_reward:
        raise ConfigError(f"{FILTER_GROUPS}.metric=seq_final_reward with algorithm.use_kl_in_reward=true: the final "
                          "reward subtracts the KL penalty, which needs the score stage's old and reference "
                          "log-probs, unknown when the rollout filters; use metric=seq_reward (the score "
                          "before the KL penalty) or algorithm.use_kl_in_reward=false")


def uses_estimator_values(cfg: RLHFConfig) -> bool:
    return estimator_takes(cfg.algorithm.adv_estimator, "values")


def _check_sections(section: Section, key: str) -> None:
    """``section.check(key)``, then every subsection's, depth-first in field order (a parent's
    rules come before its children's, so ``data`` is checked before anything that depends on it)."""
    section.check(key)
    for f in dataclasses.fields(section):
        child = getattr(section, f.name)
        if isinstance(child, Section):
            _check_sections(child, f"{key}.{f.name}" if key else f.name)


def effective_deepspeed(cfg: RLHFConfig, role: Literal["actor", "critic"] = "actor") -> DeepSpeedConfig:
    """A trained role's DeepSpeed settings (``role_deepspeed`` of its sections): the actor's
    ``actor_rollout_ref.actor.fsdp_config``, the critic's ``critic.model.fsdp_config``."""
    if role == "critic":
        return role_deepspeed(cfg.critic.deepspeed_config, cfg.critic.model.fsdp_config)
    return role_deepspeed(cfg.actor_rollout_ref.actor.deepspeed_config, cfg.actor_rollout_ref.actor.fsdp_config)


def role_deepspeed(ds: DeepSpeedConfig, fsdp: FSDPConfig) -> DeepSpeedConfig:
    """``ds`` with verl's FSDP offload flags folded in."""
    return DeepSpeedConfig(
        zero_stage=ds.zero_stage,
        dtype=ds.dtype,
        offload_optimizer=ds.offload_optimizer or fsdp.optimizer_offload or fsdp.offload_policy,
        offload_param=ds.offload_param or fsdp.param_offload or fsdp.offload_policy,
        config_path=ds.config_path,
    )


def _validate_batching(cfg: RLHFConfig) -> None:
    """Each role's micro-batching is complete (a count without dynamic batching, a budget that holds
    the longest sequence with it), named by the key to set."""
    d = cfg.data
    longest = d.max_prompt_length + d.max_response_length
    keys = {
        "actor": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
        "critic": ("critic.ppo_micro_batch_size_per_gpu", "critic.ppo_max_token_len_per_gpu"),
        "rollout": ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
        "ref": ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
    }
    for role, (count_key, budget_key) in keys.items():
        mb = micro_batching(cfg, role)
        if mb.use_dynamic_bsz:
            # a micro-batch must hold at least one full sequence, or dynamic batching cannot place it
            require(mb.token_budget >= longest, budget_key,
                    f"must be >= data.max_prompt_length + data.max_response_length = {longest}", mb.token_budget)
        else:
            require(mb.micro_batch_size > 0, count_key, "must be > 0", mb.micro_batch_size)
