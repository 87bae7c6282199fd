"""Conformance with verl 0.9.1 itself: every quantity the project registers under a verl name,
computed by our code as our trainer calls it and by verl's own functions as verl's trainer calls
them (``verl_side.py``, in verl's environment), equal within 1e-6 in float64; and the composition,
verl's trainer from a scored batch to its advantages against the gae stage on the same scored
table, equal within float32's reach. A comparison relaxed anywhere is a deliberate difference that
docs/verl.md names (``DELIBERATE``).

Run it with ``make test-verl`` (builds verl's environment, ~3 min the first time). The transcription
tests under tests/rlhf_core/algos are fast unit tests; this step is the authority.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf_core.algos.registry import ADV_ESTIMATORS, AGG_MODES, KL_CONTROLLERS, POLICY_LOSSES
from rlhf_core.algos.aggregation import agg_loss
from rlhf_core.algos.kl import kl_estimator_names, kl_penalty
from rlhf_core.algos.controllers import make_kl_controller
from rlhf_core.algos.correction_specs import RolloutCorrection
from rlhf_core.algos.rollout_correction import correct_rollout
from rlhf_core.config import load_config
from rlhf_core.data.schemas import SCORED
from rlhf_core.io.atomic import atomic_write_parquet
from rlhf_core.rewards import get_reward_fn
from rlhf_core.rewards.overlong import shape_scores
from rlhf_core.rewards.registry import GSM8K_SOURCES, registered_sources
from rlhf_core.run.layout import RunDir
from rlhf_core.stages.gae import run_gae
from rlhf_core.training.advantages import (AdvantageSettings, ScoredBatch, adv_estimator, estimator_inputs,
                                          masked_advantages, shaped_rewards)
from rlhf_core.training.rank_update import actor_loss_from_config, critic_loss_from_config

from . import cases as C

TOL = dict(rtol=1e-6, atol=1e-6)
TOL32 = dict(rtol=5e-5, atol=5e-5)
"""The trainer-level path runs in float32 on both sides, as both trainers hold their tensors; the two
sides order their float32 reductions differently (a semantic difference is orders larger)."""
TOL32_VECTORIZED = dict(rtol=5e-4, atol=5e-4)
"""grpo_vectorized's trainer-level tolerance (DELIBERATE["single-pass variance"])."""

def _close(ours, theirs, what: str, tol=TOL) -> None:
    ours = torch.as_tensor(ours, dtype=torch.float64)
    theirs = torch.as_tensor(theirs, dtype=torch.float64)
    torch.testing.assert_close(ours, theirs, **tol, msg=lambda m: f"{what}: {m}")


def _ids(builder) -> list[str]:
    return [c["id"] for c in builder()]


# ---------------------------------------------------------------------------------------------
# every verl-named entry is compared
# ---------------------------------------------------------------------------------------------


def _registered() -> dict[str, set[str]]:
    return {
        "loss aggregation mode": set(AGG_MODES.names()), "policy loss": set(POLICY_LOSSES.names()),
        "advantage estimator": set(ADV_ESTIMATORS.names()), "KL estimator": set(kl_estimator_names()),
        "KL controller": set(KL_CONTROLLERS.names()), "reward source": set(registered_sources()),
    }


