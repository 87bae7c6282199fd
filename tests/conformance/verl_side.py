"""verl's half of the conformance step: run by the Python of the verl 0.9.1 environment (never by
the project's), it reads the cases our side wrote, calls verl's own functions the way verl's
trainer calls them, and writes what they return.

    <verl-venv>/bin/python tests/conformance/verl_side.py CASES.pt RESULTS.pt

Every case is a dict with ``id``, ``family`` and its inputs (float64 tensors, numpy group ids,
plain values). This file imports nothing of the project: the two sides share only the files.
"""

from __future__ import annotations

import functools
import sys
import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore")

from verl.protocol import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.config.algorithm import KLControlConfig, RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo import core_algos, rollout_corr_helper  # noqa: E402
from verl.trainer.ppo.metric_utils import compute_data_metrics  # noqa: E402
from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage, compute_response_mask  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from verl.utils.flops_counter import ESTIMATE_FUNC, FlopsCounter, get_device_flops  # noqa: E402
from verl.utils.reward_score import default_compute_score  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402


def _global_info(mask: torch.Tensor, scale):
    """What verl's engine puts in config.global_batch_info for a mini-batch on one rank."""
    return {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": int(mask.shape[0]),
            "loss_scale_factor": scale}


def _floats(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items()}


def agg(case):
    leaf = case["loss"].clone().requires_grad_(True)
    mask = case["mask"]
    if case["parts"] is None:
        total = core_algos.agg_loss(loss_mat=leaf, loss_mask=mask, loss_agg_mode=case["mode"],
                                    loss_scale_factor=case["scale"])
    else:
        info = _global_info(mask, case["scale"])
        total = sum(core_algos.agg_loss(loss_mat=leaf[p], loss_mask=mask[p], loss_agg_mode=case["mode"], **info)
                    for p in case["parts"])
    (grad,) = torch.autograd.grad(total, leaf)
    return {"value": total.detach(), "grad": grad}


def _rollout_correction_config(settings):
    return None if settings is None else RolloutCorrectionConfig(**settings)


def _actor_config(case) -> ActorConfig:
    knobs = case["knobs"]
    policy_loss = PolicyLossConfig(loss_mode=case["mode"], **knobs["policy_loss"],
                                   rollout_correction=_rollout_correction_config(knobs.get("rollout_correction"))
                                   or RolloutCorrectionConfig())
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                       clip_ratio_low=knobs["clip_ratio_low"], clip_ratio_high=knobs["clip_ratio_high"],
                       clip_ratio_c=knobs["clip_ratio_c"], tau_pos=knobs["tau_pos"], tau_neg=knobs["tau_neg"],
                       loss_agg_mode=case["agg"], loss_scale_factor=case["scale"], policy_loss=policy_loss)


def policy_loss(case):
    """As verl's ppo_loss calls the registered loss, once per micro-batch with the mini-batch's
    global counts in config.global_batch_info."""
    config = _actor_config(case)
    config.global_batch_info.update(_global_info(case["mask"], case["scale"]))
    fn = core_algos.get_policy_loss_fn(case["mode"])
    leaf = case["log_prob"].clone().requires_grad_(True)
    total, metrics = 0.0, []
    for p in case["parts"]:
        torch.manual_seed(case["seed"])  # clip_cov draws from the default generator
        weights = None if case["weights"] is None else case["weights"][p]
        loss, m = fn(old_log_prob=case["old_log_prob"][p], log_prob=leaf[p], advantages=case["advantages"][p],
                     response_mask=case["mask"][p], loss_agg_mode=case["agg"], config=config,
                     rollout_is_weights=weights)
        total = total + loss
        metrics.append(_floats(m))
    (grad,) = torch.autograd.grad(total, leaf)
    return {"value": total.detach(), "grad": grad, "metrics": metrics}


def value_loss(case):
    leaf = case["vpreds"].clone().requires_grad_(True)
    info = _global_info(case["mask"], case["scale"])
    total, clipfracs = 0.0, []
    for p in case["parts"]:
        loss, clipfrac = core_algos.compute_value_loss(
            vpreds=leaf[p], returns=case["returns"][p], values=case["values"][p], response_mask=case["mask"][p],
            cliprange_value=case["cliprange"], loss_agg_mode=case["agg"], **info)
        total = total + loss
        clipfracs.append(float(clipfrac))
    (grad,) = torch.autograd.grad(total, leaf)
    return {"value": total.detach(), "grad": grad, "clipfrac": clipfracs}


