"""Stage `pack`: prompts/train.parquet → pack/generation_batches.parquet + pack/summary.json.

    rlhf stage pack --run-dir RUN [-c PRESET] [actor_rollout_ref.rollout.generation_batch_tokens=8192 ...]

1. Epochs, as verl's dataloader (drop_last): each epoch's order is cut into
   len(prompts) // ``data.train_batch_size`` slots of exactly that many prompts, one per
   iteration; the last partial batch sits that epoch out. With data.shuffle (verl's default) every
   epoch has its own seeded order (prompts sorted by prompt_id first, so the input file order does
   not matter), and epochs are planned until every prompt has been in a slot (at most
   ``MAX_PLANNED_EPOCHS``); iteration k uses slot (k - 1) % num_slots, so later epochs cycle through
   the planned ones. With data.shuffle=false one epoch in the prompts table's own order (the input
   files' order), the same every epoch, as verl's sequential sampler. Fewer prompts than one batch:
   one slot holding all of them (verl refuses to start).
2. Generation batches: each slot is cut by ``plan_generation_batches`` so that
   ``prompts × rollout.n × (longest prompt + data.max_response_length)`` fits
   ``rollout.generation_batch_tokens`` — fewest batches first, then least left padding.
3. Summary (over the first planned epoch): packing efficiency of the generation batches against
   random batches of the same count, and an estimate for the training micro-batches at
   ``actor.ppo_max_token_len_per_gpu`` (every response taken at its maximum length, the worst case
   the budget must hold) against fixed micro-batches of ``actor.ppo_micro_batch_size_per_gpu``
   (``resolve.micro_batching``) padded to their longest.

The stage reruns only when the train prompts or one of the keys ``pack_settings`` reads changed:
rerunning it marks every iteration stale, so unrelated settings (learning rate, temperature) must not trigger it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Annotated, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core.config import RLHFConfig
from rlhf_core.config.reads import At, build, config_keys, config_values
from rlhf_core.config.resolve import MicroBatching, per_gpu_micro_batch
from rlhf_core.data.packing import (
    PackingBudgetError, fixed_micro_batches, micro_batches_by_budget, padded_batches_efficiency,
    plan_generation_batches,
)
from rlhf_core.data.schemas import GENERATION_BATCHES
from rlhf_core.errors import DataError
from rlhf_core.io.atomic import atomic_write_json, atomic_write_parquet
from rlhf_core.run.layout import RunDir
from rlhf_core.stages.base import StageResult, stage_record

GEN_BUDGET_KEY = "actor_rollout_ref.rollout.generation_batch_tokens"
TRAIN_BUDGET_KEY = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"


@dataclass(frozen=True)
class PackSettings:
    """What the stage reads of the config (``pack_settings``): the stage's helpers take this, not the config."""

    seed: int  # data.seed
    shuffle: bool  # data.shuffle
    train_batch_size: int  # data.train_batch_size: prompts per slot
    max_response_length: int  # data.max_response_length
    n: int  # actor_rollout_ref.rollout.n
    generation_batch_tokens: int  # actor_rollout_ref.rollout.generation_batch_tokens
    training: MicroBatching
    """The actor's micro-batches (as ``resolve.micro_batching``): the training estimate's budget and fixed size."""
    mini_batch: int
    """Sequences per optimizer step (as ``resolve.mini_batch_sequences``)."""


def pack_settings(
        seed: Annotated[int, At("data.seed")], shuffle: Annotated[bool, At("data.shuffle")],
        train_batch_size: Annotated[int, At("data.train_batch_size")],
        max_response_length: Annotated[int, At("data.max_response_length")],
        # a prefix, as the config hash matches it: switching rollout.name reruns packing too, harmlessly
        n: Annotated[int, At("actor_rollout_ref.rollout.n")],
        generation_batch_tokens: Annotated[int, At(GEN_BUDGET_KEY)],
        token_budget: Annotated[int, At(TRAIN_BUDGET_KEY)],
        mini_batch_prompts: Annotated[int, At("actor_rollout_ref.actor.ppo_mini_batch_size")],
        # the global size's prefix covers the per-GPU one
        micro_batch_size: Annotated[Optional[int], At("actor_rollout_ref.actor.ppo_micro_batch_size")],
        micro_batch_size_per_gpu: Annotated[Optional[int], At("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")],
        use_dynamic_bsz: Annotated[bool, At("actor_rollout_ref.actor.use_dynamic_bsz")]) -> PackSettings:
    """Everything the stage reads of the config: its parameters are the keys its config hash covers, so
    unrelated settings (learning rate, temperature) never rerun it (a rerun marks every iteration stale)."""
    training = MicroBatching(use_dynamic_bsz, token_budget, per_gpu_micro_batch(micro_batch_size_per_gpu,
                                                                                 micro_batch_size, world_size=1))
    return PackSettings(seed=seed, shuffle=shuffle, train_batch_size=train_batch_size,
                        max_response_length=max_response_length, n=n, generation_batch_tokens=generation_batch_tokens,
                        training=training, mini_batch=mini_batch_prompts * n)


