"""Rollout stage: iteration k's prompts → ``iter_k/rollout.parquet`` (schema ``ROLLOUT``).

Sources (``actor_rollout_ref.rollout.name``):
- ``hf`` / ``vllm``: sample from the actor iteration k started from (the checkpoint of the latest
  earlier committed iteration, else the initial model; `io.pointers.actor_path`)
  over the pack stage's generation batches of slot ``(k - 1) % num_slots``; seeded by
  ``rollout.seed + k``, so iterations differ and a rerun reproduces the table.
- ``offline``: import ``rollout.offline_path`` (see ``rlhf_core.rollout.offline``); rejected rows go
  to ``iter_k/rollout_rejects.parquet``.

With ``algorithm.filter_groups.enable`` (DAPO's dynamic sampling, ``rlhf_core.rollout.dynamic_sampling``)
each response is scored with the score stage's reward function, groups whose responses all score the
same are dropped and the following slots are drawn until data.train_batch_size groups are kept;
only those go to the table (metrics ``train/num_gen_batches``, ``rollout/kept_groups``,
``rollout/filtered_groups``, ``rollout/surplus_groups``). When the estimator takes reward baselines
(remax, ``config.resolve.needs_baseline_rollout``) one greedy response per kept prompt goes to
``iter_k/rollout_baseline.parquet`` (schema ``ROLLOUT``, the same uids), which the score stage scores.

Each row carries its prompt's ``reward_source`` (the data.reward_fn_key value the score stage
routes the reward function on) and ``extra_info`` (JSON), so later tables and queries need no join.
Length metrics use verl's names: ``response_length/{mean,max,min,clip_ratio}`` and
``prompt_length/{mean,max,min,clip_ratio}`` (clip_ratio: share at the data.max_* budget).

    rlhf stage rollout --run-dir runs/demo --iteration 1
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Callable, Optional, Sequence

import pyarrow.compute as pc
import pyarrow.parquet as pq

from rlhf_core.config import RLHFConfig
from rlhf_core.config.reads import AdvEstimator, At, Built, build, config_keys
from rlhf_core.config.schema import DataConfig, FilterGroupsConfig
from rlhf_core.config.errors import ConfigError
from rlhf_core.algos.registry import estimator_takes
from rlhf_core.config.resolve import needs_baseline_rollout
from rlhf_core.notes import say_once
from rlhf_core.data.schemas import REJECTS, ROLLOUT
from rlhf_core.errors import DataError, RLHFError
from rlhf_core.io.atomic import atomic_write_parquet
from rlhf_core.io.tables import rows_with_ids
from rlhf_core.io.timing import MODEL_LOAD, TABLE_READ, timed
from rlhf_core.run.layout import RunDir
from rlhf_core.run.models import actor_path, reference_path
from rlhf_core.rollout.generate import (
    PROMPT_COLUMNS, GenerationSettings, build_rollout_engine, generate_responses, generation_engine, generation_plan,
    group_uid, kept_engine, read_prompt_rows, rollout_metrics, rollout_table, tokenizer_path_for, train_sampling,
)
from rlhf_core.paths import resolve_path
from rlhf_core.rollout.base import GeneratedSample, GenerationStats, RolloutEngine, SamplingParams, derive_seed
from rlhf_core.rollout.dynamic_sampling import (
    check_draw_again, draw_seed, draw_slot, metric_values, split_groups,
)
from rlhf_core.rollout.offline import OFFLINE_ENGINE, import_offline
from rlhf_core.config.validate import check_filter_groups, check_filter_metric, check_overlong_buffer
from rlhf_core.rewards.sequence import RewardSettings, sequence_rewards
from rlhf_core.scoring.models import ModelPaths
from rlhf_core.run.session import RunSession
from rlhf_core.stages.base import StageResult, stage_record
from rlhf_core.stages.ranks import (generation_processes, merge_engine_samples, merge_samples, merged_stats, run_on_ranks,
                                    write_share)
from rlhf_core.stages.settings import generation, reward_model_paths, reward_settings
from rlhf_core.training.run_trainer import ensure_state

def config_sections(cfg: RLHFConfig) -> tuple[str, ...]:
    """The rollout's config prefixes: what ``rollout_settings`` reads. The filter's and the estimator's
    keys count only when they make the rollout do more (the key set then differs, so switching either
    on or off reruns it), so a reward or estimator change alone does not regenerate a plain rollout,
    and the hashes of runs recorded before these features existed stay as they were."""
    return config_keys(rollout_settings, cfg=cfg)


def rollout_rejects_path(run: RunDir, iteration: int) -> Path:
    """Offline rows that were not imported, each with its reason (schema ``REJECTS``)."""
    return run.rollout_rejects(iteration)


@dataclass(frozen=True)
class RolloutSettings:
    """What the rollout's body reads of the config, built once in ``run_rollout``'s body
    (``rollout_settings``): the stage's helpers take this, not the config."""

    gen: GenerationSettings
    """The engine, its sampling and the data budgets (``settings.generation``)."""
    filter_groups: Optional[FilterGroupsConfig]
    """algorithm.filter_groups when enabled (DAPO's dynamic sampling), else None."""
    rewards: Optional[RewardSettings]
    """What the filter scores responses with, as the score stage (``settings.reward_settings``); None without it."""
    baseline_estimator: Optional[str]
    """algorithm.adv_estimator when it takes greedy baselines (``needs_baseline_rollout``: remax), else None."""