def estimator(case):
    """verl's trainer: ray_trainer.compute_advantage on a DataProto."""
    tensors = {k: case[k] for k in ("token_level_rewards", "response_mask", "values", "old_log_probs",
                                    "sum_pi_squared", "prompts", "attention_mask")}
    if case["name"] == "remax":  # the trainer adds the greedy baselines for remax only
        tensors["reward_baselines"] = case["reward_baselines"]
    if case["rollout_is_weights"] is not None:
        tensors["rollout_is_weights"] = case["rollout_is_weights"]
    non_tensors = {"uid": case["index"], **case["components"]}
    data = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
    config = AlgoConfig(gamma=case["gamma"], lam=case["lam"], adv_estimator=case["name"],
                        norm_adv_by_std_in_grpo=case["norm_by_std"], gdpo_reward_keys=case["gdpo_keys"],
                        gdpo_reward_weights=case["gdpo_weights"])
    out = compute_advantage(data, adv_estimator=case["name"], gamma=case["gamma"], lam=case["lam"], num_repeat=1,
                            norm_adv_by_std_in_grpo=case["norm_by_std"], config=config)
    return {"advantages": out.batch["advantages"], "returns": out.batch["returns"]}


def kl(case):
    leaf = case["logprob"].clone().requires_grad_(True)
    value = core_algos.kl_penalty(leaf, case["ref_logprob"], kl_penalty=case["kind"])
    (grad,) = torch.autograd.grad(value.sum(), leaf)
    return {"value": value.detach(), "grad": grad}


def _kl_controller(case):
    return core_algos.get_kl_controller(KLControlConfig(type=case["type"], kl_coef=case["kl_coef"],
                                                        target_kl=case["target_kl"], horizon=case["horizon"]))


def kl_controller(case):
    ctrl = _kl_controller(case)
    values = []
    for current_kl, n_steps in case["updates"]:
        ctrl.update(current_kl=current_kl, n_steps=n_steps)
        values.append(float(ctrl.value))
    return {"values": values}


def kl_reward(case):
    """ray_trainer.apply_kl_penalty: token_level_rewards, its metrics and the controller's step."""
    ctrl = _kl_controller(case)
    data = DataProto.from_dict(tensors={k: case[k] for k in ("token_level_scores", "old_log_probs", "ref_log_prob",
                                                               "response_mask")})
    data, metrics = apply_kl_penalty(data, kl_ctrl=ctrl, kl_penalty=case["kind"])
    return {"token_level_rewards": data.batch["token_level_rewards"], "metrics": _floats(metrics),
            "next_coef": float(ctrl.value)}


def rollout_correction(case):
    weights, mask, metrics = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=case["old_log_prob"], rollout_log_prob=case["rollout_log_prob"],
        response_mask=case["response_mask"], **case["settings"])
    return {"weights": None if weights is None else weights.batch["rollout_is_weights"], "mask": mask,
            "metrics": _floats(metrics)}


@functools.lru_cache(maxsize=None)
def _reward_manager_base():
    """verl 0.9.1's reward-loop manager base (what writes rm_scores), loaded from its file: its
    package imports the reward loop's HTTP client, which the trainer's maths never needs."""
    import importlib.util
    from pathlib import Path

    import verl

    path = Path(verl.__file__).parent / "experimental" / "reward_loop" / "reward_manager" / "base.py"
    spec = importlib.util.spec_from_file_location("verl_reward_manager_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RewardManagerBase


def _padded(rows, width, dtype=torch.float32):
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=dtype)
    return out


