"""DAPO's overlong reward shaping: the penalty against a transcription of verl's DAPO reward manager,
the refusals, and the score stage adding it to every rule-based score (reward_extra logged)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from rlhf_core.config import ConfigError, load_config, to_yaml
from rlhf_core.config.validate import check_overlong_buffer
from rlhf_core.rewards.overlong import overlong_penalty, shape_scores
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.stages.init_critic import run_init_critic
from rlhf_core.stages.pack import run_pack
from rlhf_core.stages.preprocess import run_preprocess
from rlhf_core.stages.rollout import run_rollout
from rlhf_core.stages.score import run_score


def verl_overlong_reward(valid_response_length, max_resp_len, overlong_buffer_len, overlong_penalty_factor):
    """verl/workers/reward_manager/dapo.py, the overlong_buffer_cfg.enable branch, line for line."""
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    overlong_reward = min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)
    return overlong_reward


@pytest.mark.parametrize("max_len,buffer,factor", [(20480, 4096, 1.0), (12, 4, 0.5), (8, 1, 2.0), (100, 99, 1.0)])
def test_penalty_is_verls_formula(max_len, buffer, factor):
    for length in sorted({0, 1, max_len - buffer - 1, max_len - buffer, max_len - buffer + 1, max_len - 1, max_len}):
        assert overlong_penalty(length, max_len, buffer, factor) == verl_overlong_reward(length, max_len, buffer, factor)
    assert overlong_penalty(max_len - buffer, max_len, buffer, factor) == 0.0  # the buffer starts here
    assert overlong_penalty(max_len, max_len, buffer, factor) == -factor  # the full penalty at the budget


def _cfg(*extra):
    return load_config(None, ["data.max_response_length=8", "reward_model.overlong_buffer.enable=true",
                              "reward_model.overlong_buffer.len=4", *extra])


def test_shaping_logs_and_refusals():
    logged = _cfg("reward_model.overlong_buffer.log=true").reward_model.overlong_buffer
    scores, extras = shape_scores(logged, 8, [1.0, 1.0, 0.0], [3, 6, 8], ["{}", '{"acc": 1}', "{}"])
    assert scores == [1.0, 0.5, -1.0]
    assert [json.loads(e) for e in extras] == [{"overlong": False, "overlong_reward": 0.0},
                                               {"acc": 1, "overlong": True, "overlong_reward": -0.5},
                                               {"overlong": True, "overlong_reward": -1.0}]
    assert shape_scores(_cfg().reward_model.overlong_buffer, 8, [1.0], [8], ["{}"]) == ([0.0], ["{}"])  # log=false
    off = load_config(None, ["data.max_response_length=8"]).reward_model.overlong_buffer
    assert shape_scores(off, 8, [1.0], [8], ["{}"]) == ([1.0], ["{}"])
    with pytest.raises(ConfigError, match=r"reward_model.overlong_buffer.len=8 must be < data.max_response_length=8"):
        check_overlong_buffer(_cfg("reward_model.overlong_buffer.len=8"))
    with pytest.raises(ConfigError, match="reward_model.enable=false"):
        check_overlong_buffer(_cfg("reward_model.enable=true", "reward_model.model.path=/nowhere"))


def test_score_stage_adds_the_penalty_to_every_rule_based_score(tmp_path, repo_root, tiny_model_dir):
    raw = tmp_path / "arith.jsonl"
    raw.write_text("".join((repo_root / "data/arith/train.jsonl").read_text().splitlines(True)[:6]))
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': 1.0, 'acc': True}\n")
    cfg = load_config(None, [
        f"data.train_files=[{raw}]", "data.val_fraction=0.0", "data.data_source=arith",
        "data.train_batch_size=6", "data.max_response_length=8", "data.max_prompt_length=128",
        f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.generation_batch_tokens=1024", "actor_rollout_ref.actor.ppo_mini_batch_size=6",
        "trainer.device=cpu", f"custom_reward_function.path={reward}",
        "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=5",
        "reward_model.overlong_buffer.penalty_factor=0.5", "reward_model.overlong_buffer.log=true"])
    run = RunDir(tmp_path / "run")
    write_config(run, to_yaml(cfg))
    run_preprocess(cfg, run)
    run_pack(cfg, run)
    run_rollout(cfg, run, 1)
    run_init_critic(cfg, run)
    run_score(cfg, run, 1)
    rows = pq.read_table(run.scored(1)).to_pylist()
    assert len(rows) == 12 and any(r["response_length"] > 3 for r in rows)  # some run into the buffer
    for r in rows:
        penalty = verl_overlong_reward(r["response_length"], 8, 5, 0.5)
        assert r["reward"] == pytest.approx(1.0 + penalty)
        assert json.loads(r["reward_extra"]) == {"acc": True, "overlong": penalty < 0,
                                                 "overlong_reward": pytest.approx(penalty)}
