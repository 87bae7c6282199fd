"""Critic-free advantage estimators against loop-by-row transcriptions of verl's definitions
(verl/trainer/ppo/core_algos.py), plus the edge cases each docstring states."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from rlhf_core.algos.registry import ADV_ESTIMATORS, accepted_kwargs, estimator_takes, get_adv_estimator

CRITIC_FREE = ["grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus",
               "reinforce_plus_plus_baseline", "remax"]


# ---------------------------------------------------------------------------------------------
# verl's definitions, one row and one group at a time
# ---------------------------------------------------------------------------------------------


def _by_group(scores, index):
    members = defaultdict(list)
    for i in range(len(scores)):
        members[index[i]].append(i)
    return members


def _ref_whiten(x, mask):
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / (n + 1e-8)
    var = ((x - mean) ** 2 * m).sum() / (n + 1e-8) * n / (n - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def ref_grpo(r, mask, index, norm_adv_by_std_in_grpo=True, eps=1e-6):
    scores = r.sum(-1).clone()
    out = scores.clone()
    for rows in _by_group(scores, index).values():
        group = scores[rows]
        mean, std = (torch.tensor(0.0), torch.tensor(1.0)) if len(rows) == 1 else (group.mean(), group.std())
        for i in rows:
            out[i] = (scores[i] - mean) / (std + eps) if norm_adv_by_std_in_grpo else scores[i] - mean
    adv = out.unsqueeze(-1) * mask
    return adv, adv


def ref_grpo_passk(r, mask, index, norm_adv_by_std_in_grpo=True, eps=1e-6):
    scores = r.sum(-1)
    out = torch.zeros_like(scores)
    for rows in _by_group(scores, index).values():
        group = scores[rows]
        top, where = torch.topk(group, 2)
        margin = top[0] - top[1]
        if norm_adv_by_std_in_grpo:
            margin = margin / (group.std() + eps)
        out[rows[int(where[0])]] = margin
    adv = out.unsqueeze(-1) * mask
    return adv, adv


def ref_rloo(r, mask, index):
    scores = r.sum(-1).clone()
    out = scores.clone()
    for rows in _by_group(scores, index).values():
        n = len(rows)
        if n > 1:
            mean = scores[rows].mean()
            for i in rows:
                out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    adv = out.unsqueeze(-1) * mask
    return adv, adv


def ref_opo(r, mask, index):
    scores = r.sum(-1)
    lengths = mask.sum(-1).to(scores.dtype)
    out = scores.clone()
    for rows in _by_group(scores, index).values():
        base = 0.0 if len(rows) == 1 else (lengths[rows] * scores[rows]).sum() / lengths[rows].sum()
        for i in rows:
            out[i] = scores[i] - base
    adv = out.unsqueeze(-1) * mask
    return adv, adv


def ref_gpg(r, mask, index):
    scores = r.sum(-1)
    alpha = len(scores) / max(int(torch.count_nonzero(scores)), 1)
    out = scores.clone()
    for rows in _by_group(scores, index).values():
        mean = 0.0 if len(rows) == 1 else scores[rows].mean()
        for i in rows:
            out[i] = alpha * (scores[i] - mean)
    adv = out.unsqueeze(-1) * mask
    return adv, adv


def ref_reinforce_plus_plus_baseline(r, mask, index):
    scores = r.sum(-1)
    out = scores.clone()
    for rows in _by_group(scores, index).values():
        mean = 0.0 if len(rows) == 1 else scores[rows].mean()
        for i in rows:
            out[i] = scores[i] - mean
    tiled = out.unsqueeze(-1).expand_as(r) * mask
    adv = _ref_whiten(tiled, mask) * mask
    return adv, adv


def ref_reinforce_plus_plus(r, mask, gamma):
    """verl 0.9.1: a masked step carries the running return through unchanged."""
    m = mask.to(r.dtype)
    returns = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype)
    for t in reversed(range(r.shape[1])):
        new = r[:, t] + gamma * running
        returns[:, t] = new * m[:, t]
        running = new * m[:, t] + running * (1 - m[:, t])
    return _ref_whiten(returns, mask) * mask, returns


def ref_remax(r, mask, reward_baselines):
    returns = torch.flip(torch.cumsum(torch.flip(r * mask, [-1]), -1), [-1])
    return returns - reward_baselines.unsqueeze(-1) * mask, returns


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


def _inputs(masks, seed, min_group=1, length=13):
    """Uneven groups (sizes min_group..5) in shuffled row order, gapped masks, rewards 0 at padding."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(min_group, 6, (7,), generator=gen).tolist()
    index = np.array([f"uid-{g}" for g, n in enumerate(sizes) for _ in range(n)], dtype=object)
    index = index[torch.randperm(len(index), generator=gen).numpy()]
    batch = len(index)
    mask = masks.make(gen, batch, length)
    r = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    # Some exact zeros and ties, as 0/1 rule-based rewards give.
    r = torch.where(torch.rand(batch, length, generator=gen) < 0.2, torch.zeros(()), r.round(decimals=1))
    r = torch.where(mask, r, torch.zeros((), dtype=torch.float64))
    baselines = torch.randn(batch, generator=gen, dtype=torch.float64)
    return r, mask, index, baselines