@dataclass(frozen=True)
class DynamicSampling:
    groups: FilterGroupsConfig
    rewards: RewardSettings


def filters_groups(enable: Annotated[bool, At("algorithm.filter_groups.enable")]) -> bool:
    return enable


def dynamic_sampling(groups: Annotated[FilterGroupsConfig, At("algorithm.filter_groups.")],
                     use_kl_in_reward: Annotated[bool, At("algorithm.use_kl_in_reward")],
                     rewards: Annotated[RewardSettings, Built(reward_settings)]) -> DynamicSampling:
    """The filter and what it scores responses with; its metric cannot include a KL penalty the
    rollout does not know yet (``config.validate.check_filter_metric``)."""
    check_filter_metric(groups.metric, use_kl_in_reward)
    return DynamicSampling(groups, rewards)


def decodes_baselines(adv_estimator: AdvEstimator) -> bool:
    return estimator_takes(adv_estimator, "reward_baselines")


def baseline_estimator(adv_estimator: AdvEstimator) -> str:
    return adv_estimator


def rollout_settings(gen: Annotated[GenerationSettings, Built(generation)],
                     sampling: Annotated[Optional[DynamicSampling], Built(dynamic_sampling, when=filters_groups)],
                     baselines: Annotated[Optional[str], Built(baseline_estimator, when=decodes_baselines)],
                     ) -> RolloutSettings:
    """The rollout's settings (``build(rollout_settings, cfg)``); the filter's and the estimator's keys
    are read only when they make the rollout do more."""
    return RolloutSettings(gen=gen, filter_groups=sampling.groups if sampling else None,
                           rewards=sampling.rewards if sampling else None, baseline_estimator=baselines)


@dataclass(frozen=True)
class ConfigCalls:
    """The calls of the rollout's body that need the whole config, bound to it in ``run_rollout``:
    the rank processes rebuild the config (``stages.ranks``), and the filter's models are looked up
    (the reference's path, ``run.models``) only when it scores."""

    processes: Callable[[int], int]
    """``generation_processes`` for a draw of that many generation batches (0: this process)."""
    on_ranks: Callable[[int], list[dict]]
    """``run_on_ranks``: the rollout's rank entry on that many processes, each rank's arrays."""
    filter_models: Callable[[Path], ModelPaths]
    """The models dynamic sampling scores with, for the actor at that path."""


