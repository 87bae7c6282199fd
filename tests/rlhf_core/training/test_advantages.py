"""rlhf_core.training.advantages: scored table → token rewards, GAE, whitening, checked against hand-worked values
and a plain per-response loop that never pads."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest
import torch

from rlhf_core.training.advantages import AdvantageSettings, compute_advantages, pad_list_column, scored_batch, unpad
from rlhf_core.config import ConfigError
from rlhf_core.data.schemas import ADVANTAGES, SCORED
from rlhf_core.errors import DataError


def scored_table(responses: list[dict]) -> pa.Table:
    """A SCORED table; each response dict gives reward and the three per-token lists."""
    rows = []
    for i, r in enumerate(responses):
        n = len(r["values"])
        rows.append(dict(prompt_id=f"p{i}", sample_index=0, iteration=1, data_source="arith", ground_truth="7",
                         prompt_token_ids=[5, 6, 7], response_text="x" * n, response_token_ids=list(range(10, 10 + n)),
                         response_length=n, finish_reason="stop", engine="offline", sampling_seed=0,
                         reward=r["reward"], reward_extra="{}", old_log_probs=r["old"], ref_log_probs=r["ref"],
                         values=r["values"], uid=f"1-p{i}"))
    return pa.Table.from_pylist(rows, schema=SCORED)


def random_responses(seed: int, lengths: list[int]) -> list[dict]:
    rng = random.Random(seed)

    def floats(n, lo, hi):
        return [rng.uniform(lo, hi) for _ in range(n)]

    return [dict(reward=rng.choice([0.0, 1.0, 0.5]), old=floats(n, -3, -0.1), ref=floats(n, -3, -0.1),
                 values=floats(n, -1, 1)) for n in lengths]


def plain_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list, list]:
    """The textbook reversed loop over one response's tokens (no padding, no mask)."""
    advantages, last, next_value = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        advantages[t], next_value = last, values[t]
    return advantages, [a + v for a, v in zip(advantages, values)]


NO_WHITEN = AdvantageSettings(norm_adv=False)


def test_pad_and_unpad_round_trip_every_length():
    lengths = [3, 0, 5, 1]
    responses = random_responses(0, lengths)
    table = scored_table(responses)
    padded = pad_list_column(table, "values", np.array(lengths), 6, "t")
    assert padded.shape == (4, 6) and padded.dtype == torch.float32
    assert padded[1].abs().sum() == 0 and padded[0, 3:].abs().sum() == 0
    back = unpad(padded, np.array(lengths)).to_pylist()
    assert [len(v) for v in back] == lengths
    for got, want in zip(back, responses):
        assert got == pytest.approx(want["values"], abs=1e-6)


def test_without_kl_the_score_sits_on_the_last_token_and_gamma_lam_one_gives_r_minus_v():
    responses = [dict(reward=1.0, old=[-1.0, -2.0, -0.5], ref=[-1.5, -1.0, -0.5], values=[0.2, 0.4, 0.7]),
                 dict(reward=0.0, old=[-0.3, -0.3], ref=[-2.0, -2.0], values=[-0.1, 0.3])]
    out = compute_advantages(scored_table(responses), kl_coef=0.5,
                             settings=AdvantageSettings(norm_adv=False, use_kl_in_reward=False))
    rows = out.table.to_pylist()
    assert out.table.schema.names == ADVANTAGES.names
    assert rows[0]["token_level_rewards"] == [0.0, 0.0, 1.0] and rows[1]["token_level_rewards"] == [0.0, 0.0]
    # gamma = lam = 1: every token's return is the score R, and A_t = R - V_t
    close = dict(abs=1e-6)  # float32 arithmetic
    assert rows[0]["returns"] == pytest.approx([1.0, 1.0, 1.0], **close)
    assert rows[0]["advantages"] == pytest.approx([0.8, 0.6, 0.3], **close)
    assert rows[1]["returns"] == pytest.approx([0.0, 0.0], **close)
    assert rows[1]["advantages"] == pytest.approx([0.1, -0.3], **close)
    assert out.metrics["kl/coef"] == 0.0  # the coefficient is ignored when the KL is not in the reward
    assert out.metrics["reward/token_level_mean"] == pytest.approx(0.5)
    # the KL is still measured: per-row token means of old - ref, averaged over rows
    assert out.kl_mean == pytest.approx(((0.5 - 1.0 + 0.0) / 3 + 1.7) / 2, abs=1e-6)


