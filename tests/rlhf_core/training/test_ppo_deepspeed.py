"""The PPO step on real DeepSpeed engines (CPU, tiny model): exact gradient accumulation, the
pre-clip norm and the clip, non-finite steps, the KL loss, exact resume, corrupt checkpoints, LoRA."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rlhf_core.training.batch import MicroBatchPlan, PPOData
from rlhf_core.training.ppo import ActorLoss, aggregate, train_step

pytestmark = pytest.mark.deepspeed

ACTOR_LOSS = ActorLoss(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k3+")
LOSSES = {  # Dr. GRPO's constant divisor: the gradient must not depend on the micro-batch's own width
    "token-mean": ACTOR_LOSS,
    "seq-mean-token-sum-norm": dataclasses.replace(ACTOR_LOSS, loss_agg_mode="seq-mean-token-sum-norm",
                                                   loss_scale_factor=32.0),
    "seq-mean-token-mean": dataclasses.replace(ACTOR_LOSS, loss_agg_mode="seq-mean-token-mean"),
}


def _with_noisy_ref(data: PPOData, seed: int = 1) -> PPOData:
    """A copy whose ref log-probs differ from the old ones, so the KL term has a gradient."""
    rng = np.random.default_rng(seed)
    per_token = dict(data.per_token)
    per_token["ref_log_probs"] = [a + rng.normal(0, 0.3, a.shape).astype(np.float32)
                                  for a in data.per_token["old_log_probs"]]
    return dataclasses.replace(data, per_token=per_token)


def _reference_actor_grads(model_dir, data: PPOData, rows: list[int], loss: ActorLoss):
    """Plain torch: each sequence through the HF model on its own (no packing, no DeepSpeed), the
    whole mini-batch in one (B, T) loss, one backward. Returns ({name: grad}, total norm, policy loss)."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.algos.aggregation import agg_loss
    from rlhf_core.algos.losses import compute_policy_loss
    from rlhf_core.algos.logits import entropy_from_logits
    from rlhf_core.algos.kl import kl_penalty
    from rlhf_core.training.batch import build_micro_batch

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    mb = build_micro_batch(data, [[i] for i in rows], 0)
    T = mb.response_mask.shape[1]
    lps, ents = torch.zeros(len(rows), T), torch.zeros(len(rows), T)
    for b, i in enumerate(rows):
        seq = torch.tensor([data.sequence(i)])
        P, n = len(data.prompt_ids[i]), len(data.response_ids[i])
        logits = model(input_ids=seq).logits[0, P - 1:P - 1 + n] / loss.temperature
        lps[b, :n] = torch.log_softmax(logits, -1).gather(-1, seq[0, P:, None]).squeeze(-1)
        ents[b, :n] = entropy_from_logits(logits)
    t, mask = mb.tensors, mb.response_mask
    mode = dict(loss_agg_mode=loss.loss_agg_mode, loss_scale_factor=loss.loss_scale_factor)
    pg, _ = compute_policy_loss(old_log_prob=t["old_log_probs"], log_prob=lps, advantages=t["advantages"],
                                response_mask=mask, clip_ratio_low=loss.clip_ratio_low,
                                clip_ratio_high=loss.clip_ratio_high, clip_ratio_c=loss.clip_ratio_c, **mode)
    kl = agg_loss(loss_mat=kl_penalty(logprob=lps, ref_logprob=t["ref_log_probs"], kind=loss.kl_loss_type),
                  loss_mask=mask, **mode)
    total = pg - loss.entropy_coeff * agg_loss(loss_mat=ents, loss_mask=mask, **mode) + loss.kl_loss_coef * kl
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, float(torch.nn.utils.get_total_norm(list(grads.values()))), float(pg)


def _max_rel_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    scale = max(float(v.abs().max()) for v in b.values())
    return max(float((a[k] - b[k]).abs().max()) for k in b) / scale


PLANS = {
    "dynamic, one sequence-sized budget": MicroBatchPlan(use_dynamic_bsz=True, token_budget=28, micro_batch_size=1),
    "fixed 1 per micro-batch, unpacked": MicroBatchPlan(use_dynamic_bsz=False, token_budget=0, micro_batch_size=1,
                                                        pack_rows=False),
    "fixed 5 per micro-batch, packed": MicroBatchPlan(use_dynamic_bsz=False, token_budget=0, micro_batch_size=5),
    "one micro-batch": MicroBatchPlan(use_dynamic_bsz=True, token_budget=10_000, micro_batch_size=1),
}


