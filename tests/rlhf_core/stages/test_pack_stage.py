"""The pack stage on small prompts tables: verl's epochs (full batches, the remainder sitting the
epoch out, a new order per epoch), batches under budget, manifest skip on rerun, deterministic,
clear errors."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_core.config import RLHFConfig, apply_overrides
from rlhf_core.data.packing import PackingBudgetError
from rlhf_core.data.schemas import PROMPTS
from rlhf_core.errors import DataError
from rlhf_core.io.atomic import atomic_write_parquet
from rlhf_core.run.layout import RunDir
from rlhf_core.stages.pack import MAX_PLANNED_EPOCHS, cut_slots, epoch_order, plan_epochs, run_pack

BASE = [
    "data.train_batch_size=16", "data.max_response_length=32", "data.seed=7",
    "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.generation_batch_tokens=1024",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512",
]


@pytest.fixture(scope="module")
def tokenizer():
    from rlhf_core.models.tiny import build_tokenizer, default_corpus

    return build_tokenizer(default_corpus())


def config(*overrides: str) -> RLHFConfig:
    return apply_overrides(RLHFConfig(), [*BASE, *overrides])


def write_prompts(run: RunDir, tokenizer, count: int, seed: int = 0, reverse: bool = False) -> list[str]:
    """A PROMPTS table of ``count`` arithmetic questions of varied length, tokenized with the tiny
    tokenizer's chat template; returns the prompt ids."""
    rng = random.Random(seed)
    rows = []
    for k in range(count):
        terms = " plus ".join(str(rng.randint(1, 99)) for _ in range(rng.choice([1, 2, 3, 8, 20])))
        question = f"What is {terms}?"
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        rows.append({
            "prompt_id": f"q{k:04d}", "data_source": "arith", "reward_source": "arith", "prompt": messages,
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": "0"},
            "extra_info": json.dumps({"split": "train", "index": k, "question": question, "answer": "#### 0"}),
            "source_file": "test", "source_row": k, "prompt_text": text, "prompt_token_ids": ids,
            "prompt_length": len(ids), "prompt_tokens_cut": 0,
        })
    if reverse:
        rows.reverse()
    atomic_write_parquet(run.train_prompts, pa.Table.from_pylist(rows, schema=PROMPTS), schema=PROMPTS)
    return [r["prompt_id"] for r in rows]


def read_batches(run: RunDir) -> list[dict]:
    return pq.read_table(run.generation_batches).to_pylist()


def test_every_prompt_once_and_batches_under_budget(tmp_path, tokenizer):
    run = RunDir(tmp_path / "run")
    ids = write_prompts(run, tokenizer, 50)
    lengths = dict(zip(ids, pq.read_table(run.train_prompts)["prompt_length"].to_pylist()))
    cfg = config()
    result = run_pack(cfg, run)
    assert not result.skipped
    rows = read_batches(run)
    per_slot: dict[int, list[str]] = {}
    for row in rows:
        per_slot.setdefault(row["slot"], []).extend(row["prompt_ids"])
        longest = max(lengths[p] for p in row["prompt_ids"])
        assert row["num_prompts"] * 2 * (longest + 32) <= 1024
        assert row["prompt_tokens"] == sum(lengths[p] for p in row["prompt_ids"])
        assert row["padded_tokens"] == row["num_prompts"] * longest
    # 50 = 16 + 16 + 16 + 2: every slot is a full batch, 2 prompts sit each epoch out (verl's drop_last);
    # epochs, each its own order, are planned until every prompt has been in one
    assert set(map(len, per_slot.values())) == {16} and len(per_slot) % 3 == 0
    assert result.rows == {"prompts": 50, "slots": 3, "epochs_planned": len(per_slot) // 3,
                           "generation_batches": len(rows)}
    epochs = [[per_slot[s] for s in range(e, e + 3)] for e in range(0, len(per_slot), 3)]
    for epoch in epochs:
        members = [p for slot in epoch for p in slot]
        assert len(set(members)) == 48  # nobody twice within an epoch
    assert set(p for members in per_slot.values() for p in members) == set(ids)
    assert len(epochs) == 1 or epochs[0] != epochs[1]
    for s in per_slot:
        batch_ids = [r["batch_id"] for r in rows if r["slot"] == s]
        assert sorted(batch_ids) == list(range(len(batch_ids)))

    summary = json.loads((run.pack_dir / "summary.json").read_text())
    assert summary["prompts"] == 50 and summary["slots_per_epoch"] == 3 and summary["epochs_planned"] == len(epochs)
    assert any("2 prompts sit each epoch out" in line for line in result.summary)
    m = summary["metrics"]
    assert m["pack/generation_prompt_efficiency"] > m["pack/generation_prompt_efficiency_random"]
    assert 0 < m["pack/train_budget_fill"] <= 1 and m["pack/train_micro_batches"] >= 1
    assert any("generation batches" in line for line in result.summary)


def test_slots_are_full_batches_as_verls_drop_last():
    assert cut_slots(list(range(58)), 16) == [list(range(0, 16)), list(range(16, 32)), list(range(32, 48))]
    assert [len(s) for s in cut_slots(list(range(64)), 16)] == [16, 16, 16, 16]
    assert [len(s) for s in cut_slots(list(range(5)), 16)] == [5]  # less than one batch: one slot (verl refuses)
    assert cut_slots([], 16) == []