def test_kl_in_reward_subtracts_coef_times_old_minus_ref_per_token():
    responses = random_responses(1, [4, 7, 1])
    out = compute_advantages(scored_table(responses), kl_coef=0.25, settings=AdvantageSettings(norm_adv=False))
    for row, r in zip(out.table.to_pylist(), responses):
        expected = [-0.25 * (o - f) for o, f in zip(r["old"], r["ref"])]
        expected[-1] += r["reward"]
        assert row["token_level_rewards"] == pytest.approx(expected, abs=1e-6)
    assert out.metrics["kl/coef"] == 0.25


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.7)])
def test_gae_matches_a_plain_loop_per_response(gamma, lam):
    responses = random_responses(2, [5, 0, 12, 1, 30, 2])
    out = compute_advantages(scored_table(responses), kl_coef=0.1,
                             settings=AdvantageSettings(gamma=gamma, lam=lam, norm_adv=False))
    for row in out.table.to_pylist():
        advantages, returns = plain_gae(row["token_level_rewards"], row["values"], gamma, lam)
        assert row["advantages"] == pytest.approx(advantages, abs=1e-5)
        assert row["returns"] == pytest.approx(returns, abs=1e-5)
        assert len(row["advantages"]) == len(row["returns"]) == row["response_length"]


def test_whitening_gives_zero_mean_unit_std_and_leaves_returns_alone():
    table = scored_table(random_responses(3, [8, 3, 15, 0, 6]))
    raw = compute_advantages(table, kl_coef=0.1, settings=NO_WHITEN)
    white = compute_advantages(table, kl_coef=0.1, settings=AdvantageSettings())
    flat = np.concatenate([np.array(a) for a in white.table.column("advantages").to_pylist()])
    assert len(flat) == 32
    assert flat.mean() == pytest.approx(0.0, abs=1e-5) and flat.std(ddof=1) == pytest.approx(1.0, abs=1e-4)
    assert white.table.column("returns").to_pylist() == raw.table.column("returns").to_pylist()
    assert white.metrics["advantages/mean"] == pytest.approx(0.0, abs=1e-5)
    # whitening is affine: the order of the advantages is kept
    raw_flat = np.concatenate([np.array(a) for a in raw.table.column("advantages").to_pylist()])
    assert (np.argsort(raw_flat, kind="stable") == np.argsort(flat, kind="stable")).all()


def test_metrics_are_over_valid_tokens():
    responses = [dict(reward=2.0, old=[-1.0, -1.0], ref=[-1.0, -1.0], values=[1.0, 3.0]),
                 dict(reward=0.0, old=[-1.0], ref=[-1.0], values=[5.0])]
    m = compute_advantages(scored_table(responses), kl_coef=0.1, settings=NO_WHITEN).metrics
    assert m["critic/values_mean"] == pytest.approx(3.0)  # (1 + 3 + 5) / 3, padding not counted
    assert m["reward/score_mean"] == pytest.approx(1.0) and m["reward/token_level_mean"] == pytest.approx(1.0)
    assert (m["advantages/min"], m["advantages/max"]) == pytest.approx((-5.0, 1.0))  # A = [1, -1], [-5]
    assert m["returns/mean"] == pytest.approx(4 / 3)


def test_all_empty_responses_still_give_a_table():
    out = compute_advantages(scored_table(random_responses(4, [0, 0])), kl_coef=0.1, settings=AdvantageSettings())
    assert out.table.column("advantages").to_pylist() == [[], []]
    assert out.metrics["advantages/mean"] == 0.0


@pytest.mark.parametrize("column,value,match", [
    ("values", [0.1, 0.2], "row 1 .*values has 2 entries but response_length is 3"),
    ("old_log_probs", [-1.0, float("-inf"), -1.0], "row 1 .*old_log_probs holds a non-finite"),
    ("ref_log_probs", None, "row 1 .*ref_log_probs is null"),
    ("reward", None, "row 1 .*reward is None"),
    ("reward", float("nan"), "row 1 .*reward is nan"),
])
def test_bad_rows_are_named(column, value, match):
    table = scored_table(random_responses(5, [2, 3, 4]))
    data = table.to_pylist()
    data[1][column] = value
    with pytest.raises(DataError, match=match) as err:
        compute_advantages(pa.Table.from_pylist(data, schema=SCORED), kl_coef=0.1, settings=AdvantageSettings(),
                           source="iter_1/scored.parquet")
    assert "iter_1/scored.parquet row 1 (prompt_id='p1', sample_index=0)" in str(err.value)


