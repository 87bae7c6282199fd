"""Stage `score`: iter_K/rollout.parquet → iter_K/scored.parquet (everything the advantage step needs).

    rlhf stage score --run-dir RUN --iteration K [-c PRESET] [key=value ...]

Per response: a sequence-level ``reward`` (the reward model when ``reward_model.enable``, else the
reward function routed by the row's ``data.reward_fn_key`` column, verl's ``data_source`` by
default, plus DAPO's overlong penalty when ``reward_model.overlong_buffer.enable``:
``rewards.overlong``; ``rewards.sequence``, which the rollout stage's dynamic sampling shares),
``reward_baseline`` (remax: the score of the prompt's greedy response in
``iter_K/rollout_baseline.parquet``, same reward function; null for other estimators), and three per-token lists, each exactly ``response_length`` long: ``old_log_probs`` under
the actor that generated (at the rollout temperature), ``ref_log_probs`` under the frozen reference
(same temperature), ``values`` under the critic. Each pass is cut as verl cuts it
(``config.resolve``): old log-probs by ``micro_batching(cfg, "rollout")``, reference log-probs by
``micro_batching(cfg, "ref")``, values by ``critic_value_batching`` — a token budget per
forward with use_dynamic_bsz, else micro_batch_size sequences per forward — laid out packed or
padded by ``actor_rollout_ref.model.use_remove_padding`` (the critic: ``critic_use_remove_padding``).
When the actor and reference hold byte-identical weights (iteration 1) the reference pass is
skipped and the actor's log-probs reused.

Metrics: verl's ``critic/score/mean|max|min`` (sequence scores of the non-empty responses, as
verl's compute_data_metrics), and ours: ``reward/mean``, ``reward/std``, ``reward/accuracy``
(rule-based GSM8K), ``response_length/mean``, ``kl/old_ref_mean``, ``perf/score_*``.

Inspect it with DuckDB:  SELECT avg(reward) FROM 'RUN/iter_1/scored.parquet'
"""

from __future__ import annotations

import statistics
import time
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rlhf_core.algos.registry import estimator_takes
from rlhf_core.config import RLHFConfig
from rlhf_core.config.machine import cuda_devices
from rlhf_core.config.reads import AdvEstimator, At, Built, RunDevice, build, config_keys
from rlhf_core.config.resolve import (
    MicroBatching, critic_use_remove_padding, critic_value_batching, needs_baseline_rollout, param_offload, role_batching,
    update_world_size,
)
from rlhf_core.config.schema import ActorRolloutRefConfig, CriticConfig, CustomRewardConfig, TrainerConfig
from rlhf_core.data.schemas import ROLLOUT, SCORED
from rlhf_core.errors import DataError, RLHFError
from rlhf_core.io.atomic import atomic_write_parquet
from rlhf_core.run.models import actor_path, critic_path, reference_path
from rlhf_core.run.layout import RunDir
from rlhf_core.io.timing import TABLE_READ, timed
from rlhf_core.config.validate import check_overlong_buffer
from rlhf_core.rewards.sequence import RewardSettings, row_where, sequence_rewards
from rlhf_core.scoring import (
    Throughput, compute_token_logprobs, compute_token_values, load_causal_lm, load_critic, same_weights,
    scoring_device, scoring_dtype,
)
from rlhf_core.data.packing import Share
from rlhf_core.scoring.models import ModelPaths, reference_policy, release
from rlhf_core.scoring import ref_states
from rlhf_core.run.session import RunSession
from rlhf_core.stages.base import StageResult, stage_record
from rlhf_core.stages.ranks import merge_shares, run_on_ranks, share_processes, write_share
from rlhf_core.stages.settings import UPDATE_WORLD, reward_model_paths, reward_settings
from rlhf_core.training import flops
from rlhf_core.training.ds_config import role_dtype
from rlhf_core.training.run_trainer import ensure_state

RolloutIS = Annotated[Optional[str], At("algorithm.rollout_correction.rollout_is")]
RolloutRS = Annotated[Optional[str], At("algorithm.rollout_correction.rollout_rs")]