def run_rollout(cfg: RLHFConfig, run: RunDir, iteration: int | None = None, force: bool = False,
                session: Optional[RunSession] = None) -> StageResult:
    """Write iteration ``iteration``'s rollout table; skipped when inputs and config are unchanged.
    ``session``: the flow run's (its trainer lends the actor, its kept engine generates); None:
    every model read from disk."""
    session = session or RunSession()
    if iteration is None or iteration < 1:
        raise RLHFError(f"rollout is a per-iteration stage: pass --iteration K with K >= 1 (got {iteration})")
    if not run.train_prompts.is_file():
        raise DataError(f"{run.train_prompts} not found; run `rlhf stage preprocess --run-dir {run.root}` first")
    r = cfg.actor_rollout_ref.rollout
    check_filter_groups(cfg)
    if cfg.algorithm.filter_groups.enable:
        check_overlong_buffer(cfg)
    if needs_baseline_rollout(cfg) and r.name == OFFLINE_ENGINE:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs one greedy response per "
                          "prompt from the actor, which actor_rollout_ref.rollout.name=offline does not generate; "
                          "use rollout.name=hf or vllm, or an estimator without reward baselines")
    model_dir = actor_path(cfg, run, iteration)  # the actor this iteration started from (reruns too)
    if r.name == OFFLINE_ENGINE:
        offline_file = resolve_path(r.offline_path or "")
        if not offline_file.is_file():
            raise DataError(f"actor_rollout_ref.rollout.offline_path={r.offline_path!r}: no such file")
        inputs = [run.train_prompts, model_dir, offline_file]
    else:
        if not run.generation_batches.is_file():
            raise DataError(f"{run.generation_batches} not found; "
                            f"run `rlhf stage pack --run-dir {run.root}` first")
        inputs = [run.train_prompts, run.generation_batches, model_dir]
        if cfg.algorithm.filter_groups.enable:
            inputs += [p for p in reward_model_paths(cfg) if p is not None]

        def filter_models(actor: Path) -> ModelPaths:
            rm, rm_tokenizer = reward_model_paths(cfg)
            return ModelPaths(actor=actor, reference=reference_path(cfg), critic=None, reward_model=rm,
                              rm_input_tokenizer=rm_tokenizer)

        calls = ConfigCalls(
            processes=lambda batches: generation_processes(cfg.trainer, r, session, batches),
            on_ranks=lambda world: run_on_ranks(cfg, run, session, iteration, "rollout", world),
            filter_models=filter_models)
    with stage_record(stage="rollout", cfg=cfg, run=run, iteration=iteration, inputs=inputs,
                      config_sections=config_sections(cfg), force=force) as record:
        if record.skipped:
            return record.skipped
        ensure_state(session, run, run.checkpoint_iteration(model_dir))  # held in memory, on disk, or rebuilt now
        if r.name == OFFLINE_ENGINE:
            return record.done(_offline_body(build(rollout_settings, cfg), run, iteration, model_dir, offline_file))
        return record.done(_generate_body(build(rollout_settings, cfg), calls, run, iteration, model_dir, session))


def slot_batches(run: RunDir, iteration: int) -> tuple[int, int, list[list[str]]]:
    """(slot, number of slots, prompt ids per generation batch in batch order) for iteration k."""
    num_slots, table = _read_plan(run)
    slot = (iteration - 1) % num_slots
    return slot, num_slots, _batches_of(run, table, slot)


def iteration_prompts(run: RunDir, iteration: int) -> tuple[int, int, list[list[str]], list[dict]]:
    """(slot, number of slots, prompt ids per generation batch, the prompt rows in batch order)."""
    slot, num_slots, batches = slot_batches(run, iteration)
    return slot, num_slots, batches, _prompt_rows(run, batches)


def slot_prompts(run: RunDir, slot: int) -> tuple[list[list[str]], list[dict]]:
    """(prompt ids per generation batch, prompt rows in batch order) of pack slot ``slot``."""
    _, table = _read_plan(run)
    batches = _batches_of(run, table, slot)
    return batches, _prompt_rows(run, batches)


def _read_plan(run: RunDir) -> tuple[int, list[dict]]:
    with timed(TABLE_READ):
        table = pq.read_table(run.generation_batches, columns=["slot", "batch_id", "prompt_ids"])
    if table.num_rows == 0:
        raise DataError(f"{run.generation_batches} has no generation batches; rerun the pack stage")
    return int(pc.max(table["slot"]).as_py()) + 1, table.to_pylist()


