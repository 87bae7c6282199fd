"""A response's sequence reward, as the score stage writes it and the rollout's dynamic sampling
and remax's greedy baseline compute it: the reward model's score when one is enabled, else the
reward function routed by the row's ``data.reward_fn_key`` column (verl's naive reward manager:
one ``compute_score`` call per response, with the row's verl extra_info), plus DAPO's overlong
penalty (``rewards.overlong``). Its settings are built once from the config by the stages
(``stages.settings.reward_settings``)."""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from rlhf_core.config.resolve import MicroBatching
from rlhf_core.config.schema import CustomRewardConfig, OverlongBufferConfig
from rlhf_core.errors import DataError, RLHFError
from rlhf_core.io.tables import rows_with_ids
from rlhf_core.progress import bar_disabled
from rlhf_core.rewards.overlong import shape_scores
from rlhf_core.rewards.registry import normalize_result, reward_function, routing_value
from rlhf_core.rewards.reward_model import check_same_vocabulary, held_reward_model, rerendered_ids, score_sequences
from rlhf_core.scoring.models import ModelPaths, load_tokenizer, release, scoring_dtype
from rlhf_core.scoring.held import HeldModels


@dataclass(frozen=True)
class RewardModelSettings:
    """How the reward model scores (reward_model.enable)."""

    device: torch.device
    batching: MicroBatching
    """reward_model's micro-batching over the update's world (``micro_batching``)."""
    offload: bool
    """Its weights wait in host memory between passes (``frozen_param_offload``)."""
    max_length: int
    """reward_model.max_length, null = data.max_prompt_length + max_response_length: where a re-rendered
    response is cut (reward_model.model.input_tokenizer)."""


@dataclass(frozen=True)
class RewardSettings:
    """What a response's sequence reward reads of the config (``reward_settings``): the score stage's
    rewards, and the rollout's dynamic sampling scores with the same."""

    reward_function: CustomRewardConfig
    """custom_reward_function: the function (its own process for a path), and the score counted correct."""
    reward_fn_key: str
    """data.reward_fn_key: the column that routes a row to its reward function."""
    overlong: OverlongBufferConfig
    """reward_model.overlong_buffer (DAPO's overlong penalty, ``rewards.overlong``)."""
    max_response_length: int
    reward_model: Optional[RewardModelSettings]
    """None for rule-based rewards."""


@dataclass
class SequenceRewards:
    """Per response, in row order."""

    scores: list[float]
    """The sequence score: the reward model's, or the reward function's plus the overlong penalty
    (``rewards.overlong``); the scored table's ``reward`` and verl's token_level_scores sum."""
    extras: list[str]
    """reward_extra JSON (a dict result's other keys; overlong_reward / overlong when logged)."""
    raw: list[float]
    """The reward function's (or model's) own score, before the overlong penalty."""
    acc: list[Optional[float]]
    """verl's reward_extra_info["acc"]: a float result's score, a dict result's 'acc' key (None
    when a dict result has none, and for reward-model scores)."""


def sequence_rewards(settings: RewardSettings, session: HeldModels, models: ModelPaths, rows: list[dict],
                     prompts_path: Path, where_path: Path) -> SequenceRewards:
    """Every response's sequence reward, as the score stage writes it: shared with the rollout
    stage's dynamic sampling (``algorithm.filter_groups``) and the greedy baseline (remax).
    ``rows`` are rollout-table rows; ``where_path`` names their table in errors."""
    prompts = prompt_lookup(prompts_path, rows)
    if models.reward_model is not None:
        scores, extras = _reward_model_scores(settings.reward_model, session, models, rows, prompts)
        return SequenceRewards(scores, extras, list(scores), [None] * len(scores))
    raw, extras, acc = rule_rewards(settings, rows, prompts, where_path)
    scores, extras = shape_scores(settings.overlong, settings.max_response_length, raw,
                                  [r["response_length"] for r in rows], extras)
    return SequenceRewards(scores, extras, raw, acc)


