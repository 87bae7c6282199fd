"""Rollout stage: iteration k's prompts → ``iter_k/rollout.parquet`` (schema ``ROLLOUT``).

Sources (``actor_rollout_ref.rollout.name``):
- ``hf`` / ``vllm``: sample from the actor iteration k started from (the checkpoint of the latest
  earlier committed iteration, else the initial model; `io.pointers.actor_path`)
  over the pack stage's generation batches of slot ``(k - 1) % num_slots``; seeded by
  ``rollout.seed + k``, so iterations differ and a rerun reproduces the table.
- ``offline``: import ``rollout.offline_path`` (see ``rlhf_core.rollout.offline``); rejected rows go
  to ``iter_k/rollout_rejects.parquet``.

Each row carries its prompt's ``reward_source`` (the data.reward_fn_key value the score stage
routes the reward function on) and ``extra_info`` (JSON), so later tables and queries need no join.
Length metrics use verl's names: ``response_length/{mean,max,min,clip_ratio}`` and
``prompt_length/{mean,max,min,clip_ratio}`` (clip_ratio: share at the data.max_* budget).

    rlhf stage rollout --run-dir runs/demo --iteration 1
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pyarrow.compute as pc
import pyarrow.parquet as pq

from rlhf_core.config import RLHFConfig
from rlhf_core.data.schemas import REJECTS, ROLLOUT
from rlhf_core.errors import DataError, RLHFError
from rlhf_core.io.atomic import atomic_write_parquet
from rlhf_core.io.tables import rows_with_ids
from rlhf_core.io.timing import MODEL_LOAD, TABLE_READ, timed
from rlhf_core.run.layout import RunDir
from rlhf_core.run.models import actor_path
from rlhf_core.rollout.generate import (
    PROMPT_COLUMNS, generate_responses, generation_plan, read_prompt_rows, rollout_metrics, rollout_table, sampling_from_config,
    tokenizer_path_for,
)
from rlhf_core.paths import resolve_path
from rlhf_core.rollout.base import GenerationStats, SamplingParams
from rlhf_core.rollout.offline import OFFLINE_ENGINE, import_offline
from rlhf_core.stages.base import StageResult, execute_stage
from rlhf_core.stages.ranks import merge_samples, merged_stats, run_on_ranks, stage_processes
from rlhf_core.training.resident import ensure_state

CONFIG_SECTIONS = ("data.", "actor_rollout_ref.rollout.", "actor_rollout_ref.model.")


def rollout_rejects_path(run: RunDir, iteration: int) -> Path:
    """Offline rows that were not imported, each with its reason (schema ``REJECTS``)."""
    return run.rollout_rejects(iteration)


def run_rollout(cfg: RLHFConfig, run: RunDir, iteration: int | None = None, force: bool = False) -> StageResult:
    """Write iteration ``iteration``'s rollout table; skipped when inputs and config are unchanged."""
    if iteration is None or iteration < 1:
        raise RLHFError(f"rollout is a per-iteration stage: pass --iteration K with K >= 1 (got {iteration})")
    if not run.train_prompts.is_file():
        raise DataError(f"{run.train_prompts} not found; run `rlhf stage preprocess --run-dir {run.root}` first")
    r = cfg.actor_rollout_ref.rollout
    model_dir = actor_path(cfg, run, iteration)  # the actor this iteration started from (reruns too)
    if r.name == OFFLINE_ENGINE:
        offline_file = resolve_path(r.offline_path or "")
        if not offline_file.is_file():
            raise DataError(f"actor_rollout_ref.rollout.offline_path={r.offline_path!r}: no such file")
        inputs = [run.train_prompts, model_dir, offline_file]
        body = lambda: _offline_body(cfg, run, iteration, model_dir, offline_file)  # noqa: E731
    else:
        if not run.generation_batches.is_file():
            raise DataError(f"{run.generation_batches} not found; "
                            f"run `rlhf stage pack --run-dir {run.root}` first")
        inputs = [run.train_prompts, run.generation_batches, model_dir]
        body = lambda: _generate_body(cfg, run, iteration, model_dir)  # noqa: E731
    return execute_stage(stage="rollout", cfg=cfg, run=run, iteration=iteration, inputs=inputs,
                         config_sections=CONFIG_SECTIONS, body=body, force=force)


