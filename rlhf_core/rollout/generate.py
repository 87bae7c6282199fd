"""Prompts → responses with a generation engine, and responses → the rollout table.

``generate_responses`` is the one entry point every caller shares: the rollout stage (train prompts,
the pack stage's generation batches, sampled) and validation (held-out prompts, possibly greedy)::

    gen = build(stages.settings.generation, cfg)  # built once, above this layer
    rows = read_prompt_rows(run.val_prompts)
    samples, stats = generate_responses(gen, model_dir, rows, validation_sampling(gen, seed=7), session=HeldModels())

What generation reads of the config arrives as ``GenerationSettings``; the whole config stops above.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core.config.schema import DataConfig, RolloutConfig
from rlhf_core.notes import say_once
from rlhf_core.data.schemas import ROLLOUT
from rlhf_core.errors import DataError, RLHFError
from rlhf_core.rollout.base import (
    FINISH_STOP, GeneratedSample, GenerationStats, RolloutEngine, SamplingParams, derive_seed, get_engine,
)
from rlhf_core.data.packing import Share, plan_generation_batches, shard_by_tokens
from rlhf_core.paths import resolve_model_path
from rlhf_core.progress import bar_disabled
from rlhf_core.scoring.held import HeldModels
from rlhf_core.training.ds_config import resolve_device
from rlhf_core.training.flops import floor_metrics, generation_flops, model_shape


@dataclass(frozen=True)
class GenerationSettings:
    """What generation reads of the config: the rollout and data sections, and the few other values
    an engine is built with. Built once by ``stages.settings.generation``."""

    rollout: RolloutConfig  # actor_rollout_ref.rollout
    data: DataConfig  # max_response_length; a vLLM engine's sizing also max_prompt_length, train_batch_size
    device: str  # trainer.device
    dtype: str  # the actor's training dtype (fp32 / bf16 / fp16): vLLM's log-probs must be the trainer's
    attention: Optional[str]  # actor_rollout_ref.model.override_config.attn_implementation
    tokenizer_path: Optional[str] = None  # actor_rollout_ref.model.tokenizer_path


PROMPT_COLUMNS = ("prompt_id", "data_source", "reward_source", "reward_model", "extra_info", "prompt_token_ids",
                  "prompt_length")


def read_prompt_rows(path: str | Path, columns: Optional[Sequence[str]] = PROMPT_COLUMNS) -> list[dict[str, Any]]:
    """Rows of a prompts table (prompts/train.parquet or val.parquet): the columns generation needs,
    or every column with ``columns=None``."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompt table {path} not found; run `rlhf stage preprocess --run-dir <run>` first")
    return pq.read_table(path, columns=list(columns) if columns is not None else None).to_pylist()


def train_sampling(gen: GenerationSettings, *, seed: int, greedy: Optional[bool] = None) -> SamplingParams:
    """Training rollouts' SamplingParams from ``actor_rollout_ref.rollout`` and
    ``data.max_response_length``. Greedy when rollout.do_sample is false (verl), unless ``greedy``
    says otherwise; greedy keeps rollout.n (n identical responses, as verl repeats the batch)."""
    r = gen.rollout
    greedy = (not r.do_sample) if greedy is None else greedy
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=gen.data.max_response_length, n=r.n, seed=seed, greedy=greedy)


def validation_sampling(gen: GenerationSettings, *, seed: int) -> SamplingParams:
    """Validation's SamplingParams from ``actor_rollout_ref.rollout.val_kwargs`` (verl): greedy when
    do_sample is false or the temperature is 0; val_kwargs.n responses per prompt."""
    v = gen.rollout.val_kwargs
    greedy = not v.do_sample or v.temperature == 0
    return SamplingParams(temperature=v.temperature if not greedy else 1.0, top_p=v.top_p, top_k=v.top_k,
                          max_new_tokens=gen.data.max_response_length, n=v.n, seed=seed, greedy=greedy)