def test_every_registered_name_is_compared_or_listed_as_ours():
    """Each registered name has cases, or is in ``cases.OUR_OWN`` (with the reason), never both; an
    entry there names something registered."""
    compared = {
        "loss aggregation mode": {c["mode"] for c in C.agg_cases()},
        "policy loss": {c["mode"] for c in C.policy_loss_cases()},
        "advantage estimator": {c["name"] for c in C.estimator_cases()} & {c["algorithm"]["adv_estimator"]
                                                                           for c in C.trainer_cases()},
        "KL estimator": {c["kind"] for c in C.kl_cases()},
        "KL controller": {c["type"] for c in C.kl_controller_cases()} & {c["type"] for c in C.kl_reward_cases()},
        "reward source": set(C.REWARD_ROWS) | {f"{p}*" for p in ("aime",) if any(s.startswith(p) for s in C.REWARD_ROWS)},
    }
    assert set(C.OUR_OWN) <= set(compared), f"cases.OUR_OWN: unknown kind(s) {sorted(set(C.OUR_OWN) - set(compared))}"
    for kind, names in _registered().items():
        ours = set(C.OUR_OWN.get(kind, {}))
        unchecked = names - compared[kind] - ours
        assert not unchecked, (f"registered {kind}(s) {sorted(unchecked)} are compared with nothing: add verl cases "
                               f"(tests/conformance/cases.py) or list them in cases.OUR_OWN with the reason")
        assert not compared[kind] & ours, f"{kind}(s) {sorted(compared[kind] & ours)}: listed as ours and compared"
        assert ours <= names, f"cases.OUR_OWN lists {kind}(s) {sorted(ours - names)} that nothing registers"
        assert all(str(reason).strip() for reason in C.OUR_OWN.get(kind, {}).values()), \
            f"cases.OUR_OWN[{kind!r}]: give each name its reason"
    assert set(GSM8K_SOURCES) - set(C.OUR_OWN["reward source"]) == {"openai/gsm8k"}


def test_our_own_names_are_not_verls(verl):
    """A name verl has means verl's behaviour: one listed as ours must be unknown to verl 0.9.1."""
    _, theirs = verl("names/our_own")
    known = sorted(f"{kind} {name}" for kind, names in theirs["known"].items() for name, has in names.items() if has)
    assert not known, (f"verl 0.9.1 has {', '.join(known)}: a verl name must mean verl's behaviour; take it out of "
                       f"cases.OUR_OWN so the step compares it, or register ours under another name")


# ---------------------------------------------------------------------------------------------
# losses
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", _ids(C.agg_cases))
def test_aggregation(verl, case_id):
    case, theirs = verl(case_id)
    leaf = case["loss"].clone().requires_grad_(True)
    mask = case["mask"]
    if case["parts"] is None:
        total = agg_loss(loss_mat=leaf, loss_mask=mask, loss_agg_mode=case["mode"], loss_scale_factor=case["scale"])
    else:
        total = sum(agg_loss(loss_mat=leaf[p], loss_mask=mask[p], loss_agg_mode=case["mode"],
                             global_num_tokens=int(mask.sum()), global_num_seqs=mask.shape[0],
                             loss_scale_factor=case["scale"]) for p in case["parts"])
    (grad,) = torch.autograd.grad(total, leaf)
    _close(total, theirs["value"], f"{case_id} loss")
    _close(grad, theirs["grad"], f"{case_id} gradient")


def _actor_overrides(case) -> list[str]:
    k, pl = case["knobs"], case["knobs"]["policy_loss"]
    a = "actor_rollout_ref.actor."
    out = [f"{a}clip_ratio_low={k['clip_ratio_low']}", f"{a}clip_ratio_high={k['clip_ratio_high']}",
           f"{a}clip_ratio_c={k['clip_ratio_c']}", f"{a}tau_pos={k['tau_pos']}", f"{a}tau_neg={k['tau_neg']}",
           f"{a}loss_agg_mode={case['agg']}", f"{a}loss_scale_factor={case['scale'] or 'null'}"]
    out += [f"{a}policy_loss.{name}={value}" for name, value in pl.items()]
    correction = k.get("rollout_correction")
    if case["mode"] == "bypass_mode":
        out += [f"algorithm.rollout_correction.{name}={'null' if v is None else v}" for name, v in correction.items()]
    else:
        out.append(f"{a}policy_loss.loss_mode={case['mode']}")
    return out