def slot_batches(run: RunDir, iteration: int) -> tuple[int, int, list[list[str]]]:
    """(slot, number of slots, prompt ids per generation batch in batch order) for iteration k."""
    with timed(TABLE_READ):
        table = pq.read_table(run.generation_batches, columns=["slot", "batch_id", "prompt_ids"])
    if table.num_rows == 0:
        raise DataError(f"{run.generation_batches} has no generation batches; rerun the pack stage")
    num_slots = int(pc.max(table["slot"]).as_py()) + 1
    slot = (iteration - 1) % num_slots
    rows = sorted((r for r in table.to_pylist() if r["slot"] == slot), key=lambda r: r["batch_id"])
    if not rows:
        raise DataError(f"{run.generation_batches} has no batches for slot {slot}; rerun the pack stage")
    return slot, num_slots, [r["prompt_ids"] for r in rows]


def iteration_prompts(run: RunDir, iteration: int) -> tuple[int, int, list[list[str]], list[dict]]:
    """(slot, number of slots, prompt ids per generation batch, the prompt rows in batch order)."""
    slot, num_slots, batches = slot_batches(run, iteration)
    wanted = list(dict.fromkeys(pid for batch in batches for pid in batch))  # batch order, unique
    by_id = {row["prompt_id"]: row for row in rows_with_ids(run.train_prompts, "prompt_id", wanted, PROMPT_COLUMNS)}
    unknown = [pid for pid in wanted if pid not in by_id]
    if unknown:
        raise DataError(f"{run.generation_batches} names prompt id {unknown[0]!r} that is not in "
                        f"{run.train_prompts}; rerun `rlhf stage pack --force` after preprocess")
    return slot, num_slots, batches, [by_id[pid] for pid in wanted]


def iteration_sampling(cfg: RLHFConfig, iteration: int) -> SamplingParams:
    return sampling_from_config(cfg, seed=cfg.actor_rollout_ref.rollout.seed + iteration)


def _generate_body(cfg: RLHFConfig, run: RunDir, iteration: int, model_dir: Path) -> StageResult:
    ensure_state(cfg, run, run.checkpoint_iteration(model_dir))  # held in memory, on disk, or rebuilt now
    slot, num_slots, batches, prompt_rows = iteration_prompts(run, iteration)
    sampling = iteration_sampling(cfg, iteration)
    world = min(stage_processes(cfg), len(batches)) if cfg.actor_rollout_ref.rollout.name == "hf" else 1
    if world > 1:
        samples, stats = _generate_on_ranks(cfg, run, iteration, prompt_rows, sampling, batches, world)
    else:
        samples, stats = generate_responses(cfg, model_dir, prompt_rows, sampling, batches,
                                            desc=f"rollout iter {iteration}")
    engine = cfg.actor_rollout_ref.rollout.name
    out = atomic_write_parquet(run.rollout(iteration), rollout_table(prompt_rows, samples, iteration, engine),
                               schema=ROLLOUT)
    metrics = rollout_metrics(samples, stats)
    for key, value in length_metrics(cfg, prompt_rows, samples).items():
        metrics.setdefault(key, value)  # the engine's own response_length/* stay as they are
    summary = [
        f"{len(prompt_rows)} prompts (slot {slot} of {num_slots}, {stats.batches} generation batches) "
        f"× n={sampling.n} → {len(samples)} responses with {engine} from {model_dir}",
        f"{stats.generated_tokens} tokens in {stats.seconds:.1f}s: {stats.tokens_per_s:.0f} tokens/s "
        f"(model load {stats.load_seconds:.1f}s)",
        f"response length mean {metrics['response_length/mean']:.1f}, max {metrics['response_length/max']:.0f} "
        f"of {sampling.max_new_tokens}; stopped on EOS {100 * metrics['rollout/stop_frac']:.0f}%",
        f"wrote {out}",
    ]
    return StageResult(stage="rollout", iteration=iteration, outputs={"rollout": str(out)},
                       rows={"prompts": len(prompt_rows), "responses": len(samples)}, metrics=metrics,
                       summary=summary)


