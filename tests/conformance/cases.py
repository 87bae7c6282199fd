"""The inputs both sides of the conformance step compute on: seeded float64 tensors with the shapes
that break naive code (uneven interleaved groups, groups of one, gapped masks, fully masked rows,
ties), and the knobs of every mode.

A case is a dict: ``id`` (unique, names the case in a failure), ``family`` (which function of
``verl_side`` runs it) and its inputs. Our side rebuilds the same call from the same dict.
"""

from __future__ import annotations

import numpy as np
import torch

from rlhf_core.algos.registry import ADV_ESTIMATORS, AGG_MODES, KL_CONTROLLERS, POLICY_LOSSES
from rlhf_core.algos.kl import kl_estimator_names

DT = torch.float64
POLICY_KNOBS = {
    "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "tau_pos": 1.0, "tau_neg": 1.05,
    "policy_loss": {"clip_cov_ratio": 0.05, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.05,
                    "ppo_kl_coef": 0.1, "dro_beta": 0.5},
}
KNOB_SETS = [
    POLICY_KNOBS,
    {"clip_ratio_low": 0.1, "clip_ratio_high": 0.4, "clip_ratio_c": 10.0, "tau_pos": 0.5, "tau_neg": 2.0,
     "policy_loss": {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.5, "clip_cov_ub": 2.0, "kl_cov_ratio": 0.3,
                     "ppo_kl_coef": 1.0, "dro_beta": 2.0}},
    {"clip_ratio_low": 0.3, "clip_ratio_high": 0.15, "clip_ratio_c": 1.5, "tau_pos": 3.0, "tau_neg": 0.3,
     "policy_loss": {"clip_cov_ratio": 0.5, "clip_cov_lb": -1.0, "clip_cov_ub": 10.0, "kl_cov_ratio": 0.01,
                     "ppo_kl_coef": 0.01, "dro_beta": 0.05}},
]
"""Every policy loss runs under each: verl's defaults region, wide clips with strong penalties, and
narrow asymmetric clips with a dual clip just above 1."""
BYPASS_SETTINGS = [
    {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": None, "rollout_rs_threshold": None,
     "bypass_mode": True, "loss_type": "ppo_clip", "rollout_is_batch_normalize": False},
    {"rollout_is": "sequence", "rollout_is_threshold": "0.5_5.0", "rollout_rs": "token_k1,seq_mean_k3",
     "rollout_rs_threshold": "0.6_1.6,0.05", "bypass_mode": True, "loss_type": "reinforce",
     "rollout_is_batch_normalize": True},
]
CORRECTION_SETTINGS = [
    {"rollout_is": "token", "rollout_is_threshold": 2.0},
    {"rollout_is": "token", "rollout_is_threshold": "0.5_1.5", "rollout_is_batch_normalize": True},
    {"rollout_is": "sequence", "rollout_is_threshold": 3.0},
    {"rollout_is": "sequence", "rollout_is_threshold": 4.0, "rollout_is_batch_normalize": True},
    {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.7_1.4"},
    {"rollout_rs": "token_k2,token_k3", "rollout_rs_threshold": "0.02,0.03"},
    {"rollout_rs": "seq_sum_k1,seq_sum_k2,seq_sum_k3", "rollout_rs_threshold": "1.5,0.1,0.2"},
    {"rollout_rs": "seq_mean_k1,seq_mean_k2,seq_mean_k3", "rollout_rs_threshold": "0.9_1.1,0.01,0.01"},
    {"rollout_rs": "seq_max_k2,seq_max_k3", "rollout_rs_threshold": "0.05"},
    {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k3",
     "rollout_rs_threshold": 0.02},
    {},
]
ONE_MICRO_BATCH = {"geo_mean": "verl 0.9.1's geo_mean takes a plain mean over each micro-batch's rows and "
                               "ignores the mini-batch's counts, so its loss depends on how the mini-batch is cut; "
                               "ours is the mean over the mini-batch's rows (docs/verl.md). With one micro-batch "
                               "they are equal, and that is what is compared."}
STD_ALWAYS = {name: "verl 0.9.1's trainer passes algorithm.norm_adv_by_std_in_grpo to grpo alone, so this "
                     "estimator always divides by the group's std there; ours follows the setting (docs/verl.md). "
                     "With the default (true) they are equal, and that is what is compared."
              for name in ("grpo_vectorized", "gdpo")}
KL_CONTROLLER_SETTINGS = {"fixed": {"kl_coef": 0.05, "target_kl": 0.1, "horizon": 10000},
                          "adaptive": {"kl_coef": 0.2, "target_kl": 0.02, "horizon": 1000}}

OUR_OWN: dict[str, dict[str, str]] = {
    "reward source": {
        "gsm8k": "the GSM8K rule under a short name of ours (verl's name for it, openai/gsm8k, is compared)",
        "arith": "the embedded arithmetic set (data/arith), scored by the GSM8K rule",
    },
}
"""Names we register that verl 0.9.1 does not have, by kind, each with the reason. No case is built
for them (verl has nothing to compare them with); the step checks that verl indeed lacks each one.
Every other registered name is compared."""


def verl_named(kind: str, names) -> list[str]:
    """``names`` (a registry's, in its order) without our own: the ones verl also has."""
    return [name for name in names if name not in OUR_OWN.get(kind, {})]


# ---------------------------------------------------------------------------------------------
# random inputs
# ---------------------------------------------------------------------------------------------


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def prefix_mask(g: torch.Generator, batch: int, length: int, *, empty_rows: int = 0) -> torch.Tensor:
    """Each row's valid tokens are a prefix of random length (1..T); ``empty_rows`` rows have none."""
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    lengths[:empty_rows] = 0
    return torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)