def _call(name, r, mask, index=None, baselines=None, **extra):
    fn = get_adv_estimator(name)
    offered = dict(token_level_rewards=r, response_mask=mask, index=index, reward_baselines=baselines,
                   gamma=1.0, lam=1.0, values=torch.zeros_like(r), norm_adv_by_std_in_grpo=True)
    offered.update(extra)
    return fn(**accepted_kwargs(fn, offered))


def _assert_matches(ours, ref, mask):
    zero = torch.zeros((), dtype=torch.float64)
    for got, want in zip(ours, ref):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, torch.where(mask, want, zero), rtol=0, atol=1e-6)
        assert (got[~mask] == 0).all()


GROUPED = {
    "grpo": ref_grpo, "rloo": ref_rloo, "opo": ref_opo, "gpg": ref_gpg,
    "reinforce_plus_plus_baseline": ref_reinforce_plus_plus_baseline,
}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", sorted(GROUPED))
def test_grouped_estimators_match_verl(masks, name, seed):
    r, mask, index, _ = _inputs(masks, seed)
    _assert_matches(_call(name, r, mask, index), GROUPED[name](r, mask, index), mask)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_and_passk_follow_norm_adv_by_std(masks, seed, norm):
    r, mask, index, _ = _inputs(masks, seed, min_group=2)
    for name, ref in (("grpo", ref_grpo), ("grpo_passk", ref_grpo_passk)):
        ours = _call(name, r, mask, index, norm_adv_by_std_in_grpo=norm)
        _assert_matches(ours, ref(r, mask, index, norm_adv_by_std_in_grpo=norm), mask)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_reinforce_plus_plus_matches_verl(masks, seed, gamma):
    r, mask, _, _ = _inputs(masks, seed, length=150)  # > one 64-token scan block
    _assert_matches(_call("reinforce_plus_plus", r, mask, gamma=gamma), ref_reinforce_plus_plus(r, mask, gamma), mask)


@pytest.mark.parametrize("seed", range(6))
def test_remax_matches_verl(masks, seed):
    r, mask, _, baselines = _inputs(masks, seed)
    _assert_matches(_call("remax", r, mask, baselines=baselines), ref_remax(r, mask, baselines), mask)


# ---------------------------------------------------------------------------------------------
# contract
# ---------------------------------------------------------------------------------------------


def test_every_critic_free_estimator_is_registered_and_never_reads_values():
    for name in CRITIC_FREE:
        assert name in ADV_ESTIMATORS
        assert not estimator_takes(name, "values"), name
    assert [n for n in CRITIC_FREE if estimator_takes(n, "reward_baselines")] == ["remax"]
    assert [n for n in CRITIC_FREE if not estimator_takes(n, "index")] == ["reinforce_plus_plus", "remax"]


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "remax"])
def test_token_level_estimators_ignore_rewards_at_masked_positions(masks, name):
    r, mask, index, baselines = _inputs(masks, 3, min_group=2)
    clean = _call(name, r, mask, index, baselines)
    dirty = _call(name, masks.scramble(r, mask, torch.Generator().manual_seed(0)), mask, index, baselines)
    for a, b in zip(clean, dirty):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


