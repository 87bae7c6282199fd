"""Validation: how the current actor scores on the held-out prompts, under verl's names.

    val/accuracy                         share of responses whose score is >= 1 (ours)
    val-core/<data_source>/reward/mean@n mean over prompts of the mean score of its n responses (verl)

Decoding follows ``actor_rollout_ref.rollout.val_kwargs`` as in verl: greedy unless do_sample is
true with a temperature above 0, ``n`` responses per prompt (identical when greedy), a fixed seed,
so two validations differ only by the weights. Responses and scores go to
iter_k/validation.parquet (the DuckDB view ``validation``). The KL guard's optional on-policy check
on validation prompts (``trainer.kl_guard_val_prompts``) samples them at the training rollout's
settings instead (``sample_val_responses``).

verl's statistics (``verl.trainer.ppo.metric_utils.process_validation_metrics``), per data source
and per score variable (``reward``, plus every numeric key a reward function returns in its dict):
mean@n and std@n over each prompt's n responses, and for k = 2, 4, 8, ... < n and k = n, the mean
and standard deviation over 1,000 bootstrap draws of k responses (with replacement) of their best
(best@k) and worst (worst@k) score; each is averaged over prompts. The core variable is ``acc``
when present, else ``reward``; its mean@n and best@n/* are ``val-core``, everything else ``val-aux``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Callable, Optional, Sequence

import numpy as np
import pyarrow as pa

from rlhf_core.config import RLHFConfig
from rlhf_core.config.reads import ActorDtype, ActorModel, At, Built, RunDevice, build, config_keys
from rlhf_core.config.schema import CustomRewardConfig, DataConfig, ModelConfig, RolloutConfig, TrainerConfig
from rlhf_core.data.packing import Share
from rlhf_core.data.schemas import VALIDATION
from rlhf_core.errors import DataError
from rlhf_core.io.atomic import atomic_write_parquet
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import policy_after
from rlhf_core.paths import resolve_model_path
from rlhf_core.run.models import initial_actor_path
from rlhf_core.scoring.policy_kl import KLPassSettings, actor_ref_kl, response_kl
from rlhf_core.io.timing import TABLE_READ, timed
from rlhf_core.rewards import normalize_result, reward_function
from rlhf_core.rewards.registry import routing_value
from rlhf_core.rollout.base import SamplingParams, derive_seed
from rlhf_core.rollout.generate import (
    PROMPT_COLUMNS, GenerationSettings, generate_responses, generation_engine, generation_plan, read_prompt_rows,
    train_sampling, validation_sampling,
)
from rlhf_core.run.session import RunSession
from rlhf_core.stages.base import StageResult, stage_record
from rlhf_core.stages.ranks import generation_processes, merge_engine_samples, merge_samples, run_on_ranks, write_share
from rlhf_core.stages.settings import generation
from rlhf_core.training.run_trainer import ensure_state


ValRollout = Annotated[RolloutConfig, At(
    "actor_rollout_ref.rollout.", only=("val_kwargs.", "seed", "name", "cpu_threads", "generation_batch_tokens",
                                        "hf_decode"),
    unhashed="validation samples with val_kwargs, never the training sampling (temperature, top_p, n, ...); the "
             "engine's memory and placement keys decide where it runs, not what it samples")]
ValData = Annotated[DataConfig, At(
    "data.", only=("max_response_length", "max_prompt_length"),  # max_prompt_length: the static KV cache's size
    unhashed="validation reads the held-out prompts as preprocess wrote them; the other data keys size a vLLM "
             "engine's batch (train_batch_size), not what it samples")]


def validation_generation(rollout: ValRollout, data: ValData, model: ActorModel, dtype: ActorDtype,
                          device: RunDevice) -> GenerationSettings:
    """Validation's generation: the rollout's (``stages.settings.generation``), hashing only the keys
    that can change what validation samples (``ValRollout``, ``ValData``)."""
    return generation(rollout, data, model, dtype, device)


CORRECT_AT = 1.0
"""A response counts as correct when its reward is at least this (the rule-based score of a right answer)."""


@dataclass(frozen=True)
class ValidationSettings:
    """What validation reads of a config, built once per validation (``validation_settings``)."""

    generation: GenerationSettings
    reward_function: CustomRewardConfig
    reward_fn_key: str
    """data.reward_fn_key: the column that routes a prompt to its reward function (``routing_value``)."""
    processes: Callable[[int], int]
    """How many processes a generation of n batches is dealt to; 0: this one (``ranks.generation_processes``)."""
    on_ranks: Callable[[int], list]
    """``validate_share`` on that many processes, each rank's arrays (``ranks.run_on_ranks``)."""