def rule_rewards(settings: RewardSettings, rows: list[dict], prompts: dict[str, dict],
                  path: Path) -> tuple[list[float], list[str], list[Optional[float]]]:
    """One compute_score call per response (verl's naive reward manager), routed by the row's
    data.reward_fn_key column, with the row's verl extra_info: (scores, reward_extra, acc)."""
    key = settings.reward_fn_key
    rewards, extras, accs = [], [], []
    with reward_function(settings.reward_function) as reward_fn:  # custom_reward_function.path: its own process
        for i, row in enumerate(tqdm(rows, desc="rewards", unit="resp", leave=False, disable=bar_disabled())):
            prompt = prompts[row["prompt_id"]]
            where = row_where(path, i, row)
            source = routing_value(row, prompt, key=key, where=where)
            try:
                result = reward_fn(source, row["response_text"], row["ground_truth"], row["extra_info"])
            except RLHFError as exc:
                raise type(exc)(f"{where}: {exc}") from None
            except Exception as exc:  # a bug in a registered function: keep its traceback, add the row
                exc.add_note(f"while scoring {where} with the reward function")
                raise
            score, extra = normalize_result(result, where)
            rewards.append(score)
            extras.append(extra)
            accs.append(_acc(result, score))
    return rewards, extras, accs


def _acc(result: Any, score: float) -> Optional[float]:
    """verl's reward_extra_info["acc"] of one result: the score of a plain result, a dict's 'acc'."""
    if not isinstance(result, dict):
        return score
    acc = result.get("acc")
    return None if acc is None else float(acc)


def _reward_model_scores(settings: RewardModelSettings, session: HeldModels, models: ModelPaths, rows: list[dict],
                         prompts: dict[str, dict]) -> tuple[list[float], list[str]]:
    """verl's reward-model scoring: the RM reads the actor's own token ids when
    reward_model.model.input_tokenizer is null (its tokenizer must then be the actor's), else each
    response decoded with input_tokenizer and re-rendered with the RM's chat template, cut to
    reward_model.max_length tokens (null = max_prompt_length + max_response_length)."""
    device = settings.device
    with held_reward_model(models.reward_model, device, scoring_dtype(device), settings.offload,
                           session=session) as rm:
        if models.rm_input_tokenizer is None:
            check_same_vocabulary(rm, load_tokenizer(models.actor, session=session, shared=True), models.actor)
            sequences = [list(r["prompt_token_ids"]) + list(r["response_token_ids"]) for r in rows]
        else:
            source = load_tokenizer(models.rm_input_tokenizer, session=session, shared=True)
            sequences = [rerendered_ids(rm, prompts[r["prompt_id"]]["prompt"], r["response_token_ids"], source,
                                        settings.max_length) for r in rows]
        scores = score_sequences(rm, sequences, settings.batching, budget_key="critic.forward_max_token_len_per_gpu")
    release(weakref.ref(rm.model), device, session)
    return scores, [json.dumps({"rm_score": s}) for s in scores]


def row_where(path: Path, i: int, row: dict) -> str:
    """How an error names rollout row ``i`` of the table at ``path``."""
    return f"{path} row {i} (prompt_id={row['prompt_id']!r}, sample_index={row['sample_index']})"


def prompt_lookup(prompts_path: Path, rows: list[dict]) -> dict[str, dict]:
    """prompt_id → {"prompt": chat messages, "extra_info", "reward_source"} for the prompts the
    rollout used."""
    used = {r["prompt_id"] for r in rows}
    columns = ["prompt_id", "prompt", "extra_info", "reward_source"]
    lookup = {r["prompt_id"]: r for r in rows_with_ids(prompts_path, "prompt_id", used, columns)}
    missing = sorted(used - set(lookup))
    if missing:
        raise DataError(f"{len(missing)} rollout prompt_id(s) are not in {prompts_path} (first: "
                        f"{missing[0]!r}); the prompts were re-preprocessed after the rollout: rerun the "
                        "rollout stage")
    return lookup
