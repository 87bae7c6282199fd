"""The lr schedule against a transcription of verl's (verl/utils/torch_functional.py
get_constant_schedule_with_warmup / get_cosine_schedule_with_warmup, built in fsdp_workers and
stepped once per update call), read the way verl logs actor/lr: before the step of each iteration."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.config import load_config, resolve
from rlhf_core.training.engines import lr_schedule
from rlhf_core.training.rank_update import lr_schedule_for


def _verl_lambda(kind, warmup, total, min_lr_ratio, num_cycles):
    """verl's lr_lambda, restated from its formulas (init_lr_ratio = 0)."""
    def constant(step):
        return float(step) / float(max(1.0, warmup)) if step < warmup else 1.0

    def cosine(step):
        if step < warmup:
            return float(step) / float(max(1, warmup))
        progress = float(step - warmup) / float(max(1, total - warmup))
        coef, intercept = (1 - min_lr_ratio) * 0.5, (1 + min_lr_ratio) * 0.5
        return max(min_lr_ratio, math.cos(math.pi * float(num_cycles) * 2.0 * progress) * coef + intercept)

    return constant if kind == "constant" else cosine


def _verl_lrs(base, kind, warmup, total, min_lr_ratio=0.0, num_cycles=0.5):
    """actor/lr of iterations 1..total in verl: get_last_lr() of a LambdaLR, then scheduler.step()."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _verl_lambda(kind, warmup, total, min_lr_ratio, num_cycles))
    lrs = []
    for _ in range(total):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return lrs


SETTINGS = [  # (overrides, total iterations)
    ([], 5),  # verl's default: constant, no warm-up
    (["actor_rollout_ref.actor.optim.lr_warmup_steps=3"], 8),
    (["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.25"], 12),
    (["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"], 10),
    (["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
      "actor_rollout_ref.actor.optim.min_lr_ratio=0.1"], 9),
    (["actor_rollout_ref.actor.optim.warmup_style=cosine", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
      "actor_rollout_ref.actor.optim.num_cycles=1.5", "actor_rollout_ref.actor.optim.min_lr_ratio=0.2"], 20),
    (["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "actor_rollout_ref.actor.optim.lr_warmup_steps=4"], 4),
]


@pytest.mark.parametrize("overrides, total", SETTINGS)
def test_lr_of_each_iteration_is_verls(overrides, total):
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=3e-4", *overrides])
    optim = cfg.actor_rollout_ref.actor.optim
    factor = lr_schedule_for(optim, total)
    ours = [3e-4 * factor(k - 1) for k in range(1, total + 1)]  # iteration k trains at step k - 1
    want = _verl_lrs(3e-4, resolve.scheduler_type(optim), resolve.warmup_steps(optim, total), total,
                     optim.min_lr_ratio, optim.num_cycles)
    assert ours == pytest.approx(want, rel=1e-12, abs=0)


def test_warm_up_starts_at_zero_and_an_unknown_schedule_is_refused():
    assert lr_schedule("constant", 4, 10)(0) == 0.0  # verl: the first step of a warm-up trains at lr 0
    assert lr_schedule("cosine", 0, 10, min_lr_ratio=0.3)(10) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="constant"):
        lr_schedule("linear", 0, 10)
