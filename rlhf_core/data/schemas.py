"""Declared pyarrow schemas of every table a stage writes: the contract between stages.

Rows of the iteration tables are identified by (prompt_id, sample_index). Per-token list columns
(log-probs, values, rewards, advantages, returns) have exactly ``response_length`` entries, aligned
with ``response_token_ids``: entry t belongs to response token t.

``extra_info`` is verl's free-form per-row dict (any keys, any nesting). A declared struct cannot
hold keys that differ from file to file, so it is stored as JSON text (``encode_extra_info``) in the
prompts table and carried unchanged into rollout / scored / advantages; DuckDB reads it with
``extra_info->>'$.index'`` or ``json_extract(extra_info, '$.split')``.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import pyarrow as pa

CHAT_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])

# prompts/train.parquet and prompts/val.parquet — verl's columns plus the tokenized prompt
PROMPTS = pa.schema([
    ("prompt_id", pa.string()),          # stable id: the source's id column, else a content hash
    ("data_source", pa.string()),        # verl's data_source column
    ("reward_source", pa.string()),      # value of the data.reward_fn_key column: routes the reward function
    ("prompt", pa.list_(CHAT_MESSAGE)),  # chat messages, verl's `prompt` column
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.string()),         # JSON object text: verl's extra_info, every key kept
    ("source_file", pa.string()),        # where the row came from
    ("source_row", pa.int64()),          # 0-based row (line) number in source_file
    ("prompt_text", pa.string()),        # chat template applied, generation prompt opened (cut when truncated)
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("prompt_length", pa.int32()),
    ("prompt_tokens_cut", pa.int32()),   # tokens removed by data.truncation (0 = the whole prompt)
])


def encode_extra_info(info: Optional[dict[str, Any]]) -> str:
    """extra_info as the JSON text stored in the tables (None → "{}"); keys keep their order."""
    return json.dumps(info or {}, ensure_ascii=False, default=str)


def decode_extra_info(text: Optional[str]) -> dict[str, Any]:
    """The dict a reward function receives (verl passes extra_info as a dict); null → {}."""
    return json.loads(text) if text else {}


# prompts/rejects.parquet — nothing is dropped silently
REJECTS = pa.schema([
    ("source_file", pa.string()),
    ("source_row", pa.int64()),          # 0-based row (line) number in the source file
    ("reason", pa.string()),             # e.g. "missing answer", "prompt too long (612 > 512 tokens)"
    ("raw", pa.string()),                # the offending row, truncated to 1,000 characters
])

# pack/generation_batches.parquet — the train prompts shuffled per epoch (seeded), cut into
# iteration slots of data.train_batch_size prompts, each slot packed into generation batches whose
# (prompt + max response) × n tokens fit rollout.generation_batch_tokens
GENERATION_BATCHES = pa.schema([
    ("slot", pa.int32()),                # iteration k uses slot (k - 1) % num_slots
    ("batch_id", pa.int32()),            # order within the slot
    ("prompt_ids", pa.list_(pa.string())),
    ("num_prompts", pa.int32()),
    ("prompt_tokens", pa.int64()),       # real prompt tokens in the batch
    ("padded_tokens", pa.int64()),       # slots a left-padded batch occupies: num_prompts × longest prompt
])

# iter_K/rollout.parquet
ROLLOUT = pa.schema([
    ("prompt_id", pa.string()),
    ("sample_index", pa.int32()),        # 0 .. n-1 per prompt
    ("iteration", pa.int32()),
    ("data_source", pa.string()),
    ("ground_truth", pa.string()),
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("response_text", pa.string()),
    ("response_token_ids", pa.list_(pa.int32())),  # EOS included when generation stopped on it
    ("response_length", pa.int32()),
    ("finish_reason", pa.string()),      # "stop" (EOS) | "length" (hit max_response_length) | "offline"
    ("engine", pa.string()),             # "hf" | "vllm" | "offline"
    ("sampling_seed", pa.int64()),
    ("reward_source", pa.string()),      # the prompt's reward_source (data.reward_fn_key's value)
    ("extra_info", pa.string()),         # the prompt's extra_info JSON, for reward functions and queries
    ("uid", pa.string()),                # verl's uid: one per prompt of the iteration, shared by its n responses
    # the engine's own log-probability of each sampled token, under the distribution it sampled from
    # (verl's logprobs_mode=processed_logprobs: log_softmax(logits / temperature) after any top-k / top-p
    # cut; a greedy rollout's at temperature 1); null for imported (offline) responses
    ("rollout_log_probs", pa.list_(pa.float32())),
])

# iter_K/scored.parquet = rollout columns + these
SCORED_EXTRA = [
    ("reward", pa.float32()),            # sequence-level score from the reward function / model
    ("reward_extra", pa.string()),       # JSON of a dict-valued compute_score result (else "{}")
    ("old_log_probs", pa.list_(pa.float32())),
    ("ref_log_probs", pa.list_(pa.float32())),
    ("values", pa.list_(pa.float32())),               # the critic's; zeros in a run without a critic
    ("reward_baseline", pa.float32()),               # score of the prompt's greedy response (remax), else null
    ("sum_pi_squared", pa.list_(pa.float32())),      # sum over the vocabulary of pi^2 (actor.calculate_sum_pi_squared), else null
]
SCORED = pa.schema(list(ROLLOUT) + [pa.field(n, t) for n, t in SCORED_EXTRA])

# iter_K/advantages.parquet = scored columns + these (the update stage reads only this table)
ADVANTAGES_EXTRA = [
    ("token_level_rewards", pa.list_(pa.float32())),  # score on the last token minus kl_coef·KL
    ("advantages", pa.list_(pa.float32())),           # GAE, whitened when algorithm.norm_adv
    ("returns", pa.list_(pa.float32())),              # un-whitened advantages + values
    ("rollout_is_weights", pa.list_(pa.float32())),   # rollout correction's importance weights, else null
    ("response_mask", pa.list_(pa.bool_())),          # false where rollout correction rejected a token, else null
]
ADVANTAGES = pa.schema(list(SCORED) + [pa.field(n, t) for n, t in ADVANTAGES_EXTRA])

VALIDATION = pa.schema([
    ("iteration", pa.int32()),
    ("prompt_id", pa.string()),
    ("sample_index", pa.int32()),
    ("data_source", pa.string()),
    ("ground_truth", pa.string()),
    ("response_text", pa.string()),
    ("response_length", pa.int32()),
    ("finish_reason", pa.string()),
    ("reward", pa.float32()),
    ("correct", pa.bool_()),
])
"""iter_k/validation.parquet: one row per validation response (stage validate)."""