def build_rollout_engine(gen: GenerationSettings, model_path: str | Path, name: Optional[str] = None, *,
                         session: HeldModels, resident: bool = False, data_parallel_size: int = 1,
                         external_launcher: bool = False) -> RolloutEngine:
    """The engine named by ``actor_rollout_ref.rollout.name`` (or ``name``), loaded on ``model_path``;
    ``resident``: a vLLM engine that pauses during the update and takes new weights in place;
    ``external_launcher``: this process is one rank of ``data_parallel_size`` vLLM engines of
    rollout.tensor_model_parallel_size ranks each, spread over torchrun's processes; ``session``: the
    run's models in memory (the hf engine borrows the trainer's module; vLLM loads a published copy)."""
    r = gen.rollout
    name = name or generation_engine(r)
    engine_cls = get_engine(name)  # unknown names fail here, listing the engines
    tokenizer_path = tokenizer_path_for(gen, Path(model_path))
    if name == "vllm":
        model_path = session.live.on_disk(model_path)  # a state only a worker group holds: its published copy
        max_model_len = gen.data.max_prompt_length + gen.data.max_response_length
        sequences = gen.data.train_batch_size * max(r.n, r.val_kwargs.n)
        return engine_cls(model_path, tensor_parallel_size=r.tensor_model_parallel_size,
                          data_parallel_size=data_parallel_size, gpu_memory_utilization=r.gpu_memory_utilization,
                          dtype=gen.dtype, seed=r.seed, max_model_len=max_model_len,
                          tokenizer_path=tokenizer_path, resident=resident, cpu_threads=r.cpu_threads,
                          rollout_tokens=sequences * max_model_len, external_launcher=external_launcher)
    return engine_cls(model_path, device=gen.device, tokenizer_path=tokenizer_path, dtype=gen.dtype,
                      cpu_threads=r.cpu_threads, attention=gen.attention, decode=r.hf_decode,
                      max_cache_len=gen.data.max_prompt_length + gen.data.max_response_length, session=session)


def generation_engine(rollout: RolloutConfig) -> str:
    """The engine that generates for the run: rollout.name, except that ``offline`` imports training
    responses and generates nothing, so validation (and remax's baseline) generate with ``hf``."""
    name = rollout.name
    if name != "offline":
        return name
    say_once("rollout: actor_rollout_ref.rollout.name=offline imports the training responses; validation "
             "generates with the hf engine (Hugging Face generate)")
    return "hf"


def tokenizer_path_for(gen: GenerationSettings, model_path: Path) -> Path:
    """A checkpoint carries its tokenizer; only a bare initial model falls back to model.tokenizer_path."""
    configured = gen.tokenizer_path
    if (model_path / "tokenizer_config.json").is_file() or not configured:
        return model_path

    return resolve_model_path(configured)