@pytest.mark.parametrize("case_id", _ids(C.policy_loss_cases))
def test_policy_loss(verl, case_id):
    """Through the update's own loss object (built from the config as the update builds it), per
    micro-batch with the mini-batch's global counts; values, gradient and every metric verl logs."""
    case, theirs = verl.raw(case_id)
    if "error" in theirs and theirs["error"].startswith("ZeroDivisionError") and case["mode"] == "bypass_mode":
        _all_weights_cut(case)  # DELIBERATE["no effective sample"]
        return
    case, theirs = verl(case_id)
    loss_fn = actor_loss_from_config(load_config(overrides=_actor_overrides(case)))
    mask = case["mask"]
    leaf = case["log_prob"].clone().requires_grad_(True)
    total, metrics = 0.0, []
    for p in case["parts"]:
        torch.manual_seed(case["seed"])
        tensors = {"old_log_probs": case["old_log_prob"][p], "advantages": case["advantages"][p]}
        if case["weights"] is not None:
            tensors["rollout_is_weights"] = case["weights"][p]
        loss, m = loss_fn.policy_loss(log_prob=leaf[p], tensors=tensors, mask=mask[p], n_tok=int(mask.sum()),
                                      n_seq=mask.shape[0])
        total = total + loss
        metrics.append(m)
    (grad,) = torch.autograd.grad(total, leaf)
    _close(total, theirs["value"], f"{case_id} loss")
    _close(grad, theirs["grad"], f"{case_id} gradient")
    for part, (ours, verls) in enumerate(zip(metrics, theirs["metrics"])):
        ours = {(k if "/" in k else f"actor/{k}"): float(v) for k, v in ours.items()}
        for name, value in verls.items():
            assert name in ours, f"{case_id} micro-batch {part}: verl logs {name}, we do not"
            _close(ours[name], value, f"{case_id} micro-batch {part} {name}")
        for name in set(ours) - set(verls):  # a quantity verl does not log for this mode is 0 here
            assert ours[name] == 0.0, f"{case_id}: {name}={ours[name]} where verl logs nothing"


def _all_weights_cut(case) -> None:
    """verl's bypass_mode raised ZeroDivisionError: a micro-batch whose IS weights IcePop cut to 0
    (its effective sample size divides by zero). Ours gives that micro-batch an effective sample
    size of 0, and a finite loss and gradient."""
    loss_fn = actor_loss_from_config(load_config(overrides=_actor_overrides(case)))
    mask, leaf = case["mask"], case["log_prob"].clone().requires_grad_(True)
    cut = []
    for p in case["parts"]:
        loss, m = loss_fn.policy_loss(log_prob=leaf[p], tensors={"old_log_probs": case["old_log_prob"][p],
                                                                  "advantages": case["advantages"][p]},
                                      mask=mask[p], n_tok=int(mask.sum()), n_seq=mask.shape[0])
        (grad,) = torch.autograd.grad(loss, leaf)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), case["id"]
        cut.append(float(m["rollout_corr/rollout_is_eff_sample_size"]) == 0.0)
    assert any(cut), f"{case['id']}: verl divided by zero, but no micro-batch has all its weights cut here"


@pytest.mark.parametrize("case_id", _ids(C.value_loss_cases))
def test_value_loss(verl, case_id):
    case, theirs = verl(case_id)
    cfg = load_config(overrides=[f"critic.loss_agg_mode={case['agg']}", f"critic.cliprange_value={case['cliprange']}"])
    loss_fn = critic_loss_from_config(cfg)
    if case["scale"] is not None:
        loss_fn = type(loss_fn)(cliprange_value=loss_fn.cliprange_value, loss_agg_mode=loss_fn.loss_agg_mode,
                                loss_scale_factor=case["scale"])
    mask = case["mask"]
    leaf = case["vpreds"].clone().requires_grad_(True)
    total, clipfracs = 0.0, []
    for p in case["parts"]:
        loss, m = loss_fn.value_loss(vpreds=leaf[p], tensors={"values": case["values"][p], "returns": case["returns"][p]},
                                     mask=mask[p], n_tok=int(mask.sum()), n_seq=mask.shape[0])
        total = total + loss
        clipfracs.append(float(m["vf_clipfrac"]))
    (grad,) = torch.autograd.grad(total, leaf)
    _close(total, theirs["value"], f"{case_id} loss")
    _close(grad, theirs["grad"], f"{case_id} gradient")
    _close(clipfracs, theirs["clipfrac"], f"{case_id} vf_clipfrac per micro-batch")


# ---------------------------------------------------------------------------------------------
# advantages and the KL in the reward
# ---------------------------------------------------------------------------------------------