def _batches_of(run: RunDir, plan: list[dict], slot: int) -> list[list[str]]:
    rows = sorted((r for r in plan if r["slot"] == slot), key=lambda r: r["batch_id"])
    if not rows:
        raise DataError(f"{run.generation_batches} has no batches for slot {slot}; rerun the pack stage")
    return [r["prompt_ids"] for r in rows]


def _prompt_rows(run: RunDir, batches: list[list[str]]) -> list[dict]:
    wanted = list(dict.fromkeys(pid for batch in batches for pid in batch))  # batch order, unique
    by_id = {row["prompt_id"]: row for row in rows_with_ids(run.train_prompts, "prompt_id", wanted, PROMPT_COLUMNS)}
    unknown = [pid for pid in wanted if pid not in by_id]
    if unknown:
        raise DataError(f"{run.generation_batches} names prompt id {unknown[0]!r} that is not in "
                        f"{run.train_prompts}; rerun `rlhf stage pack --force` after preprocess")
    return [by_id[pid] for pid in wanted]


def iteration_sampling(gen: GenerationSettings, iteration: int) -> SamplingParams:
    return train_sampling(gen, seed=gen.rollout.seed + iteration)


@dataclass
class Drawn:
    """What the rollout generated: prompt rows of every draw, concatenated (samples' prompt_index
    indexes them, so every uid is unique), the samples kept for the table, and counts."""

    prompt_rows: list[dict] = field(default_factory=list)
    samples: list[GeneratedSample] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    slots: list[int] = field(default_factory=list)
    filtered_groups: int = 0
    surplus_groups: int = 0


class StageEngine:
    """One engine for every generation of the stage in this process (refill draws, the greedy
    baseline), built on first use: a model load per stage, not per draw. A resident engine (the
    session's, ``kept_engine``) is borrowed and left open."""

    def __init__(self, gen: GenerationSettings, model_dir: Path, session: RunSession) -> None:
        self.gen, self.model_dir, self.session = gen, model_dir, session
        self.engine: Optional[RolloutEngine] = None
        self.owned = False
        self.load_seconds = 0.0

    def get(self) -> RolloutEngine:
        if self.engine is None:
            started = time.perf_counter()
            self.engine = kept_engine(self.gen, self.model_dir, self.session)
            self.owned = self.engine is None
            self.engine = self.engine or build_rollout_engine(self.gen, self.model_dir, session=self.session)
            self.load_seconds = time.perf_counter() - started
        return self.engine

    def close(self) -> None:
        if self.engine is not None and self.owned:
            self.engine.close()
        self.engine = None


def _generate_body(settings: RolloutSettings, calls: ConfigCalls, run: RunDir, iteration: int,
                   model_dir: Path, session: RunSession) -> StageResult:
    engines = StageEngine(settings.gen, model_dir, session)
    try:
        return _generate_with(settings, calls, run, iteration, model_dir, engines)
    finally:
        engines.close()


