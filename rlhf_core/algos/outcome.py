"""Critic-free advantage estimators: outcome (sequence-level) rewards, baselines from the group.

Registered under verl's names with verl's semantics (verl/trainer/ppo/core_algos.py). Shapes:
``token_level_rewards`` and ``response_mask`` (B, T); ``index`` (B,) numpy array of group ids (verl's
uid: the rollout.n responses to one prompt share one); ``reward_baselines`` (B,). Every estimator
returns ``(advantages, returns)``, both (B, T), 0 at masked positions, in ``token_level_rewards``'
dtype (half types are reduced in float32).

A response's *score* is the sum of its whole ``token_level_rewards`` row, as verl takes it, so
``token_level_rewards`` must be 0 at padding (``apply_kl_penalty`` makes it so). ``response_mask``
only says where the advantage goes: a token the rollout correction rejected (masked, yet part of
the response) keeps its reward in the score, and so does a row it rejected whole, which gets
all-zero output but still counts in its group's mean, std and size with its score. An empty
response's score sits in the row's last column, where verl's reward manager writes it, and counts
the same way. The token-level estimators (``reinforce_plus_plus``, ``remax``, the optimal token
baselines) read rewards at valid positions only, as verl's do, so a rejected token's reward drops
out of their returns.

Groups are handled without a Python loop over rows: ``np.unique(index, return_inverse=True)`` gives
each row a group number, and per-group sums come from ``index_add_``.

None of these estimators names ``values``: naming it would make a run build a critic.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

import numpy as np
import torch

from .advantage import compute_gae
from .aggregation import masked_whiten
from .registry import register_adv_estimator

Scalar = Union[float, torch.Tensor]

# verl's epsilon in every group-std division (compute_grpo_outcome_advantage's default).
GRPO_EPSILON = 1e-6


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    # Group statistics over a few responses still lose most of bf16's 8 mantissa bits.
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    """(B,) each row's score: the sum of its whole row (masked positions included), in the math dtype."""
    return token_level_rewards.to(_math_dtype(token_level_rewards.dtype)).sum(dim=-1)


def _broadcast(per_row: torch.Tensor, valid: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, T): the row's value at its valid tokens, 0 elsewhere, in ``like``'s dtype."""
    zero = torch.zeros((), dtype=per_row.dtype, device=per_row.device)
    return torch.where(valid, per_row.unsqueeze(-1), zero).to(like.dtype)


class _Groups:
    """Row -> group number for a (B,) ``index``, and per-group reductions of (B,) tensors."""

    def __init__(self, index: np.ndarray, batch: int, device: torch.device) -> None:
        index = np.asarray(index)
        if index.shape != (batch,):
            raise ValueError(f"index must hold one group id per row, shape ({batch},); got shape {index.shape}")
        try:
            self.ids, inverse = np.unique(index, return_inverse=True)
        except TypeError as exc:
            raise ValueError(f"index holds group ids that cannot be compared with each other ({exc}); "
                             "give every row a group id of one type (verl's uid strings)") from None
        self.row_group = torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)
        self.count = self.sum(torch.ones(batch, dtype=torch.float64, device=device))

    def __len__(self) -> int:
        return len(self.ids)

    def sum(self, per_row: torch.Tensor) -> torch.Tensor:
        """(G,) sums of ``per_row`` over each group's rows."""
        out = torch.zeros(len(self.ids), dtype=per_row.dtype, device=per_row.device)
        return out.index_add_(0, self.row_group, per_row)

    def size(self, like: torch.Tensor) -> torch.Tensor:
        """(G,) group sizes in ``like``'s dtype."""
        return self.count.to(like.dtype)

    def mean(self, scores: torch.Tensor) -> torch.Tensor:
        """(G,) group means."""
        return self.sum(scores) / self.size(scores)

    def std(self, scores: torch.Tensor) -> torch.Tensor:
        """(G,) unbiased (n - 1) group standard deviations, as torch.std; 0 for a group of one
        (callers that need verl's value there override it)."""
        centered = scores - self.mean(scores)[self.row_group]
        return torch.sqrt(self.sum(centered.square()) / (self.size(scores) - 1).clamp(min=1))


def _verl_group_mean(groups: _Groups, scores: torch.Tensor) -> torch.Tensor:
    """(G,) group means, except 0 for a group of one: verl's baseline there, so a lone response keeps
    its raw score rather than getting advantage 0."""
    single = groups.size(scores) == 1
    return torch.where(single, torch.zeros_like(scores[:1]), groups.mean(scores))


