"""Every family resolves names, lists valid names on a typo, and accepts plug-ins by decorator."""

from __future__ import annotations

import pytest
import torch

import rlhf_core.algos as algos


@pytest.mark.parametrize(
    "lookup, bad_name, must_list",
    [
        (algos.get_adv_estimator, "gea", ["gae"]),
        (algos.get_policy_loss_fn, "vanila", ["vanilla"]),
        (algos.get_kl_estimator, "k5", ["k1", "k2", "k3", "abs", "k3+", "low_var_kl+"]),
        (algos.get_agg_fn, "token_mean", ["token-mean", "seq-mean-token-sum-norm"]),
        (algos.get_kl_controller_cls, "pid", ["fixed", "adaptive"]),
    ],
)
def test_unknown_names_raise_listing_valid_names(lookup, bad_name, must_list):
    with pytest.raises(ValueError) as info:
        lookup(bad_name)
    message = str(info.value)
    assert bad_name in message and all(name in message for name in must_list)


def test_plugins_register_by_decorator_and_get_straight_through_for_free():
    @algos.register_kl_estimator("test_only_half_k1")
    def half_k1(logprob, ref_logprob):
        return 0.5 * (logprob - ref_logprob)

    @algos.register_agg_mode("test_only_sum")
    def plain_sum(loss_mat, valid, **_):
        return torch.where(valid, loss_mat, torch.zeros(())).sum()

    @algos.register_adv_estimator("test_only_outcome")
    def outcome(*, token_level_rewards, response_mask, **_):
        returns = token_level_rewards.sum(-1, keepdim=True) * response_mask
        return returns, returns

    try:
        x, y = torch.tensor([1.0, 3.0]), torch.tensor([0.0, 1.0])
        assert torch.equal(algos.kl_penalty(logprob=x, ref_logprob=y, kind="test_only_half_k1"), 0.5 * (x - y))
        assert torch.equal(algos.kl_penalty(logprob=x, ref_logprob=y, kind="test_only_half_k1+"), 0.5 * (x - y))
        loss = algos.agg_loss(loss_mat=torch.ones(2, 3), loss_mask=torch.ones(2, 3), loss_agg_mode="test_only_sum")
        assert loss == 6
        assert algos.get_adv_estimator("test_only_outcome") is outcome
        with pytest.raises(ValueError, match="reserved"):
            algos.register_kl_estimator("bad+")
    finally:
        algos.KL_ESTIMATORS.unregister("test_only_half_k1")
        algos.AGG_MODES.unregister("test_only_sum")
        algos.ADV_ESTIMATORS.unregister("test_only_outcome")