def generate_responses(
    gen: GenerationSettings,
    model_path: str | Path,
    prompt_rows: Sequence[Mapping[str, Any]],
    sampling: SamplingParams,
    batches: Optional[Sequence[Sequence[str]]] = None,
    *,
    session: HeldModels,
    engine: Optional[RolloutEngine] = None,
    desc: str = "rollout",
    share: Optional[Share] = None,
) -> tuple[list[GeneratedSample], GenerationStats]:
    """Sample ``sampling.n`` responses for every prompt row.

    ``prompt_rows`` need ``prompt_id`` and ``prompt_token_ids``. ``batches`` lists prompt ids per
    generation batch (the pack stage's plan); without it they are planned here the same way
    (``plan_generation_batches`` within ``rollout.generation_batch_tokens``). Batch b is sampled
    with ``derive_seed(sampling.seed, b)``, so a batch reproduces whatever ran before it. An engine that batches on its own (vLLM) gets
    every prompt in one call. Returned samples' ``prompt_index`` indexes ``prompt_rows``.
    ``share`` = (rank, world): only that process's batches (``own_batches``), numbered and seeded
    as in one process, so the merged samples are the one-process samples; with vLLM, this process
    is one rank of world / TP engines and generates its engine's prompts (``_run_engine_share``).
    ``session``: the run's models in memory, and its kept engine (``kept_engine``).
    """
    plan = generation_plan(gen.rollout, prompt_rows, sampling, batches)
    stats = GenerationStats()
    if engine is None:
        engine = kept_engine(gen, model_path, session, **launch_options(gen.rollout, share))
    owned = engine is None
    started = time.perf_counter()
    engine = engine or build_rollout_engine(gen, model_path, session=session, **launch_options(gen.rollout, share))
    stats.load_seconds = time.perf_counter() - started if owned else 0.0
    try:
        if engine.schedules_own_batches:  # one call with every prompt (a share: this engine's prompts)
            flat = [i for batch in plan for i in batch]
            if share is not None:
                return _run_engine_share(engine, prompt_rows, sampling, flat, stats, share,
                                         gen.rollout.tensor_model_parallel_size), stats
            plan = [flat]
        mine = None if share is None else set(own_batches(plan, prompt_rows, sampling, *share))
        samples = _run_plan(engine, prompt_rows, sampling, plan, stats, desc, mine)
    finally:
        if owned:
            engine.close()
    stats.extra.update(generation_floor(gen, model_path, prompt_rows, samples, session))
    return samples, stats


def generation_floor(gen: GenerationSettings, model_path: str | Path, prompt_rows: Sequence[Mapping[str, Any]],
                     samples: Sequence[GeneratedSample], session: HeldModels) -> dict[str, float]:
    """The model FLOPs of generating ``samples`` and the seconds they take at this device's matmul rate,
    as the rollout stage reports them (``training.flops.floor_metrics``); {} when the model's shape cannot
    be read."""
    shape = model_shape(model_path, session.live)
    if shape is None or not samples:
        return {}
    flops = generation_flops(shape, [len(prompt_rows[s.prompt_index]["prompt_token_ids"]) for s in samples],
                             [len(s.token_ids) for s in samples])
    return floor_metrics("rollout", flops, resolve_device(gen.device), gen.dtype)


def launch_options(rollout: RolloutConfig, share: Optional[Share]) -> dict[str, Any]:
    """How this process's engine is built for ``share`` = (rank, world) of torchrun's processes: a
    vLLM engine becomes one rank of world / TP engines of rollout.tensor_model_parallel_size ranks
    each (vLLM's external launcher); the hf engine needs nothing."""
    if share is None or generation_engine(rollout) != "vllm":
        return {}
    return {"external_launcher": True, "data_parallel_size": vllm_layout(rollout, share[1])[1]}


def vllm_layout(rollout: RolloutConfig, processes: int) -> tuple[int, int]:
    """(tensor parallel, data parallel) of vLLM engines on ``processes`` processes: engines of
    rollout.tensor_model_parallel_size ranks, as many as the processes make."""
    tp = rollout.tensor_model_parallel_size
    if tp < 1 or processes % tp:
        raise RLHFError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide the {processes} "
                        "rollout processes (trainer.stage_processes, else one per GPU): make it a divisor")
    return tp, processes // tp


def own_prompts(flat: Sequence[int], prompt_rows: Sequence[Mapping[str, Any]], sampling: SamplingParams,
                dp_rank: int, dp: int) -> list[int]:
    """Engine ``dp_rank``'s places in ``flat`` (the one-engine call's prompt order), dealt by token
    load (prompt tokens plus n × max_new_tokens: what the prompt can cost)."""
    loads = [len(prompt_rows[i]["prompt_token_ids"]) + sampling.n * sampling.max_new_tokens for i in flat]
    return shard_by_tokens(loads, dp)[dp_rank]