def gapped_mask(g: torch.Generator, batch: int, length: int, *, empty_rows: int = 0) -> torch.Tensor:
    """A prefix mask with random holes inside the prefixes (observation spans), every non-empty row
    keeping at least its first token."""
    mask = prefix_mask(g, batch, length) & (torch.rand(batch, length, generator=g) > 0.3)
    mask[:, 0] = True
    mask[:empty_rows] = False
    return mask


def groups(g: torch.Generator, batch: int) -> np.ndarray:
    """Uneven groups (sizes 1, 2, 3, 5, ...) whose rows interleave, as uid strings."""
    sizes, total = [], 0
    while total < batch:
        size = min([1, 2, 3, 5][int(torch.randint(0, 4, (1,), generator=g))], batch - total)
        sizes.append(size)
        total += size
    ids = [f"uid-{k}" for k, size in enumerate(sizes) for _ in range(size)]
    order = torch.randperm(batch, generator=g).tolist()
    return np.array([ids[i] for i in order], dtype=object)


def pairs_of_groups(g: torch.Generator, batch: int) -> np.ndarray:
    """Interleaved groups of at least two rows (grpo_passk needs two per group)."""
    ids = [f"uid-{i // 2}" for i in range(batch)]
    if batch % 2:
        ids[-1] = ids[-2]
    order = torch.randperm(batch, generator=g).tolist()
    return np.array([ids[i] for i in order], dtype=object)


def tied_scores(g: torch.Generator, batch: int) -> torch.Tensor:
    """Scores from a small set, so ties within groups and all-equal groups occur."""
    return torch.tensor([0.0, 0.5, 1.0, 1.0])[torch.randint(0, 4, (batch,), generator=g)].to(DT)


