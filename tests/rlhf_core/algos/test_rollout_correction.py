"""rollout_correction's edge cases that verl's own code does not survive (the conformance step
compares everything else with verl 0.9.1 itself)."""

from __future__ import annotations

import torch

from rlhf_core.algos.correction_specs import RolloutCorrection

from rlhf_core.algos.rollout_correction import correct_rollout


def test_icepop_cutting_every_weight_gives_an_effective_sample_size_of_zero():
    """verl divides by zero there (ZeroDivisionError, docs/verl.md); no weight left means no
    effective sample, and every other metric stays finite."""
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    rollout = old - 3.0  # every ratio e^3 ~ 20, above the IcePop window [0.5, 5]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    for level in ("token", "sequence"):
        weights, kept, metrics = correct_rollout(
            old_log_prob=old, rollout_log_prob=rollout, response_mask=mask,
            settings=RolloutCorrection(rollout_is=level, rollout_is_threshold="0.5_5.0"))
        assert (weights == 0).all() and torch.equal(kept, mask)
        assert metrics["rollout_corr/rollout_is_eff_sample_size"] == 0
        assert all(torch.isfinite(v).all() for v in metrics.values()), level