def validation_settings(generation: Annotated[GenerationSettings, Built(validation_generation)],
                        reward_function: Annotated[CustomRewardConfig, At("custom_reward_function.")],
                        reward_fn_key: Annotated[str, At("data.reward_fn_key")], *,
                        processes: Callable[[int], int], on_ranks: Callable[[int], list]) -> ValidationSettings:
    """Validation's settings (``build(validation_settings, cfg, processes=..., on_ranks=...)``); the
    process counts are the session's, read when asked for (its worker group or kept engine decides them)."""
    return ValidationSettings(generation=generation, reward_function=reward_function, reward_fn_key=reward_fn_key,
                              processes=processes, on_ranks=on_ranks)


def validation_actor(run: RunDir, k: int) -> Optional[Path]:
    """The actor validated after step ``k``: the policy as it was after k (the latest commit at or
    before k), whatever was committed since; None before any commit — the initial model
    (``run.models.initial_actor_path``). A rolled-back iteration validates the policy that survived it."""
    ckpt = policy_after(run, k)
    return ckpt / "actor" if ckpt else None


def sample_val_responses(gen: GenerationSettings, session: RunSession, run: RunDir, actor_dir: Path,
                         limit: Optional[int] = None,
                         seed_offset: Any = "validation", sampling: Optional[SamplingParams] = None,
                         share: Optional[Share] = None) -> tuple[list[dict], list]:
    """(prompt rows, GeneratedSamples) on the first ``limit`` validation prompts. ``sampling``
    defaults to one response per prompt at the training rollout's settings (the guard's on-policy
    check); validation passes its val_kwargs sampling. ``share``: only that process's generation
    batches (``generate_responses``)."""
    rows = _val_rows(run, limit)
    samples, _ = generate_responses(gen, actor_dir, rows, _val_sampling(gen, seed_offset, sampling),
                                    session=session, desc="validation", share=share)
    return rows, samples


def _val_rows(run: RunDir, limit: Optional[int] = None) -> list[dict]:
    with timed(TABLE_READ):
        rows = read_prompt_rows(run.val_prompts, columns=PROMPT_COLUMNS)
    return rows[:limit] if limit else rows


def _val_sampling(gen: GenerationSettings, seed_offset: Any, sampling: Optional[SamplingParams]) -> SamplingParams:
    seed = derive_seed(gen.rollout.seed, seed_offset)
    return replace(sampling or replace(train_sampling(gen, seed=seed), n=1), seed=seed)


def validation_samples(settings: ValidationSettings, session: RunSession, run: RunDir, actor: Path
                       ) -> tuple[list[dict], list]:
    """``sample_val_responses`` at val_kwargs sampling, on ``settings.processes`` local processes
    (hf: each its share of the generation batches; vLLM: each engine its share of the prompts; all
    seeded as in one process)."""
    gen = settings.generation
    sampling = validation_sampling(gen, seed=0)  # seed set from rollout.seed by _val_sampling
    if settings.processes(sys.maxsize):
        rows, seeded = _val_rows(run), _val_sampling(gen, "validation", sampling)
        plan = generation_plan(gen.rollout, rows, seeded)
        world = settings.processes(len(plan))
        if world and generation_engine(gen.rollout) == "vllm":
            shares = settings.on_ranks(world)
            return rows, merge_engine_samples(shares, [i for batch in plan for i in batch])
        if world:
            shares = settings.on_ranks(world)
            return rows, merge_samples(shares, plan, rows, seeded)
    return sample_val_responses(gen, session, run, actor, sampling=sampling)


