"""The advantage step on a scored table: KL-shaped token rewards, GAE, whitening. No I/O, no run dir.

    scored table (B responses)
      └─► right-padded (B, T) tensors: old/ref log-probs, values, response_mask; scores (B,)
            └─► token_level_rewards   r_t = score·[t is the last token] − kl_coef · KL_t
                  └─► advantages, returns = estimator(r, V; gamma, lam); advantages whitened
                        └─► advantages table: the scored columns + three per-token lists

T is the longest response of the batch; every per-token list written back is exactly
``response_length`` long (entry t belongs to response token t). The KL coefficient is an input:
the controller that chooses it, and its state on disk, belong to the gae stage.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from rlhf_core.algos.registry import accepted_kwargs, estimator_takes, get_adv_estimator
from rlhf_core.algos.kl import apply_kl_penalty
from rlhf_core.algos.aggregation import masked_whiten
from rlhf_core.algos.correction_specs import RolloutCorrection
from rlhf_core.algos.rollout_correction import correct_rollout
from rlhf_core.config import ConfigError
from rlhf_core.data.schemas import ADVANTAGES_EXTRA, SCORED
from rlhf_core.errors import DataError

PER_TOKEN_INPUTS = ("old_log_probs", "ref_log_probs", "values")
OPTIONAL_PER_TOKEN = ("rollout_log_probs", "sum_pi_squared")
"""Per-token columns a scored table may hold: all rows or none (the offline engine records no
rollout log-probs; sum_pi_squared only with actor.calculate_sum_pi_squared)."""


@dataclass(frozen=True)
class AdvantageSettings:
    """The ``algorithm.*`` values the advantage step reads (plain values: no config object in the math)."""

    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv: bool = True
    use_kl_in_reward: bool = True
    kl_penalty: str = "kl"
    norm_adv_by_std_in_grpo: bool = True
    use_critic: bool = True
    """Whether the run has a critic (``config.resolve.uses_critic``): its values metrics are reported."""
    gdpo_reward_keys: Optional[tuple[str, ...]] = None
    """gdpo's reward components: keys of the reward function's dict result (the scored reward_extra)."""
    gdpo_reward_weights: Optional[tuple[float, ...]] = None
    rollout_correction: RolloutCorrection = RolloutCorrection()
    """algorithm.rollout_correction: applied here (weights, rejection) unless in bypass mode, where the
    loss applies it; its metrics are reported whenever the table has the rollout's log-probs."""

    @classmethod
    def from_algorithm(cls, algorithm: Any) -> "AdvantageSettings":
        """From ``cfg.algorithm`` (an ``AlgorithmConfig``)."""
        c = algorithm.rollout_correction
        correction = RolloutCorrection(rollout_is=c.rollout_is, rollout_is_threshold=c.rollout_is_threshold,
                                       rollout_is_batch_normalize=c.rollout_is_batch_normalize,
                                       rollout_rs=c.rollout_rs, rollout_rs_threshold=c.rollout_rs_threshold,
                                       bypass_mode=c.bypass_mode, loss_type=c.loss_type)
        return cls(adv_estimator=algorithm.adv_estimator, gamma=float(algorithm.gamma), lam=float(algorithm.lam),
                   norm_adv=bool(algorithm.norm_adv), use_kl_in_reward=bool(algorithm.use_kl_in_reward),
                   kl_penalty=algorithm.kl_penalty,
                   norm_adv_by_std_in_grpo=bool(algorithm.norm_adv_by_std_in_grpo),
                   gdpo_reward_keys=tuple(algorithm.gdpo_reward_keys) if algorithm.gdpo_reward_keys else None,
                   gdpo_reward_weights=(tuple(algorithm.gdpo_reward_weights)
                                        if algorithm.gdpo_reward_weights else None),
                   rollout_correction=correction)