def _trainer_batch(case, algorithm: AlgoConfig) -> DataProto:
    """The batch as verl's trainer holds it when its "adv" step starts: prompts, responses and the
    attention mask from the rollout (responses right-padded to data.max_response_length), the
    response mask computed from them, the reward loop's rm_scores (each score at index
    valid_response_length - 1), the reward function's extra info as non-tensor columns, old/ref
    log-probs, the critic's values, the rollout's log-probs, and the inputs an estimator asks for."""
    width, lengths = case["width"], case["lengths"]
    prompts = torch.tensor(case["prompt_token_ids"], dtype=torch.long)
    responses = _padded([list(range(7, 7 + n)) for n in lengths], width, torch.long)
    valid = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    tensors = {"prompts": prompts, "responses": responses,
               "attention_mask": torch.cat([torch.ones_like(prompts), valid], dim=-1),
               "old_log_probs": _padded(case["old_log_probs"], width),
               "ref_log_prob": _padded(case["ref_log_probs"], width),
               "rollout_log_probs": _padded(case["rollout_log_probs"], width)}
    if algorithm.adv_estimator == "gae":
        tensors["values"] = _padded(case["values"], width)
    if algorithm.adv_estimator in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        tensors["sum_pi_squared"] = _padded(case["sum_pi_squared"], width)
    if algorithm.adv_estimator == "remax":
        tensors["reward_baselines"] = torch.tensor(case["reward_baseline"], dtype=torch.float32)
    data = DataProto.from_dict(tensors=tensors, non_tensors={"uid": np.array(case["uid"], dtype=object)})
    data.batch["response_mask"] = compute_response_mask(data)
    data.batch["token_level_scores"] = _reward_manager_base().assemble_rm_scores(data, case["reward"])
    extra = {key: [row[key] for row in case["reward_extra"]] for key in case["reward_extra"][0]}
    data.non_tensor_batch.update({k: np.array(v) for k, v in extra.items()})
    return data


def trainer(case):
    """verl 0.9.1's trainer from a scored batch to its advantages: RayPPOTrainer.fit's "adv" step
    (the v1 trainer's _compute_advantage makes the same three calls): the KL in the reward, the
    rollout correction in decoupled mode, compute_advantage; then compute_data_metrics."""
    a = dict(case["algorithm"])
    algorithm = AlgoConfig(**{**a, "kl_ctrl": KLControlConfig(**a["kl_ctrl"]),
                              "rollout_correction": RolloutCorrectionConfig(**a["rollout_correction"])})
    batch = _trainer_batch(case, algorithm)
    kl_ctrl = core_algos.get_kl_controller(algorithm.kl_ctrl)
    metrics = {}
    if algorithm.use_kl_in_reward:
        batch, kl_metrics = apply_kl_penalty(batch, kl_ctrl=kl_ctrl, kl_penalty=algorithm.kl_penalty)
        metrics.update(kl_metrics)
    else:
        batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    correction = algorithm.get("rollout_correction", None)
    bypass = correction and correction.get("bypass_mode", False)
    if correction is not None and "rollout_log_probs" in batch.batch and not bypass:
        batch, is_metrics = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(batch, correction)
        metrics.update(is_metrics)
    batch = compute_advantage(batch, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma, lam=algorithm.lam,
                              num_repeat=1, norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True),
                              config=algorithm)
    metrics.update(compute_data_metrics(batch, use_critic=algorithm.adv_estimator == "gae"))
    out = {k: batch.batch[k] for k in ("token_level_rewards", "response_mask", "advantages", "returns")}
    out["rollout_is_weights"] = batch.batch["rollout_is_weights"] if "rollout_is_weights" in batch.batch else None
    return {**out, "metrics": _floats(metrics), "next_coef": float(kl_ctrl.value)}


def reward(case):
    return {"scores": [default_compute_score(source, solution, truth, extra_info={})
                       for source, solution, truth in case["rows"]]}