def test_unknown_estimator_and_missing_columns_are_clear_errors():
    table = scored_table(random_responses(6, [2]))
    with pytest.raises(ConfigError, match="algorithm.adv_estimator.*'gae'"):
        compute_advantages(table, kl_coef=0.1, settings=AdvantageSettings(adv_estimator="grpo_typo"))
    with pytest.raises(DataError, match="missing column.*values"):
        scored_batch(table.drop_columns(["values"]), "t")
    with pytest.raises(DataError, match="no rows"):
        scored_batch(table.slice(0, 0), "t")


def verl_data_metrics(table: pa.Table) -> dict[str, float]:
    """A transcription of the reductions of verl's compute_data_metrics (metric_utils.py) on the
    right-padded (B, T) tensors of an advantages table: per-response sums over non-empty responses;
    token statistics over masked_select of the valid tokens; unbiased variances."""
    rows = table.to_pylist()
    width = max(1, max(r["response_length"] for r in rows))

    def padded(name):
        return torch.tensor([r[name] + [0.0] * (width - len(r[name])) for r in rows], dtype=torch.float32)

    mask = torch.tensor([[t < r["response_length"] for t in range(width)] for r in rows])
    rewards, adv, ret, val = padded("token_level_rewards"), padded("advantages"), padded("returns"), padded("values")
    seq_reward = rewards.sum(-1)[torch.tensor([r["response_length"] > 0 for r in rows])]
    out = {"critic/rewards/mean": torch.mean(seq_reward), "critic/rewards/max": torch.max(seq_reward),
           "critic/rewards/min": torch.min(seq_reward)}
    for name, tensor in (("advantages", adv), ("returns", ret), ("values", val)):
        valid = torch.masked_select(tensor, mask)
        out.update({f"critic/{name}/mean": torch.mean(valid), f"critic/{name}/max": torch.max(valid),
                    f"critic/{name}/min": torch.min(valid)})
    valid_ret, valid_val = torch.masked_select(ret, mask), torch.masked_select(val, mask)
    out["critic/vf_explained_var"] = 1.0 - torch.var(valid_ret - valid_val) / (torch.var(valid_ret) + 1e-5)
    return {k: float(v) for k, v in out.items()}


@pytest.mark.parametrize("settings", [AdvantageSettings(), NO_WHITEN, AdvantageSettings(use_kl_in_reward=False)])
def test_verl_metric_names_match_verls_reductions(settings):
    table = scored_table(random_responses(7, [6, 0, 11, 3, 1, 9]))
    out = compute_advantages(table, kl_coef=0.05, settings=settings)
    expected = verl_data_metrics(out.table)
    for name, value in expected.items():
        assert out.metrics[name] == pytest.approx(value, abs=1e-6), name
    # ours stay as aliases of the same numbers
    assert out.metrics["advantages/mean"] == out.metrics["critic/advantages/mean"]
    assert out.metrics["returns/max"] == out.metrics["critic/returns/max"]
    assert out.metrics["critic/values_mean"] == out.metrics["critic/values/mean"]


def test_kl_penalty_metrics_only_when_the_kl_is_in_the_reward():
    """verl's apply_kl_penalty: the batch mean of each response's token-mean KL, and the coefficient used."""
    responses = random_responses(8, [4, 7, 2])
    table = scored_table(responses)
    with_kl = compute_advantages(table, kl_coef=0.05, settings=AdvantageSettings(use_kl_in_reward=True)).metrics
    per_response = [np.mean(np.array(r["old"]) - np.array(r["ref"])) for r in responses]  # kl_penalty "kl" = k1
    assert with_kl["actor/reward_kl_penalty"] == pytest.approx(float(np.mean(per_response)), abs=1e-6)
    assert with_kl["actor/reward_kl_penalty_coeff"] == pytest.approx(0.05)
    without = compute_advantages(table, kl_coef=0.05, settings=AdvantageSettings(use_kl_in_reward=False)).metrics
    assert "actor/reward_kl_penalty" not in without and "actor/reward_kl_penalty_coeff" not in without


# ---------------------------------------------------------------------------------------------
# rollout correction (algorithm.rollout_correction) in the gae step
# ---------------------------------------------------------------------------------------------


