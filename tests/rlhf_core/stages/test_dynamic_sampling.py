"""Dynamic sampling (algorithm.filter_groups) through the real rollout stage: groups scored alike are
dropped, the next slots are drawn until data.train_batch_size groups are kept, the table is cut to
exactly that many, a forced rerun reproduces it, and too few groups stop with the limit named."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from rlhf_core.config import ConfigError, load_config, to_yaml
from rlhf_core.config.loader import config_hash
from rlhf_core.data.schemas import ROLLOUT
from rlhf_core.errors import DataError
from rlhf_core.config.validate import check_filter_groups
from rlhf_core.rollout.dynamic_sampling import metric_values, split_groups
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.stages.pack import run_pack
from rlhf_core.stages.preprocess import run_preprocess
from rlhf_core.stages.rollout import config_sections, run_rollout

# A prompt whose answer is a multiple of 3 scores 0.5 whatever the response (its group has zero
# variance); any other prompt's score is a hash of the response text, so its n sampled responses differ.
REWARD = """
import zlib

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 3 == 0:
        return 0.5
    return (zlib.crc32(solution_str.encode()) % 1000) / 1000
"""


def flat(ground_truth: str) -> bool:
    return int(ground_truth) % 3 == 0


def config(raw, model_dir, reward, *extra):
    """12 prompts, 2 pack slots of 6, n=2, 8-token responses."""
    return load_config(None, [
        f"data.train_files=[{raw}]", "data.val_fraction=0.0", "data.data_source=arith",
        "data.train_batch_size=6", "data.max_response_length=8", "data.max_prompt_length=128",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.generation_batch_tokens=1024", "actor_rollout_ref.actor.ppo_mini_batch_size=6",
        "trainer.device=cpu", f"custom_reward_function.path={reward}",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score", *extra])


@pytest.fixture
def run_setup(tmp_path, repo_root, tiny_model_dir):
    raw = tmp_path / "arith.jsonl"
    raw.write_text("".join((repo_root / "data/arith/train.jsonl").read_text().splitlines(True)[:12]))
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    cfg = config(raw, tiny_model_dir, reward)
    run = RunDir(tmp_path / "run")
    write_config(run, to_yaml(cfg))
    run_preprocess(cfg, run)
    run_pack(cfg, run)
    slots = {}
    for row in sorted(pq.read_table(run.generation_batches).to_pylist(), key=lambda r: r["batch_id"]):
        slots.setdefault(row["slot"], []).extend(row["prompt_ids"])
    answers = {p["prompt_id"]: p["reward_model"]["ground_truth"] for p in pq.read_table(run.train_prompts).to_pylist()}
    return cfg, run, (raw, tiny_model_dir, reward), slots, answers


def test_filter_keeps_varied_groups_refills_from_the_next_slot_and_truncates(run_setup):
    cfg, run, _, slots, answers = run_setup
    assert sorted(slots) == [0, 1] and all(len(ids) == 6 for ids in slots.values())
    flat_in = {s: [p for p in ids if flat(answers[p])] for s, ids in slots.items()}
    assert 0 < len(flat_in[0]) and len(flat_in[0]) + len(flat_in[1]) < 6  # the data this test needs
    varied = [p for s in (0, 1) for p in slots[s] if not flat(answers[p])]  # draw order

    result = run_rollout(cfg, run, 1)
    table = pq.read_table(run.rollout(1))
    assert table.schema.equals(ROLLOUT)
    rows = table.to_pylist()
    # slot 0 kept too few groups; slot 1 was drawn; the first 6 varied groups in draw order are kept
    assert list(dict.fromkeys(r["prompt_id"] for r in rows)) == varied[:6]
    assert len(rows) == 12 and [r["sample_index"] for r in rows] == [0, 1] * 6
    uids = list(dict.fromkeys(r["uid"] for r in rows))
    assert len(uids) == 6 and all(sum(r["uid"] == u for r in rows) == 2 for u in uids)
    # uids index the prompt rows of both draws: slot 0's prompts are 0..5, slot 1's 6..11
    index = {p: i for i, p in enumerate(slots[0] + slots[1])}
    assert uids == [f"1-{index[p]}" for p in varied[:6]]
    for u in uids:
        texts = [r["response_text"] for r in rows if r["uid"] == u]
        assert texts[0] != texts[1]  # what made the group's scores differ
    seeds = {s: {r["sampling_seed"] for r in rows if r["prompt_id"] in slots[s]} for s in (0, 1)}
    assert seeds[0] and seeds[1] and not seeds[0] & seeds[1]  # the refill draw has seeds of its own
    m = result.metrics
    assert m["train/num_gen_batches"] == 2 and m["rollout/kept_groups"] == 6
    assert m["rollout/filtered_groups"] == len(flat_in[0]) + len(flat_in[1])
    assert m["rollout/surplus_groups"] == len(varied) - 6
    assert result.rows == {"prompts": 6, "responses": 12}

    run_rollout(cfg, run, 1, force=True)  # every draw seeded from the iteration and draw number
    assert pq.read_table(run.rollout(1)).equals(table)


def test_too_few_groups_stop_naming_the_limit(run_setup):
    cfg, run, (raw, model, reward), _, _ = run_setup
    with pytest.raises(DataError, match=r"max_num_gen_batches=1"):
        run_rollout(config(raw, model, reward, "algorithm.filter_groups.max_num_gen_batches=1"), run, 1)
    assert not run.rollout(1).exists()
    # every group alike: no limit set, the two slots drawn once each, then a clear stop
    alike = raw.parent / "alike.py"
    alike.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with pytest.raises(DataError, match=r"every one of the 2 pack slots"):
        run_rollout(config(raw, model, alike), run, 1)


def test_metric_sources_and_refusals(tmp_path, tiny_model_dir):
    kept, dropped = split_groups(["a", "a", "b", "b", "c"], [1.0, 0.0, 2.0, 2.0, 5.0])
    assert (kept, dropped) == (["a", "c"], ["b"])  # c: a group of one response is kept, as verl
    where = ["row 0", "row 1"]
    assert metric_values("seq_reward", [0.5, -0.25], [1.0, 0.0], [1.0, 0.0], where) == [0.5, -0.25]
    assert metric_values("score", [0.5, -0.25], [1.0, 0.0], [1.0, 0.0], where) == [1.0, 0.0]
    assert metric_values("acc", [0.5, -0.25], [1.0, 0.0], [1.0, 0.0], where) == [1.0, 0.0]
    with pytest.raises(DataError, match="row 1: algorithm.filter_groups.metric=acc"):
        metric_values("acc", [0.5, 0.5], [1.0, 0.0], [1.0, None], where)
    base = [f"actor_rollout_ref.model.path={tiny_model_dir}", "algorithm.filter_groups.enable=true"]
    with pytest.raises(ConfigError, match="seq_final_reward with algorithm.use_kl_in_reward=true"):
        check_filter_groups(load_config(None, base + ["algorithm.filter_groups.metric=seq_final_reward",
                                                      "algorithm.use_kl_in_reward=true"]))
    check_filter_groups(load_config(None, base + ["algorithm.filter_groups.metric=seq_final_reward"]))


def test_reward_settings_rerun_a_rollout_only_when_it_filters(tmp_path, tiny_model_dir):
    base = [f"actor_rollout_ref.model.path={tiny_model_dir}"]

    def digest(*extra):
        cfg = load_config(None, base + list(extra))
        return config_hash(cfg, config_sections(cfg))

    plain = digest()
    assert digest("custom_reward_function.name=other", "algorithm.filter_groups.metric=acc") == plain
    on = ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc")
    assert digest(*on) != plain
    assert digest(*on, "custom_reward_function.name=other") != digest(*on)
    assert digest(*on, "algorithm.filter_groups.max_num_gen_batches=3") != digest(*on)


def test_refill_into_the_next_epochs_slots_leaves_out_prompts_already_drawn(tmp_path, repo_root, tiny_model_dir):
    """7 prompts in slots of 3: an epoch leaves one out, so the pack plans a second epoch whose slots
    repeat prompts. Only three prompts have responses that differ, one of them the prompt epoch 0
    left out: the refill must reach epoch 1, drawing none of the prompts it already drew again."""
    raw = tmp_path / "arith.jsonl"
    raw.write_text("".join((repo_root / "data/arith/train.jsonl").read_text().splitlines(True)[:7]))
    reward = tmp_path / "reward.py"
    cfg = config(raw, tiny_model_dir, reward, "data.train_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=3")
    run = RunDir(tmp_path / "run")
    write_config(run, to_yaml(cfg))
    run_preprocess(cfg, run)
    run_pack(cfg, run)
    slots = {}
    for row in sorted(pq.read_table(run.generation_batches).to_pylist(), key=lambda r: r["batch_id"]):
        slots.setdefault(row["slot"], []).extend(row["prompt_ids"])
    answers = {p["prompt_id"]: p["reward_model"]["ground_truth"] for p in pq.read_table(run.train_prompts).to_pylist()}
    assert len(set(answers.values())) == 7 and len(slots) >= 3  # distinct answers; a second epoch planned
    left_out = next(p for p in answers if p not in slots[0] + slots[1])
    varied = slots[0][:2] + [left_out]
    reward.write_text("import zlib\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      f"    if ground_truth in {sorted(answers[p] for p in varied)!r}:\n"
                      "        return (zlib.crc32(solution_str.encode()) % 1000) / 1000\n"
                      "    return 0.5\n")

    result = run_rollout(cfg, run, 1)
    rows = pq.read_table(run.rollout(1)).to_pylist()
    assert list(dict.fromkeys(r["prompt_id"] for r in rows)) == varied
    assert len({(r["prompt_id"], r["sample_index"]) for r in rows}) == len(rows) == 6
    reach = next(d for d in range(2, len(slots)) if left_out in slots[d])  # the draw that finds it
    assert result.metrics["train/num_gen_batches"] == reach + 1
    # every prompt generated once: 3 + 3 in epoch 0, then only epoch 1's prompts not seen yet
    assert result.metrics["rollout/filtered_groups"] == 4  # the 4 alike prompts, each once
    assert result.metrics["rollout/surplus_groups"] == 0