@dataclass
class ScoredBatch:
    """A scored table's numeric columns as tensors (B responses, T = longest response, at least 1)."""

    scores: torch.Tensor          # (B,) float32, the sequence-level ``reward``
    old_log_probs: torch.Tensor   # (B, T) float32, 0 at padding
    ref_log_probs: torch.Tensor   # (B, T) float32, 0 at padding
    values: torch.Tensor          # (B, T) float32, 0 at padding
    response_mask: torch.Tensor   # (B, T) bool, True for t < response_length (minus rejected tokens)
    lengths: np.ndarray           # (B,) int64 response lengths
    index: np.ndarray             # (B,) object: verl's uid, the group (prompt) of each response
    reward_baselines: Optional[torch.Tensor] = None  # (B,) float32: remax's greedy-response scores
    rollout_log_probs: Optional[torch.Tensor] = None  # (B, T) the rollout engine's own, when recorded
    sum_pi_squared: Optional[torch.Tensor] = None     # (B, T) sum_v pi_v^2, when the score stage recorded it
    rollout_is_weights: Optional[torch.Tensor] = None  # (B, T) rollout correction's importance weights
    reward_components: Optional[dict[str, torch.Tensor]] = None  # gdpo: key → (B,) component scores


@dataclass
class AdvantageOutput:
    table: pa.Table               # the scored columns + token_level_rewards, advantages, returns
    metrics: dict[str, float]
    kl_mean: float                # what a KL controller is fed: mean over responses of the per-token mean KL
    num_responses: int
    num_groups: int               # distinct uids: prompts, each with its rollout.n responses


# ---------------------------------------------------------------------------------------------
# table <-> tensors
# ---------------------------------------------------------------------------------------------


def _where(table: pa.Table, i: int, source: str) -> str:
    ids = {c: table.column(c)[i].as_py() for c in ("prompt_id", "sample_index") if c in table.column_names}
    named = ", ".join(f"{k}={v!r}" for k, v in ids.items())
    return f"{source} row {i}" + (f" ({named})" if named else "")


def _first(flags: np.ndarray) -> int:
    return int(np.flatnonzero(flags)[0])


def _require_columns(table: pa.Table, source: str) -> None:
    missing = [n for n in SCORED.names if n not in table.column_names]
    if missing:
        raise DataError(f"{source} is not a scored table: missing column(s) {', '.join(missing)}; "
                        "rerun the score stage")


def pad_list_column(table: pa.Table, name: str, lengths: np.ndarray, width: int, source: str) -> torch.Tensor:
    """List column ``name`` → (B, width) float32 tensor, entry i right-padded with 0.

    Every list must hold exactly ``lengths[i]`` finite numbers; the first row that does not is
    named in the error. Vectorised: the flat values are scattered to (row, position) in one step.
    """
    column = table.column(name).combine_chunks()
    if column.null_count:
        i = _first(column.is_null().to_numpy(zero_copy_only=False))
        raise DataError(f"{_where(table, i, source)}: {name} is null; rerun the score stage")
    counts = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    if (counts != lengths).any():
        i = _first(counts != lengths)
        raise DataError(f"{_where(table, i, source)}: {name} has {counts[i]} entries but response_length is "
                        f"{lengths[i]}; rerun the score stage")
    flat_array = pc.list_flatten(column)
    flat = flat_array.to_numpy(zero_copy_only=False).astype(np.float32)
    if flat_array.null_count or not np.isfinite(flat).all():
        bad = ~np.isfinite(flat)
        row = int(np.searchsorted(np.cumsum(lengths), _first(bad), side="right"))
        raise DataError(f"{_where(table, row, source)}: {name} holds a non-finite or null value; "
                        "rerun the score stage (a -inf log-prob means the model gave a sampled token zero probability)")
    rows = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    out = np.zeros((len(lengths), width), dtype=np.float32)
    out[rows, np.arange(len(flat)) - starts] = flat
    return torch.from_numpy(out)