def log_probs(g: torch.Generator, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, new) log-probabilities: negative, new = old plus a token and a row drift, so that ratios
    leave every clip range for some tokens and rows."""
    old = -(torch.rand(batch, length, generator=g, dtype=DT) * 3.0 + 0.02)
    drift = 0.3 * torch.randn(batch, length, generator=g, dtype=DT) + 0.2 * torch.randn(batch, 1, generator=g, dtype=DT)
    return old, torch.clamp(old + drift, max=-1e-3)


def parts_of(g: torch.Generator, batch: int, n: int) -> list[list[int]]:
    """A random cut of the rows into ``n`` micro-batches (none empty)."""
    order = torch.randperm(batch, generator=g).tolist()
    cuts = sorted(torch.randperm(batch - 1, generator=g)[: n - 1].add(1).tolist())
    return [order[a:b] for a, b in zip([0] + cuts, cuts + [batch])]


def zero_outside(mask: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """verl's tensors hold 0 at padding; ours must not depend on it, verl's may."""
    return [torch.where(mask, t, torch.zeros((), dtype=t.dtype)) for t in tensors]


# ---------------------------------------------------------------------------------------------
# the cases
# ---------------------------------------------------------------------------------------------


def agg_cases() -> list[dict]:
    cases = []
    for mode in verl_named("loss aggregation mode", AGG_MODES.names()):
        for seed in range(3):
            g = gen(100 + seed)
            batch, length = 11, 13
            mask = gapped_mask(g, batch, length, empty_rows=1 if seed else 0)
            loss = torch.randn(batch, length, generator=g, dtype=DT)
            (loss,) = zero_outside(mask, loss)
            scale = None if seed == 0 else 20
            parts = None if seed == 0 else parts_of(g, batch, 3)
            cases.append({"id": f"agg/{mode}/{seed}", "family": "agg", "mode": mode, "loss": loss, "mask": mask,
                          "scale": scale, "parts": parts})
    return cases


def _policy_inputs(seed: int, batch: int = 12, length: int = 15, extreme: bool = False) -> dict:
    """``extreme``: a few tokens whose log-ratio log pi - log pi_old is +-25, past every +-20 clamp
    (verl's on the ratio and on the IS weights), and one row far off as a whole."""
    g = gen(200 + seed)
    mask = gapped_mask(g, batch, length, empty_rows=1)
    old, new = log_probs(g, batch, length)
    if extreme:
        old[1, 0], new[1, 0] = -26.0, -1.0
        old[2, 0], new[2, 0] = -0.5, -25.5
        old[3, 0], new[3, 0] = -21.0, -0.2
        new[4] = old[4] - 3.0
    adv = 2 * torch.randn(batch, 1, generator=g, dtype=DT) + 0.5 * torch.randn(batch, length, generator=g, dtype=DT)
    weights = torch.rand(batch, length, generator=g, dtype=DT) * 1.5 + 0.5
    old, new, adv, weights = zero_outside(mask, old, new, adv, weights)
    return {"mask": mask, "old_log_prob": old, "log_prob": new, "advantages": adv, "weights": weights,
            "parts": parts_of(g, batch, 3)}


def _policy_case(mode: str, agg: str, seed: int, weighted: bool, k: int, correction, knob_set: int,
                 extreme: bool) -> dict:
    inputs = _policy_inputs(seed, extreme=extreme)
    if not weighted or mode == "bypass_mode":  # bypass computes its own weights
        inputs["weights"] = None
    if mode in ONE_MICRO_BATCH:
        inputs["parts"] = [sorted(i for part in inputs["parts"] for i in part)]
    knobs = dict(KNOB_SETS[knob_set], rollout_correction=correction)
    suffix = f"/knobs{knob_set}" if knob_set else ""
    return {"id": f"policy_loss/{mode}/{agg}/{seed}{'/w' if weighted else ''}/{k}{suffix}{'/extreme' if extreme else ''}",
            "family": "policy_loss", "mode": mode, "agg": agg,
            "scale": 20 if agg == "seq-mean-token-sum-norm" else None,
            "knobs": knobs, "seed": 1234 + seed, **inputs}


def policy_loss_cases() -> list[dict]:
    """Every mode x aggregation with verl's-default-like knobs, unweighted and with rollout IS
    weights; then every mode under each other knob set, and every knob set with log-ratios past
    the clamps, weighted, under one aggregation each (rotating)."""
    cases = []
    aggs = verl_named("loss aggregation mode", AGG_MODES.names())
    for m, mode in enumerate(verl_named("policy loss", POLICY_LOSSES.names())):
        settings = BYPASS_SETTINGS if mode == "bypass_mode" else [None]
        for k, correction in enumerate(settings):
            for agg in aggs:
                for seed, weighted in ((0, False), (1, True)):
                    cases.append(_policy_case(mode, agg, seed, weighted, k, correction, 0, False))
            for knob_set in range(len(KNOB_SETS)):
                for extreme in (False, True):
                    if knob_set == 0 and not extreme:
                        continue
                    agg = aggs[(m + 2 * knob_set + extreme) % len(aggs)]
                    cases.append(_policy_case(mode, agg, 2 + knob_set, True, k, correction, knob_set, extreme))
    return cases


def value_loss_cases() -> list[dict]:
    cases = []
    for agg in verl_named("loss aggregation mode", AGG_MODES.names()):
        g = gen(300)
        batch, length = 10, 12
        mask = gapped_mask(g, batch, length, empty_rows=1)
        values = torch.randn(batch, length, generator=g, dtype=DT)
        vpreds = values + 0.8 * torch.randn(batch, length, generator=g, dtype=DT)
        returns = values + torch.randn(batch, length, generator=g, dtype=DT)
        vpreds, values, returns = zero_outside(mask, vpreds, values, returns)
        cases.append({"id": f"value_loss/{agg}", "family": "value_loss", "agg": agg, "mask": mask,
                      "vpreds": vpreds, "values": values, "returns": returns, "cliprange": 0.5,
                      "scale": 20 if agg == "seq-mean-token-sum-norm" else None, "parts": parts_of(g, batch, 3)})
    return cases


def _estimator_case(name: str, seed: int, mask_kind: str, *, gdpo_keys=None, is_weights=False,
                    norm_by_std=True) -> dict:
    g = gen(400 + seed)
    batch, length, prompt = 14, 12, 3
    mask = (gapped_mask if mask_kind == "gapped" else prefix_mask)(g, batch, length)
    index = pairs_of_groups(g, batch) if name == "grpo_passk" else groups(g, batch)
    scores = tied_scores(g, batch) if seed % 2 == 0 else torch.randn(batch, generator=g, dtype=DT)
    last = mask & (mask.flip(-1).long().cumsum(-1).flip(-1) == 1)
    rewards = torch.where(last, scores.unsqueeze(-1), torch.zeros((), dtype=DT))
    rewards = rewards - 0.01 * torch.rand(batch, length, generator=g, dtype=DT) * mask  # a KL-shaped reward
    values = torch.randn(batch, length, generator=g, dtype=DT)
    old = -(torch.rand(batch, length, generator=g, dtype=DT) * 3 + 0.01)
    sum_pi_squared = torch.exp(old).square() + torch.rand(batch, length, generator=g, dtype=DT) * 0.3
    rewards, values, old, sum_pi_squared = zero_outside(mask, rewards, values, old, sum_pi_squared)
    components = {}
    if gdpo_keys:
        components = {key: np.array(torch.randint(0, 3, (batch,), generator=g).double().div(2).tolist())
                      for key in gdpo_keys}
    weights = torch.rand(batch, length, generator=g, dtype=DT) * 1.5 + 0.5 if is_weights else None
    response_mask = mask.to(DT)
    return {"id": f"estimator/{name}/{seed}/{mask_kind}{'/is' if is_weights else ''}{'/keys' if gdpo_keys else ''}"
                  f"{'' if norm_by_std else '/nostd'}",
            "family": "estimator", "name": name, "token_level_rewards": rewards, "response_mask": response_mask,
            "values": values, "old_log_probs": old, "sum_pi_squared": sum_pi_squared, "index": index,
            "reward_baselines": torch.rand(batch, generator=g, dtype=DT),
            "rollout_is_weights": None if weights is None else weights * response_mask,
            "prompts": torch.ones(batch, prompt, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(batch, prompt, dtype=torch.long), mask.long()], dim=-1),
            "components": components, "gdpo_keys": list(gdpo_keys) if gdpo_keys else None,
            "gdpo_weights": [1.0, 0.5] if gdpo_keys else None, "gamma": 0.97, "lam": 0.9,
            "norm_by_std": norm_by_std}