def _generate_with(settings: RolloutSettings, calls: ConfigCalls, run: RunDir, iteration: int, model_dir: Path,
                   engines: StageEngine) -> StageResult:
    slot, num_slots, batches, prompt_rows = iteration_prompts(run, iteration)
    sampling = iteration_sampling(engines.gen, iteration)
    samples, stats = _generate_draw(calls, iteration, engines, prompt_rows, sampling, batches, first=True)
    drawn = Drawn(prompt_rows=list(prompt_rows), samples=samples, stats=stats, slots=[slot])
    if settings.filter_groups is not None:
        drawn = _filter_and_refill(settings, calls, run, iteration, engines, drawn, num_slots)
    drawn.stats.load_seconds += engines.load_seconds  # the one load of this process's engine
    engine = settings.gen.rollout.name
    out = atomic_write_parquet(run.rollout(iteration), rollout_table(drawn.prompt_rows, drawn.samples, iteration, engine),
                               schema=ROLLOUT)
    outputs = {"rollout": str(out)}
    stats, samples, prompt_rows = drawn.stats, drawn.samples, drawn.prompt_rows
    metrics = rollout_metrics(samples, stats)
    for key, value in length_metrics(settings.gen.data, prompt_rows, samples).items():
        metrics.setdefault(key, value)  # the engine's own response_length/* stay as they are
    groups = len({s.prompt_index for s in samples})
    summary = [
        f"{groups} prompts (slot {slot} of {num_slots}, {stats.batches} generation batches) "
        f"× n={sampling.n} → {len(samples)} responses with {engine} from {model_dir}",
        f"{stats.generated_tokens} tokens in {stats.seconds:.1f}s: {stats.tokens_per_s:.0f} tokens/s "
        f"(model load {stats.load_seconds:.1f}s)",
        f"response length mean {metrics['response_length/mean']:.1f}, max {metrics['response_length/max']:.0f} "
        f"of {sampling.max_new_tokens}; stopped on EOS {100 * metrics['rollout/stop_frac']:.0f}%",
    ]
    if settings.filter_groups is not None:
        metrics.update({"train/num_gen_batches": float(len(drawn.slots)), "rollout/kept_groups": float(groups),
                        "rollout/filtered_groups": float(drawn.filtered_groups),
                        "rollout/surplus_groups": float(drawn.surplus_groups)})
        summary.append(f"dynamic sampling ({settings.filter_groups.metric}): {len(drawn.slots)} draws "
                       f"(slots {', '.join(map(str, drawn.slots))}), {drawn.filtered_groups} groups scored alike "
                       f"and dropped, {drawn.surplus_groups} kept groups over data.train_batch_size cut")
    if settings.baseline_estimator is not None:
        baseline = _write_baseline(run, iteration, engines, drawn)
        outputs["rollout_baseline"] = str(baseline)
        summary.append(f"greedy baseline response per prompt ({settings.baseline_estimator}) → {baseline}")
    summary.append(f"wrote {out}")
    return StageResult(stage="rollout", iteration=iteration, outputs=outputs,
                       rows={"prompts": groups, "responses": len(samples)}, metrics=metrics,
                       summary=summary)


def _generate_draw(calls: ConfigCalls, iteration: int, engines: StageEngine, prompt_rows: list[dict],
                   sampling: SamplingParams, batches: list[list[str]], first: bool, desc: str = ""):
    """One draw's samples (prompt_index into ``prompt_rows``) and stats. The iteration's own draw
    runs on every local process as before; the rank entry knows only that draw, so later draws
    (dynamic sampling) run in this process."""
    world = calls.processes(len(batches)) if first else 0
    if world:
        return _generate_on_ranks(engines.gen, calls, prompt_rows, sampling, batches, world)
    return generate_responses(engines.gen, engines.model_dir, prompt_rows, sampling, batches,
                              session=engines.session, engine=engines.get(), desc=desc or f"rollout iter {iteration}")


def _filter_and_refill(settings: RolloutSettings, calls: ConfigCalls, run: RunDir, iteration: int,
                       engines: StageEngine, drawn: Drawn, num_slots: int) -> Drawn:
    """Keep the groups whose responses differ on filter_groups.metric; draw the next slots while
    fewer than data.train_batch_size are kept; cut to exactly that many (``dynamic_sampling``)."""
    fg, wanted = settings.filter_groups, settings.gen.data.train_batch_size
    models = calls.filter_models(engines.model_dir)
    kept_samples: list[GeneratedSample] = []
    kept_groups = 0
    new_samples = drawn.samples
    while True:
        kept, filtered = _kept_uids(settings, engines.session, run, iteration, models, drawn.prompt_rows,
                                    new_samples)
        drawn.filtered_groups += len(filtered)
        take = kept[:max(wanted - kept_groups, 0)]
        drawn.surplus_groups += len(kept) - len(take)
        taken = set(take)
        kept_samples += [s for s in new_samples if group_uid(iteration, s.prompt_index) in taken]
        kept_groups += len(take)
        if not check_draw_again(kept_groups, wanted, len(drawn.slots), fg.max_num_gen_batches, num_slots):
            break
        d = len(drawn.slots)
        slot = draw_slot(drawn.slots[0], d, num_slots)
        drawn.slots.append(slot)
        offset = len(drawn.prompt_rows)
        rows, batches = _draw_prompts(run, slot, {r["prompt_id"] for r in drawn.prompt_rows})
        if not rows:
            new_samples = []
            continue
        base = iteration_sampling(engines.gen, iteration)
        sampling = replace(base, seed=draw_seed(base.seed, d))
        samples, stats = _generate_draw(calls, iteration, engines, rows, sampling, batches, first=False,
                                        desc=f"rollout iter {iteration} draw {d + 1}")
        _add_stats(drawn.stats, stats)
        drawn.prompt_rows += rows
        new_samples = [replace(s, prompt_index=s.prompt_index + offset) for s in samples]
    drawn.samples = kept_samples
    return drawn


