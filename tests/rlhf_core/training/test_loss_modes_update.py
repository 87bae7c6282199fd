"""Every policy-loss mode trains through the real update step (DeepSpeed on CPU, tiny model): the
gradient after the last backward equals plain torch's gradient of that mode's loss on the whole
mini-batch, with the mode's knobs from ``actor.policy_loss`` — so ActorLoss hands each mode what
it names, and micro-batch shares add up (clip_cov / kl_cov pick their tokens per call, so they are
checked on one micro-batch)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rlhf_core.algos.registry import POLICY_LOSSES, accepted_kwargs, get_policy_loss_fn
from rlhf_core.algos.correction_specs import RolloutCorrection
from rlhf_core.training.batch import MicroBatchPlan, build_micro_batch, split_mini_batch
from rlhf_core.training.ppo import ActorLoss, train_step

pytestmark = pytest.mark.deepspeed

KNOBS = (("clip_cov_ratio", 0.2), ("clip_cov_lb", -5.0), ("clip_cov_ub", 5.0), ("kl_cov_ratio", 0.2),
         ("ppo_kl_coef", 0.1), ("dro_beta", 0.5), ("tau_pos", 1.0), ("tau_neg", 1.05))
"""Large ratios so the covariance modes select tokens in a 7-sequence batch."""
BYPASS = RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0, bypass_mode=True, loss_type="reinforce")
"""bypass_mode's settings (algorithm.rollout_correction): the reinforce loss with token weights."""
ONE = MicroBatchPlan(use_dynamic_bsz=True, token_budget=10_000, micro_batch_size=1)
EACH = MicroBatchPlan(use_dynamic_bsz=False, token_budget=0, micro_batch_size=1, pack_rows=False)
PER_CALL = {"clip_cov", "kl_cov"}


def _off_policy(data, seed: int = 2):
    """Old log-probs moved away from the model's own, so no |log ratio| sits at its kink at 0 (where
    plain torch and the engine, 1e-7 apart, would take opposite sides)."""
    rng = np.random.default_rng(seed)
    per_token = dict(data.per_token)
    per_token["old_log_probs"] = [a + rng.normal(0, 0.1, a.shape).astype(np.float32)
                                  for a in data.per_token["old_log_probs"]]
    return dataclasses.replace(data, per_token=per_token)


def _plain_torch_grads(model_dir, data, rows, loss: ActorLoss):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    mb = build_micro_batch(data, [[i] for i in rows], 0)
    lps = torch.zeros(mb.response_mask.shape)
    for b, i in enumerate(rows):
        seq = torch.tensor([data.sequence(i)])
        P, n = len(data.prompt_ids[i]), len(data.response_ids[i])
        logits = model(input_ids=seq).logits[0, P - 1:P - 1 + n] / loss.temperature
        lps[b, :n] = torch.log_softmax(logits, -1).gather(-1, seq[0, P:, None]).squeeze(-1)
    fn = get_policy_loss_fn(loss.loss_mode)
    t = mb.tensors
    pg, _ = fn(**accepted_kwargs(fn, dict(
        old_log_prob=t["old_log_probs"], log_prob=lps, advantages=t["advantages"], response_mask=mb.response_mask,
        clip_ratio_low=loss.clip_ratio_low, clip_ratio_high=loss.clip_ratio_high, clip_ratio_c=loss.clip_ratio_c,
        loss_agg_mode=loss.loss_agg_mode, rollout_is_weights=t.get("rollout_is_weights"),
        rollout_correction=loss.rollout_correction, **dict(loss.loss_mode_settings))))
    pg.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}, float(pg)


@pytest.mark.parametrize("mode", sorted(set(POLICY_LOSSES.names()) - {"vanilla"}))
def test_each_loss_mode_trains_with_its_own_loss(mode, make_engines, ppo_data, tiny_model_dir, dist):
    from rlhf_core.training.engines import full_gradients

    rows = [0, 3, 4, 7, 8, 9, 11]
    ppo_data = _off_policy(ppo_data)
    loss = dataclasses.replace(ActorLoss(), loss_mode=mode, loss_mode_settings=KNOBS,
                               rollout_correction=BYPASS if mode == "bypass_mode" else None)
    # the covariance modes rank (clip_cov: draw among) tokens in the order the micro-batch holds them
    (packed_rows,) = split_mini_batch(ppo_data.lengths, rows, ONE)
    in_order = [i for row in packed_rows for i in row] if mode in PER_CALL else rows
    torch.manual_seed(0)  # clip_cov draws its tokens from torch's generator
    ref, ref_pg = _plain_torch_grads(tiny_model_dir, ppo_data, in_order, loss)
    _, actor, _ = make_engines(0, "actor_rollout_ref.actor.optim.lr=1e-30", "actor_rollout_ref.actor.grad_clip=1e9")
    for name, plan in {"one micro-batch": ONE, "one sequence each": EACH}.items():
        if mode in PER_CALL and plan is EACH:
            continue
        captured = {}
        torch.manual_seed(0)
        result = train_step(actor, ppo_data, rows, plan, loss, dist, pad_id=0,
                            on_gradients=lambda te: captured.update(full_gradients(te)))
        scale = max(float(v.abs().max()) for v in ref.values())
        assert scale > 0, "the mode's loss has no gradient on this batch: the check would be empty"
        assert max(float((captured[k] - ref[k]).abs().max()) for k in ref) / scale < 1e-5, name
        assert result.metrics["actor/pg_loss"] == pytest.approx(ref_pg, rel=1e-5, abs=1e-7), name



def test_rollout_correction_columns_weight_and_mask_the_update(make_engines, ppo_data, tiny_model_dir, dist):
    """An advantages table with rollout correction's columns (importance weights, rejected tokens)
    trains on exactly plain torch's gradient of the weighted loss over the kept tokens, on any
    micro-batching; the rejected tokens leave the mini-batch's token count."""
    from rlhf_core.training.engines import full_gradients

    rng = np.random.default_rng(5)
    data = _off_policy(ppo_data)
    lengths = [len(r) for r in data.response_ids]
    weights = [rng.uniform(0.5, 2.0, n).astype(np.float32) for n in lengths]
    kept = [rng.uniform(size=n) > 0.3 for n in lengths]
    data = dataclasses.replace(data, per_token={**data.per_token, "rollout_is_weights": weights}, kept=kept)
    rows = [0, 3, 4, 7, 8, 9, 11]
    loss = ActorLoss()
    ref, ref_pg = _plain_torch_grads(tiny_model_dir, data, rows, loss)
    _, actor, _ = make_engines(0, "actor_rollout_ref.actor.optim.lr=1e-30", "actor_rollout_ref.actor.grad_clip=1e9")
    for name, plan in {"one micro-batch": ONE, "one sequence each": EACH}.items():
        captured = {}
        result = train_step(actor, data, rows, plan, loss, dist, pad_id=0,
                            on_gradients=lambda te: captured.update(full_gradients(te)))
        scale = max(float(v.abs().max()) for v in ref.values())
        assert max(float((captured[k] - ref[k]).abs().max()) for k in ref) / scale < 1e-5, name
        assert result.metrics["actor/pg_loss"] == pytest.approx(ref_pg, rel=1e-5, abs=1e-7), name