def estimator_cases() -> list[dict]:
    cases = []
    for name in verl_named("advantage estimator", ADV_ESTIMATORS.names()):
        if name == "gdpo":  # verl's trainer needs the component keys; it places each at (valid tokens - 1)
            cases += [_estimator_case(name, seed, "prefix", gdpo_keys=("acc", "fmt")) for seed in range(3)]
            continue
        for seed in range(2):
            for kind in ("prefix", "gapped"):
                cases.append(_estimator_case(name, seed, kind))
        if name in ("grpo", "grpo_passk"):  # see STD_ALWAYS for the others
            cases.append(_estimator_case(name, 5, "prefix", norm_by_std=False))
        if name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
            cases.append(_estimator_case(name, 3, "prefix", is_weights=True))
    return cases


def kl_cases() -> list[dict]:
    g = gen(500)
    logprob, ref = log_probs(g, 6, 9)
    ref = ref - 2.0 * torch.rand(6, 9, generator=g, dtype=DT) * (torch.rand(6, 9, generator=g) > 0.8)  # a few far apart
    return [{"id": f"kl/{kind}", "family": "kl", "kind": kind, "logprob": logprob, "ref_logprob": ref}
            for kind in verl_named("KL estimator", kl_estimator_names())]


def kl_controller_cases() -> list[dict]:
    updates = [(0.001, 32), (0.05, 64), (0.5, 64), (0.02, 16), (0.0, 128), (0.03, 256)]
    return [{"id": f"kl_controller/{kind}", "family": "kl_controller", "type": kind, "updates": updates,
             **KL_CONTROLLER_SETTINGS[kind]} for kind in verl_named("KL controller", KL_CONTROLLERS.names())]