def _kept_uids(settings: RolloutSettings, session: RunSession, run: RunDir, iteration: int, models: ModelPaths,
               prompt_rows: list[dict], samples: list[GeneratedSample]) -> tuple[list[str], list[str]]:
    """(kept, filtered) group uids of one draw's samples, scored as the score stage will score them."""
    if not samples:
        return [], []
    rows = rollout_table(prompt_rows, samples, iteration, settings.gen.rollout.name).to_pylist()
    rewards = sequence_rewards(settings.rewards, session, models, rows, run.train_prompts, run.rollout(iteration))
    where = [f"iteration {iteration} response (prompt_id={r['prompt_id']!r}, sample_index={r['sample_index']})"
             for r in rows]
    values = metric_values(settings.filter_groups.metric, rewards.scores, rewards.raw, rewards.acc, where)
    return split_groups([r["uid"] for r in rows], values)


def _draw_prompts(run: RunDir, slot: int, drawn_ids: set[str]) -> tuple[list[dict], list[list[str]]]:
    """Slot ``slot``'s prompt rows and generation batches, less the prompts this iteration already
    drew (a prompt in slots of two epochs); empty batches dropped."""
    batches, rows = slot_prompts(run, slot)
    batches = [kept for kept in ([pid for pid in b if pid not in drawn_ids] for b in batches) if kept]
    return [r for r in rows if r["prompt_id"] not in drawn_ids], batches


def _add_stats(total: GenerationStats, more: GenerationStats) -> None:
    total.generated_tokens += more.generated_tokens
    total.seconds += more.seconds
    total.load_seconds += more.load_seconds
    total.batches += more.batches


def _write_baseline(run: RunDir, iteration: int, engines: StageEngine, drawn: Drawn) -> Path:
    """remax's baseline: one greedy response (n=1) per prompt group of the table, written with the
    group's uid to ``run.rollout_baseline(iteration)`` (schema ROLLOUT)."""
    indices = list(dict.fromkeys(s.prompt_index for s in drawn.samples))  # the table's groups, in order
    rows = [drawn.prompt_rows[i] for i in indices]
    seed = derive_seed(iteration_sampling(engines.gen, iteration).seed, "greedy_baseline")
    sampling = replace(train_sampling(engines.gen, seed=seed, greedy=True), n=1)
    samples, _ = generate_responses(engines.gen, engines.model_dir, rows, sampling, session=engines.session,
                                    engine=engines.get(), desc=f"greedy baseline iter {iteration}")
    samples = [replace(s, prompt_index=indices[s.prompt_index]) for s in samples]
    table = rollout_table(drawn.prompt_rows, samples, iteration, engines.gen.rollout.name)
    return atomic_write_parquet(run.rollout_baseline(iteration), table, schema=ROLLOUT)


def _generate_on_ranks(gen: GenerationSettings, calls: ConfigCalls, prompt_rows: list[dict],
                       sampling: SamplingParams, batches: list[list[str]], world: int):
    """``generate_responses`` with the generation batches dealt to ``world`` local processes
    (``own_batches``); every batch is seeded and composed as in one process, so the merged samples,
    in batch order, are the one-process samples."""
    shares = calls.on_ranks(world)
    rollout = gen.rollout
    plan = generation_plan(rollout, prompt_rows, sampling, batches)
    if generation_engine(rollout) == "vllm":
        return merge_engine_samples(shares, [i for batch in plan for i in batch]), merged_stats(shares, 1)
    return merge_samples(shares, plan, prompt_rows, sampling), merged_stats(shares, len(plan))