def score_samples(reward: CustomRewardConfig, key: str, rows: list[dict],
                  samples: list) -> tuple[list[float], list[dict]]:
    """(score, the reward function's extra values) per sample, with the call the score stage makes
    (routed by ``routing_value`` on column ``key``, data.reward_fn_key; verl's extra_info passed), as
    verl's val reward does."""
    scores, extras = [], []
    with reward_function(reward) as reward_fn:  # custom_reward_function.path: its own process
        for s in samples:
            row = rows[s.prompt_index]
            where = f"validation prompt {row['prompt_id']}"
            truth = (row.get("reward_model") or {}).get("ground_truth")
            try:
                result = reward_fn(routing_value(row, key=key, where=where), s.text, truth, row.get("extra_info"))
            except DataError as exc:  # e.g. a function that exited or hung: name the row, as the score stage does
                raise type(exc)(f"{where}: {exc}") from None
            score, extra = normalize_result(result, where=where)
            scores.append(score)
            extras.append(json.loads(extra))
    return scores, extras


def score_variables(scores: Sequence[float], extras: Sequence[dict]) -> dict[str, list[float]]:
    """verl's per-sample variables: ``reward`` (the score) plus every key that is numeric in every
    sample's extra dict (e.g. ``acc``)."""
    variables = {"reward": [float(x) for x in scores]}
    keys = set.intersection(*(set(e) for e in extras)) if extras else set()
    for key in sorted(keys - {"reward"}):
        values = [e[key] for e in extras]
        if all(isinstance(v, (int, float)) for v in values):
            variables[key] = [float(v) for v in values]
    return variables


def _bootstrap_sizes(n: int) -> list[int]:
    """verl's subset sizes for best@k / worst@k: 2, 4, 8, ... below n, then n (none for n = 1)."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def prompt_statistics(values: np.ndarray, rng: np.random.Generator, n_bootstrap: int = 1000) -> dict[str, float]:
    """mean@n, std@n, best@k/{mean,std}, worst@k/{mean,std} of one prompt's n scores, shape (n,).
    best@k: each of ``n_bootstrap`` draws takes k of the n scores with replacement and keeps the max."""
    n = len(values)
    out = {f"mean@{n}": float(values.mean())}
    if n > 1:
        out[f"std@{n}"] = float(values.std())
    for k in _bootstrap_sizes(n):
        draws = values[rng.integers(0, n, size=(n_bootstrap, k))]  # (n_bootstrap, k)
        best, worst = draws.max(axis=1), draws.min(axis=1)  # (n_bootstrap,) each
        out.update({f"best@{k}/mean": float(best.mean()), f"best@{k}/std": float(best.std()),
                    f"worst@{k}/mean": float(worst.mean()), f"worst@{k}/std": float(worst.std())})
    return out


def _section(var: str, core_var: str, name: str, n_max: int) -> str:
    """verl's split: the core variable's mean / maj / best at the largest n is val-core, the rest val-aux."""
    core = var == core_var and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
    return "val-core" if core else "val-aux"


def validation_metrics(data_sources: Sequence[str], prompt_ids: Sequence[str], variables: dict[str, Sequence[float]],
                       seed: int = 42, n_bootstrap: int = 1000) -> dict[str, float]:
    """verl's validation metrics, ``val-core|val-aux/<data_source>/<variable>/<statistic>``: each
    prompt's statistics (``prompt_statistics``) averaged over the data source's prompts. Inputs are
    per sample (a prompt's n responses share its prompt id)."""
    rng = np.random.default_rng(seed)
    groups: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (source, pid) in enumerate(zip(data_sources, prompt_ids)):
        groups[source][pid].append(i)
    out: dict[str, float] = {}
    core_var = "acc" if "acc" in variables else "reward"
    for source, prompts in groups.items():
        for var, values in variables.items():
            column = np.asarray(values, dtype=np.float64)
            per_prompt: dict[str, list[float]] = defaultdict(list)
            for indices in prompts.values():
                for name, value in prompt_statistics(column[indices], rng, n_bootstrap).items():
                    per_prompt[name].append(value)
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in per_prompt)
            for name, vals in per_prompt.items():
                out[f"{_section(var, core_var, name, n_max)}/{source}/{var}/{name}"] = float(np.mean(vals))
    return out