def kl_reward_cases() -> list[dict]:
    cases = []
    for kind in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"):
        for ctrl in verl_named("KL controller", KL_CONTROLLERS.names()):
            g = gen(600)
            batch, length = 9, 11
            mask = prefix_mask(g, batch, length)
            old, ref = log_probs(g, batch, length)
            scores = torch.randn(batch, generator=g, dtype=DT)
            last = mask & (mask.flip(-1).long().cumsum(-1).flip(-1) == 1)
            token_scores = torch.where(last, scores.unsqueeze(-1), torch.zeros((), dtype=DT))
            old, ref = zero_outside(mask, old, ref)
            cases.append({"id": f"kl_reward/{kind}/{ctrl}", "family": "kl_reward", "kind": kind, "type": ctrl,
                          **KL_CONTROLLER_SETTINGS[ctrl], "token_level_scores": token_scores, "scores": scores,
                          "old_log_probs": old, "ref_log_prob": ref, "response_mask": mask.to(DT)})
    return cases


def rollout_correction_cases() -> list[dict]:
    """Every setting on prefix and gapped masks with an empty row; seed 2 adds log-ratios past the
    +-20 clamp (SAFETY_BOUND) on single tokens and summed over a row."""
    cases = []
    for k, settings in enumerate(CORRECTION_SETTINGS):
        for seed in range(3):
            g = gen(700 + seed)
            batch, length = 13, 10
            mask = (gapped_mask if seed else prefix_mask)(g, batch, length, empty_rows=1)
            rollout, train = log_probs(g, batch, length)
            train = train - 0.3 * (torch.rand(batch, 1, generator=g, dtype=DT) > 0.7)  # some rows far off
            if seed == 2:
                rollout[1, 0], train[1, 0] = -27.0, -0.5
                rollout[2, 0], train[2, 0] = -0.5, -26.0
                train[3] = rollout[3] - 4.0  # a row whose summed log-ratio passes -20
            rollout, train = zero_outside(mask, rollout, train)
            full = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
                    "rollout_rs": None, "rollout_rs_threshold": None, **settings}
            cases.append({"id": f"rollout_correction/{k}/{seed}", "family": "rollout_correction",
                          "old_log_prob": train, "rollout_log_prob": rollout, "response_mask": mask.to(DT),
                          "settings": full})
    return cases


# ---------------------------------------------------------------------------------------------
# the trainer's advantage path: KL in the reward, then rollout correction, then the estimator
# ---------------------------------------------------------------------------------------------

