"""Scoring passes: per-token log-probs (actor, reference) and values (critic) over packed micro-batches."""

from rlhf_core.scoring.logprobs import (
    ROW_TOKENS,
    Throughput,
    compute_token_logprobs,
    compute_token_values,
    plan_micro_batches,
)
from rlhf_core.scoring.models import (
    load_causal_lm,
    load_critic,
    same_weights,
    scoring_device,
    scoring_dtype,
    weights_fingerprint,
)

__all__ = [
    "ROW_TOKENS", "Throughput", "compute_token_logprobs", "compute_token_values", "load_causal_lm",
    "load_critic", "plan_micro_batches", "same_weights", "scoring_device", "scoring_dtype",
    "weights_fingerprint",
]