def config_sections(cfg: RLHFConfig) -> tuple[str, ...]:
    """The config this stage's output depends on (its manifest's config hash): its builder's keys."""
    return config_keys(validation_settings, cfg=cfg)


def run_validate(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None, force: bool = False,
                 session: Optional[RunSession] = None) -> StageResult:
    """Decode the validation prompts with the actor after ``iteration`` (val_kwargs sampling); write
    iter_k/validation.parquet; metrics under our names and verl's. At iteration 0 with the warm start
    on (and trainer.val_base_model), the model it started from too: iter_0/validation_base.parquet,
    ``val_base/*``. ``session``: the flow run's (its trainer lends the actor, its kept engine
    generates); None: every model read from disk."""
    session = session or RunSession()
    if iteration is None:
        raise ValueError("the validate stage needs an iteration (the actor after that iteration is validated)")
    k = iteration
    actor = validation_actor(run, k) or initial_actor_path(cfg)
    base = base_model_validated(cfg.actor_rollout_ref.model, cfg.trainer, k)

    inputs = [run.val_prompts, actor] + ([base] if base is not None else [])
    with stage_record(stage="validate", cfg=cfg, run=run, iteration=k, inputs=inputs,
                      config_sections=config_sections(cfg), force=force) as record:
        if record.skipped:
            return record.skipped
        ensure_state(session, run, run.checkpoint_iteration(actor))  # held in memory, on disk, or rebuilt now
        settings = build(validation_settings, cfg,
                         processes=lambda batches: generation_processes(cfg.trainer, cfg.actor_rollout_ref.rollout,
                                                                        session, batches),
                         on_ranks=lambda world: run_on_ranks(cfg, run, session, k, "validate", world))
        sampling = validation_sampling(settings.generation, seed=0)
        rows, samples = validation_samples(settings, session, run, actor)
        scores, extras = score_samples(settings.reward_function, settings.reward_fn_key, rows, samples)
        metrics, out = _record_validation(k, rows, samples, scores, run.validation(k))
        metrics.update(validation_metrics([rows[s.prompt_index].get("data_source") or "unknown" for s in samples],
                                          [rows[s.prompt_index]["prompt_id"] for s in samples],
                                          score_variables(scores, extras)))
        how = "greedy" if sampling.greedy else f"sampled at temperature {sampling.temperature:g}"
        summary = [f"val/accuracy {accuracy_text(metrics, 'val')} on {len(rows)} prompts × {sampling.n} "
                   f"({how}; actor {actor})"]
        outputs = {"validation": str(out)}
        if base is not None:  # one process: the stage's ranks validate the run's own policies only
            base_rows, base_samples = sample_val_responses(settings.generation, session, run, base, sampling=sampling)
            base_scores, _ = score_samples(settings.reward_function, settings.reward_fn_key, base_rows, base_samples)
            base_metrics, outputs["base_validation"] = _record_validation(k, base_rows, base_samples, base_scores,
                                                                          run.base_validation())
            metrics.update({f"{BASE_PREFIX}/{name.split('/', 1)[1]}": v for name, v in base_metrics.items()})
            summary.append(f"{BASE_PREFIX}/accuracy {accuracy_text(metrics, BASE_PREFIX)}: the model before the "
                           f"warm start ({base})")
        return record.done(StageResult(stage="validate", iteration=k, outputs={k_: str(v) for k_, v in outputs.items()},
                                       rows={"validation": len(samples)}, metrics=metrics, summary=summary))


BASE_PREFIX = "val_base"
"""Metric prefix of the model before the warm start (``val_base/accuracy``, ...): ours, measured once."""