# ---------------------------------------------------------------------------------------------
# pure steps (tested directly)
# ---------------------------------------------------------------------------------------------


def epoch_order(prompt_ids: list[str], seed: int, epoch: int = 0, shuffle: bool = True) -> list[int]:
    """Indices into ``prompt_ids`` in this epoch's order: sorted by id, then a seeded shuffle, so
    the order depends on the set of prompts and the seed only; ``shuffle`` False keeps the given order."""
    if not shuffle:
        return list(range(len(prompt_ids)))
    order = sorted(range(len(prompt_ids)), key=lambda i: prompt_ids[i])
    random.Random(f"pack:{seed}:{epoch}").shuffle(order)
    return order


MAX_PLANNED_EPOCHS = 16
"""With data.shuffle, epochs are planned until every prompt has been in a slot; a prompt left out of
e epochs in a row has probability (remainder / prompts)^e, so this bound is reached only by absurd
batch sizes, never by a real data set."""


def cut_slots(order: list[int], batch_size: int) -> list[list[int]]:
    """One epoch's slots: consecutive full batches of ``batch_size`` (the remainder is left out, as
    verl's drop_last), or one slot of everything when there is less than one batch."""
    if batch_size < 1:
        raise DataError(f"data.train_batch_size must be >= 1, got {batch_size}")
    if len(order) < batch_size:
        return [order] if order else []
    return [order[s:s + batch_size] for s in range(0, len(order) - batch_size + 1, batch_size)]


def plan_epochs(prompt_ids: list[str], batch_size: int, seed: int, shuffle: bool) -> tuple[list[list[int]], int]:
    """(slots of every planned epoch, epoch-major; slots per epoch). See the module docstring."""
    if not shuffle:
        slots = cut_slots(epoch_order(prompt_ids, seed, shuffle=False), batch_size)
        return slots, len(slots)
    slots: list[list[int]] = []
    seen: set[int] = set()
    per_epoch = 0
    for epoch in range(MAX_PLANNED_EPOCHS):
        epoch_slots = cut_slots(epoch_order(prompt_ids, seed, epoch), batch_size)
        per_epoch = len(epoch_slots)
        slots += epoch_slots
        seen.update(i for slot in epoch_slots for i in slot)
        if len(seen) == len(prompt_ids):
            break
    return slots, per_epoch


@dataclass
class SlotPlan:
    slot: int
    prompts: list[int]  # indices into the prompts table, in slot order
    batches: list[list[int]]  # generation batches: indices into the prompts table


def plan_slots(lengths: list[int], slots: list[list[int]], max_response_length: int, n: int,
               budget: int) -> list[SlotPlan]:
    plans = []
    for s, members in enumerate(slots):
        try:
            local = plan_generation_batches([lengths[i] for i in members], max_response_length, n, budget,
                                            budget_key=GEN_BUDGET_KEY)
        except PackingBudgetError as err:
            long_one = max(members, key=lambda i: lengths[i])
            raise PackingBudgetError(f"slot {s}: {err} (the longest prompt has {lengths[long_one]} "
                                     f"tokens; each costs its length + data.max_response_length "
                                     f"= {lengths[long_one] + max_response_length}, times rollout.n = {n})") from None
        plans.append(SlotPlan(slot=s, prompts=members, batches=[[members[k] for k in b] for b in local]))
    return plans


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------