def _scored_batch(case) -> ScoredBatch:
    mask = case["response_mask"] != 0
    components = {k: torch.tensor(list(v), dtype=torch.float64) for k, v in case["components"].items()}
    return ScoredBatch(scores=case["token_level_rewards"].sum(-1), old_log_probs=case["old_log_probs"],
                       ref_log_probs=case["old_log_probs"], values=case["values"], response_mask=mask,
                       lengths=mask.sum(-1).numpy(), index=case["index"], reward_baselines=case["reward_baselines"],
                       sum_pi_squared=case["sum_pi_squared"], rollout_is_weights=case["rollout_is_weights"],
                       reward_components=components or None)


@pytest.mark.parametrize("case_id", _ids(C.estimator_cases))
def test_estimator(verl, case_id):
    """The gae stage's estimator call (every input offered, GAE whitened as verl's is) against verl's
    ray_trainer.compute_advantage on a DataProto."""
    case, theirs = verl(case_id)
    settings = AdvantageSettings(adv_estimator=case["name"], gamma=case["gamma"], lam=case["lam"], norm_adv=True,
                                 norm_adv_by_std_in_grpo=case["norm_by_std"],
                                 gdpo_reward_keys=tuple(case["gdpo_keys"]) if case["gdpo_keys"] else None,
                                 gdpo_reward_weights=tuple(case["gdpo_weights"]) if case["gdpo_weights"] else None)
    batch, estimator = _scored_batch(case), adv_estimator(settings.adv_estimator)
    # the three calls compute_advantages makes between the shaped rewards and the advantages table
    advantages, returns = estimator(**estimator_inputs(estimator, batch, case["token_level_rewards"], settings))
    advantages, returns = masked_advantages(advantages, returns, batch, settings)
    mask = case["response_mask"] != 0
    # verl may leave junk at masked positions (e.g. the running return); ours are 0 there by contract
    _close(advantages[mask], theirs["advantages"][mask], f"{case_id} advantages")
    _close(returns[mask], theirs["returns"][mask], f"{case_id} returns")


@pytest.mark.parametrize("case_id", _ids(C.kl_cases))
def test_kl_estimator_value_and_gradient(verl, case_id):
    case, theirs = verl(case_id)
    leaf = case["logprob"].clone().requires_grad_(True)
    value = kl_penalty(logprob=leaf, ref_logprob=case["ref_logprob"], kind=case["kind"])
    (grad,) = torch.autograd.grad(value.sum(), leaf)
    _close(value, theirs["value"], f"{case_id} value")
    _close(grad, theirs["grad"], f"{case_id} gradient")


@pytest.mark.parametrize("case_id", _ids(C.kl_controller_cases))
def test_kl_controller(verl, case_id):
    case, theirs = verl(case_id)
    ctrl = make_kl_controller(case["type"], case["kl_coef"], case["target_kl"], case["horizon"])
    values = []
    for current_kl, n_steps in case["updates"]:
        ctrl.update(current_kl=current_kl, n_steps=n_steps)
        values.append(ctrl.value)
    _close(values, theirs["values"], f"{case_id} coefficients")


@pytest.mark.parametrize("case_id", _ids(C.kl_reward_cases))
def test_kl_in_reward(verl, case_id):
    """The gae stage's shaping (score on the last token minus beta * KL) and its controller step
    against ray_trainer.apply_kl_penalty."""
    case, theirs = verl(case_id)
    mask = case["response_mask"] != 0
    zeros = torch.zeros_like(case["old_log_probs"])
    batch = ScoredBatch(scores=case["scores"], old_log_probs=case["old_log_probs"], ref_log_probs=case["ref_log_prob"],
                        values=zeros, response_mask=mask, lengths=mask.sum(-1).numpy(),
                        index=np.arange(mask.shape[0]).astype(str))
    ctrl = make_kl_controller(case["type"], case["kl_coef"], case["target_kl"], case["horizon"])
    rewards, kl_mean = shaped_rewards(batch, kl_coef=ctrl.value, kind=case["kind"])
    coef = ctrl.value
    ctrl.update(current_kl=kl_mean, n_steps=mask.shape[0])
    _close(rewards, theirs["token_level_rewards"], f"{case_id} token_level_rewards")
    _close(kl_mean, theirs["metrics"]["actor/reward_kl_penalty"], f"{case_id} actor/reward_kl_penalty")
    _close(coef, theirs["metrics"]["actor/reward_kl_penalty_coeff"], f"{case_id} actor/reward_kl_penalty_coeff")
    _close(ctrl.value, theirs["next_coef"], f"{case_id} next coefficient")


