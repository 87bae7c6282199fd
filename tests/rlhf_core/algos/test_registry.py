"""Every family resolves names, lists valid names on a typo, and accepts plug-ins by decorator."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlhf_core.algos.aggregation import agg_loss
from rlhf_core.algos.kl import get_kl_estimator, kl_penalty
from rlhf_core.algos.registry import (ADV_ESTIMATORS, AGG_MODES, KL_ESTIMATORS, get_adv_estimator, get_agg_fn,
                                      get_kl_controller_cls, get_policy_loss_fn, register_adv_estimator,
                                      register_agg_mode, register_kl_estimator)


@pytest.mark.parametrize(
    "lookup, bad_name, must_list",
    [
        (get_adv_estimator, "gea", ["gae"]),
        (get_policy_loss_fn, "vanila", ["vanilla"]),
        (get_kl_estimator, "k5", ["k1", "k2", "k3", "abs", "k3+", "low_var_kl+"]),
        (get_agg_fn, "token_mean", ["token-mean", "seq-mean-token-sum-norm"]),
        (get_kl_controller_cls, "pid", ["fixed", "adaptive"]),
    ],
)
def test_unknown_names_raise_listing_valid_names(lookup, bad_name, must_list):
    with pytest.raises(ValueError) as info:
        lookup(bad_name)
    message = str(info.value)
    assert bad_name in message and all(name in message for name in must_list)


def test_plugins_register_by_decorator_and_get_straight_through_for_free():
    @register_kl_estimator("test_only_half_k1")
    def half_k1(logprob, ref_logprob):
        return 0.5 * (logprob - ref_logprob)

    @register_agg_mode("test_only_sum")
    def plain_sum(loss_mat, valid, **_):
        return torch.where(valid, loss_mat, torch.zeros(())).sum()

    @register_adv_estimator("test_only_outcome")
    def outcome(*, token_level_rewards, response_mask, **_):
        returns = token_level_rewards.sum(-1, keepdim=True) * response_mask
        return returns, returns

    try:
        x, y = torch.tensor([1.0, 3.0]), torch.tensor([0.0, 1.0])
        assert torch.equal(kl_penalty(logprob=x, ref_logprob=y, kind="test_only_half_k1"), 0.5 * (x - y))
        assert torch.equal(kl_penalty(logprob=x, ref_logprob=y, kind="test_only_half_k1+"), 0.5 * (x - y))
        loss = agg_loss(loss_mat=torch.ones(2, 3), loss_mask=torch.ones(2, 3), loss_agg_mode="test_only_sum")
        assert loss == 6
        assert get_adv_estimator("test_only_outcome") is outcome
        with pytest.raises(ValueError, match="reserved"):
            register_kl_estimator("bad+")
    finally:
        KL_ESTIMATORS.unregister("test_only_half_k1")
        AGG_MODES.unregister("test_only_sum")
        ADV_ESTIMATORS.unregister("test_only_outcome")


def test_a_name_table_is_filled_by_its_providers_at_the_first_lookup():
    """The schema checks names against these tables without importing torch; a lookup imports the
    modules that register the built-in entries, so every built-in is there at once."""
    code = ("import sys; from rlhf_core.algos.registry import POLICY_LOSSES; from rlhf_core.config import schema; "
            "assert 'torch' not in sys.modules, 'torch imported by the name tables or the schema'; "
            "assert 'vanilla' in POLICY_LOSSES and 'gspo' in POLICY_LOSSES; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_module_that_registers_a_built_in_is_a_provider_of_its_table():
    """A module of rlhf_core/algos that registers an entry but is missing from its table's providers
    would leave the name unknown to a config checked before that module happens to be imported."""
    code = ("import importlib, pkgutil, rlhf_core.algos as algos\n"
            "from rlhf_core.algos import registry\n"
            "tables = [t for t in vars(registry).values() if isinstance(t, registry.Registry)]\n"
            "before = {t.kind: t.names() for t in tables}\n"
            "for m in pkgutil.iter_modules(algos.__path__): importlib.import_module(f'rlhf_core.algos.{m.name}')\n"
            "after = {t.kind: t.names() for t in tables}\n"
            "assert len(tables) == 5 and before == after, {k: sorted(set(after[k]) - set(before[k])) for k in after}")
    subprocess.run([sys.executable, "-c", code], check=True)
