"""Rollout: turn prompts into responses with an engine (``hf``, ``vllm``) or import logged ones
(``offline``). Engines load lazily: importing this package imports neither torch models nor vllm."""

from rlhf_core.rollout.base import (
    ENGINES, FINISH_LENGTH, FINISH_OFFLINE, FINISH_STOP, GeneratedSample, GenerationStats, RolloutEngine,
    SamplingParams, derive_seed, get_engine, trim_response,
)
from rlhf_core.rollout.generate import (
    GenerationSettings, build_rollout_engine, generate_responses, read_prompt_rows, rollout_metrics, rollout_table,
    train_sampling, validation_sampling,
)

__all__ = [
    "ENGINES", "FINISH_LENGTH", "FINISH_OFFLINE", "FINISH_STOP", "GeneratedSample", "GenerationSettings", "GenerationStats",
    "RolloutEngine", "SamplingParams", "build_rollout_engine", "derive_seed",
    "generate_responses", "get_engine", "read_prompt_rows", "rollout_metrics", "rollout_table",
    "train_sampling", "trim_response", "validation_sampling",
]
