"""Validation: how often the current actor answers the held-out prompts correctly.

    val/accuracy = share of validation prompts whose response scores >= 1 under the reward function

One response per prompt (prompts/val.parquet), sampled at the rollout temperature through the
rollout engine (``rollout.generate.generate_responses``) with a fixed seed, so two validations
differ only by the weights. Responses and scores go to iter_k/validation.parquet (the DuckDB view
``validation``). The same sampling feeds the KL guard's optional on-policy check on validation
prompts (``trainer.kl_guard_val_prompts``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from rlhf_core.config import RLHFConfig
from rlhf_core.io.atomic import atomic_write_parquet
from rlhf_core.io.manifest import read_manifest
from rlhf_core.io.pointers import actor_path
from rlhf_core.io.rundir import RunDir
from rlhf_core.io.timing import TABLE_READ, timed
from rlhf_core.stages.base import StageResult, execute_stage

VALIDATION = pa.schema([
    ("iteration", pa.int32()),
    ("prompt_id", pa.string()),
    ("data_source", pa.string()),
    ("ground_truth", pa.string()),
    ("response_text", pa.string()),
    ("response_length", pa.int32()),
    ("finish_reason", pa.string()),
    ("reward", pa.float32()),
    ("correct", pa.bool_()),
])

VALIDATION_SECTIONS = ("data.max_response_length", "actor_rollout_ref.rollout.temperature",
                       "actor_rollout_ref.rollout.top_p", "actor_rollout_ref.rollout.top_k",
                       "actor_rollout_ref.rollout.seed", "actor_rollout_ref.rollout.name",
                       "custom_reward_function.")
CORRECT_AT = 1.0
"""A response counts as correct when its reward is at least this (the rule-based score of a right answer)."""


def validation_path(run: RunDir, k: int) -> Path:
    return run.iter_dir(k) / "validation.parquet"


def validation_actor(cfg: RLHFConfig, run: RunDir, k: int) -> Path:
    """The actor validated after iteration ``k``: its own checkpoint when the guard committed it,
    else whatever is last-good (a rolled-back iteration validates the policy that survived)."""
    if read_manifest(run, k).get("guard", {}).get("committed") and (run.checkpoint(k) / "actor").is_dir():
        return run.checkpoint(k) / "actor"
    return actor_path(cfg, run)


def sample_val_responses(cfg: RLHFConfig, run: RunDir, actor_dir: Path, limit: Optional[int] = None,
                         seed_offset: Any = "validation") -> tuple[list[dict], list]:
    """(prompt rows, one GeneratedSample per row) on the first ``limit`` validation prompts."""
    from rlhf_core.rollout.base import derive_seed
    from rlhf_core.rollout.generate import generate_responses, read_prompt_rows, sampling_from_config

    with timed(TABLE_READ):
        rows = read_prompt_rows(run.val_prompts)
    rows = rows[:limit] if limit else rows
    sampling = sampling_from_config(cfg, seed=derive_seed(cfg.actor_rollout_ref.rollout.seed, seed_offset))
    from dataclasses import replace

    sampling = replace(sampling, n=1)
    samples, _ = generate_responses(cfg, actor_dir, rows, sampling, desc="validation")
    return rows, samples


def score_samples(cfg: RLHFConfig, rows: list[dict], samples: list) -> list[float]:
    from rlhf_core.rewards import get_reward_fn, normalize_result

    reward_fn = get_reward_fn(cfg)
    scores = []
    for s in samples:
        row = rows[s.prompt_index]
        truth = (row.get("reward_model") or {}).get("ground_truth")
        result = reward_fn(row.get("data_source"), s.text, truth, None)
        scores.append(normalize_result(result, where=f"validation prompt {row['prompt_id']}")[0])
    return scores


def run_validate(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None, force: bool = False) -> StageResult:
    """Sample the validation prompts with the current actor; write iter_k/validation.parquet."""
    if iteration is None:
        raise ValueError("the validate stage needs an iteration (the actor after that iteration is validated)")
    k = iteration
    actor = validation_actor(cfg, run, k)

    def body() -> StageResult:
        rows, samples = sample_val_responses(cfg, run, actor)
        scores = score_samples(cfg, rows, samples)
        table = pa.Table.from_pylist([{
            "iteration": k, "prompt_id": rows[s.prompt_index]["prompt_id"],
            "data_source": rows[s.prompt_index].get("data_source"),
            "ground_truth": (rows[s.prompt_index].get("reward_model") or {}).get("ground_truth"),
            "response_text": s.text, "response_length": len(s.token_ids), "finish_reason": s.finish_reason,
            "reward": score, "correct": score >= CORRECT_AT} for s, score in zip(samples, scores)], schema=VALIDATION)
        out = atomic_write_parquet(validation_path(run, k), table, schema=VALIDATION)
        n = max(len(scores), 1)
        metrics = {"val/accuracy": sum(x >= CORRECT_AT for x in scores) / n, "val/reward_mean": sum(scores) / n,
                   "val/response_length_mean": sum(len(s.token_ids) for s in samples) / n,
                   "val/num_prompts": float(len(scores))}
        return StageResult(stage="validate", iteration=k, outputs={"validation": str(out)},
                           rows={"validation": len(scores)}, metrics=metrics,
                           summary=[f"val/accuracy {metrics['val/accuracy']:.3f} on {len(scores)} prompts "
                                    f"(actor {actor})"])

    return execute_stage(stage="validate", cfg=cfg, run=run, iteration=k, inputs=[run.val_prompts, actor],
                         config_sections=VALIDATION_SECTIONS, body=body, force=force)


def val_kl_from_samples(cfg: RLHFConfig, samples: tuple[list[dict], list], actor_dir: Path) -> dict[str, float]:
    """On-policy KL(actor ‖ ref) on responses the actor itself sampled for validation prompts:
    {"val_kl_mean", "val_kl_tokens"} (per-token mean of the exact per-position KL, ``guard.token_kl``)."""
    from rlhf_core.guard import actor_ref_kl, response_kl

    rows, generated = samples
    keep = [s for s in generated if s.token_ids]
    sequences = [list(rows[s.prompt_index]["prompt_token_ids"]) + list(s.token_ids) for s in keep]
    prompt_lengths = [len(rows[s.prompt_index]["prompt_token_ids"]) for s in keep]
    kls, _ = actor_ref_kl(cfg, actor_dir, sequences, prompt_lengths)
    kl = response_kl(kls)
    return {"val_kl_mean": kl["kl_mean"], "val_kl_tokens": float(kl["num_tokens"])}