def base_model_validated(model: ModelConfig, trainer: TrainerConfig, k: int) -> Optional[Path]:
    """The model the warm start fine-tunes (``model.path``: actor_rollout_ref.model), when validation at
    step ``k`` validates it too: at k = 0 only, with the warm start on and trainer.val_base_model."""
    if k != 0 or not (model.warm_start.enable and trainer.val_base_model):
        return None
    return resolve_model_path(model.path)


def _record_validation(k: int, rows: list[dict], samples: list, scores: list[float],
                       path: Path) -> tuple[dict[str, float], Path]:
    """``samples`` and their ``scores`` written to ``path`` (schema VALIDATION); our metrics (``val/*``) and the file."""
    table = pa.Table.from_pylist([{
        "iteration": k, "prompt_id": rows[s.prompt_index]["prompt_id"], "sample_index": s.sample_index,
        "data_source": rows[s.prompt_index].get("data_source"),
        "ground_truth": (rows[s.prompt_index].get("reward_model") or {}).get("ground_truth"),
        "response_text": s.text, "response_length": len(s.token_ids), "finish_reason": s.finish_reason,
        "reward": score, "correct": score >= CORRECT_AT} for s, score in zip(samples, scores)], schema=VALIDATION)
    return _our_metrics(rows, samples, scores), atomic_write_parquet(path, table, schema=VALIDATION)


def wilson_interval(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95 % (z = 1.96) Wilson score interval of a success rate ``correct / n``: unlike the normal
    approximation it stays inside [0, 1] and is not empty at 0 or n successes. (0, 1) when n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def accuracy_text(metrics: dict[str, float], prefix: str = "val") -> str:
    """'0.582 [0.521, 0.641]': the accuracy under ``prefix`` and its 95 % interval."""
    return (f"{metrics[f'{prefix}/accuracy']:.3f} [{metrics[f'{prefix}/accuracy_ci_low']:.3f}, "
            f"{metrics[f'{prefix}/accuracy_ci_high']:.3f}]")


def _our_metrics(rows: list[dict], samples: list, scores: list[float]) -> dict[str, float]:
    n = max(len(scores), 1)
    correct = sum(x >= CORRECT_AT for x in scores)
    low, high = wilson_interval(correct, len(scores))
    return {"val/accuracy": correct / n, "val/accuracy_ci_low": low, "val/accuracy_ci_high": high,
            "val/reward_mean": sum(scores) / n,
            "val/response_length_mean": sum(len(s.token_ids) for s in samples) / n,
            "val/num_prompts": float(len(rows)), "val/num_responses": float(len(scores))}


def val_kl_from_samples(kl: KLPassSettings, session: RunSession, reference: Path, samples: tuple[list[dict], list],
                        actor_dir: Path) -> dict[str, float]:
    """On-policy KL(actor ‖ ref) on responses the actor itself sampled for validation prompts:
    {"val_kl_mean", "val_kl_tokens"} (per-token mean of the exact per-position KL, ``scoring.policy_kl.token_kl``)."""
    rows, generated = samples
    keep = [s for s in generated if s.token_ids]
    sequences = [list(rows[s.prompt_index]["prompt_token_ids"]) + list(s.token_ids) for s in keep]
    prompt_lengths = [len(rows[s.prompt_index]["prompt_token_ids"]) for s in keep]
    kls, _ = actor_ref_kl(kl, session, actor_dir, reference, sequences, prompt_lengths)
    measured = response_kl(kls)
    return {"val_kl_mean": measured["kl_mean"], "val_kl_tokens": float(measured["num_tokens"])}


def validate_share(cfg, run: RunDir, iteration: int, rank: int, world: int, out: Path, session: RunSession) -> None:
    """This rank's generation batches of validation (HF engine), seeded as in one process."""
    actor = validation_actor(run, iteration) or initial_actor_path(cfg)
    gen = build(validation_generation, cfg)
    _, samples = sample_val_responses(gen, session, run, actor, sampling=validation_sampling(gen, seed=0),
                                      share=(rank, world))
    write_share(out, {}, samples=json.dumps([dataclasses.asdict(s) for s in samples]))