def test_epochs_are_planned_until_every_prompt_was_in_one():
    ids = [f"p{k}" for k in range(300)]
    slots, per_epoch = plan_epochs(ids, 256, seed=1, shuffle=True)  # verl's quickstart shape: one step per epoch
    assert per_epoch == 1 and all(len(s) == 256 for s in slots)
    assert set(i for s in slots for i in s) == set(range(300)) and 2 <= len(slots) <= MAX_PLANNED_EPOCHS
    assert [slots[e] for e in range(len(slots))] == [
        epoch_order(ids, 1, epoch=e)[:256] for e in range(len(slots))]  # epoch e: its own seeded order
    in_order, per_epoch = plan_epochs(ids, 256, seed=1, shuffle=False)
    assert in_order == [list(range(256))] and per_epoch == 1  # verl's sequential sampler: the same every epoch
    exact, per_epoch = plan_epochs(ids[:256], 128, seed=1, shuffle=True)
    assert per_epoch == 2 and len(exact) == 2  # no remainder: one epoch covers everyone


def test_epoch_order_depends_on_the_prompt_set_and_seed_only():
    ids = [f"p{k}" for k in range(40)]
    order = epoch_order(ids, seed=3)
    assert sorted(order) == list(range(40))
    shuffled = list(reversed(ids))
    assert [shuffled[i] for i in epoch_order(shuffled, seed=3)] == [ids[i] for i in order]
    assert epoch_order(ids, seed=4) != order and epoch_order(ids, seed=3, epoch=1) != order


def test_rerun_is_skipped_unless_its_inputs_or_keys_change(tmp_path, tokenizer):
    run = RunDir(tmp_path / "run")
    write_prompts(run, tokenizer, 40)
    first = run_pack(config(), run)
    before = run.generation_batches.read_bytes()
    assert not first.skipped
    assert run_pack(config(), run).skipped
    # keys the stage does not read leave it alone (rerunning would mark every iteration stale)
    unrelated = config("actor_rollout_ref.actor.optim.lr=3e-6", "actor_rollout_ref.rollout.temperature=0.5")
    assert run_pack(unrelated, run).skipped
    changed = run_pack(config("actor_rollout_ref.rollout.generation_batch_tokens=2048"), run)
    assert not changed.skipped and run.generation_batches.read_bytes() != before
    assert run_pack(config("actor_rollout_ref.rollout.generation_batch_tokens=2048"), run, force=True).skipped is False


def test_deterministic_and_independent_of_file_order(tmp_path, tokenizer):
    a, b, c = (RunDir(tmp_path / name) for name in "abc")
    write_prompts(a, tokenizer, 45)
    write_prompts(b, tokenizer, 45, reverse=True)
    write_prompts(c, tokenizer, 45)
    run_pack(config(), a)
    run_pack(config(), b)
    run_pack(config("data.seed=8"), c)
    assert read_batches(a) == read_batches(b)
    assert read_batches(a) != read_batches(c)


def test_shuffle_off_keeps_the_prompts_order(tmp_path, tokenizer):
    """data.shuffle=false (verl: a sequential sampler): slot k holds the table's prompts k·B .. (k+1)·B-1."""
    run = RunDir(tmp_path / "run")
    ids = write_prompts(run, tokenizer, 45, reverse=True)
    assert epoch_order(ids, seed=3, shuffle=False) == list(range(45))
    result = run_pack(config("data.shuffle=false"), run)
    per_slot: dict[int, list[str]] = {}
    for row in read_batches(run):
        per_slot.setdefault(row["slot"], []).extend(row["prompt_ids"])
    # one epoch, replayed: the table's first 32 prompts; the last 13 (< one batch) sit out, as in verl
    assert [sorted(per_slot[s]) for s in sorted(per_slot)] == [sorted(ids[:16]), sorted(ids[16:32])]
    assert not run_pack(config("data.shuffle=true"), run).skipped and not result.skipped  # a key the stage reads
    shuffled: dict[int, list[str]] = {}
    for row in read_batches(run):
        shuffled.setdefault(row["slot"], []).extend(row["prompt_ids"])
    assert sorted(shuffled[0]) != sorted(ids[:16])


def test_budget_too_small_names_the_key_and_prompt(tmp_path, tokenizer):
    run = RunDir(tmp_path / "run")
    write_prompts(run, tokenizer, 20)
    with pytest.raises(PackingBudgetError) as err:
        run_pack(config("actor_rollout_ref.rollout.generation_batch_tokens=64"), run)
    assert "generation_batch_tokens" in str(err.value) and "slot 0" in str(err.value)
    assert not run.generation_batches.exists(), "nothing is written when planning fails"


def test_fixed_micro_batches_without_a_usable_budget(tmp_path, tokenizer):
    """use_dynamic_bsz off: the config rule on the budget does not apply, so a budget below the
    longest sequence only drops the budget what-if from the summary."""
    run = RunDir(tmp_path / "run")
    write_prompts(run, tokenizer, 20)
    result = run_pack(config("actor_rollout_ref.actor.use_dynamic_bsz=false",
                             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40"), run)
    assert "pack/train_micro_batches" not in result.metrics
    assert result.metrics["pack/train_fixed_micro_batches"] == 2 * 16 / 4  # one epoch: 16 prompts × n=2 in fours
    assert any("no budget estimate" in line for line in result.summary)


def test_missing_prompts_table_says_which_stage_to_run(tmp_path):
    run = RunDir(tmp_path / "run")
    with pytest.raises(DataError, match="rlhf stage preprocess"):
        run_pack(config(), run)