def generation_stats(lengths: list[int], plans: list[SlotPlan], max_response_length: int, n: int,
                     budget: int, seed: int) -> dict[str, float]:
    """Left-padding efficiency of the planned batches vs random batches of the same count."""
    ours, random_batches, kv_used = [], [], 0
    rng = random.Random(f"pack-baseline:{seed}")
    for plan in plans:
        ours += plan.batches
        shuffled = rng.sample(plan.prompts, len(plan.prompts))
        size = -(-len(shuffled) // len(plan.batches))
        random_batches += [shuffled[s:s + size] for s in range(0, len(shuffled), size)]
        kv_used += sum(len(b) * n * (max(lengths[i] for i in b) + max_response_length) for b in plan.batches)
    num = len(ours)
    return {
        "pack/generation_batches": float(num),
        "pack/generation_prompts_per_batch": sum(map(len, ours)) / max(1, num),
        "pack/generation_prompt_efficiency": padded_batches_efficiency(lengths, ours),
        "pack/generation_prompt_efficiency_random": padded_batches_efficiency(lengths, random_batches),
        "pack/generation_budget_fill": kv_used / max(1, num * budget),
    }


def _padded_slots(lengths: list[int], batches: list[list[int]]) -> int:
    """Slots of batches laid out one sequence per row, padded to the batch's longest."""
    return sum(len(b) * max((lengths[i] for i in b), default=0) for b in batches)


def training_stats(lengths: list[int], plans: list[SlotPlan], settings: PackSettings) -> dict[str, float]:
    """Training micro-batches per epoch, every sequence at prompt + max response length, split per
    mini-batch: budget packing (use_dynamic_bsz) vs fixed micro-batches padded to their longest
    (use_dynamic_bsz=False, sequences in shuffled order). With use_dynamic_bsz off and a budget
    smaller than the longest sequence, the budget what-if is left out rather than failing."""
    n, max_response_length = settings.n, settings.max_response_length
    batching = settings.training
    budget, fixed = batching.token_budget, batching.micro_batch_size
    mini = settings.mini_batch  # sequences per optimizer step
    longest = max(lengths, default=0) + max_response_length
    with_budget = batching.use_dynamic_bsz or longest <= budget
    rng = random.Random(f"pack-baseline:{settings.seed}")
    real = bins_count = padded = fixed_count = fixed_padded = 0
    for plan in plans:
        seqs = [lengths[i] + max_response_length for i in plan.prompts for _ in range(n)]
        for s in range(0, len(seqs), mini):
            part = seqs[s:s + mini]
            real += sum(part)
            if with_budget:
                bins = micro_batches_by_budget(part, budget, budget_key=TRAIN_BUDGET_KEY)
                bins_count += len(bins)
                padded += _padded_slots(part, bins)
            order = rng.sample(range(len(part)), len(part))
            chunks = [[order[i] for i in c] for c in fixed_micro_batches(len(part), fixed)]
            fixed_count += len(chunks)
            fixed_padded += _padded_slots(part, chunks)
    stats = {"pack/train_fixed_micro_batches": float(fixed_count),
             "pack/train_fixed_pad_efficiency": real / max(1, fixed_padded)}
    if with_budget:
        stats.update({"pack/train_micro_batches": float(bins_count),
                      "pack/train_budget_fill": real / max(1, bins_count * budget),
                      "pack/train_padded_bins_efficiency": real / max(1, padded)})
    return stats


# ---------------------------------------------------------------------------------------------
# I/O and the stage
# ---------------------------------------------------------------------------------------------


def read_prompt_lengths(run: RunDir) -> tuple[list[str], list[int]]:
    """(prompt ids, prompt lengths) of the run's train prompts; errors name the file and the fix."""
    path = run.train_prompts
    names = set(pq.read_schema(path).names)
    missing = {"prompt_id", "prompt_length"} - names
    if missing:
        raise DataError(f"{path} lacks column(s) {', '.join(sorted(missing))}; rerun the preprocess stage")
    table = pq.read_table(path, columns=["prompt_id", "prompt_length"])
    ids, lengths = table["prompt_id"].to_pylist(), table["prompt_length"].to_pylist()
    if not ids:
        raise DataError(f"{path} has no prompts; see {run.rejects} for why rows were rejected")
    seen: dict[str, int] = {}
    for row, pid in enumerate(ids):
        if pid in seen:
            raise DataError(f"{path}: prompt_id {pid!r} appears in rows {seen[pid]} and {row}; "
                            f"prompt ids must be unique (rerun preprocess with data.dedup=true)")
        seen[pid] = row
    return ids, [int(n) for n in lengths]


def batches_table(ids: list[str], lengths: list[int], plans: list[SlotPlan]) -> pa.Table:
    rows = [{"slot": p.slot, "batch_id": b, "prompt_ids": [ids[i] for i in batch], "num_prompts": len(batch),
             "prompt_tokens": sum(lengths[i] for i in batch),
             "padded_tokens": len(batch) * max(lengths[i] for i in batch)}
            for p in plans for b, batch in enumerate(p.batches)]
    return pa.Table.from_pylist(rows, schema=GENERATION_BATCHES)


def _summary_lines(num_prompts: int, plans: list[SlotPlan], metrics: dict[str, float],
                   settings: PackSettings) -> list[str]:
    m = metrics
    sizes = sorted({len(p.prompts) for p in plans})
    return [
        f"pack: {num_prompts} prompts → {len(plans)} slots per epoch of {'/'.join(map(str, sizes))} prompts "
        f"→ {int(m['pack/generation_batches'])} generation batches "
        f"({m['pack/generation_prompts_per_batch']:.1f} prompts each, "
        f"budget {settings.generation_batch_tokens} tokens)",
        f"generation prompt padding: {m['pack/generation_prompt_efficiency']:.1%} real tokens grouped by length "
        f"vs {m['pack/generation_prompt_efficiency_random']:.1%} for random batches of the same count; "
        f"budget fill {m['pack/generation_budget_fill']:.1%}",
        _training_line(m, settings.training),
    ]


def _epochs_line(num_prompts: int, epochs: int, first_epoch: list[SlotPlan], shuffle: bool) -> str:
    used = sum(len(p.prompts) for p in first_epoch)
    order = "a seeded order per epoch" if shuffle else "the prompts table's order (data.shuffle=false)"
    return (f"epochs: {len(first_epoch)} iterations each, {num_prompts - used} prompts sit each epoch out "
            f"(verl's drop_last); {epochs} epoch(s) planned, {order}")


def _training_line(m: dict[str, float], batching: MicroBatching) -> str:
    fixed = (f"{int(m['pack/train_fixed_micro_batches'])} fixed micro-batches of "
             f"{batching.micro_batch_size} padded to their longest: "
             f"{m['pack/train_fixed_pad_efficiency']:.1%}")
    if "pack/train_micro_batches" not in m:
        return (f"training (every response at max length): {fixed}; no budget estimate (use_dynamic_bsz off and "
                f"ppo_max_token_len_per_gpu={batching.token_budget} below the longest sequence)")
    return (f"training (every response at max length): {int(m['pack/train_micro_batches'])} micro-batches of "
            f"≤{batching.token_budget} tokens, budget fill {m['pack/train_budget_fill']:.1%} "
            f"(padded per bin: {m['pack/train_padded_bins_efficiency']:.1%}) vs {fixed}")


def config_sections(cfg: RLHFConfig) -> tuple[str, ...]:
    """The config this stage's output depends on (its manifest's config hash): what its builder reads."""
    return config_keys(pack_settings)


def run_pack(cfg: RLHFConfig, run: RunDir, iteration: Optional[int] = None, force: bool = False) -> StageResult:
    """Plan the run's generation batches (see the module docstring); writes
    pack/generation_batches.parquet (schema GENERATION_BATCHES) and pack/summary.json."""
    if not run.train_prompts.is_file():
        raise DataError(f"{run.train_prompts} not found; run `rlhf stage preprocess --run-dir {run.root}` first")

    with stage_record(stage="pack", cfg=cfg, run=run, iteration=None, inputs=[run.train_prompts],
                      config_sections=config_sections(cfg), force=force) as record:
        if record.skipped:
            return record.skipped
        settings = build(pack_settings, cfg)
        ids, lengths = read_prompt_lengths(run)
        slots, per_epoch = plan_epochs(ids, settings.train_batch_size, settings.seed, settings.shuffle)
        plans = plan_slots(lengths, slots, settings.max_response_length, settings.n, settings.generation_batch_tokens)
        for p in plans:
            assert sorted(i for b in p.batches for i in b) == sorted(p.prompts), "a slot's prompts, each batched once"
        first_epoch = plans[:per_epoch]
        metrics = generation_stats(lengths, first_epoch, settings.max_response_length, settings.n,
                                   settings.generation_batch_tokens, settings.seed)
        metrics.update(training_stats(lengths, first_epoch, settings))
        table = batches_table(ids, lengths, plans)
        atomic_write_parquet(run.generation_batches, table, schema=GENERATION_BATCHES)
        summary_path = run.pack_summary
        epochs = len(plans) // max(per_epoch, 1)
        lines = [*_summary_lines(len(ids), first_epoch, metrics, settings),
                 _epochs_line(len(ids), epochs, first_epoch, settings.shuffle)]
        atomic_write_json(summary_path, {
            "prompts": len(ids), "slots_per_epoch": per_epoch, "epochs_planned": epochs, "slots_planned": len(plans),
            "generation_batches": table.num_rows,
            "slot_sizes": [len(p.prompts) for p in plans], "batches_per_slot": [len(p.batches) for p in plans],
            "config": config_values(pack_settings, cfg), "metrics": metrics, "summary": lines,
        })
        return record.done(StageResult(
            stage="pack", iteration=None,
            outputs={"generation_batches": str(run.generation_batches), "summary": str(summary_path)},
            # "slots" = iterations per epoch (pipeline.steps_per_epoch reads it)
            rows={"prompts": len(ids), "slots": per_epoch, "epochs_planned": epochs,
                  "generation_batches": table.num_rows},
            metrics=metrics, summary=lines + [f"wrote {run.generation_batches} and {summary_path}"],
        ))