@pytest.mark.parametrize("stage, mode", [(0, "token-mean"), (2, "token-mean"), (3, "token-mean"),
                                         (0, "seq-mean-token-sum-norm"), (2, "seq-mean-token-mean")])
def test_accumulated_gradient_equals_full_batch_gradient_and_clip_is_applied(
        stage, mode, make_engines, ppo_data, tiny_model_dir, dist):
    """Whatever the micro-batching and packing, the gradient after the last backward equals the
    plain-torch full-batch gradient (one (B, T) loss, one backward); the reported norm is that
    gradient's pre-clip norm; the logged losses are the full batch's; and the optimizer received
    the gradient clipped at actor.grad_clip (AdamW's first moment after one step is (1 - β1)·g_clipped)."""
    from rlhf_core.training.engines import full_gradients
    from rlhf_core.training.optim_state import gather_optimizer_state

    data = _with_noisy_ref(ppo_data)
    rows = [0, 3, 4, 7, 8, 9, 11]
    assert max(data.lengths[i] for i in rows) <= 28
    loss = LOSSES[mode]
    ref_grads, ref_norm, ref_pg = _reference_actor_grads(tiny_model_dir, data, rows, loss)
    max_norm = ref_norm / 4
    # lr 1e-30 (config rules want > 0): AdamW moves no weight, so every plan sees the same parameters
    _, actor, _ = make_engines(stage, "actor_rollout_ref.actor.optim.lr=1e-30",
                               "actor_rollout_ref.actor.optim.weight_decay=0",
                               f"actor_rollout_ref.actor.grad_clip={max_norm}")
    for i, (name, plan) in enumerate(PLANS.items()):
        captured = {}
        result = train_step(actor, data, rows, plan, loss, dist, pad_id=0,
                            on_gradients=lambda te: captured.update(full_gradients(te)))
        assert _max_rel_diff(captured, ref_grads) < 1e-5, name
        assert result.metrics["actor/pg_loss"] == pytest.approx(ref_pg, rel=1e-5, abs=1e-7), name
        assert result.metrics["actor/grad_norm"] == pytest.approx(ref_norm, rel=1e-5), name
        assert result.metrics["actor/step_applied"] == 1.0
        if i == 0:
            moments = gather_optimizer_state(actor)
            clipped = {n: 0.1 * g * (max_norm / ref_norm) for n, g in ref_grads.items()}
            got = {n: moments[n + "::exp_avg"] for n in ref_grads}
            assert _max_rel_diff(got, clipped) < 1e-4
    assert result.metrics["actor/micro_batches"] == 1


@pytest.mark.parametrize("stage", [0, 2])
def test_non_finite_gradient_skips_the_step_and_is_counted(stage, make_engines, ppo_data, dist, full_params):
    per_token = dict(ppo_data.per_token)
    per_token["advantages"] = [a.copy() for a in ppo_data.per_token["advantages"]]
    per_token["advantages"][2][0] = np.nan
    bad = dataclasses.replace(ppo_data, per_token=per_token)
    _, actor, _ = make_engines(stage, "actor_rollout_ref.actor.optim.lr=1e-2")
    plan = PLANS["fixed 5 per micro-batch, packed"]
    before = full_params(actor)
    skipped = train_step(actor, bad, [0, 1, 2, 3], plan, ACTOR_LOSS, dist, pad_id=0)
    after = full_params(actor)
    assert skipped.metrics["actor/step_applied"] == 0.0
    assert not np.isfinite(skipped.metrics["actor/grad_norm"])
    assert all(torch.equal(before[n], after[n]) for n in before)
    good = train_step(actor, bad, [4, 5, 6], plan, ACTOR_LOSS, dist, pad_id=0)
    assert good.metrics["actor/step_applied"] == 1.0
    assert any(not torch.equal(after[n], v) for n, v in full_params(actor).items())
    from rlhf_core.training.ppo import PPOOutcome

    summary = aggregate(PPOOutcome(steps={"actor": [skipped.metrics, good.metrics]}))
    assert summary["actor/skipped_steps"] == 1.0 and summary["actor/num_steps"] == 2.0
    assert summary["actor/grad_norm"] == pytest.approx(good.metrics["actor/grad_norm"])