def dapo_manager(case):
    """verl's DAPO reward manager (overlong shaping) on real token ids, decoded by a real tokenizer."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from verl.workers.reward_manager.dapo import DAPORewardManager

    tokenizer = AutoTokenizer.from_pretrained(case["tokenizer"])
    manager = DAPORewardManager(tokenizer=tokenizer, num_examine=0, compute_score=default_compute_score,
                                reward_fn_key="data_source", max_resp_len=case["max_resp_len"],
                                overlong_buffer_cfg=OmegaConf.create(case["overlong"]))
    data = DataProto.from_dict(
        tensors={"prompts": case["prompts"], "responses": case["responses"], "attention_mask": case["attention_mask"]},
        non_tensors={"data_source": np.array(case["data_source"], dtype=object),
                     "reward_model": np.array([{"ground_truth": g} for g in case["ground_truth"]], dtype=object),
                     "extra_info": np.array([{} for _ in case["ground_truth"]], dtype=object)})
    out = manager(data, return_dict=True)
    extra = {k: [float(x) if isinstance(x, (bool, int, float)) else x for x in v]
             for k, v in out["reward_extra_info"].items()}
    return {"reward_tensor": out["reward_tensor"], "extra": extra}


def config(case):
    """verl 0.9.1's generated PPO config (what main_ppo starts from), flattened: key → default as
    written (an interpolation stays its ${...} text)."""
    from pathlib import Path

    import verl
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config"
                                                 / "_generated_ppo_trainer.yaml"), resolve=False)
    flat = {}

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(tree, "")
    return {"defaults": {k: v for k, v in flat.items() if not k.endswith("_target_")}}


def _refuses(call) -> bool:
    """Whether verl turns the name down: its error for an unknown mode or source."""
    try:
        call()
    except (NotImplementedError, ValueError):
        return True
    return False


def _knows(kind: str, name: str) -> bool:
    """Whether verl 0.9.1 has ``name`` as a ``kind``: in its registry where it keeps one, else whether
    the function that takes the name accepts it."""
    one = torch.zeros(1, 1, dtype=torch.float64)
    probes = {
        "advantage estimator": lambda: name in {e.value for e in core_algos.AdvantageEstimator}
        or name in core_algos.ADV_ESTIMATOR_REGISTRY,
        "policy loss": lambda: name in core_algos.POLICY_LOSS_REGISTRY,
        "loss aggregation mode": lambda: not _refuses(lambda: core_algos.agg_loss(one, torch.ones_like(one), name)),
        "KL estimator": lambda: not _refuses(lambda: core_algos.kl_penalty(one, one, kl_penalty=name)),
        "KL controller": lambda: not _refuses(lambda: core_algos.get_kl_controller(
            KLControlConfig(type=name, kl_coef=0.1, target_kl=0.1, horizon=100))),
        "reward source": lambda: not _refuses(lambda: default_compute_score(name, "Answer: 1", "1", extra_info={})),
    }
    return probes[kind]()


def names(case):
    """For each name we list as our own, whether verl has it."""
    return {"known": {kind: {name: _knows(kind, name) for name in listed} for kind, listed in case["names"].items()}}


def flops(case):
    """verl's FlopsCounter estimate (TFLOP/s over the case's seconds) for the case's model config; its own
    device look-up needs CUDA, so the promised FLOP/s are asked for by name (``device_flops``)."""
    fields = dict(case["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    lengths = case["lengths"]
    # FlopsCounter.estimate_flops with the estimate alone (its device look-up needs CUDA)
    estimate = ESTIMATE_FUNC[FlopsCounter(config).config.model_type]
    return {"tflops_per_s": estimate(config, sum(lengths), lengths, case["seconds"])}


def device_flops(case):
    """verl's promised FLOP/s by device name (unit "B": its look-up's raw FLOP/s)."""
    return {"promised": [get_device_flops(unit="B", device_name=name) for name in case["names"]]}


FAMILIES = {f.__name__: f for f in (config, agg, policy_loss, value_loss, estimator, kl, kl_controller, kl_reward,
                                    rollout_correction, trainer, reward, dapo_manager, names, flops, device_flops)}


def main(cases_path: str, results_path: str) -> None:
    cases = torch.load(cases_path, weights_only=False)
    results = {}
    for case in cases:
        try:
            results[case["id"]] = FAMILIES[case["family"]](case)
        except Exception as exc:  # reported per case by our side, which names the case
            results[case["id"]] = {"error": f"{type(exc).__name__}: {exc}"}
    torch.save(results, results_path)
    print(f"verl side: {len(cases)} cases, {sum('error' in r for r in results.values())} raised", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} CASES.pt RESULTS.pt")
    main(sys.argv[1], sys.argv[2])