# ---------------------------------------------------------------------------------------------
# rollout correction
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", _ids(C.rollout_correction_cases))
def test_rollout_correction(verl, case_id):
    case, theirs = verl(case_id)
    settings = RolloutCorrection(**case["settings"])
    weights, mask, metrics = correct_rollout(old_log_prob=case["old_log_prob"], rollout_log_prob=case["rollout_log_prob"],
                                             response_mask=case["response_mask"], settings=settings)
    assert (weights is None) == (theirs["weights"] is None), f"{case_id}: weights present on one side only"
    if weights is not None:
        _close(weights, theirs["weights"], f"{case_id} rollout_is_weights")
    _close(mask, theirs["mask"], f"{case_id} response_mask")
    assert set(metrics) == set(theirs["metrics"]), (f"{case_id}: metric names differ: ours only "
                                                    f"{sorted(set(metrics) - set(theirs['metrics']))}, verl only "
                                                    f"{sorted(set(theirs['metrics']) - set(metrics))}")
    for name, value in theirs["metrics"].items():
        _close(float(metrics[name]), value, f"{case_id} {name}")


# ---------------------------------------------------------------------------------------------
# the trainer's whole advantage path, through the gae stage
# ---------------------------------------------------------------------------------------------

DELIBERATE = {
    "masked positions": ("0 at every masked position", "verl leaves values at masked positions for some "
                         "estimators (remax's and gae's returns, opo's NaN for a group without valid tokens); "
                         "the comparison is at the tokens verl's final response_mask keeps, ours must be 0 "
                         "elsewhere"),
    "no effective sample": ("ZeroDivisionError", "verl's IS metrics divide by zero when IcePop cuts every weight "
                            "of a (micro-)batch, and the step fails; ours reports an effective sample size of 0 and "
                            "trains on"),
    "single-pass variance": ("single-pass group variance", "verl's grpo_vectorized takes the group variance as "
                             "(sum of squares - squared sum / n) / (n - 1) in float32, which cancels digits on a "
                             "group of close scores; ours is the two-pass variance of grpo. In float64 (the "
                             "estimator cases) they agree within 1e-6; in float32 within TOL32_VECTORIZED"),
}
"""The comparisons the trainer-level step relaxes, each with the words of docs/verl.md that name it
as a deliberate difference (checked below): a difference that is not named there fails the step."""

NOT_THE_GAE_STAGES = ("critic/score/", "response_length", "prompt_length/", "response/aborted_ratio")
"""verl's compute_data_metrics also reports these; here the rollout and score stages do (their
tests), not the gae stage."""