def config_sections(cfg: RLHFConfig) -> tuple[str, ...]:
    """The config this stage's output depends on (its manifest's config hash): what ``score_settings``
    reads. A decoupled correction's keys and the estimator count only when they change the passes
    (the key set then differs, so switching to or from remax reruns the stage; other estimator
    changes do not)."""
    return config_keys(score_settings, cfg=cfg)


def model_paths(cfg: RLHFConfig, run: RunDir, iteration: int) -> ModelPaths:
    rm, rm_tokenizer = reward_model_paths(cfg)
    # the models iteration k started from, so a rerun of an old iteration reproduces its table
    return ModelPaths(actor=actor_path(cfg, run, iteration), reference=reference_path(cfg),
                      critic=critic_path(cfg, run, iteration), reward_model=rm, rm_input_tokenizer=rm_tokenizer)


@dataclass(frozen=True)
class PassPlan:
    """How one scoring pass cuts its forwards."""

    batching: MicroBatching
    packed: bool
    budget_key: str


@dataclass(frozen=True)
class ScoreSettings:
    """What the score stage's body reads of the config, built once in ``run_score``'s body and in each
    rank's ``score_share`` (``score_settings``): its helpers take this, not the config."""

    rewards: RewardSettings
    baseline: bool
    """Whether the estimator takes reward_baselines (``needs_baseline_rollout``: remax)."""
    bypass_mode: bool
    """algorithm.rollout_correction.bypass_mode: the rollout's log-probs are the old policy."""
    sum_pi_squared: bool
    """verl's actor.calculate_sum_pi_squared, and always when the estimator reads it (verl refuses to
    start without the key there; computing it is what the user meant)."""
    old_log_probs_auto: bool
    """The config's half of rollout.old_log_probs=auto's rule (``old_from_rollout``: the dtype and the
    rows complete it)."""
    device: torch.device
    """Where the passes run (trainer.device)."""
    dtype: str
    """actor.deepspeed_config.dtype, as configured: ``actor_dtype`` resolves it."""
    model_key: str
    """The actor's initial model (``role_model_key``), which 'auto' resolves the dtype for."""
    temperature: float
    """actor_rollout_ref.rollout.temperature: the passes' log-probs are at the rollout's temperature."""
    attention: Optional[str]
    """The actor's attention implementation (the reference's too)."""
    critic_attention: Optional[str]
    plans: dict[str, PassPlan]
    """How each pass cuts its forwards (actor, reference, critic), for the update's world."""
    ref_offload: bool
    """The reference's weights wait in host memory between passes (``frozen_param_offload``)."""

    def actor_dtype(self, device: str) -> str:
        """The actor's training dtype on ``device`` (``ds_config.role_dtype``, as generation's), resolved when a pass
        asks: resolving 'auto' reads the model, and says the choice once on a CPU."""
        return role_dtype(self.dtype, self.model_key, device)


def decoupled_is(rollout_is: RolloutIS) -> bool:
    return rollout_is is not None


def decoupled_rs(rollout_rs: RolloutRS) -> bool:
    return rollout_rs is not None


def is_mode(value: RolloutIS) -> Optional[str]:
    return value


def rs_mode(value: RolloutRS) -> Optional[str]:
    return value


def estimator_shapes_scoring(adv_estimator: AdvEstimator) -> bool:
    """Whether the estimator makes the stage score more: greedy baselines (remax) or sum_pi_squared."""
    return estimator_takes(adv_estimator, "reward_baselines") or estimator_takes(adv_estimator, "sum_pi_squared")


def shaping_estimator(adv_estimator: AdvEstimator) -> str:
    return adv_estimator