TRAINER_CORRECTIONS = {
    "off": {},  # the rollout's log-probs are there: metrics only, the mask unchanged
    "token": {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k2",
              "rollout_rs_threshold": 0.05},
    "sequence": {"rollout_is": "sequence", "rollout_is_threshold": "0.2_5.0", "rollout_rs": "seq_mean_k1",
                 "rollout_rs_threshold": "0.8_1.25"},
    "chained": {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0", "rollout_is_batch_normalize": True,
                "rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.6_1.6,0.3"},
}
TRAINER_KL = {True: ("low_var_kl", {"type": "adaptive", "kl_coef": 0.05, "target_kl": 0.02, "horizon": 1000}),
              False: ("kl", {"type": "fixed", "kl_coef": 0.001, "target_kl": 0.1, "horizon": 10000})}
GDPO_KEYS, GDPO_WEIGHTS = ["acc", "fmt"], [1.0, 0.5]
SCORES = [-1.0, 0.0, 0.5, 1.0]
"""Rule-based scores (math_dapo's -1 for a wrong answer): dyadic, so a group of equal scores has an
exact mean and std 0 in float32 on both sides."""


def _trainer_groups(g: torch.Generator, batch: int, name: str) -> np.ndarray:
    """16 rows in uneven, interleaved groups: two of one, 2, 3, 4 and 5 (grpo_passk needs two per
    group: its sizes are 2, 3, 3, 3 and 5)."""
    sizes = [2, 3, 3, 3, 5] if name == "grpo_passk" else [1, 2, 3, 5, 1, 4]
    ids = [f"uid-{k}" for k, size in enumerate(sizes) for _ in range(size)]
    assert len(ids) == batch
    order = torch.randperm(batch, generator=g).tolist()
    return np.array([ids[i] for i in order], dtype=object)


def scored_rows(seed: int, name: str, batch: int = 16, longest: int = 10) -> dict:
    """One iteration's scored table as per-row lists (float32 values, as the table stores them).

    Row 0 and one more are empty (length 0) with a nonzero score; row 1's last token and every
    token of row 2 are far off the rollout's policy (rejected by the token and sequence criteria);
    row 3's log-ratios pass both +-20 clamps; about one token in six elsewhere is off by 0.6 nats;
    one group has equal scores."""
    g = gen(800 + seed)
    lengths = torch.randint(2, longest + 1, (batch,), generator=g)
    lengths[0] = lengths[int(torch.randint(4, batch, (1,), generator=g))] = 0
    index = _trainer_groups(g, batch, name)
    scores = torch.tensor(SCORES)[torch.randint(0, len(SCORES), (batch,), generator=g)]
    first = index[5]
    scores[torch.from_numpy(index == first)] = 0.5  # a group (maybe of one) with equal scores
    scores[(lengths == 0) & (scores == 0)] = -1.0  # an empty response's score counts in verl's group
    old = -(torch.rand(batch, longest, generator=g) * 3 + 0.02)
    ref = old - 0.3 * torch.randn(batch, longest, generator=g)
    drift = 0.05 * torch.randn(batch, longest, generator=g)
    drift += 0.6 * torch.sign(torch.randn(batch, longest, generator=g)) * (torch.rand(batch, longest, generator=g) < 0.17)
    n1, n3 = int(lengths[1]), int(lengths[3])
    drift[1, n1 - 1] = 0.9
    drift[2] = -0.8
    rollout = old - drift  # log pi_train - log pi_rollout = drift
    old[3, 0], rollout[3, 0] = -0.5, -30.0  # log-ratio +29.5
    if n3 > 1:
        old[3, 1], rollout[3, 1] = -30.0, -0.5  # log-ratio -29.5
    values = torch.randn(batch, longest, generator=g)
    sum_pi_squared = torch.exp(old).square() + 0.3 * torch.rand(batch, longest, generator=g)
    acc = torch.randint(0, 2, (batch,), generator=g).float()
    fmt = torch.randint(0, 3, (batch,), generator=g).float() / 2
    acc[0], fmt[0] = 1.0, 0.5  # the empty response's components count in verl's groups

    def rows(t: torch.Tensor) -> list[list[float]]:
        return [t[i, :int(n)].tolist() for i, n in enumerate(lengths)]

    return {"lengths": lengths.tolist(), "uid": index.tolist(), "reward": scores.tolist(),
            "old_log_probs": rows(old), "ref_log_probs": rows(ref), "rollout_log_probs": rows(rollout),
            "values": rows(values), "sum_pi_squared": rows(sum_pi_squared),
            "reward_baseline": torch.rand(batch, generator=g).tolist(),
            "reward_extra": [{"acc": float(a), "fmt": float(f)} for a, f in zip(acc, fmt)],
            "prompt_token_ids": [[3, 4, 5]] * batch, "width": longest + 2}