def unpad(tensor: torch.Tensor, lengths: np.ndarray) -> pa.ListArray:
    """(B, T) tensor → list<float32> array whose entry i is ``tensor[i, :lengths[i]]``."""
    mask = torch.arange(tensor.shape[1]).unsqueeze(0) < torch.from_numpy(lengths).unsqueeze(1)
    # Boolean indexing walks row-major, and each row's valid tokens are a prefix: row i's values
    # come out in order, right after row i-1's.
    flat = tensor.detach().to(torch.float32)[mask].cpu().numpy()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, pa.float32()))


def scored_batch(table: pa.Table, source: str = "scored table") -> ScoredBatch:
    """Tensors of a SCORED-schema table (checks lengths, nulls and finiteness, naming the bad row)."""
    _require_columns(table, source)
    if table.num_rows == 0:
        raise DataError(f"{source} has no rows: the rollout produced no responses; rerun rollout and score")
    length_column = table.column("response_length").combine_chunks()
    if length_column.null_count:
        raise DataError(f"{_where(table, _first(length_column.is_null().to_numpy(zero_copy_only=False)), source)}: "
                        "response_length is null; rerun the rollout stage")
    lengths = length_column.to_numpy(zero_copy_only=False).astype(np.int64)
    token_counts = pc.list_value_length(table.column("response_token_ids").combine_chunks())
    token_counts = token_counts.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    if (token_counts != lengths).any():
        i = _first(token_counts != lengths)
        raise DataError(f"{_where(table, i, source)}: response_length={lengths[i]} but response_token_ids holds "
                        f"{max(token_counts[i], 0)} tokens; rerun the rollout stage")
    reward = table.column("reward").combine_chunks()
    scores = reward.to_numpy(zero_copy_only=False).astype(np.float32)
    if reward.null_count or not np.isfinite(scores).all():
        i = _first(~np.isfinite(scores))
        raise DataError(f"{_where(table, i, source)}: reward is {reward[i].as_py()}; fix the reward function "
                        "(it must return a finite number) and rerun the score stage")
    width = max(int(lengths.max()), 1)  # T >= 1 keeps the (B, T) maths defined when every response is empty
    padded = {n: pad_list_column(table, n, lengths, width, source) for n in PER_TOKEN_INPUTS}
    mask = torch.arange(width).unsqueeze(0) < torch.from_numpy(lengths).unsqueeze(1)
    optional = {n: pad_list_column(table, n, lengths, width, source) for n in OPTIONAL_PER_TOKEN
                if n in table.column_names and table.column(n).null_count < table.num_rows}
    return ScoredBatch(scores=torch.from_numpy(scores), old_log_probs=padded["old_log_probs"],
                       ref_log_probs=padded["ref_log_probs"], values=padded["values"], response_mask=mask,
                       lengths=lengths, index=_group_index(table, source),
                       reward_baselines=_reward_baselines(table, source), **optional)


def _group_index(table: pa.Table, source: str) -> np.ndarray:
    """verl's uid per row: the group (prompt) the estimator normalises within."""
    column = table.column("uid")
    if column.null_count:
        i = _first(np.asarray(column.is_null().to_pylist()))
        raise DataError(f"{_where(table, i, source)}: uid is null (every rollout row carries its prompt group's); "
                        "rerun the rollout stage")
    return np.asarray(column.to_pylist(), dtype=object)


def _reward_baselines(table: pa.Table, source: str) -> Optional[torch.Tensor]:
    """The reward_baseline column as (B,) float32 when every row has one, None when none has."""
    column = table.column("reward_baseline").combine_chunks()
    if column.null_count == len(column):
        return None
    values = column.to_numpy(zero_copy_only=False).astype(np.float32)
    if column.null_count or not np.isfinite(values).all():
        i = _first(~np.isfinite(values))
        raise DataError(f"{_where(table, i, source)}: reward_baseline is {column[i].as_py()}; rerun the score stage")
    return torch.from_numpy(values)


# ---------------------------------------------------------------------------------------------
# the maths
# ---------------------------------------------------------------------------------------------


