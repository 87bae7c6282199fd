"""ReMax's baseline through the real rollout and score stages: an estimator that takes
reward_baselines makes the rollout decode one greedy response per prompt group
(iter_K/rollout_baseline.parquet) and the score stage write each row's reward_baseline: its group's
greedy response scored by the same reward function."""

from __future__ import annotations

import zlib

import pyarrow.parquet as pq
import pytest

from rlhf_core.algos.registry import ADV_ESTIMATORS, register_adv_estimator
from rlhf_core.config import load_config, to_yaml
from rlhf_core.data.schemas import ROLLOUT
from rlhf_core.errors import DataError
from rlhf_core.run.layout import RunDir, write_config
from rlhf_core.stages.gae import run_gae
from rlhf_core.stages.pack import run_pack
from rlhf_core.stages.preprocess import run_preprocess
from rlhf_core.stages.rollout import run_rollout
from rlhf_core.stages.score import run_score

ESTIMATOR = "test_baseline_taker"
REWARD = """
import zlib

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (zlib.crc32(solution_str.encode()) % 1000) / 1000
"""


def score_of(text: str) -> float:
    return (zlib.crc32(text.encode()) % 1000) / 1000


RECEIVED: list = []


@pytest.fixture
def baseline_estimator():
    """A stand-in for remax until the real one lands: it names reward_baselines and keeps what it got."""
    @register_adv_estimator(ESTIMATOR)
    def takes_baselines(*, token_level_rewards, response_mask, reward_baselines):
        RECEIVED.append(reward_baselines.tolist())
        return token_level_rewards, token_level_rewards

    RECEIVED.clear()
    yield ESTIMATOR
    ADV_ESTIMATORS.unregister(ESTIMATOR)


def test_greedy_baseline_table_and_reward_baseline(tmp_path, repo_root, tiny_model_dir, baseline_estimator):
    raw = tmp_path / "arith.jsonl"
    raw.write_text("".join((repo_root / "data/arith/train.jsonl").read_text().splitlines(True)[:6]))
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)

    def config(*extra):
        return load_config(None, [
            f"data.train_files=[{raw}]", "data.val_fraction=0.0", "data.data_source=arith",
            "data.train_batch_size=6", "data.max_response_length=8", "data.max_prompt_length=128",
            f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.generation_batch_tokens=1024", "actor_rollout_ref.actor.ppo_mini_batch_size=6",
            "trainer.device=cpu", f"custom_reward_function.path={reward}",
            f"algorithm.adv_estimator={baseline_estimator}", "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=4", *extra])

    cfg = config()
    run = RunDir(tmp_path / "run")
    write_config(run, to_yaml(cfg))
    run_preprocess(cfg, run)
    run_pack(cfg, run)
    result = run_rollout(cfg, run, 1)
    assert result.outputs["rollout_baseline"] == str(run.rollout_baseline(1))
    rollout = pq.read_table(run.rollout(1)).to_pylist()
    table = pq.read_table(run.rollout_baseline(1))
    assert table.schema.equals(ROLLOUT)
    baseline = table.to_pylist()
    # one greedy response per group, in the rollout's group order, with the group's uid and prompt
    assert [b["uid"] for b in baseline] == list(dict.fromkeys(r["uid"] for r in rollout))
    first = {r["uid"]: r for r in rollout if r["sample_index"] == 0}
    assert all(b["sample_index"] == 0 and b["prompt_id"] == first[b["uid"]]["prompt_id"] for b in baseline)

    # greedy: another sampling seed changes the sampled responses, not the baseline
    other = config("actor_rollout_ref.rollout.seed=12345")
    run_rollout(other, run, 1)
    assert [r["response_text"] for r in pq.read_table(run.rollout(1)).to_pylist()] != \
        [r["response_text"] for r in rollout]
    assert pq.read_table(run.rollout_baseline(1)).drop_columns("sampling_seed").equals(table.drop_columns("sampling_seed"))
    run_rollout(cfg, run, 1)  # back to the first table

    scored_result = run_score(cfg, run, 1)
    scored = pq.read_table(run.scored(1)).to_pylist()
    greedy = {b["uid"]: score_of(b["response_text"]) + min(-(b["response_length"] - 4) / 4, 0) for b in baseline}
    assert len(scored) == 12
    for row in scored:
        assert row["reward_baseline"] == pytest.approx(greedy[row["uid"]])  # same reward, overlong shaping too
        assert row["reward"] == pytest.approx(score_of(row["response_text"]) + min(-(row["response_length"] - 4) / 4, 0))

    assert scored_result.metrics["reward/baseline_mean"] == pytest.approx(
        sum(greedy[r["uid"]] for r in scored) / len(scored))
    run_gae(cfg, run, 1)  # the advantage step hands the column to the estimator, row for row
    assert RECEIVED[-1] == pytest.approx([r["reward_baseline"] for r in scored])

    # the baseline table is an input of the score stage: a changed one reruns it (here: refused, a
    # group's greedy response is missing)
    assert run_score(cfg, run, 1).skipped
    pq.write_table(table.slice(1), run.rollout_baseline(1))
    with pytest.raises(DataError, match=f"no greedy response for group uid '{baseline[0]['uid']}'"):
        run_score(cfg, run, 1)


def test_only_a_baseline_estimator_adds_the_estimator_to_the_stages_config(tiny_model_dir, baseline_estimator):
    from rlhf_core.stages import rollout, score

    plain = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir}"])
    remax = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir}",
                               f"algorithm.adv_estimator={baseline_estimator}"])
    for stage in (rollout, score):
        assert "algorithm.adv_estimator" not in stage.config_sections(plain)  # gae → grpo reruns neither
        assert "algorithm.adv_estimator" in stage.config_sections(remax)
