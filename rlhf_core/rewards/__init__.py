"""Rewards: verl-compatible rule-based reward functions routed by data.reward_fn_key, and reward models."""

from rlhf_core.rewards.registry import (
    GSM8K_SOURCES,
    get_reward_fn,
    normalize_result,
    register_reward,
    registered_sources,
    reward_function,
    routing_value,
)

__all__ = ["GSM8K_SOURCES", "get_reward_fn", "normalize_result", "register_reward", "registered_sources",
           "reward_function", "routing_value"]
