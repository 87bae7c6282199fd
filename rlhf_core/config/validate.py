"""Check a whole config: each section's own rules (``check`` beside its fields in ``schema.py``),
then the rules that compare sections, plus the FSDP → DeepSpeed mapping.

A rule about one section's fields belongs in that section's ``check``; only a rule that reads two
sections (a mini-batch against data.train_batch_size, micro-batching resolved across actor, critic,
rollout and ref) lives here.
"""

from __future__ import annotations

import dataclasses

from rlhf_core.config.resolve import micro_batching
from rlhf_core.config.schema import LOGGERS_HERE, DeepSpeedConfig, RLHFConfig, Section, require

__all__ = ["LOGGERS_HERE", "effective_deepspeed", "validate"]  # run/plan.py reads LOGGERS_HERE here


def validate(cfg: RLHFConfig) -> None:
    _check_sections(cfg, "")
    d, a = cfg.data, cfg.actor_rollout_ref.actor
    require(a.ppo_mini_batch_size <= d.train_batch_size, "actor_rollout_ref.actor.ppo_mini_batch_size",
            f"counts prompts, as in verl, and must be <= data.train_batch_size={d.train_batch_size}",
            a.ppo_mini_batch_size)
    cm = cfg.critic.ppo_mini_batch_size
    require(cm is None or 0 < cm <= d.train_batch_size, "critic.ppo_mini_batch_size",
            f"counts prompts, as in verl, and must be in [1, data.train_batch_size={d.train_batch_size}]", cm)
    _validate_batching(cfg)


def _check_sections(section: Section, key: str) -> None:
    """``section.check(key)``, then every subsection's, depth-first in field order (a parent's
    rules come before its children's, so ``data`` is checked before anything that depends on it)."""
    section.check(key)
    for f in dataclasses.fields(section):
        child = getattr(section, f.name)
        if isinstance(child, Section):
            _check_sections(child, f"{key}.{f.name}" if key else f.name)


def effective_deepspeed(cfg: RLHFConfig) -> DeepSpeedConfig:
    """The actor's DeepSpeed settings with verl's FSDP offload flags folded in."""
    a = cfg.actor_rollout_ref.actor
    ds, fsdp = a.deepspeed_config, a.fsdp_config
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