@register_adv_estimator("grpo")
def compute_grpo_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300): ``A_i = (s_i - mean_g) / (std_g + 1e-6)``
    broadcast over row i's valid tokens, g the row's group, std unbiased (n - 1).

    Without ``norm_adv_by_std_in_grpo`` (Dr. GRPO) only the mean is subtracted. Returns equal the
    advantages. Edge cases, as verl: a group of one uses mean 0 and std 1, so its advantage is
    ``s / (1 + 1e-6)`` (``s`` unnormalised); all-equal rewards give std 0 and advantage 0; a fully
    masked row keeps its score in its group and gets all-zero output.
    """
    valid = _valid(response_mask)
    scores = _scores(token_level_rewards)
    groups = _Groups(index, scores.shape[0], scores.device)
    per_row = _grpo_normalised(scores, groups, norm_adv_by_std_in_grpo)
    advantages = _broadcast(per_row, valid, token_level_rewards)
    return advantages, advantages.clone()


def _grpo_normalised(scores: torch.Tensor, groups: _Groups, norm_adv_by_std_in_grpo: bool) -> torch.Tensor:
    """(B,) GRPO's per-row advantage of (B,) ``scores``: centred on the group mean, divided by the
    group std + 1e-6 when ``norm_adv_by_std_in_grpo`` (a group of one: mean 0, std 1)."""
    centered = scores - _verl_group_mean(groups, scores)[groups.row_group]
    if norm_adv_by_std_in_grpo:
        single = groups.size(scores) == 1
        std = torch.where(single, torch.ones_like(scores[:1]), groups.std(scores))
        centered = centered / (std[groups.row_group] + GRPO_EPSILON)
    return centered


@register_adv_estimator("grpo_passk")
def compute_grpo_passk_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (https://arxiv.org/abs/2503.19595): in each group only the
    best response gets a non-zero advantage, ``s_max - s_second`` (divided by ``std_g + 1e-6`` when
    ``norm_adv_by_std_in_grpo``); every other row gets 0. Returns equal the advantages.

    Raises ``ValueError`` naming the group when a group has fewer than 2 responses (rollout.n must
    be >= 2), as verl does. A tie for the best gives 0 to every row of the group (the margin is 0,
    whichever tied row is picked); all-equal rewards likewise give 0.
    """
    valid = _valid(response_mask)
    scores = _scores(token_level_rewards)
    groups = _Groups(index, scores.shape[0], scores.device)
    sizes = groups.size(scores)
    small = (sizes < 2).nonzero().flatten().tolist()
    if small:
        named = ", ".join(repr(groups.ids[g]) for g in small[:5]) + (" ..." if len(small) > 5 else "")
        raise ValueError(f"grpo_passk needs at least 2 responses per group, so rollout.n must be >= 2; "
                         f"{len(small)} group(s) have one: index {named}")
    # Rows sorted by group, best score first within a group (two stable sorts).
    by_score = torch.argsort(scores, descending=True, stable=True)
    order = by_score[torch.argsort(groups.row_group[by_score], stable=True)]
    first = (torch.cumsum(groups.count, 0) - groups.count).long()
    best, second = order[first], order[first + 1]
    margin = scores[best] - scores[second]
    if norm_adv_by_std_in_grpo:
        margin = margin / (groups.std(scores) + GRPO_EPSILON)
    per_row = torch.zeros_like(scores).index_put_((best,), margin)
    advantages = _broadcast(per_row, valid, token_level_rewards)
    return advantages, advantages.clone()