def trainer_algorithm(name: str, correction: str, kl_in_reward: bool, norm_by_std: bool = True) -> dict:
    """verl's algorithm.* section for the case (nested as verl's AlgoConfig)."""
    kind, ctrl = TRAINER_KL[kl_in_reward]
    full = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
            "rollout_rs": None, "rollout_rs_threshold": None, "bypass_mode": False, "loss_type": "ppo_clip",
            **TRAINER_CORRECTIONS[correction]}
    return {"adv_estimator": name, "gamma": 0.97, "lam": 0.9, "norm_adv_by_std_in_grpo": norm_by_std,
            "use_kl_in_reward": kl_in_reward, "kl_penalty": kind, "kl_ctrl": ctrl, "rollout_correction": full,
            "gdpo_reward_keys": GDPO_KEYS if name == "gdpo" else None,
            "gdpo_reward_weights": GDPO_WEIGHTS if name == "gdpo" else None}


def trainer_cases() -> list[dict]:
    """Every estimator under every correction, with and without the KL in the reward; grpo and
    grpo_passk also without the std division (see STD_ALWAYS for the others)."""
    cases = []
    for k, name in enumerate(verl_named("advantage estimator", ADV_ESTIMATORS.names())):
        variants = [(c, kl, True) for c in TRAINER_CORRECTIONS for kl in (True, False)]
        if name in ("grpo", "grpo_passk"):
            variants += [("token", True, False), ("sequence", False, False)]
        for j, (correction, kl, norm_by_std) in enumerate(variants):
            cases.append({"id": f"trainer/{name}/{correction}/{'kl' if kl else 'nokl'}{'' if norm_by_std else '/nostd'}",
                          "family": "trainer", "algorithm": trainer_algorithm(name, correction, kl, norm_by_std),
                          **scored_rows(10 * k + j, name)})
    return cases