def shaped_rewards(batch: ScoredBatch, *, kl_coef: float, kind: str) -> tuple[torch.Tensor, float]:
    """(token_level_rewards (B, T), measured KL) with ``r_t = score·[t last] − kl_coef·KL_t``, 0 at padding
    but for an empty response, whose score sits in the last column (where verl's reward manager puts it).

    ``kl_coef = 0`` gives the score on each response's last token only (the inputs are checked
    finite, so ``0·KL`` is exactly 0). The measured KL (estimator ``kind`` of the sampling policy
    against the reference) is the mean over responses of the per-token mean (an empty response
    counting 0), as verl feeds its controller.
    """
    rewards, metrics = apply_kl_penalty(scores=batch.scores, old_log_prob=batch.old_log_probs,
                                        ref_log_prob=batch.ref_log_probs, response_mask=batch.response_mask,
                                        kl_coef=kl_coef, kind=kind)
    return rewards, float(metrics["kl/mean"])


def adv_estimator(name: str) -> Callable:
    """The registered advantage estimator ``name`` (algorithm.adv_estimator); a miss is a ConfigError."""
    try:
        return get_adv_estimator(name)
    except ValueError as exc:
        raise ConfigError(f"algorithm.adv_estimator: {exc}") from None


def estimator_inputs(estimator: Callable, batch: ScoredBatch, rewards: torch.Tensor,
                     settings: AdvantageSettings) -> dict[str, Any]:
    """The keyword arguments of ``estimator`` (``settings.adv_estimator``'s registered function): it is
    offered every input the batch has and takes those it names; an input it names that the scored
    table lacks is an error saying which stage to rerun."""
    offered = dict(token_level_rewards=rewards, values=batch.values, response_mask=batch.response_mask,
                   gamma=settings.gamma, lam=settings.lam, index=batch.index,
                   norm_adv_by_std_in_grpo=settings.norm_adv_by_std_in_grpo, old_log_probs=batch.old_log_probs,
                   rollout_is_weights=batch.rollout_is_weights, reward_components=batch.reward_components,
                   reward_weights=settings.gdpo_reward_weights)
    for name, column, fix in (("reward_baselines", "reward_baseline", "rerun rollout and score"),
                              ("sum_pi_squared", "sum_pi_squared", "rerun the score stage with this estimator")):
        if estimator_takes(settings.adv_estimator, name):
            value = getattr(batch, name)
            if value is None:
                raise DataError(f"algorithm.adv_estimator={settings.adv_estimator} needs the scored table's "
                                f"{column} column, which this table lacks; {fix}")
            offered[name] = value
    return accepted_kwargs(estimator, offered)