def _override(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def _algorithm_overrides(algorithm: dict) -> list[str]:
    """verl's algorithm.* keys of the case as `rlhf run` overrides (verl's command line)."""
    out = []
    for key, value in algorithm.items():
        if isinstance(value, dict):
            out += [f"algorithm.{key}.{k}={_override(v)}" for k, v in value.items()]
        else:
            out.append(f"algorithm.{key}={_override(value)}")
    return out


def _scored_table(case) -> pa.Table:
    """The case's rows as the score stage writes them (float32 lists, one entry per response token)."""
    rows = []
    for i, n in enumerate(case["lengths"]):
        rows.append(dict(prompt_id=f"p-{case['uid'][i]}", sample_index=i, iteration=1, data_source="openai/gsm8k",
                         ground_truth="7", prompt_token_ids=case["prompt_token_ids"][i], response_text="x" * n,
                         response_token_ids=list(range(7, 7 + n)), response_length=n, finish_reason="stop",
                         engine="hf", sampling_seed=0, reward_source="openai/gsm8k", extra_info="{}",
                         uid=case["uid"][i], rollout_log_probs=case["rollout_log_probs"][i],
                         reward=case["reward"][i], reward_extra=json.dumps(case["reward_extra"][i]),
                         old_log_probs=case["old_log_probs"][i], ref_log_probs=case["ref_log_probs"][i],
                         values=case["values"][i], reward_baseline=case["reward_baseline"][i],
                         sum_pi_squared=case["sum_pi_squared"][i]))
    return pa.Table.from_pylist(rows, schema=SCORED)


@pytest.mark.parametrize("case_id", _ids(C.trainer_cases))
def test_trainer_advantage_path(verl, case_id, tmp_path):
    """verl 0.9.1's trainer (KL in the reward, rollout correction, compute_advantage, then
    compute_data_metrics) against the gae stage on the same scored table, configured by the same
    algorithm.* keys: token rewards, the rejection mask, the IS weights, advantages and returns at
    every token verl's mask keeps, every rollout_corr/ and critic/ metric, the KL metrics and the
    controller's next coefficient."""
    case, theirs = verl(case_id)
    run = RunDir(tmp_path / "run")
    atomic_write_parquet(run.scored(1), _scored_table(case), schema=SCORED)
    overrides = _algorithm_overrides(case["algorithm"]) + ["actor_rollout_ref.rollout.n=5"]  # grpo_passk needs >= 2
    result = run_gae(load_config(overrides=overrides), run, 1)
    rows = pq.read_table(run.advantages(1)).to_pylist()
    kept_by_verl = theirs["response_mask"] != 0
    tol = TOL32_VECTORIZED if case["algorithm"]["adv_estimator"] == "grpo_vectorized" else TOL32
    for i, (row, n) in enumerate(zip(rows, case["lengths"])):
        where = f"{case_id} row {i}"
        kept = kept_by_verl[i, :n]
        assert not kept_by_verl[i, n:].any(), f"{where}: verl keeps a padding position"
        assert (row["response_mask"] or [True] * n) == kept.tolist(), f"{where}: response_mask"
        _close(row["token_level_rewards"], theirs["token_level_rewards"][i, :n], f"{where} token_level_rewards", TOL32)
        if theirs["rollout_is_weights"] is None:
            assert row["rollout_is_weights"] is None, f"{where}: weights where verl has none"
        else:
            _close(row["rollout_is_weights"], theirs["rollout_is_weights"][i, :n], f"{where} rollout_is_weights",
                   TOL32)
        for name in ("advantages", "returns"):  # DELIBERATE["masked positions"]
            ours = torch.tensor(row[name], dtype=torch.float64)
            _close(ours[kept], theirs[name][i, :n][kept], f"{where} {name}", tol)
            assert (ours[~kept] == 0).all(), f"{where}: {name} not 0 at a masked position"
    metrics = result.metrics
    for name, value in theirs["metrics"].items():
        if name.startswith(NOT_THE_GAE_STAGES):
            continue
        assert name in metrics, f"{case_id}: verl reports {name}, the gae stage does not"
        _close(metrics[name], value, f"{case_id} {name}", tol if name.startswith("critic/") else TOL32)
    ours_only = {k for k in metrics if k.startswith("rollout_corr/")} - set(theirs["metrics"])
    assert not ours_only, f"{case_id}: rollout_corr metrics verl does not report: {sorted(ours_only)}"
    if case["algorithm"]["use_kl_in_reward"]:
        _close(metrics["kl/coef_next"], theirs["next_coef"], f"{case_id} next KL coefficient", TOL32)


def test_trainer_cases_hold_what_they_claim(verl):
    """Each rejecting case rejects some tokens and keeps others; the token-level ones cut rows part
    way, and some non-empty row is rejected whole; every case has empty responses with a score, and
    all but grpo_passk's groups of one."""
    for case_id in _ids(C.trainer_cases):
        case, theirs = verl(case_id)
        lengths = torch.tensor(case["lengths"])
        original = torch.arange(theirs["response_mask"].shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
        kept = theirs["response_mask"] != 0
        assert (lengths == 0).sum() >= 2 and all(case["reward"][i] != 0 for i in range(len(lengths)) if lengths[i] == 0)
        if case["algorithm"]["adv_estimator"] != "grpo_passk":
            assert 1 in np.unique(case["uid"], return_counts=True)[1], f"{case_id}: no group of one"
        if case["algorithm"]["rollout_correction"]["rollout_rs"] is None:
            assert torch.equal(kept, original), f"{case_id}: rejected without a criterion"
            continue
        rows_left = kept.sum(-1)
        assert ((rows_left == 0) & (lengths > 0)).any(), f"{case_id}: no non-empty row rejected whole"
        assert (rows_left > 0).sum() >= len(lengths) // 2, f"{case_id}: most rows rejected"
        if "token" in case["algorithm"]["rollout_correction"]["rollout_rs"]:
            assert ((rows_left > 0) & (rows_left < lengths)).any(), f"{case_id}: no row cut part way"


def test_relaxed_comparisons_are_deliberate_differences_in_the_docs(repo_root):
    text = (repo_root / "docs" / "verl.md").read_text()
    for name, (words, why) in DELIBERATE.items():
        assert words in text, f"{name}: docs/verl.md must name this deliberate difference ({why})"


# ---------------------------------------------------------------------------------------------
# rewards
# ---------------------------------------------------------------------------------------------


def test_rule_based_rewards(verl):
    """verl's default_compute_score and our reward function on the same responses, every source both
    route (GSM8K, MATH, DAPO), with the default custom_reward_function settings (verl's)."""
    case, theirs = verl("reward/default_compute_score")
    fn = get_reward_fn(load_config().custom_reward_function)
    for (source, solution, truth), expected in zip(case["rows"], theirs["scores"]):
        got = fn(source, solution, truth, extra_info={})
        if isinstance(expected, dict):
            assert isinstance(got, dict), f"{source} {solution[:40]!r}: verl returns a dict, we return {got!r}"
            for key, value in expected.items():
                assert got.get(key) == pytest.approx(value, abs=1e-6) if isinstance(value, (int, float)) \
                    else got.get(key) == value, f"{source} {solution[:40]!r} {key}: {got.get(key)!r} vs verl {value!r}"
        else:
            score = got["score"] if isinstance(got, dict) else got
            assert float(score) == pytest.approx(float(expected), abs=1e-6), \
                f"{source} {solution[:40]!r} (truth {truth!r}): ours {score!r}, verl {expected!r}"


def test_dapo_overlong_shaping(verl, tokenizer):
    """verl's DAPO reward manager (overlong buffer on, logging on) against the score stage's reward
    function plus ``shape_scores``, on the same token ids decoded the way the rollout decodes them."""
    case, theirs = verl("dapo_manager/overlong")
    _, tok = tokenizer
    buffer = case["overlong"]
    cfg = load_config(overrides=["reward_model.overlong_buffer.enable=true", f"reward_model.overlong_buffer.len={buffer['len']}",
                                 f"reward_model.overlong_buffer.penalty_factor={buffer['penalty_factor']}",
                                 "reward_model.overlong_buffer.log=true",
                                 f"data.max_response_length={case['max_resp_len']}"])
    fn = get_reward_fn(cfg.custom_reward_function)
    lengths = case["response_lengths"]
    texts = tok.batch_decode([r[:n].tolist() for r, n in zip(case["responses"], lengths)], skip_special_tokens=True)
    raw = [fn(s, t, g, extra_info={}) for s, t, g in zip(case["data_source"], texts, case["ground_truth"])]
    raw_scores = [r["score"] if isinstance(r, dict) else float(r) for r in raw]
    extras = [json.dumps({k: v for k, v in r.items() if k != "score"} if isinstance(r, dict) else {}) for r in raw]
    scores, shaped_extras = shape_scores(cfg.reward_model.overlong_buffer, cfg.data.max_response_length, raw_scores,
                                         lengths, extras)
    verl_scores = [float(theirs["reward_tensor"][i, n - 1]) for i, n in enumerate(lengths)]
    _close(scores, verl_scores, "shaped scores")
    penalties = [json.loads(e)["overlong_reward"] for e in shaped_extras]
    _close(penalties, theirs["extra"]["overlong_reward"], "overlong_reward")
    assert [float(json.loads(e)["overlong"]) for e in shaped_extras] == theirs["extra"]["overlong"]
    assert any(p < 0 for p in penalties) and any(p == 0 for p in penalties), "the case must straddle the buffer"


# ---------------------------------------------------------------------------------------------
# verl 0.9.1's config: every key has a home here, and its default is verl's or documented
# ---------------------------------------------------------------------------------------------

PLACEHOLDERS = {"actor_rollout_ref.model.path", "critic.model.path", "data.train_files", "data.val_files",
                "actor_rollout_ref.rollout.name", "trainer.n_gpus_per_node", "trainer.nnodes"}
"""verl's placeholders (paths, the engine, the machine), not defaults to compare; docs/verl.md says
what they are here."""


def _home(key: str, schema: set[str]) -> str:
    from rlhf_core.config import verl_keys as vk

    if key in schema:
        return "schema"
    for name in ("RENAMED", "ONLY_DEFAULT", "NO_EFFECT"):
        if vk.lookup(getattr(vk, name), key) is not None:
            return name
    return ""


def test_every_verl_key_has_a_home(verl):
    """A verl 0.9.1 user's command loads: each key of verl's generated PPO config is a field here,
    moves to one (RENAMED), is refused unless at verl's default (ONLY_DEFAULT), or is named as having
    no effect here with the reason (NO_EFFECT); and each ONLY_DEFAULT key's verl default is allowed."""
    from rlhf_core.config import flatten, verl_keys as vk

    _, theirs = verl("config/ppo_trainer")
    schema = set(flatten(load_config()))
    homeless = sorted(k for k, v in theirs["defaults"].items() if v != {} and not _home(k, schema))  # {}: a section
    assert not homeless, f"verl 0.9.1 keys with no home here (add a field or a verl_keys entry): {homeless}"
    for key, value in theirs["defaults"].items():
        only = vk.lookup(vk.ONLY_DEFAULT, key)
        if only is not None and not str(value).startswith("${"):
            assert value in vk.ONLY_DEFAULT[only][0], f"{key}: verl's default {value!r} is refused here"


def test_defaults_are_verls_or_documented(verl, repo_root):
    """Every key this schema shares with verl 0.9.1 (directly or by RENAMED) has verl's default, or a
    row in docs/verl.md's 'Defaults that differ' table (which names no key that agrees)."""
    import re

    from rlhf_core.config import flatten, verl_keys as vk

    _, theirs = verl("config/ppo_trainer")
    defaults = theirs["defaults"]
    expected = {k: v for k, v in defaults.items() if v is not None}
    for src, dst in vk.RENAMED.items():  # verl 0.9.1's reward.* hold what its legacy reward_model.* (null) did
        if src in defaults and defaults.get(dst) is None:
            expected[dst] = defaults[src]
    ours = flatten(load_config())
    shared = {k: v for k, v in expected.items()
              if k in ours and k not in PLACEHOLDERS and not (isinstance(v, str) and (v.startswith("${") or v == "???"))}
    section = (repo_root / "docs" / "verl.md").read_text().split("## Defaults that differ", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_.0-9]+)`", section, flags=re.M))
    differing = {k for k, v in shared.items() if ours[k] != v and not (isinstance(v, (int, float)) and ours[k] == v)}
    assert not sorted(differing - documented), {k: (ours[k], shared[k]) for k in sorted(differing - documented)}
    assert len(shared) > 100, f"only {len(shared)} shared defaults compared: the mapping broke"


# ---------------------------------------------------------------------------------------------
# performance metrics (perf/mfu/actor, perf/mfu/critic)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", [c["id"] for c in C.flops_cases() if c["family"] == "flops"])
def test_update_flops_estimate(verl, case_id):
    """Our verl_update_flops is verl's FlopsCounter estimate (its perf/mfu numerator) on the same config."""
    from rlhf_core.training.flops import verl_update_flops
    from rlhf_core.training.memory import ModelShape

    case, theirs = verl(case_id)
    shape = ModelShape.from_dict(case["config"])
    _close(verl_update_flops(shape, case["lengths"]) / case["seconds"] / 1e12, theirs["tflops_per_s"], case_id)


def test_promised_device_flops(verl):
    """verl_promised_flops is verl's get_device_flops for every device name (inf for one it does not know)."""
    from rlhf_core.training.flops import verl_promised_flops

    case, theirs = verl("flops/devices")
    ours = [verl_promised_flops("cpu" if name == "CPU" else "cuda", name) for name in case["names"]]
    assert ours == theirs["promised"], list(zip(case["names"], ours, theirs["promised"]))