def test_kl_loss_pulls_the_actor_toward_the_reference(make_engines, tiny_model_dir, tmp_path, dist):
    """Actor and reference are different models; with zero advantages only the KL term has a
    gradient, and the measured KL falls step after step."""
    from rlhf_core.data.schemas import ADVANTAGES
    from rlhf_core.io.atomic import atomic_write_parquet
    from rlhf_core.models.tiny import TinyModelSpec, build_tiny_model
    from rlhf_core.training.batch import read_advantages
    from rlhf_core.training.synthetic import synthetic_advantages

    other = build_tiny_model(tmp_path / "other", TinyModelSpec(seed=7))
    table = synthetic_advantages(other, 8, seed=3, advantage_scale=0.0, ref_model_dir=tiny_model_dir)
    atomic_write_parquet(tmp_path / "adv.parquet", table, ADVANTAGES)
    data = read_advantages(tmp_path / "adv.parquet")
    _, actor, _ = make_engines(0, "actor_rollout_ref.actor.optim.lr=2e-4", actor_dir=other)
    loss = ActorLoss(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="low_var_kl+")
    plan = PLANS["one micro-batch"]
    kls = []
    for _ in range(6):
        m = train_step(actor, data, list(range(8)), plan, loss, dist, pad_id=0).metrics
        assert m["actor/pg_loss"] == 0.0
        kls.append(m["actor/kl_loss"])
    assert kls[0] > 0 and all(b < a for a, b in zip(kls, kls[1:])), kls
    assert kls[-1] < 0.2 * kls[0], kls


def test_one_process_at_zero_0_accumulates_without_deepspeeds_all_reduce(make_engines, ppo_data, tiny_model_dir, dist):
    """A group of one has nothing to reduce: the backward skips DeepSpeed's flatten / all-reduce / copy
    back (``TrainEngine.backward``) and the accumulated gradient is still the full-batch one."""
    from rlhf_core.training.engines import full_gradients

    data = _with_noisy_ref(ppo_data)
    rows = [0, 3, 4, 7]
    loss = LOSSES["token-mean"]
    ref_grads, _, _ = _reference_actor_grads(tiny_model_dir, data, rows, loss)
    _, actor, _ = make_engines(0, "actor_rollout_ref.actor.optim.lr=1e-30")
    reductions = []
    real = actor.engine.allreduce_gradients
    actor.engine.allreduce_gradients = lambda *a, **k: reductions.append(1) or real(*a, **k)
    captured = {}
    train_step(actor, data, rows, PLANS["dynamic, one sequence-sized budget"], loss, dist, pad_id=0,
               on_gradients=lambda te: captured.update(full_gradients(te)))
    assert reductions == [] and dist.world_size == 1
    assert _max_rel_diff(captured, ref_grads) < 1e-5


def test_the_update_reports_how_far_the_old_log_probs_are_from_its_own_before_its_first_step(make_engines, ppo_data, dist):
    """actor/old_log_prob_diff_mean/max: |log pi - old| over the first mini-batch before any step (the
    trainer's own log-probs at the weights the old ones stand for); later steps, whose weights moved,
    report none. The table's old log-probs were scored by this very model: ~0 apart; one token moved
    by 0.01 reads 0.01."""
    from rlhf_core.training.ppo import RoleSchedule, RoleSettings, run_ppo

    def first_gap(data):
        _, actor, _ = make_engines(0, "actor_rollout_ref.actor.optim.lr=1e-2")
        how = RoleSettings(ActorLoss(), epochs=1, plan=PLANS["fixed 5 per micro-batch, packed"], mini_batch_size=6,
                           shuffle=False)
        outcome = run_ppo([RoleSchedule(actor, how)], data, seed="0:1", dist=dist, pad_id=0)
        steps = outcome.steps["actor"]
        assert len(steps) == 2 and "actor/old_log_prob_diff_max" not in steps[1]
        metrics = aggregate(outcome)
        return metrics["actor/old_log_prob_diff_mean"], metrics["actor/old_log_prob_diff_max"]

    mean, peak = first_gap(ppo_data)
    assert 0 <= mean <= peak < 1e-5
    moved = dataclasses.replace(ppo_data, per_token=dict(ppo_data.per_token))
    old = [a.copy() for a in moved.per_token["old_log_probs"]]
    old[2][0] += 0.01  # row 2 is in the first mini-batch (rows 0-5)
    moved.per_token["old_log_probs"] = old
    tokens = sum(len(r) for r in moved.response_ids[:6])
    mean, peak = first_gap(moved)
    assert peak == pytest.approx(0.01, abs=1e-5) and mean == pytest.approx(0.01 / tokens, abs=2e-6)