def score_settings(
        arr: Annotated[ActorRolloutRefConfig, At("actor_rollout_ref.")], critic: Annotated[CriticConfig, At("critic.")],
        rewards: Annotated[RewardSettings, Built(reward_settings)],
        bypass_mode: Annotated[bool, At("algorithm.rollout_correction.bypass_mode")],  # which log-probs are the old policy
        # a decoupled correction makes rollout.old_log_probs=auto recompute: only then do its keys enter
        rollout_is: Annotated[Optional[str], Built(is_mode, when=decoupled_is)],
        rollout_rs: Annotated[Optional[str], Built(rs_mode, when=decoupled_rs)],
        adv_estimator: Annotated[Optional[str], Built(shaping_estimator, when=estimator_shapes_scoring)],
        device: RunDevice, trainer: Annotated[TrainerConfig, At("trainer.", unhashed=UPDATE_WORLD)]) -> ScoreSettings:
    """The score stage's settings (``build(score_settings, cfg)``). Passes: verl's budgets for the three
    passes — old log-probs (rollout.log_prob_*), reference log-probs (ref.log_prob_*), critic values
    (critic.forward_*) — packing from use_remove_padding. Old log-probs from the rollout
    (rollout.old_log_probs=auto): see ``old_from_rollout``."""
    r, a, scoring = arr.rollout, arr.actor, scoring_device(device)
    world = update_world_size(trainer, cuda_devices())
    plans = {
        "actor": PassPlan(role_batching(arr, critic, "rollout", world), arr.model.use_remove_padding,
                          "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
        "reference": PassPlan(role_batching(arr, critic, "ref", world), arr.model.use_remove_padding,
                              "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
        "critic": PassPlan(critic_value_batching(arr, critic, world), critic_use_remove_padding(critic, arr.model),
                           "critic.forward_max_token_len_per_gpu"),
    }
    auto = (r.old_log_probs == "auto" and r.name == "hf" and r.hf_decode == "dynamic"
            and arr.model.lora_rank == 0 and (r.do_sample or r.temperature == 1.0)
            and r.top_k <= 0 and r.top_p >= 1.0 and rollout_is is None and rollout_rs is None
            and scoring.type == "cpu")
    estimator = adv_estimator or ""
    return ScoreSettings(
        rewards=rewards, baseline=bool(estimator) and estimator_takes(estimator, "reward_baselines"),
        bypass_mode=bypass_mode,
        sum_pi_squared=(a.calculate_sum_pi_squared or (bool(estimator) and estimator_takes(estimator, "sum_pi_squared"))),
        old_log_probs_auto=auto, device=scoring, dtype=a.deepspeed_config.dtype, model_key=arr.model.path,
        temperature=r.temperature, attention=arr.model.override_config.attn_implementation,
        critic_attention=critic.model.override_config.attn_implementation, plans=plans,
        ref_offload=param_offload(arr.ref.fsdp_config))


def run_score(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None, force: bool = False,
              session: Optional[RunSession] = None) -> StageResult:
    """Score iteration ``iteration``'s rollout; skipped when its inputs and config are unchanged.
    ``session``: the flow run's (its trainer lends the actor and critic, it holds the reference and
    keeps the reference's states for the guard); None: every model read from disk."""
    session = session or RunSession()
    if iteration is None or iteration < 1:
        raise RLHFError("score is a per-iteration stage: give --iteration K (K >= 1)")
    rollout_path = run.rollout(iteration)
    if not rollout_path.is_file():
        raise DataError(f"{rollout_path} not found: run `rlhf stage rollout --run-dir {run.root} "
                        f"--iteration {iteration}` first")
    if not run.train_prompts.is_file():
        raise DataError(f"{run.train_prompts} not found: run `rlhf stage preprocess --run-dir {run.root}` first")
    check_overlong_buffer(cfg)
    models = model_paths(cfg, run, iteration)
    inputs = [rollout_path, run.train_prompts, models.actor, models.reference]
    inputs += [p for p in (models.critic, models.reward_model, models.rm_input_tokenizer) if p is not None]
    if needs_baseline_rollout(cfg):
        baseline_path = run.rollout_baseline(iteration)
        if not baseline_path.is_file():
            raise DataError(f"{baseline_path} not found: algorithm.adv_estimator={cfg.algorithm.adv_estimator} "
                            f"needs the greedy baseline responses; rerun `rlhf stage rollout --run-dir {run.root} "
                            f"--iteration {iteration} --force`")
        inputs.append(baseline_path)  # a new baseline table reruns the score stage

    def on_ranks(items: int) -> Optional[list[dict]]:
        """Every rank's share of the model passes over ``items`` responses; None: run them here."""
        world = share_processes(cfg.trainer, session, items)
        return run_on_ranks(cfg, run, session, iteration, "score", world) if world else None

    with stage_record(stage="score", cfg=cfg, run=run, iteration=iteration, inputs=inputs,
                      config_sections=config_sections(cfg), force=force) as record:
        if record.skipped:
            return record.skipped
        ensure_state(session, run, run.checkpoint_iteration(models.actor))  # held in memory, on disk, or rebuilt now
        return record.done(_score(build(score_settings, cfg), session, run, iteration, models, on_ranks))


def _score(settings: ScoreSettings, session: RunSession, run: RunDir, iteration: int, models: ModelPaths,
           on_ranks: Callable[[int], Optional[list[dict]]]) -> StageResult:
    rollout_path = run.rollout(iteration)
    with timed(TABLE_READ):
        scored = pq.read_table(rollout_path)
        rows = scored.to_pylist()
    _check_rollout(scored.column_names, rows, rollout_path)
    started = time.perf_counter()
    sequence = sequence_rewards(settings.rewards, session, models, rows, run.train_prompts, rollout_path)
    reward_seconds = time.perf_counter() - started
    rewards, extras = sequence.scores, sequence.extras
    baselines = (greedy_baselines(settings.rewards, session, run, iteration, models, scored.column("uid").to_pylist())
                 if settings.baseline else [None] * len(rows))
    meter = Throughput()
    reusable = old_from_rollout(settings, rows)
    passes = _passes(settings, session, models, rows, meter, on_ranks, reusable)
    old, ref, values, ref_reused = passes.old_log_probs, passes.ref_log_probs, passes.values, passes.ref_reused
    from_rollout = settings.bypass_mode or passes.old_from_rollout
    if from_rollout:  # verl's bypass mode, or rollout.old_log_probs=auto: the engine's own are the old policy
        old = _rollout_log_probs(rows, rollout_path)
    _check_lengths(rows, {"old_log_probs": old, "ref_log_probs": ref, "values": values})
    sums = passes.sum_pi_squared if passes.sum_pi_squared is not None else [None] * len(rows)
    for name, column in [("reward", rewards), ("reward_extra", extras), ("old_log_probs", old),
                         ("ref_log_probs", ref), ("values", values), ("reward_baseline", baselines),
                         ("sum_pi_squared", sums)]:
        scored = scored.append_column(name, pa.array(column, type=SCORED.field(name).type))
    out = run.scored(iteration)
    atomic_write_parquet(out, scored, schema=SCORED)
    metrics = score_metrics(settings.rewards.reward_function, rows, rewards, old, ref, meter,
                            rule_based=models.reward_model is None, raw=sequence.raw)
    # rollout.old_log_probs=auto's choice (bypass mode's loss corrects the gap itself: not counted here)
    metrics["score/old_log_probs_from_rollout"] = float(passes.old_from_rollout and not settings.bypass_mode)
    metrics.update(score_floor(settings, session, models, rows, passes))
    metrics.update(pass_seconds(meter, reward_seconds))
    if baselines[0] is not None:
        metrics["reward/baseline_mean"] = statistics.fmean(baselines)
    summary = _summary(rows, metrics, meter, ref_reused, out, from_rollout)
    return StageResult(stage="score", iteration=iteration, outputs={"scored": str(out)},
                       rows={"scored": len(rows)}, metrics=metrics, summary=summary)


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


def _check_rollout(columns: list[str], rows: list[dict], path: Path) -> None:
    missing = [name for name in ROLLOUT.names if name not in columns]
    if missing:
        raise DataError(f"{path} lacks the columns {missing} of a rollout table: rerun the rollout stage")
    if not rows:
        raise DataError(f"{path} has no rows: the rollout produced no responses; rerun the rollout stage")
    for i, row in enumerate(rows):
        n = len(row["response_token_ids"] or [])
        if row["response_length"] != n:
            raise DataError(f"{row_where(path, i, row)}: response_length={row['response_length']} but "
                            f"response_token_ids holds {n} tokens; rerun the rollout stage")
        if not row["prompt_token_ids"]:
            raise DataError(f"{row_where(path, i, row)}: empty prompt_token_ids; rerun preprocess and rollout")


def greedy_baselines(settings: RewardSettings, session: RunSession, run: RunDir, iteration: int,
                     models: ModelPaths, uids: list[str]) -> list[float]:
    """remax's reward_baselines: each row's group's greedy response scored by the same reward
    function (overlong shaping included), summed over the response as verl's sum_reward=True —
    one sequence score per response here, so the sum is that score."""
    path = run.rollout_baseline(iteration)
    with timed(TABLE_READ):
        table = pq.read_table(path)
        rows = table.to_pylist()
    _check_rollout(table.column_names, rows, path)
    baseline_scores = sequence_rewards(settings, session, models, rows, run.train_prompts, path).scores
    by_uid: dict[str, float] = {}
    for row, score in zip(rows, baseline_scores):
        by_uid[row["uid"]] = by_uid.get(row["uid"], 0.0) + score
    missing = sorted(set(uids) - set(by_uid))
    if missing:
        raise DataError(f"{path} has no greedy response for group uid {missing[0]!r} of "
                        f"{run.rollout(iteration)} ({len(missing)} missing); the two tables come from "
                        f"different rollouts: rerun `rlhf stage rollout --iteration {iteration} --force`")
    return [by_uid[u] for u in uids]


# ---------------------------------------------------------------------------------------------
# model passes
# ---------------------------------------------------------------------------------------------


def _passes(settings: ScoreSettings, session: RunSession, models: ModelPaths, rows: list[dict], meter,
            on_ranks: Callable[[int], Optional[list[dict]]], from_rollout: bool = False):
    """``model_passes`` in this process, or on ``stage_processes`` local processes (every GPU of
    the node), each a token-balanced share of every pass's micro-batches (``stages.ranks``):
    ``on_ranks`` runs them there and returns the shares, or None for this process."""
    shares = on_ranks(len(rows))
    if shares is None:
        return model_passes(settings, session, models, rows, meter, from_rollout=from_rollout)
    meter.tokens += sum(int(s["tokens"]) for s in shares)
    meter.seconds += max(float(s["seconds"]) for s in shares)  # the ranks ran side by side
    # each rank ran its micro-batches of the one-process plans: the one-process values, bit for bit
    ref_reused = all(bool(s["ref_reused"]) for s in shares)
    skipped = takes_old_from_rollout(settings, ref_reused, from_rollout)
    columns = [[None] * len(rows) if name == "old_log_probs" and skipped
               else merge_shares(shares, name, len(rows)) for name in ("old_log_probs", "ref_log_probs", "values")]
    sums = merge_shares(shares, "sum_pi_squared", len(rows)) if settings.sum_pi_squared else None
    return Passes(*columns, ref_reused, sums, skipped)


@dataclass
class Passes:
    """The score stage's model passes, each a list (one entry per response) of per-token lists."""

    old_log_probs: list
    ref_log_probs: list
    values: list
    ref_reused: bool
    """Whether the reference log-probs are the actor's (the same weights)."""
    sum_pi_squared: Optional[list] = None
    """sum_v pi_v^2 under the actor, when ``ScoreSettings.sum_pi_squared``."""
    old_from_rollout: bool = False
    """The actor's pass was skipped: the rollout's log-probs are the old ones (``takes_old_from_rollout``)."""


def takes_old_from_rollout(settings: ScoreSettings, ref_reused: bool, from_rollout: bool = False) -> bool:
    """Whether the stage skips the actor's pass: verl's bypass mode takes the rollout engine's own
    log-probs as the old policy, and so does rollout.old_log_probs=auto where they are the trainer's
    arithmetic (``from_rollout``: ``old_from_rollout``), so the pass would only be thrown away — unless
    it is needed for sum_pi_squared, or as the reference (the reference's weights are the actor's, as in
    iteration 1); then its own log-probs are the old ones (outside bypass mode)."""
    wanted = settings.bypass_mode or from_rollout
    return wanted and not settings.sum_pi_squared and not ref_reused


def old_from_rollout(settings: ScoreSettings, rows: list[dict]) -> bool:
    """rollout.old_log_probs=auto's rule: the rollout's log-probs are the old policy when they are the
    trainer's own arithmetic — every row sampled by the hf engine, which runs the trainer's module (or
    its checkpoint) in the trainer's dtype, on the CPU in fp32, decoding with the dynamic KV cache and
    without LoRA (measured: ~2e-7 from the recomputed log-probs; in bf16 ~3e-3, docs/benchmarks.md §8),
    its sampled distribution the scored one (no top-k / top-p cut; greedy only at temperature 1), and
    no decoupled rollout correction that compares the two (the config's part: ``score_settings``).
    Otherwise the actor's pass recomputes them."""
    return (settings.old_log_probs_auto and settings.actor_dtype("cpu") == "fp32"
            and all(row.get("engine") == "hf" and row.get("rollout_log_probs") is not None for row in rows))


def model_passes(settings: ScoreSettings, session: RunSession, models: ModelPaths, rows: list[dict], meter,
                 share: Optional[Share] = None, from_rollout: bool = False) -> Passes:
    """The actor's old log-probs (and sum_pi_squared), the reference's log-probs and the critic's values;
    with ``share`` = (rank, world) only that process's micro-batches of each pass (None elsewhere).
    ``from_rollout``: the rollout's log-probs are the old ones (``old_from_rollout``)."""
    device = settings.device
    dtype = scoring_dtype(device, settings.actor_dtype(device.type))
    temperature, actor_attention, plans = settings.temperature, settings.attention, settings.plans
    sequences = [list(r["prompt_token_ids"]) + list(r["response_token_ids"]) for r in rows]
    prompt_lengths = [len(r["prompt_token_ids"]) for r in rows]

    def common(role: str) -> dict:
        plan = plans[role]
        return dict(sequences=sequences, prompt_lengths=prompt_lengths, budget=plan.batching,
                    packed=plan.packed, budget_key=plan.budget_key, throughput=meter, share=share)

    sums = None
    ref_reused = same_weights(models.actor, models.reference)
    skipped = takes_old_from_rollout(settings, ref_reused, from_rollout)
    # the reference's last hidden states, kept for this iteration's KL guard (scoring.ref_states); in one
    # process only (a share's ranks are gone when the guard runs)
    keeping = (session.ref_states.recording(models.reference, dtype, actor_attention) if share is None
               else nullcontext())
    with keeping as record:
        def logprobs(model, role: str, reference: bool) -> list[list[float]]:
            states: Optional[dict] = {} if reference and record is not None else None
            out = compute_token_logprobs(model, temperature=temperature, pad_id=_pad_id(model),
                                         desc=f"{role} log-probs", head_inputs=states, **common(role))
            if states is not None:
                ref_states.keep(record, sequences, prompt_lengths, states)
            return _as_lists(out)

        if skipped:
            old = [None] * len(rows)  # the caller takes the rollout's log-probs
        else:
            # shared: the actor the rollout just sampled from, which the guard measures next
            actor = load_causal_lm(models.actor, device, dtype, role="actor", session=session, shared=True,
                                   attention=actor_attention)
            if settings.sum_pi_squared:  # one pass gives both: log-prob and sum_v pi^2 of the same softmax
                both = compute_token_logprobs(actor, temperature=temperature, pad_id=_pad_id(actor),
                                              desc="actor log-probs", sum_pi_squared=True, **common("actor"))
                old = _as_lists([None if t is None else t[:, 0] for t in both])
                sums = _as_lists([None if t is None else t[:, 1] for t in both])
            else:  # with the reference's weights (iteration 1) this pass is the reference's too
                old = logprobs(actor, "actor", reference=ref_reused)
            alive = weakref.ref(actor)
            del actor
            release(alive, device, session)
        if ref_reused:
            ref = [None if x is None else list(x) for x in old]
        else:
            with reference_policy(models.reference, device, dtype, actor_attention,
                                  settings.ref_offload, session=session) as reference:
                ref = logprobs(reference, "reference", reference=True)
            release(weakref.ref(reference), device, session)
    if models.critic is None:  # a critic-free estimator: the column keeps its shape, nobody reads it
        return Passes(old, ref, [None if x is None else [0.0] * len(x) for x in ref], ref_reused, sums, skipped)
    critic = load_critic(models.critic, device, dtype, attention=settings.critic_attention, session=session)
    values = compute_token_values(critic, pad_id=_pad_id(critic), desc="critic values", **common("critic"))
    values = _as_lists(values)
    alive = weakref.ref(critic)  # the critic changes every iteration: not worth caching
    del critic
    release(alive, device, session)
    return Passes(old, ref, values, ref_reused, sums, skipped)


PASS_TIMERS = {"actor log-probs": "old_log_prob", "reference log-probs": "ref", "critic values": "values"}
"""Each model pass of this stage by its progress description, and verl's step timer it stands for
(``run.report.TIMING``: perf/score_seconds/<timer> becomes timing_s/<timer>)."""


def pass_seconds(meter: Throughput, reward_seconds: float) -> dict[str, float]:
    """perf/score_seconds/<verl timer>: the seconds of each pass that ran here (one process; with several
    the stage's passes ran side by side, and only the reward's is known) and of the sequence rewards."""
    out = {f"perf/score_seconds/{timer}": meter.pass_seconds[desc]
           for desc, timer in PASS_TIMERS.items() if desc in meter.pass_seconds}
    return {**out, "perf/score_seconds/reward": reward_seconds}


def score_floor(settings: ScoreSettings, session: RunSession, models: ModelPaths, rows: list[dict],
                passes: Passes) -> dict[str, float]:
    """The model FLOPs of the passes this stage ran (the actor's unless skipped, the reference's unless
    reused, the critic's, the reward model's) and their floor at this device's matmul rate
    (``training.flops``); {} when a model's shape cannot be read."""
    lengths = [len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in rows]
    positions = sum(len(r["response_token_ids"]) for r in rows)  # the LM head runs on the response only
    ran = [(models.actor, positions)] if not passes.old_from_rollout else []
    ran += [(models.reference, positions)] if not passes.ref_reused else []
    ran += [(p, 0) for p in (models.critic, models.reward_model) if p is not None]
    shapes = [(flops.model_shape(path, session.live), at) for path, at in ran]
    if any(shape is None for shape, _ in shapes):
        return {}
    device = settings.device.type
    total = sum(flops.forward_flops(shape, lengths, at) for shape, at in shapes)
    return flops.floor_metrics("score", total, device, settings.actor_dtype(device))


def _rollout_log_probs(rows: list[dict], path: Path) -> list[list[float]]:
    """The rollout engine's own log-probs of every response (bypass mode's old policy)."""
    missing = [i for i, r in enumerate(rows) if r.get("rollout_log_probs") is None]
    if missing:
        raise DataError(f"{path} row {missing[0]}: no rollout_log_probs (the offline engine records none), which "
                        "algorithm.rollout_correction.bypass_mode=true trains against; rerun rollout with the hf or "
                        "vllm engine, or turn bypass_mode off")
    return [list(r["rollout_log_probs"]) for r in rows]


def _as_lists(tensors: list[Optional[torch.Tensor]]) -> list[Optional[list[float]]]:
    return [None if t is None else t.tolist() for t in tensors]


def _pad_id(model) -> int:
    """Any valid id works (padding is masked out); the model's own pad id when it has one."""
    pad = getattr(model.config, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def _check_lengths(rows: list[dict], columns: dict[str, list[list[float]]]) -> None:
    for name, column in columns.items():
        for i, (row, values) in enumerate(zip(rows, column)):
            if len(values) != row["response_length"]:  # a bug, not user input: fail before writing
                raise AssertionError(f"{name} of row {i} has {len(values)} entries, "
                                     f"expected {row['response_length']}")


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def sequence_score_metrics(rewards: list[float], lengths: list[int]) -> dict[str, float]:
    """verl's critic/score/{mean,max,min}: over the responses that are not empty (verl leaves
    aborted, zero-length responses out); over all when every response is empty."""
    kept = [r for r, n in zip(rewards, lengths) if n > 0] or list(rewards)
    return {"critic/score/mean": statistics.fmean(kept), "critic/score/max": max(kept),
            "critic/score/min": min(kept)}


def score_metrics(reward_function: CustomRewardConfig, rows, rewards, old, ref, meter, rule_based: bool,
                  raw: Optional[list[float]] = None) -> dict[str, float]:
    """``raw``: the reward function's scores before the overlong penalty (accuracy counts those);
    ``reward_function``: custom_reward_function (a built-in's accuracy counts scores >= its score)."""
    lengths = [r["response_length"] for r in rows]
    tokens = max(1, sum(lengths))
    metrics = {
        **sequence_score_metrics(rewards, lengths),
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "response_length/mean": statistics.fmean(lengths),
        "perf/score_tokens_per_s": meter.tokens_per_s,
        "perf/score_model_seconds": meter.seconds,
        "kl/old_ref_mean": sum(o - r for lo, lr in zip(old, ref) for o, r in zip(lo, lr)) / tokens,
    }
    if rule_based and not reward_function.path:
        correct = sum(r >= reward_function.score for r in (rewards if raw is None else raw))
        metrics["reward/accuracy"] = correct / len(rewards)
    return metrics


def _summary(rows, metrics, meter, ref_reused: bool, out: Path, from_rollout: bool = False) -> list[str]:
    lines = [f"{len(rows)} responses, {sum(r['response_length'] for r in rows)} response tokens "
             f"(mean length {metrics['response_length/mean']:.1f})",
             f"reward mean {metrics['reward/mean']:.4f} ± {metrics['reward/std']:.4f}"
             + (f", accuracy {metrics['reward/accuracy']:.3f}" if "reward/accuracy" in metrics else "")]
    passes = ", ".join(f"{name} ({n} micro-batches)" for name, n in meter.passes.items())
    reuse = "; reference = actor (identical weights): its log-probs reused" if ref_reused else ""
    reuse += "; old log-probs: the rollout's own" if from_rollout else ""
    lines.append(f"model passes: {passes}{reuse}")
    lines.append(f"scoring throughput {meter.tokens_per_s:,.0f} tokens/s ({meter.tokens:,} tokens in "
                 f"{meter.seconds:.1f}s)")
    lines.append(f"wrote {out}")
    return lines


def score_share(cfg, run: RunDir, iteration: int, rank: int, world: int, out: Path, session: RunSession) -> None:
    """This rank's micro-batches of the score stage's model passes (old/ref log-probs, values)."""
    rows = pq.read_table(run.rollout(iteration), columns=["prompt_token_ids", "response_token_ids", "engine",
                                                           "rollout_log_probs"]).to_pylist()
    meter, settings = Throughput(), build(score_settings, cfg)
    passes = model_passes(settings, session, model_paths(cfg, run, iteration), rows, meter, share=(rank, world),
                          from_rollout=old_from_rollout(settings, rows))
    columns = {"old_log_probs": passes.old_log_probs, "ref_log_probs": passes.ref_log_probs, "values": passes.values}
    if passes.sum_pi_squared is not None:
        columns["sum_pi_squared"] = passes.sum_pi_squared
    write_share(out, columns, ref_reused=passes.ref_reused, tokens=meter.tokens, seconds=meter.seconds)
