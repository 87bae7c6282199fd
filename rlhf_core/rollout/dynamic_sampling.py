"""DAPO's dynamic sampling (``algorithm.filter_groups``): keep only prompt groups whose responses
differ on a metric, and draw more prompts until data.train_batch_size groups are kept.

The rollout stage generates iteration k's prompts (draw 0: the pack stage's slot
``(k - 1) % num_slots``), scores every response with the score stage's reward function
(``rewards.sequence.sequence_rewards``, overlong shaping included) and keeps a group (one uid: one
prompt's n responses) when the metric's standard deviation over the group is > 0 or the group has
one response, as verl's DAPO trainer. While fewer than train_batch_size groups are kept it draws the
next slots (draw d: slot ``(first + d) % num_slots``, seeded ``draw_seed``), up to
``max_num_gen_batches`` draws in all (<= 0: no limit) and never more than num_slots draws; then
it keeps the first train_batch_size kept groups in draw order (verl's ``batch[:train_batch_size * n]``).

The metric of one response (``metric_values``), from where verl's trainer reads it:

- ``reward`` (verl 0.9.1's default): the sequence score before any KL penalty, overlong penalty
  included (verl: the reward manager's rm_scores summed);
- ``acc``: reward_extra_info["acc"]: a float result's score, a dict result's ``acc`` key (before
  the overlong penalty; a dict result without ``acc`` is an error, as in verl);
- ``score``: the reward function's own score (before the overlong penalty); verl reads a dict
  result's ``score`` key and has none for a float result, which here is the float itself;
- ``seq_reward``: token_level_scores summed: the sequence score, overlong penalty included;
- ``seq_final_reward``: token_level_rewards summed: the same without algorithm.use_kl_in_reward;
  with it the KL penalty needs the old and reference log-probs of the score stage, which do not
  exist yet here: refused (``config.validate.check_filter_groups``).

Where this differs from verl:

- verl takes the extra batches from its dataloader, so the next training step starts where the
  refill stopped; here iteration k+1 still starts at its own slot: iteration k's prompts stay a pure
  function of k (and the pack stage's plan), so any iteration reruns alone and reproduces its table,
  and a run resumed at iteration k needs no record of how many draws earlier iterations took. The
  extra draws may therefore reuse prompts that later iterations draw again.
- a prompt already drawn in this iteration (the same prompt in a slot of another epoch) is left out
  of a later draw, so (prompt_id, sample_index) stays unique in the table.
- "std > 0" is decided exactly (the group's values are not all equal) rather than by a floating-point
  std that rounding can leave a hair above 0 for equal values.
- each draw is one pack-stage slot of train_batch_size prompts; verl's data.gen_batch_size has no
  counterpart.
"""

from __future__ import annotations

from typing import Optional, Sequence

from rlhf_core.config.errors import ConfigError
from rlhf_core.config.validate import FILTER_METRICS as METRICS
from rlhf_core.errors import DataError
from rlhf_core.rollout.base import derive_seed

KEY = "algorithm.filter_groups"



def metric_values(metric: str, scores: Sequence[float], raw: Sequence[float],
                  acc: Sequence[Optional[float]], where: Sequence[str]) -> list[float]:
    """The filter metric of every response: ``scores`` shaped sequence scores, ``raw`` the reward
    function's own scores, ``acc`` verl's acc (None: the result had none); ``where`` names each row."""
    if metric in ("reward", "seq_reward", "seq_final_reward"):  # no KL in the reward (check_filter_groups)
        return [float(s) for s in scores]
    if metric == "score":
        return [float(s) for s in raw]
    if metric == "acc":
        for a, w in zip(acc, where):
            if a is None:
                raise DataError(f"{w}: {KEY}.metric=acc but the reward function returned a dict without "
                                "'acc' (verl reads reward_extra_info['acc']); return 'acc' in the dict or "
                                f"use {KEY}.metric=score")
        return [float(a) for a in acc]
    raise ConfigError(f"{KEY}.metric={metric!r}: must be one of {', '.join(METRICS)}")


def split_groups(uids: Sequence[str], values: Sequence[float]) -> tuple[list[str], list[str]]:
    """(kept uids, filtered uids), each in first-appearance order: a group is kept when its values
    differ (std > 0) or it holds one response."""
    groups: dict[str, list[float]] = {}
    for uid, value in zip(uids, values, strict=True):
        groups.setdefault(uid, []).append(value)
    kept = [u for u, vals in groups.items() if len(vals) == 1 or min(vals) != max(vals)]
    kept_set = set(kept)
    return kept, [u for u in groups if u not in kept_set]


def draw_slot(first_slot: int, draw: int, num_slots: int) -> int:
    """Draw d's slot: the slots after the iteration's own, wrapping."""
    return (first_slot + draw) % num_slots


def draw_seed(iteration_seed: int, draw: int) -> int:
    """Draw 0 keeps the iteration's seed (a run without filtering samples the same); later draws
    get seeds derived from it and the draw number: distinct, and the same on every rerun."""
    return iteration_seed if draw == 0 else derive_seed(iteration_seed, "filter_groups_draw", draw)


def check_draw_again(kept: int, wanted: int, draws: int, max_num_gen_batches: int, num_slots: int) -> bool:
    """Whether another draw is needed after ``draws`` draws kept ``kept`` groups; raises when the
    limit (max_num_gen_batches, else every slot drawn once) is reached with too few."""
    if kept >= wanted:
        return False
    if 0 < max_num_gen_batches <= draws:
        raise DataError(f"dynamic sampling kept {kept} of data.train_batch_size={wanted} groups after {draws} "
                        f"draws = {KEY}.max_num_gen_batches={max_num_gen_batches}: too many groups score the "
                        f"same on {KEY}.metric; raise max_num_gen_batches (<= 0: no limit), use harder or "
                        "easier prompts, or more responses per prompt (actor_rollout_ref.rollout.n)")
    if draws >= num_slots:
        raise DataError(f"dynamic sampling kept {kept} of data.train_batch_size={wanted} groups after drawing "
                        f"every one of the {num_slots} pack slots once ({KEY}.max_num_gen_batches="
                        f"{max_num_gen_batches}): the train prompts hold too few groups whose responses differ "
                        f"on {KEY}.metric; lower data.train_batch_size or add prompts")
    return True