REWARD_ROWS = {
    "openai/gsm8k": [
        ("Let's add. 3 + 4 = 7\n#### 7", "7"), ("#### 7", "8"), ("The answer is 7.", "7"),
        ("#### 1,234", "1234"), ("#### -5", "-5"), ("#### 3.5", "3.5"), ("#### 12 and then #### 13", "13"),
        ("#### $42", "42"), ("", "1"), ("####42", "42"), ("#### 0042", "42"), ("so #### 10.", "10"),
    ],
    "lighteval/MATH": [
        (r"so the answer is \boxed{\frac{1}{2}}", r"\frac{1}{2}"), (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{2}", "2"), (r"\boxed 2", "2"), (r"\fbox{3}", "3"), (r"no box 3", "3"),
        (r"\boxed{x^2+1}", "x^2 + 1"), (r"\boxed{\dfrac{3}{4}}", r"\frac34"), (r"\boxed{10\%}", "10"),
        (r"\boxed{\text{(A)}}", "A"), (r"\boxed{1,000}", "1000"), (r"\boxed{ \sqrt{2} }", r"\sqrt2"),
    ],
    "DigitalLearningGmbH/MATH-lighteval": [(r"\boxed{5}", "5"), (r"\boxed{6}", "5")],
    "HuggingFaceH4/MATH-500": [(r"\boxed{\pi}", r"\pi"), (r"\boxed{3.14}", r"\pi")],
    "math_dapo": [
        ("Answer: 42", "42"), ("Answer: 41", "42"), (r"\boxed{42}", "42"), ("The answer is 42", "42"),
        ("Answer: \\frac{1}{2}", "\\frac{1}{2}"), ("Answer: 1/2", "\\frac{1}{2}"), ("Answer: 3,000", "3000"),
        ("blah " * 400 + "Answer: 7", "7"), ("Answer: x = 5", "5"), ("Answer: $5$", "5"),
    ],
    "math": [("Answer: 12", "12"), ("Answer: 13", "12")],
    "math_dapo_reasoning": [("Answer: 12", "12")],
    "aime2024": [("Answer: 204", "204"), ("Answer: 33", "204")],
    "aime_2025_extra": [("Answer: 9", "9")],
}


def reward_cases() -> list[dict]:
    rows = [(source, solution, truth) for source, pairs in REWARD_ROWS.items() for solution, truth in pairs]
    return [{"id": "reward/default_compute_score", "family": "reward", "rows": rows}]


def dapo_manager_case(tokenizer_dir: str, tokenizer) -> dict:
    """verl's DAPO reward manager with the overlong buffer on: responses around the buffer's edge."""
    texts = ["Answer: 12", "So the answer is #### 12 " + "x" * 40, "Answer: 7" + " words" * 30, "Answer: 12"]
    truths = ["12", "12", "7", "13"]
    prompt_ids = tokenizer("What is 5 + 7?")["input_ids"]
    responses = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(len(r) for r in responses)
    pad = tokenizer.pad_token_id
    padded = torch.tensor([r + [pad] * (width - len(r)) for r in responses])
    prompts = torch.tensor([prompt_ids] * len(texts))
    attention = torch.cat([torch.ones_like(prompts), (torch.arange(width) < torch.tensor(
        [len(r) for r in responses]).unsqueeze(1)).long()], dim=-1)
    lengths = sorted(len(r) for r in responses)
    max_len = lengths[-1] + 2
    return {"id": "dapo_manager/overlong", "family": "dapo_manager", "tokenizer": tokenizer_dir,
            "prompts": prompts, "responses": padded, "attention_mask": attention,
            "data_source": ["math_dapo"] * len(texts), "ground_truth": truths, "max_resp_len": max_len,
            "overlong": {"enable": True, "len": max_len - lengths[1], "penalty_factor": 1.5, "log": True},
            "response_lengths": [len(r) for r in responses]}


def names_case() -> dict:
    """Our own names, for verl to say it has none of them."""
    return {"id": "names/our_own", "family": "names", "names": {kind: sorted(names) for kind, names in OUR_OWN.items()}}


FLOPS_MODELS = {  # config.json fields of decoder-only models verl's Qwen2/Llama FLOP formula covers
    "qwen2.5-0.5b-4l": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 4,
                        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 512},
    "qwen2.5-0.5b": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936},
    "tiny": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512},
    "llama-head-dim": {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 3,
                       "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 96, "vocab_size": 1000},
}
DEVICE_NAMES = ("CPU", "NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA GB200", "NVIDIA L40S",
                "NVIDIA L40", "NVIDIA H20", "AMD Instinct MI300X", "NVIDIA A10", "Tesla T4")


def flops_cases() -> list[dict]:
    """verl's update FLOP estimate (its perf/mfu/actor|critic numerator) and its promised device FLOP/s."""
    lengths = {"even": [118] * 8, "mixed": [37, 512, 1, 260, 99], "one": [4096]}
    cases = [{"id": f"flops/{model}/{batch}", "family": "flops", "config": config, "lengths": seqs, "seconds": 2.5}
             for model, config in FLOPS_MODELS.items() for batch, seqs in lengths.items()]
    return cases + [{"id": "flops/devices", "family": "device_flops", "names": list(DEVICE_NAMES)}]


def all_cases(tokenizer_dir: str, tokenizer) -> list[dict]:
    cases = ([{"id": "config/ppo_trainer", "family": "config"}, names_case()] + agg_cases() + policy_loss_cases()
             + value_loss_cases() + estimator_cases() + kl_cases()
             + kl_controller_cases() + kl_reward_cases() + rollout_correction_cases() + trainer_cases() + reward_cases()
             + [dapo_manager_case(tokenizer_dir, tokenizer)] + flops_cases())
    ids = [c["id"] for c in cases]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return cases