def _run_engine_share(engine: RolloutEngine, prompt_rows: Sequence[Mapping[str, Any]], sampling: SamplingParams,
                      flat: list[int], stats: GenerationStats, share: Share, tp: int) -> list[GeneratedSample]:
    """This process's part of the one-engine call over ``flat``: its engine's prompts, each seeded by
    its place in the whole call (so greedy — and, batch composition aside, sampled — responses are
    the one engine's). The ranks of one engine generate alike; its first rank returns them."""
    rank, world = share
    places = own_prompts(flat, prompt_rows, sampling, rank // tp, world // tp)
    tic = time.perf_counter()
    out = engine.generate([list(prompt_rows[flat[k]]["prompt_token_ids"]) for k in places],
                          replace(sampling, seed=derive_seed(sampling.seed, 0)), seed_indices=places)
    stats.seconds += time.perf_counter() - tic
    stats.batches = 1
    for s in out:
        s.prompt_index = flat[places[s.prompt_index]]  # share position → prompt_rows position
    if rank % tp:
        return []
    stats.generated_tokens += sum(len(s.token_ids) for s in out)
    return out


def kept_engine(gen: GenerationSettings, model_path: str | Path, session: HeldModels, **launch: Any
                ) -> Optional[RolloutEngine]:
    """With resident models and vLLM: the session's one engine (in a worker group, each rank's rank of
    it: ``launch``), holding ``model_path``'s weights, built on first use. The resident trainer
    syncs each new state into it in place; any other state is loaded into it here — from the module
    that holds it, else from its checkpoint on disk (an older step's validation). None otherwise:
    the caller builds an engine for this call and closes it."""
    live = session.live
    if not live.keeping_engines() or gen.rollout.name != "vllm":
        return None
    engine = live.engine_for(model_path)
    if engine is not None:
        return engine
    held = live.held_engine()
    if held is None:
        engine = build_rollout_engine(gen, model_path, session=session, resident=True, **launch)
    else:
        engine, borrowed = held.engine, live.lookup(model_path)
        if borrowed is not None:
            engine.sync_from(borrowed.module)
        else:
            engine.load_model_dir(live.on_disk(model_path))
    live.hold_engine(engine, model_path)
    return engine


def generation_plan(rollout: RolloutConfig, prompt_rows: Sequence[Mapping[str, Any]], sampling: SamplingParams,
                    batches: Optional[Sequence[Sequence[str]]] = None) -> list[list[int]]:
    """Generation batches as lists of positions in ``prompt_rows``: ``batches`` (prompt ids, the pack
    stage's plan) translated, else planned within ``rollout.generation_batch_tokens``."""
    index_of = {row["prompt_id"]: i for i, row in enumerate(prompt_rows)}
    if batches is None:
        lengths = [len(row["prompt_token_ids"]) for row in prompt_rows]
        return [list(b) for b in plan_generation_batches(
            lengths, sampling.max_new_tokens, sampling.n, rollout.generation_batch_tokens,
            budget_key="actor_rollout_ref.rollout.generation_batch_tokens")]
    plan = []
    for b, ids in enumerate(batches):
        missing = [pid for pid in ids if pid not in index_of]
        if missing:
            raise DataError(f"generation batch {b} names prompt id {missing[0]!r} that is not in the prompt "
                            f"table; rerun the pack stage (`rlhf stage pack --force`) after preprocess")
        plan.append([index_of[pid] for pid in ids])
    return plan


def own_batches(plan: list[list[int]], prompt_rows: Sequence[Mapping[str, Any]], sampling: SamplingParams,
                rank: int, world: int) -> list[int]:
    """Rank ``rank``'s generation batch ids of ``plan``, dealt by token load (prompt tokens plus
    n × max_new_tokens per prompt: what the batch can cost)."""
    loads = [sum(len(prompt_rows[i]["prompt_token_ids"]) + sampling.n * sampling.max_new_tokens for i in batch)
             for batch in plan]
    return shard_by_tokens(loads, world)[rank]


def _run_plan(engine: RolloutEngine, prompt_rows: Sequence[Mapping[str, Any]], sampling: SamplingParams,
              plan: list[list[int]], stats: GenerationStats, desc: str,
              owned: Optional[set[int]] = None) -> list[GeneratedSample]:
    """Generate ``plan``'s batches in order (only the ``owned`` batch ids when given); batch b is
    seeded by ``derive_seed(sampling.seed, b)`` whoever runs it."""
    from tqdm.auto import tqdm

    samples: list[GeneratedSample] = []
    bar = tqdm(total=len(plan) if owned is None else len(owned), desc=desc, unit="batch", dynamic_ncols=True, disable=bar_disabled())
    try:
        for batch_id, positions in enumerate(plan):
            if owned is not None and batch_id not in owned:
                continue
            batch_sampling = replace(sampling, seed=derive_seed(sampling.seed, batch_id))
            tic = time.perf_counter()
            out = engine.generate([list(prompt_rows[i]["prompt_token_ids"]) for i in positions], batch_sampling)
            stats.seconds += time.perf_counter() - tic
            for s in out:
                s.prompt_index = positions[s.prompt_index]  # batch position → prompt_rows position
            samples.extend(out)
            stats.generated_tokens += sum(len(s.token_ids) for s in out)
            stats.batches += 1
            bar.update(1)
            bar.set_postfix(tok_s=f"{stats.tokens_per_s:.0f}", responses=len(samples))
    finally:
        bar.close()
    return samples


def rollout_metrics(samples: Sequence[GeneratedSample], stats: GenerationStats) -> dict[str, float]:
    """Namespaced metrics of one rollout (verl names where verl has them)."""
    lengths = [len(s.token_ids) for s in samples] or [0]
    return {
        **{name: value for name, value in stats.extra.items() if name.startswith("perf/")},  # generation_floor
        "perf/rollout_tokens_per_s": stats.tokens_per_s,
        "perf/rollout_seconds": stats.seconds,
        "perf/rollout_load_seconds": stats.load_seconds,
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": float(max(lengths)),
        "response_length/min": float(min(lengths)),
        "rollout/stop_frac": sum(s.finish_reason == FINISH_STOP for s in samples) / max(len(samples), 1),
        "rollout/num_responses": float(len(samples)),
    }


def rollout_table(prompt_rows: Sequence[Mapping[str, Any]], samples: Sequence[GeneratedSample],
                  iteration: int, engine: str) -> pa.Table:
    """The rollout table (schema ``ROLLOUT``): one row per sample, prompt columns copied over."""
    columns: dict[str, list] = {name: [] for name in ROLLOUT.names}
    for s in samples:
        row = prompt_rows[s.prompt_index]
        columns["prompt_id"].append(row["prompt_id"])
        columns["sample_index"].append(s.sample_index)
        columns["iteration"].append(iteration)
        columns["data_source"].append(row.get("data_source"))
        columns["ground_truth"].append((row.get("reward_model") or {}).get("ground_truth"))
        columns["prompt_token_ids"].append(list(row["prompt_token_ids"]))
        columns["response_text"].append(s.text)
        columns["response_token_ids"].append(s.token_ids)
        columns["response_length"].append(len(s.token_ids))
        columns["finish_reason"].append(s.finish_reason)
        columns["engine"].append(engine)
        columns["sampling_seed"].append(s.seed if s.seed is not None else -1)
        columns["reward_source"].append(row.get("reward_source") or row.get("data_source"))
        columns["extra_info"].append(row.get("extra_info") or "{}")
        columns["uid"].append(group_uid(iteration, s.prompt_index))
        columns["rollout_log_probs"].append(s.log_probs)
    return pa.table(columns, schema=ROLLOUT)


def group_uid(iteration: int, prompt_index: int) -> str:
    """verl's uid of one prompt's group of responses: unique within the run and the same on every
    rerun (verl draws a random uuid4; a reproducible rollout needs a reproducible id)."""
    return f"{iteration}-{prompt_index}"