def masked_advantages(advantages: torch.Tensor, returns: torch.Tensor, batch: ScoredBatch,
                      settings: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimator's (advantages, returns), both (B, T), made 0 at padding; advantages whitened over
    the batch's valid tokens when ``settings.norm_adv`` and the estimator reads values (verl whitens
    GAE's; every critic-free estimator normalises, or not, on its own), returns never (they are the
    critic's targets)."""
    if settings.norm_adv and estimator_takes(settings.adv_estimator, "values"):
        advantages = masked_whiten(advantages, batch.response_mask)
    zero = torch.zeros((), dtype=advantages.dtype)
    return torch.where(batch.response_mask, advantages, zero), torch.where(batch.response_mask, returns, zero)


def apply_rollout_correction(batch: ScoredBatch, settings: AdvantageSettings,
                             source: str) -> tuple[ScoredBatch, dict[str, float]]:
    """verl's decoupled rollout correction on the batch: importance weights and a rejection mask from
    the rollout engine's log-probs against the trainer's (old_log_probs), and the rollout_corr/
    metrics. In bypass mode the loss does it (nothing here); without the engine's log-probs there is
    nothing to correct, which is an error only when a correction was asked for. When the old log-probs
    are the engine's own (actor_rollout_ref.rollout.old_log_probs=auto, never with a correction set) the
    metrics say so (kl 0, ppl_ratio 1); the update reports the gap it starts from."""
    correction = settings.rollout_correction
    if correction.bypass_mode:
        return batch, {}
    if batch.rollout_log_probs is None:
        if correction.rollout_is is not None or correction.rollout_rs is not None:
            raise DataError(f"{source} has no rollout_log_probs (the engine's own log-probs; the offline engine "
                            "records none), so algorithm.rollout_correction cannot weight or reject anything; "
                            "rerun rollout with the hf or vllm engine, or set rollout_is and rollout_rs to null")
        return batch, {}
    if not bool(batch.response_mask.any()):
        return batch, {}
    weights, mask, metrics = correct_rollout(old_log_prob=batch.old_log_probs.double(),
                                             rollout_log_prob=batch.rollout_log_probs.double(),
                                             response_mask=batch.response_mask, settings=correction)
    corrected = replace(batch, response_mask=mask.bool(),
                        rollout_is_weights=None if weights is None else weights.float())
    return corrected, {k: float(v) for k, v in metrics.items()}


def reward_components(table: pa.Table, keys: tuple[str, ...], source: str) -> dict[str, torch.Tensor]:
    """gdpo's components: key → (B,) the reward function's dict result at that key, per response
    (the scored reward_extra JSON). A response without one of the keys is named in the error."""
    extras = table.column("reward_extra").to_pylist()
    out: dict[str, list[float]] = {key: [] for key in keys}
    for i, text in enumerate(extras):
        info = json.loads(text or "{}")
        for key in keys:
            value = info.get(key)
            if not isinstance(value, (int, float)):
                raise DataError(f"{_where(table, i, source)}: reward_extra has no number at {key!r} "
                                f"(algorithm.gdpo_reward_keys); the reward function must return a dict holding "
                                f"every gdpo key, e.g. {{'score': ..., {key!r}: ...}}")
            out[key].append(float(value))
    return {key: torch.tensor(values, dtype=torch.float32) for key, values in out.items()}


def _stats(prefix: str, selected: torch.Tensor) -> dict[str, float]:
    """{prefix}/mean, /max, /min of a 1-D tensor, reduced in its own dtype as verl's
    compute_data_metrics does (torch.mean / max / min); 0 for an empty tensor."""
    if selected.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {f"{prefix}/mean": float(torch.mean(selected)), f"{prefix}/max": float(torch.max(selected)),
            f"{prefix}/min": float(torch.min(selected))}


def explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float:
    """verl's critic/vf_explained_var over valid tokens: 1 − Var(R − V) / (Var(R) + 1e-5), with
    torch.var's unbiased (n − 1) variance; 0 when fewer than two tokens."""
    if returns.numel() < 2:
        return 0.0
    return float(1.0 - torch.var(returns - values) / (torch.var(returns) + 1e-5))


def advantage_metrics(batch: ScoredBatch, rewards: torch.Tensor, advantages: torch.Tensor, returns: torch.Tensor,
                      *, kl_coef: float, kl_mean: float, kl_in_reward: bool = False,
                      use_critic: bool = True) -> dict[str, float]:
    """verl's names (compute_data_metrics' reductions): critic/rewards/{mean,max,min} over the
    per-response sums of whole token-level reward rows (rejected tokens included; empty responses
    left out, as verl leaves out aborted ones), critic/{advantages,returns,values}/{mean,max,min} and
    critic/vf_explained_var over the valid tokens after rollout rejection (the values ones only with
    ``use_critic``, as verl); with the KL in the reward, actor/reward_kl_penalty (the measured KL fed
    to the controller) and actor/reward_kl_penalty_coeff (the coefficient used).

    Ours, kept as aliases: kl/in_reward_mean, kl/coef, reward/score_mean (mean sequence score),
    reward/token_level_mean (mean over all responses of the per-response sum),
    advantages/*, returns/*, critic/values_mean."""
    mask = batch.response_mask
    sums = rewards.sum(-1)  # (B,) whole rows, as the estimators score them
    alive = torch.from_numpy(batch.lengths > 0)
    valid_returns, valid_values = returns[mask], batch.values[mask]
    metrics = {
        **_stats("critic/rewards", sums[alive] if bool(alive.any()) else sums),
        **_stats("critic/advantages", advantages[mask]),
        **_stats("critic/returns", valid_returns),
        **_stats("critic/values", valid_values),
        "critic/vf_explained_var": explained_variance(valid_returns, valid_values),
        "kl/in_reward_mean": kl_mean,
        "kl/coef": float(kl_coef),
        "reward/score_mean": float(batch.scores.double().mean()),
        "reward/token_level_mean": float(sums.double().mean()),
    }
    if kl_in_reward:
        metrics.update({"actor/reward_kl_penalty": kl_mean, "actor/reward_kl_penalty_coeff": float(kl_coef)})
    for name in ("advantages", "returns"):
        metrics.update({f"{name}/{s}": metrics[f"critic/{name}/{s}"] for s in ("mean", "max", "min")})
    if use_critic:
        metrics["critic/values_mean"] = metrics["critic/values/mean"]
    else:
        for key in [k for k in metrics if k.startswith("critic/values/")] + ["critic/vf_explained_var"]:
            del metrics[key]
    assert all(math.isfinite(v) for v in metrics.values()), metrics  # inputs were checked finite
    return metrics


def compute_advantages(table: pa.Table, *, kl_coef: float, settings: AdvantageSettings,
                       source: str = "scored table") -> AdvantageOutput:
    """Scored table → advantages table (SCORED columns + token_level_rewards, advantages, returns,
    and rollout correction's rollout_is_weights / response_mask, null when it did not apply).

    ``kl_coef`` is the KL coefficient to use; it is ignored (0) unless ``settings.use_kl_in_reward``.
    ``source`` names the table in error messages.
    """
    batch = scored_batch(table, source)
    if settings.gdpo_reward_keys and estimator_takes(settings.adv_estimator, "reward_components"):
        batch = replace(batch, reward_components=reward_components(table, settings.gdpo_reward_keys, source))
    coef = float(kl_coef) if settings.use_kl_in_reward else 0.0
    rewards, kl_mean = shaped_rewards(batch, kl_coef=coef, kind=settings.kl_penalty)
    batch, correction_metrics = apply_rollout_correction(batch, settings, source)
    estimator = adv_estimator(settings.adv_estimator)
    advantages, returns = estimator(**estimator_inputs(estimator, batch, rewards, settings))  # algos/: the math
    advantages, returns = masked_advantages(advantages, returns, batch, settings)
    out = table.select(SCORED.names)
    for (name, _), tensor in zip(ADVANTAGES_EXTRA, (rewards, advantages, returns)):
        out = out.append_column(name, unpad(tensor, batch.lengths))
    weights = None if batch.rollout_is_weights is None else unpad(batch.rollout_is_weights, batch.lengths)
    out = out.append_column("rollout_is_weights", weights if weights is not None else
                            pa.nulls(table.num_rows, pa.list_(pa.float32())))
    rejected = settings.rollout_correction.rollout_rs is not None and not settings.rollout_correction.bypass_mode
    out = out.append_column("response_mask", unpad_mask(batch.response_mask, batch.lengths) if rejected else
                            pa.nulls(table.num_rows, pa.list_(pa.bool_())))
    metrics = advantage_metrics(batch, rewards, advantages, returns, kl_coef=coef, kl_mean=kl_mean,
                                kl_in_reward=settings.use_kl_in_reward, use_critic=settings.use_critic)
    metrics.update(correction_metrics)
    return AdvantageOutput(table=out, metrics=metrics, kl_mean=kl_mean, num_responses=table.num_rows,
                           num_groups=len(set(batch.index.tolist())))


def unpad_mask(mask: torch.Tensor, lengths: np.ndarray) -> pa.ListArray:
    """(B, T) bool → list<bool> array whose entry i is ``mask[i, :lengths[i]]``."""
    keep = torch.arange(mask.shape[1]).unsqueeze(0) < torch.from_numpy(lengths).unsqueeze(1)
    flat = mask[keep].cpu().numpy()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, pa.bool_()))