GROUP_SCORED = dict(GROUPED, grpo_passk=ref_grpo_passk)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", sorted(GROUP_SCORED))
def test_group_estimators_score_the_whole_row_as_verl(masks, name, seed):
    """Rewards at masked positions (tokens the rollout correction rejected) count in the score, as in
    verl, which sums the whole token_level_rewards row; only the advantage's placement follows the mask."""
    r, mask, index, _ = _inputs(masks, seed, min_group=2)
    rejected = torch.randn(r.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    r = torch.where(mask, r, rejected.round(decimals=1))
    ours = _call(name, r, mask, index)
    _assert_matches(ours, GROUP_SCORED[name](r, mask, index), mask)
    masked_only = _call(name, torch.where(mask, r, torch.zeros((), dtype=torch.float64)), mask, index)
    assert not torch.equal(ours[0], masked_only[0])  # the rejected rewards did change the scores


def test_a_correct_answer_whose_last_token_is_rejected_keeps_its_score():
    """The group [1, 0, 0] whose correct answer loses its last token to rejection: verl's GRPO still
    scores it 1, so its kept tokens get +1.155 and the others -0.577 (not all 0)."""
    r, mask = _one_token_rows([1.0, 0.0, 0.0])
    mask[0, 2] = False  # the score's token, rejected
    adv, _ = _call("grpo", r, mask, np.array(["a", "a", "a"], dtype=object))
    s = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    expected = ((s - s.mean()) / (s.std() + 1e-6)).unsqueeze(-1) * mask
    torch.testing.assert_close(adv, expected)
    assert adv[0, 0] == pytest.approx(1.1547, abs=1e-4) and adv[1, 0] == pytest.approx(-0.5774, abs=1e-4)


@pytest.mark.parametrize("name", CRITIC_FREE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_dtype_follows_the_rewards(masks, name, dtype):
    r, mask, index, baselines = _inputs(masks, 4, min_group=2)
    adv, ret = _call(name, r.to(dtype), mask.long(), index, baselines.float())
    assert adv.dtype == ret.dtype == dtype and adv.shape == ret.shape == r.shape
    assert torch.isfinite(adv.float()).all()


# ---------------------------------------------------------------------------------------------
# edge cases
# ---------------------------------------------------------------------------------------------


def _one_token_rows(scores, lengths=None):
    scores = torch.tensor(scores, dtype=torch.float64)
    lengths = [3] * len(scores) if lengths is None else lengths
    mask = torch.arange(3).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    r = torch.zeros(len(scores), 3, dtype=torch.float64)
    last = (torch.tensor(lengths) - 1).clamp(min=0)
    r[torch.arange(len(scores)), last] = torch.where(torch.tensor(lengths) > 0, scores, 0.0)
    return r, mask


def test_group_of_one():
    # Rows 0-1 form group a; row 2 is alone in group b.
    r, mask = _one_token_rows([1.0, 0.0, 2.5])
    index = np.array(["a", "a", "b"], dtype=object)
    expected = {"grpo": 2.5 / (1 + 1e-6), "rloo": 2.5, "opo": 2.5, "gpg": 2.5 * 3 / 2}
    for name, value in expected.items():
        adv, _ = _call(name, r, mask, index)
        torch.testing.assert_close(adv[2], torch.full((3,), value, dtype=torch.float64), msg=name)
    adv, _ = _call("grpo", r, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv[2], torch.full((3,), 2.5, dtype=torch.float64))


@pytest.mark.parametrize("name", ["grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"])
def test_all_equal_rewards_give_zero(name):
    r, mask = _one_token_rows([0.75, 0.75, 0.75, 1.0, 1.0], lengths=[3, 1, 2, 3, 2])
    index = np.array(["a", "a", "a", "b", "b"], dtype=object)
    adv, ret = _call(name, r, mask, index)
    assert (adv == 0).all() and (ret == 0).all()


@pytest.mark.parametrize("name", ["grpo", "rloo", "opo", "gpg"])
def test_fully_masked_row_gives_zeros_but_counts_in_its_group_with_its_score(name):
    r, mask = _one_token_rows([1.0, 9.0, 3.0])
    mask[1] = False  # every token of row 1 rejected: it still scored 9
    index = np.array(["a", "a", "a"], dtype=object)
    adv, _ = _call(name, r, mask, index)
    assert (adv[1] == 0).all()
    ref = {"grpo": ref_grpo, "rloo": ref_rloo, "opo": ref_opo, "gpg": ref_gpg}[name]
    torch.testing.assert_close(adv, ref(r, mask, index)[0])  # the group's scores are [1, 9, 3]


def test_opo_group_of_empty_rows_gives_zero_where_verl_gives_nan():
    r, mask = _one_token_rows([0.0, 0.0, 1.0], lengths=[0, 0, 3])
    adv, _ = _call("opo", r, mask, np.array(["a", "a", "b"], dtype=object))
    assert torch.isfinite(adv).all() and (adv[:2] == 0).all() and (adv[2] == 1).all()


def test_grpo_passk_refuses_a_group_of_one_naming_it():
    r, mask = _one_token_rows([1.0, 0.0, 2.0])
    with pytest.raises(ValueError, match=r"rollout\.n must be >= 2.*'lonely'"):
        _call("grpo_passk", r, mask, np.array(["pair", "pair", "lonely"], dtype=object))


def test_grpo_passk_rewards_only_the_best_by_its_margin():
    r, mask = _one_token_rows([0.2, 0.9, 0.5, 1.0, 1.0])
    index = np.array(["a", "a", "a", "b", "b"], dtype=object)
    adv, _ = _call("grpo_passk", r, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.0, 0.4, 0.0, 0.0, 0.0], dtype=torch.float64))


def test_reinforce_plus_plus_carries_the_return_through_a_hole():
    r = torch.tensor([[1.0, 2.0, 9.0, 4.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False, True]])
    _, returns = _call("reinforce_plus_plus", r, mask, gamma=0.5)
    # The hole neither discounts nor adds its reward (9): G_1 = 2 + 0.5 * 4, G_0 = 1 + 0.5 * G_1.
    torch.testing.assert_close(returns, torch.tensor([[3.0, 4.0, 0.0, 4.0]], dtype=torch.float64))


def test_remax_returns_pass_through_holes_and_ignore_gamma():
    r = torch.tensor([[1.0, 2.0, 0.0, 4.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False, True]])
    adv, returns = _call("remax", r, mask, baselines=torch.tensor([3.0], dtype=torch.float64), gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([[7.0, 6.0, 0.0, 4.0]], dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor([[4.0, 3.0, 0.0, 1.0]], dtype=torch.float64))


def test_index_must_have_one_id_per_row():
    r, mask = _one_token_rows([1.0, 0.0])
    with pytest.raises(ValueError, match=r"one group id per row"):
        _call("grpo", r, mask, np.array(["a"], dtype=object))