def _generate_on_ranks(cfg: RLHFConfig, run: RunDir, iteration: int, prompt_rows: list[dict],
                       sampling: SamplingParams, batches: list[list[str]], world: int):
    """``generate_responses`` with the generation batches dealt to ``world`` local processes
    (``own_batches``); every batch is seeded and composed as in one process, so the merged samples,
    in batch order, are the one-process samples."""
    shares = run_on_ranks(cfg, run, iteration, "rollout", world)
    plan = generation_plan(cfg, prompt_rows, sampling, batches)
    return merge_samples(shares, plan, prompt_rows, sampling), merged_stats(shares, len(plan))


def _offline_body(cfg: RLHFConfig, run: RunDir, iteration: int, model_dir: Path,
                  offline_file: Path) -> StageResult:
    from transformers import AutoTokenizer

    ensure_state(cfg, run, run.checkpoint_iteration(model_dir))

    with timed(TABLE_READ):
        prompt_rows = read_prompt_rows(run.train_prompts, columns=None)  # text columns: prompts matched by text
    with timed(MODEL_LOAD):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path_for(cfg, model_dir))
    imported = import_offline(offline_file, prompt_rows, tokenizer,
                              max_response_length=cfg.data.max_response_length,
                              prompts_name=str(run.train_prompts.relative_to(run.root)))
    out = atomic_write_parquet(run.rollout(iteration),
                               rollout_table(prompt_rows, imported.samples, iteration, OFFLINE_ENGINE),
                               schema=ROLLOUT)
    rejects = atomic_write_parquet(rollout_rejects_path(run, iteration), imported.rejects_table(), schema=REJECTS)
    metrics = rollout_metrics(imported.samples, GenerationStats())
    metrics = {k: v for k, v in metrics.items() if not k.startswith("perf/")}  # nothing was generated
    for key, value in length_metrics(cfg, prompt_rows, imported.samples).items():
        metrics.setdefault(key, value)  # the engine's own response_length/* stay as they are
    metrics["rollout/offline_rejected"] = float(len(imported.rejects))
    prompts = len({s.prompt_index for s in imported.samples})
    summary = [f"imported {len(imported.samples)} responses for {prompts} prompts from {offline_file}",
               f"rejected {len(imported.rejects)} rows → {rejects}"
               + (f" (first: {imported.rejects[0]['reason']})" if imported.rejects else ""),
               f"response length mean {metrics['response_length/mean']:.1f}, max "
               f"{metrics['response_length/max']:.0f}", f"wrote {out}"]
    return StageResult(stage="rollout", iteration=iteration,
                       outputs={"rollout": str(out), "rollout_rejects": str(rejects)},
                       rows={"prompts": prompts, "responses": len(imported.samples),
                             "rejected": len(imported.rejects)}, metrics=metrics, summary=summary)


def length_metrics(cfg: RLHFConfig, prompt_rows: Sequence[dict], samples: Sequence) -> dict[str, float]:
    """verl's length metrics over one rollout's responses (each response counts its prompt once):
    prompt_length/{mean,max,min,clip_ratio}, response_length/{mean,max,min,clip_ratio}; clip_ratio
    = share of lengths equal to data.max_prompt_length / data.max_response_length."""
    prompt = [len(prompt_rows[s.prompt_index]["prompt_token_ids"]) for s in samples]
    response = [len(s.token_ids) for s in samples]
    return {**_stats("prompt_length", prompt, cfg.data.max_prompt_length),
            **_stats("response_length", response, cfg.data.max_response_length)}


def _stats(name: str, lengths: list[int], budget: int) -> dict[str, float]:
    values = lengths or [0]
    clipped = sum(n == budget for n in lengths) / max(len(lengths), 1)
    return {f"{name}/mean": sum(values) / len(values), f"{name}/max": float(max(values)),
            f"{name}/min": float(min(values)), f"{name}/clip_ratio": clipped}