@register_adv_estimator("rloo")
def compute_rloo_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740): the baseline of row i is the mean
    of the *other* responses in its group, ``A_i = s_i - (sum_g - s_i) / (n - 1) = (s_i - mean_g) * n / (n - 1)``.

    Returns equal the advantages. Edge cases, as verl: a group of one keeps its raw score (no other
    response to compare with); all-equal rewards give 0; a fully masked row gives zeros.
    """
    valid = _valid(response_mask)
    scores = _scores(token_level_rewards)
    groups = _Groups(index, scores.shape[0], scores.device)
    sizes = groups.size(scores)
    scale = (sizes / (sizes - 1).clamp(min=1))[groups.row_group]
    leave_one_out = (scores - groups.mean(scores)[groups.row_group]) * scale
    per_row = torch.where(sizes[groups.row_group] > 1, leave_one_out, scores)
    advantages = _broadcast(per_row, valid, token_level_rewards)
    return advantages, advantages.clone()


@register_adv_estimator("opo")
def compute_opo_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025, https://arxiv.org/abs/2505.23585): the baseline is the group's
    length-weighted mean score, ``b_g = sum_i |y_i| s_i / sum_i |y_i|`` with ``|y_i|`` the valid-token
    count of row i; ``A_i = s_i - b_g``. Returns equal the advantages.

    Edge cases: a group of one uses baseline 0 (raw score), as verl; all-equal rewards give 0. A group
    of two or more whose rows are all fully masked (empty, or rejected whole) gets baseline 0 (verl
    divides 0 by 0 and gives NaN there, at every position of those rows); their output is 0.
    """
    valid = _valid(response_mask)
    scores = _scores(token_level_rewards)
    groups = _Groups(index, scores.shape[0], scores.device)
    lengths = valid.sum(dim=-1).to(scores.dtype)
    total_length = groups.sum(lengths)
    weighted = groups.sum(lengths * scores) / total_length.clamp(min=1)
    use_baseline = (groups.size(scores) > 1) & (total_length > 0)
    baseline = torch.where(use_baseline, weighted, torch.zeros_like(weighted))
    advantages = _broadcast(scores - baseline[groups.row_group], valid, token_level_rewards)
    return advantages, advantages.clone()