def _with_rollout_log_probs(table: pa.Table, shift: list[float]) -> pa.Table:
    """The engine's own log-probs: the trainer's plus a per-response shift (a bf16 engine, say)."""
    old = table.column("old_log_probs").to_pylist()
    rollout = [[x + s for x in row] for row, s in zip(old, shift)]
    index = table.schema.get_field_index("rollout_log_probs")
    return table.set_column(index, "rollout_log_probs", pa.array(rollout, pa.list_(pa.float32())))


def _correction(**kw):
    from rlhf_core.algos.correction_specs import RolloutCorrection

    return AdvantageSettings(norm_adv=False, rollout_correction=RolloutCorrection(**kw))


def test_the_mismatch_metrics_come_whenever_the_rollout_recorded_log_probs():
    table = _with_rollout_log_probs(scored_table(random_responses(3, [4, 2, 5])), [0.0, 0.0, 0.0])
    out = compute_advantages(table, kl_coef=0.0, settings=NO_WHITEN)
    assert out.metrics["rollout_corr/kl"] == pytest.approx(0.0, abs=1e-7)
    assert out.metrics["rollout_corr/ppl_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert out.table.column("rollout_is_weights").null_count == 3  # nothing asked for: no weights, no mask
    assert out.table.column("response_mask").null_count == 3
    plain = compute_advantages(scored_table(random_responses(3, [4, 2, 5])), kl_coef=0.0, settings=NO_WHITEN)
    assert not any(k.startswith("rollout_corr/") for k in plain.metrics)  # offline rows: nothing to measure


def test_token_weights_and_rejection_reach_the_advantages_table():
    table = _with_rollout_log_probs(scored_table(random_responses(4, [3, 3, 3])), [0.0, -1.0, 0.05])
    # row 1: the trainer's policy is e times the engine's on every token (ratio 2.72 > 2 → truncated to 2);
    # token_k1 with ratio bounds [0.9, 1.5] rejects row 1's tokens and keeps the others
    out = compute_advantages(table, kl_coef=0.0, settings=_correction(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.9_1.5"))
    weights = out.table.column("rollout_is_weights").to_pylist()
    kept = out.table.column("response_mask").to_pylist()
    assert weights[0] == pytest.approx([1.0] * 3) and weights[1] == pytest.approx([2.0] * 3)
    assert weights[2] == pytest.approx([np.exp(-0.05)] * 3, rel=1e-5)
    assert kept == [[True] * 3, [False] * 3, [True] * 3]
    assert out.table.column("advantages").to_pylist()[1] == [0.0, 0.0, 0.0]  # rejected: out of the estimator's mask
    assert out.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 3)


def test_rejected_tokens_keep_their_rewards_in_critic_rewards_and_the_kl():
    """verl's compute_data_metrics sums whole token-reward rows, rejection or not, and its KL in the
    reward is shaped before the correction: a response rejected whole still adds its score and its
    KL penalty to critic/rewards."""
    responses = [dict(reward=r, old=[-1.0, -0.5], ref=[-1.2, -0.9], values=[0.0, 0.0]) for r in (1.0, 2.0, 0.0)]
    table = _with_rollout_log_probs(scored_table(responses), [0.0, -1.0, 0.0])  # row 1 rejected whole
    settings = AdvantageSettings(adv_estimator="grpo", use_kl_in_reward=True, rollout_correction=_correction(
        rollout_rs="token_k1", rollout_rs_threshold="0.9_1.5").rollout_correction)
    out = compute_advantages(table, kl_coef=0.5, settings=settings)
    assert out.table.column("response_mask").to_pylist()[1] == [False, False]
    sums = [sum(row) for row in out.table.column("token_level_rewards").to_pylist()]
    assert sums[1] == pytest.approx(2.0 - 0.5 * (0.2 + 0.4), abs=1e-6)
    assert out.metrics["critic/rewards/mean"] == pytest.approx(np.mean(sums), abs=1e-6)
    assert out.metrics["critic/rewards/max"] == pytest.approx(max(sums), abs=1e-6)


def test_a_correction_without_the_rollouts_log_probs_is_refused():
    with pytest.raises(DataError, match="no rollout_log_probs.*offline engine"):
        compute_advantages(scored_table(random_responses(5, [2, 2])), kl_coef=0.0,
                           settings=_correction(rollout_is="sequence"))
