"""DAPO's overlong reward shaping (``reward_model.overlong_buffer``), as verl's DAPO reward manager.

A response of L tokens, with budget M = data.max_response_length and buffer B = overlong_buffer.len,
gets

    expected = M − B;  exceed = L − expected;  penalty = min(−exceed / B · penalty_factor, 0)

added to its sequence score: nothing up to M − B tokens, then a linear fall to −penalty_factor at
L = M. With ``overlong_buffer.log`` the response's reward_extra also records ``overlong_reward``
(the penalty) and ``overlong`` (penalty < 0), as verl's reward_extra_info.

It shapes the rule-based reward function's scores only: verl's DAPO reward manager hands a reward
model's scores (rm_scores) through untouched, so a reward model with the buffer enabled is refused
(``check_overlong_buffer``) rather than silently left unshaped.
"""

from __future__ import annotations

import json
from typing import Sequence

from rlhf_core.config.schema import OverlongBufferConfig

KEY = "reward_model.overlong_buffer"


def overlong_penalty(response_length: int, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> float:
    """The (non-positive) score added to a response of ``response_length`` tokens."""
    expected = max_response_length - buffer_len
    exceed = response_length - expected
    return min(-exceed / buffer_len * penalty_factor, 0.0)



def shape_scores(buffer: OverlongBufferConfig, max_response_length: int, scores: Sequence[float],
                 lengths: Sequence[int], extras: Sequence[str]) -> tuple[list[float], list[str]]:
    """(scores with the penalty added, reward_extra JSON with overlong_reward / overlong when
    ``buffer.log``); unchanged copies when the buffer is off. ``extras`` are JSON objects. The
    buffer was checked against the budget and the reward model when the config was loaded
    (``config.validate.check_overlong_buffer``)."""
    if not buffer.enable:
        return list(scores), list(extras)
    shaped, logged = [], []
    for score, length, extra in zip(scores, lengths, extras, strict=True):
        penalty = overlong_penalty(length, max_response_length, buffer.len, buffer.penalty_factor)
        shaped.append(score + penalty)
        if buffer.log:
            info = json.loads(extra or "{}")
            info.update(overlong_reward=penalty, overlong=penalty < 0)
            extra = json.dumps(info, sort_keys=True, default=str)
        logged.append(extra)
    return shaped, logged