@register_adv_estimator("gpg")
def compute_gpg_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025, https://arxiv.org/abs/2504.02546): ``A_i = alpha * (s_i - mean_g)`` with
    ``alpha = B / max(#rows with s != 0, 1)`` over the whole batch (verl's f_norm = 1, no std division).

    Returns equal the advantages. Edge cases, as verl: a group of one uses mean 0, so gets
    ``alpha * s``; all-equal rewards give 0; a fully masked row gives zeros but counts with its score
    (in B, in alpha's denominator when its score is not 0, and in its group).
    """
    valid = _valid(response_mask)
    scores = _scores(token_level_rewards)
    groups = _Groups(index, scores.shape[0], scores.device)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    per_row = alpha * (scores - _verl_group_mean(groups, scores)[groups.row_group])
    advantages = _broadcast(per_row, valid, token_level_rewards)
    return advantages, advantages.clone()


@register_adv_estimator("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (Hu 2025, https://arxiv.org/abs/2501.03262): ``s_i - mean_g``
    broadcast over row i's valid tokens, then whitened over all valid tokens of the batch
    (``masked_whiten``: token-weighted mean, unbiased variance). Returns equal the advantages.

    Edge cases: a group of one uses mean 0 (raw score) before whitening, as verl; all-equal rewards
    in every group give all-zero centred scores and so 0 after whitening. With fewer than two valid
    tokens in the whole batch verl's whitening raises; ours gives 0 there.
    """
    valid = _valid(response_mask)
    scores = _scores(token_level_rewards)
    groups = _Groups(index, scores.shape[0], scores.device)
    centered = _broadcast(scores - _verl_group_mean(groups, scores)[groups.row_group], valid, scores)
    advantages = masked_whiten(centered, valid).to(token_level_rewards.dtype)
    return advantages, advantages.clone()


@register_adv_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: Scalar,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, https://arxiv.org/abs/2501.03262): returns are the discounted reward-to-go
    over each row's valid tokens, ``G_t = r_t + gamma * G_t'`` with t' the next valid token (a masked
    position inside a row is skipped: it neither discounts nor adds its reward, as verl 0.9.1 carries
    the running return through it); the advantages are the returns whitened over all valid tokens of
    the batch. That is GAE with V = 0 and lambda = 1, which is how it is computed.

    Edge cases: returns and advantages are 0 at masked positions; a fully masked row gives zeros and
    is left out of the whitening statistics; with fewer than two valid tokens in the batch verl's
    whitening raises, ours gives advantage 0.
    """
    valid = _valid(response_mask)
    dtype = _math_dtype(token_level_rewards.dtype)
    rewards = token_level_rewards.to(dtype)
    returns, _ = compute_gae(token_level_rewards=rewards, values=torch.zeros_like(rewards), response_mask=valid,
                             gamma=gamma, lam=1.0)
    advantages = masked_whiten(returns, valid)
    return advantages.to(token_level_rewards.dtype), returns.to(token_level_rewards.dtype)


@register_adv_estimator("remax")
def compute_remax_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reward_baselines: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, https://arxiv.org/abs/2310.10505): returns are the undiscounted reward-to-go
    over valid tokens, ``G_t = sum_{s >= t, s valid} r_s`` (holes pass through: no restart, unlike
    reinforce_plus_plus; verl ignores gamma here too), and ``A_t = G_t - b`` with ``b`` the row's
    ``reward_baselines`` entry (the score of a greedy response to the same prompt). No whitening.

    Edge cases: a fully masked row gives zeros; verl leaves ``G_t`` (not 0) at masked positions
    inside a row, ours are 0 there.
    """
    valid = _valid(response_mask)
    dtype = _math_dtype(token_level_rewards.dtype)
    zero = torch.zeros((), dtype=dtype, device=token_level_rewards.device)
    r = torch.where(valid, token_level_rewards.to(dtype), zero)
    to_go = torch.flip(torch.cumsum(torch.flip(r, [-1]), dim=-1), [-1])
    returns = torch.where(valid, to_go, zero)
    advantages = torch.where(valid, to_go - reward_baselines.to(device=r.device, dtype=dtype).unsqueeze(-1), zero)
    return advantages.to(token_level_rewards.dtype), returns.to(token_level_rewards.dtype)


# verl's vectorized GRPO computes the loop version's quantities (in float32 there).
register_adv_estimator("grpo_vectorized")(compute_grpo_advantage)


@register_adv_estimator("rloo_vectorized")
def compute_rloo_vectorized_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorized RLOO: ``rloo``'s leave-one-out advantage, except that a group of one gets 0
    (``rloo`` keeps its raw score there). Returns equal the advantages."""
    valid = _valid(response_mask)
    scores = _scores(token_level_rewards)
    groups = _Groups(index, scores.shape[0], scores.device)
    sizes = groups.size(scores)[groups.row_group]
    per_row = (sizes * scores - groups.sum(scores)[groups.row_group]) / (sizes - 1).clamp(min=1) * (sizes > 1)
    advantages = _broadcast(per_row, valid, token_level_rewards)
    return advantages, advantages.clone()


@register_adv_estimator("gdpo")
def compute_gdpo_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    norm_adv_by_std_in_grpo: bool = True,
    reward_components: Optional[Mapping[str, torch.Tensor]] = None,
    reward_weights: Optional[Sequence[float]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (https://arxiv.org/abs/2601.05242): normalise each reward component within its group
    before adding them up, so a large component cannot drown a small one.

    ``reward_components``: name → (B,) score of each response (the keys of a dict-valued reward
    function named by algorithm.gdpo_reward_keys, in that order); ``reward_weights`` one weight per
    component (default 1). Each component gets GRPO's group normalisation; their weighted sum is
    whitened over the batch's valid tokens. Without components (verl: no gdpo_reward_keys) the one
    component is the response's score (the sum of its ``token_level_rewards`` row). Returns equal the
    advantages. As verl (which writes each component at the response's last token, or at the last
    column for an empty response, and sums the row), every response's component counts in its group,
    whether its tokens were rejected or it has none.
    """
    valid = _valid(response_mask)
    if reward_components:
        components = [c.to(device=token_level_rewards.device) for c in reward_components.values()]
    else:
        components = [_scores(token_level_rewards)]
    weights = [1.0] * len(components) if reward_weights is None else list(reward_weights)
    if len(weights) != len(components):
        raise ValueError(f"gdpo: {len(weights)} reward weights for {len(components)} reward components; "
                         "give algorithm.gdpo_reward_weights one weight per gdpo_reward_keys entry")
    total = torch.zeros(valid.shape, dtype=_math_dtype(token_level_rewards.dtype), device=valid.device)
    groups = _Groups(index, valid.shape[0], valid.device)
    for weight, component in zip(weights, components):
        normalised = _grpo_normalised(component.to(total.dtype), groups, norm_adv_by_std_in_grpo)
        total = total + weight * _broadcast(normalised, valid, total)
    advantages = masked_whiten(total, valid).to(token_level_rewards.dtype)
    return advantages, advantages.clone()


def _reward_to_go(token_level_rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, T) undiscounted sum of the rewards at valid positions from t to the end of the row."""
    r = torch.where(valid, token_level_rewards, torch.zeros((), dtype=token_level_rewards.dtype))
    return torch.flip(torch.cumsum(torch.flip(r, [-1]), dim=-1), [-1])


def _path_variance(old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, valid: torch.Tensor,
                   rollout_is_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, T) W_t = sum_{j <= t, j valid} ||s_j||^2 with ||s_j||^2 = 1 - 2 pi_j + sum_v pi_v^2 (the
    squared norm of the score of token j's softmax), times rho_j^2 under truncated IS."""
    per_token = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights.square()
    return torch.cumsum(torch.where(valid, per_token, torch.zeros((), dtype=per_token.dtype)), dim=-1)


def _zero_longest_tail(baselines: torch.Tensor, rows: list[int], lengths: torch.Tensor) -> None:
    """When one row of a group is strictly the longest, it alone reaches positions past the second
    longest: its baseline there would be its own return, so it is set to 0 instead (in place)."""
    ordered = sorted(int(lengths[i]) for i in rows)
    longest = [i for i in rows if int(lengths[i]) == ordered[-1]]
    if len(longest) == 1 and ordered[-1] > ordered[-2]:
        baselines[longest[0], ordered[-2]:] = 0.0


def _groups_of(index: np.ndarray) -> dict:
    """group id → row indices, in order of first appearance."""
    groups: dict = {}
    for row, gid in enumerate(np.asarray(index).tolist()):
        groups.setdefault(gid, []).append(row)
    return groups


@register_adv_estimator("optimal_token_baseline")
def compute_optimal_token_baseline_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: Optional[torch.Tensor] = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline: a baseline per position t and group,
    ``B_t = sum_i G_it W_it / (sum_i W_it + eps)`` over the group's rows i, with G the reward-to-go and
    W the path-variance proxy (``_path_variance``: needs the sampling policy's log-probs and
    ``sum_pi_squared`` = sum over the vocabulary of pi^2 at each token, actor.calculate_sum_pi_squared).
    ``A_t = G_t - B_t``; returns are G. A group of one has baseline 0; ``handle_zero_tail`` zeroes the
    baseline of a group's single longest row past the second-longest row's end.

    Positions are the padded ones (t counts from each row's start), as verl's; 0 at masked positions.
    """
    valid = _valid(response_mask)
    with torch.no_grad():
        returns = _reward_to_go(token_level_rewards, valid)
        w = torch.where(valid, _path_variance(old_log_probs, sum_pi_squared, valid, rollout_is_weights), 0.0)
        lengths = valid.sum(dim=-1)
        baselines = torch.zeros_like(returns)
        for rows in _groups_of(index).values():
            if len(rows) == 1:
                continue
            idx = torch.tensor(rows, device=returns.device)
            per_step = (returns[idx] * w[idx]).sum(dim=0) / (w[idx].sum(dim=0) + epsilon)
            baselines[idx] = per_step.to(baselines.dtype).unsqueeze(0).expand(len(rows), -1)
            if handle_zero_tail:
                _zero_longest_tail(baselines, rows, lengths)
        zero = torch.zeros((), dtype=returns.dtype)
        return torch.where(valid, returns - baselines, zero), returns


@register_adv_estimator("tir_optimal_token_baseline")
def compute_tir_optimal_token_baseline_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: Optional[torch.Tensor] = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline for multi-turn rows (tool-integrated reasoning): as
    ``optimal_token_baseline``, but position t counts valid tokens only (observation tokens inside a
    row are skipped), so the baselines of rows whose turns interleave differently still align by how
    much each has generated. Rows without valid tokens are left out of their group. Returns are the
    reward-to-go at the original positions; advantages are 0 at masked positions.
    """
    valid = _valid(response_mask)
    with torch.no_grad():
        returns = _reward_to_go(token_level_rewards, valid)
        w = _path_variance(old_log_probs, sum_pi_squared, valid, rollout_is_weights)
        lengths = valid.sum(dim=-1)
        width = int(lengths.max()) if lengths.numel() else 0
        packed_w = returns.new_zeros((valid.shape[0], width))
        packed_returns = returns.new_zeros((valid.shape[0], width))
        compact = torch.arange(width, device=valid.device).unsqueeze(0) < lengths.unsqueeze(1)
        packed_w[compact], packed_returns[compact] = w[valid], returns[valid]
        baselines = torch.zeros_like(packed_returns)
        groups = _groups_of(np.asarray(index)[lengths.cpu().numpy() > 0]) if width else {}
        alive_rows = torch.nonzero(lengths > 0).flatten().tolist()
        for members in groups.values():
            rows = [alive_rows[m] for m in members]
            if len(rows) == 1:
                continue
            idx = torch.tensor(rows, device=returns.device)
            b_star = (packed_returns[idx] * packed_w[idx]).sum(dim=0) / (packed_w[idx].sum(dim=0) + epsilon)
            baselines[idx] = b_star.to(baselines.dtype)
            if handle_zero_tail:
                _zero_longest_tail(baselines, rows, lengths)
        advantages = torch.zeros_like(returns)
        advantages[valid] = (packed_returns - baselines)[compact]
        return advantages, returns