def _offline_body(settings: RolloutSettings, run: RunDir, iteration: int, model_dir: Path,
                  offline_file: Path) -> StageResult:
    from transformers import AutoTokenizer

    with timed(TABLE_READ):
        prompt_rows = read_prompt_rows(run.train_prompts, columns=None)  # text columns: prompts matched by text
    with timed(MODEL_LOAD):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path_for(settings.gen, model_dir))
    imported = import_offline(offline_file, prompt_rows, tokenizer,
                              max_response_length=settings.gen.data.max_response_length,
                              prompts_name=str(run.train_prompts.relative_to(run.root)))
    out = atomic_write_parquet(run.rollout(iteration),
                               rollout_table(prompt_rows, imported.samples, iteration, OFFLINE_ENGINE),
                               schema=ROLLOUT)
    rejects = atomic_write_parquet(rollout_rejects_path(run, iteration), imported.rejects_table(), schema=REJECTS)
    metrics = rollout_metrics(imported.samples, GenerationStats())
    metrics = {k: v for k, v in metrics.items() if not k.startswith("perf/")}  # nothing was generated
    for key, value in length_metrics(settings.gen.data, prompt_rows, imported.samples).items():
        metrics.setdefault(key, value)  # the engine's own response_length/* stay as they are
    metrics["rollout/offline_rejected"] = float(len(imported.rejects))
    prompts = len({s.prompt_index for s in imported.samples})
    ignored = []
    if imported.ignored_columns:
        ignored = [f"{offline_file}'s {' and '.join(sorted(imported.ignored_columns))} column is not used: the score "
                   "stage scores every response with the run's reward function (custom_reward_function.path "
                   "for your own scorer)"]
        say_once(f"rollout: {ignored[0]}")
    summary = [f"imported {len(imported.samples)} responses for {prompts} prompts from {offline_file}", *ignored,
               f"rejected {len(imported.rejects)} rows → {rejects}"
               + (f" (first: {imported.rejects[0]['reason']})" if imported.rejects else ""),
               f"response length mean {metrics['response_length/mean']:.1f}, max "
               f"{metrics['response_length/max']:.0f}", f"wrote {out}"]
    return StageResult(stage="rollout", iteration=iteration,
                       outputs={"rollout": str(out), "rollout_rejects": str(rejects)},
                       rows={"prompts": prompts, "responses": len(imported.samples),
                             "rejected": len(imported.rejects)}, metrics=metrics, summary=summary)


def length_metrics(data: DataConfig, prompt_rows: Sequence[dict], samples: Sequence) -> dict[str, float]:
    """verl's length metrics over one rollout's responses (each response counts its prompt once):
    prompt_length/{mean,max,min,clip_ratio}, response_length/{mean,max,min,clip_ratio}; clip_ratio
    = share of lengths equal to data.max_prompt_length / data.max_response_length."""
    prompt = [len(prompt_rows[s.prompt_index]["prompt_token_ids"]) for s in samples]
    response = [len(s.token_ids) for s in samples]
    return {**_stats("prompt_length", prompt, data.max_prompt_length),
            **_stats("response_length", response, data.max_response_length)}


def _stats(name: str, lengths: list[int], budget: int) -> dict[str, float]:
    values = lengths or [0]
    clipped = sum(n == budget for n in lengths) / max(len(lengths), 1)
    return {f"{name}/mean": sum(values) / len(values), f"{name}/max": float(max(values)),
            f"{name}/min": float(min(values)), f"{name}/clip_ratio": clipped}


def rollout_share(cfg, run: RunDir, iteration: int, rank: int, world: int, out: Path, session: RunSession) -> None:
    """This rank's generation batches of the rollout (HF engine), seeded as in one process."""
    _, _, batches, prompt_rows = iteration_prompts(run, iteration)
    gen = build(generation, cfg)
    samples, stats = generate_responses(gen, actor_path(cfg, run, iteration), prompt_rows,
                                        iteration_sampling(gen, iteration), batches, session=session,
                                        desc=f"rollout iter {iteration} rank {rank}", share=(rank, world))
    write_share(out, {}, samples=json.dumps([dataclasses.asdict(s) for s in samples]),
                 generated_tokens=stats.generated_tokens, seconds=stats.seconds, load_seconds=stats.load_seconds)
