"""Properties of the token-budget packers: nothing lost or duplicated, no bin over budget, bin counts
near the lower bound, rank balance, and clear errors."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_core.data.packing import (
    PackingBudgetError,
    fixed_micro_batches,
    lower_bound_bins,
    micro_batches_by_budget,
    pack_balanced,
    pack_bfd,
    pack_ffd,
    packing_efficiency,
    pad_to_longest_efficiency,
    padded_batches_efficiency,
    plan_generation_batches,
    split_into_rows,
)

PACKERS = [pack_ffd, pack_bfd]


@st.composite
def lengths_and_budget(draw, max_items: int = 120):
    budget = draw(st.integers(min_value=1, max_value=400))
    lengths = draw(st.lists(st.integers(min_value=1, max_value=budget), max_size=max_items))
    return lengths, budget


def assert_each_index_once(bins, n):
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(n))


def naive_first_fit_decreasing(lengths, budget):
    """The textbook O(n·bins) loop, the reference for the segment-tree version."""
    bins, rooms = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for j, room in enumerate(rooms):
            if lengths[i] <= room:
                bins[j].append(i)
                rooms[j] -= lengths[i]
                break
        else:
            bins.append([i])
            rooms.append(budget - lengths[i])
    return bins


@pytest.mark.parametrize("packer", PACKERS, ids=lambda p: p.__name__)
@settings(max_examples=150, deadline=None)
@given(case=lengths_and_budget())
def test_packers_keep_every_index_once_and_respect_budget(packer, case):
    lengths, budget = case
    bins = packer(lengths, budget)
    assert_each_index_once(bins, len(lengths))
    assert all(b for b in bins), "a packer never returns an empty bin"
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)
    lower = lower_bound_bins(lengths, budget)
    assert lower <= len(bins) <= 2 * lower + 1


@settings(max_examples=150, deadline=None)
@given(case=lengths_and_budget())
def test_ffd_matches_the_naive_loop(case):
    lengths, budget = case
    assert pack_ffd(lengths, budget) == naive_first_fit_decreasing(lengths, budget)


@settings(max_examples=100, deadline=None)
@given(case=lengths_and_budget(), num_ranks=st.integers(min_value=1, max_value=6))
def test_balanced_packing_across_ranks(case, num_ranks):
    lengths, budget = case
    per_rank = pack_balanced(lengths, budget, num_ranks)
    assert len(per_rank) == num_ranks
    assert_each_index_once([b for bins in per_rank for b in bins], len(lengths))
    assert len({len(bins) for bins in per_rank}) == 1, "every rank must run the same number of steps"
    assert all(sum(lengths[i] for i in b) <= budget for bins in per_rank for b in bins)
    loads = [sum(lengths[i] for b in bins for i in b) for bins in per_rank]
    assert max(loads) - min(loads) <= max(lengths, default=0)
    for bins in per_rank:  # empty bins only where the rank has too few sequences to fill its steps
        if any(not b for b in bins):
            assert all(len(b) <= 1 for b in bins)


def test_balanced_packing_pads_only_a_rank_short_of_sequences():
    lengths = [90, 90, 90]  # three near-budget sequences on two ranks: 2 steps each, one empty
    per_rank = pack_balanced(lengths, 100, 2)
    assert sorted(len(b) for bins in per_rank for b in bins) == [0, 1, 1, 1]


def test_short_rank_splits_its_heaviest_bin_before_padding():
    from rlhf_core.data.packing import _equalise_bin_count

    lengths = [50, 40, 30, 20, 5]
    bins = _equalise_bin_count(lengths, [[0, 1, 4], [2, 3]], target=4)
    assert len(bins) == 4 and all(bins)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4]
    assert _equalise_bin_count(lengths, [[0], [1]], target=3) == [[0], [1], []]


def test_micro_batches_by_budget_single_and_multi_rank():
    rng = random.Random(0)
    lengths = [rng.randint(20, 300) for _ in range(200)]
    single = micro_batches_by_budget(lengths, 1024)
    assert single == pack_bfd(lengths, 1024)
    shares = [micro_batches_by_budget(lengths, 1024, num_ranks=3, rank=r) for r in range(3)]
    assert shares == pack_balanced(lengths, 1024, 3)
    with pytest.raises(PackingBudgetError, match="rank 3"):
        micro_batches_by_budget(lengths, 1024, num_ranks=3, rank=3)


def test_over_budget_sequence_names_index_length_and_key():
    with pytest.raises(PackingBudgetError) as err:
        pack_bfd([10, 700, 20], 512, budget_key="actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    msg = str(err.value)
    assert "sequence 1" in msg and "length 700" in msg and "ppo_max_token_len_per_gpu" in msg
    with pytest.raises(PackingBudgetError, match="sequence 0"):
        pack_ffd([513], 512)
    with pytest.raises(PackingBudgetError, match="sequence 2"):
        pack_balanced([1, 2, 600], 512, 2)


def test_fixed_micro_batches():
    assert fixed_micro_batches(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert fixed_micro_batches(0, 3) == []
    with pytest.raises(PackingBudgetError):
        fixed_micro_batches(4, 0)


def padded_slots(prompts, batches, max_response):
    return sum(len(b) * (max(prompts[i] for i in b) + max_response) for b in batches)


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first]] + part
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]


@settings(max_examples=100, deadline=None)
@given(prompts=st.lists(st.integers(min_value=1, max_value=200), max_size=80),
       max_response=st.integers(min_value=0, max_value=100), n=st.integers(min_value=1, max_value=4),
       rows=st.integers(min_value=1, max_value=6))
def test_generation_batches_fit_their_padded_cost(prompts, max_response, n, rows):
    budget = rows * n * (200 + max_response)
    batches = plan_generation_batches(prompts, max_response, n, budget)
    assert_each_index_once(batches, len(prompts))
    for b in batches:
        assert len(b) * n * (max(prompts[i] for i in b) + max_response) <= budget
    # no more batches than greedy runs of the sorted prompts, and no more padding than they have
    greedy, run = [], []
    for i in sorted(range(len(prompts)), key=lambda i: -prompts[i]):
        if run and (len(run) + 1) * n * (prompts[run[0]] + max_response) > budget:
            greedy.append(run)
            run = []
        run.append(i)
    greedy += [run] if run else []
    assert len(batches) == len(greedy)
    assert padded_slots(prompts, batches, max_response) <= padded_slots(prompts, greedy, max_response)


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.integers(min_value=1, max_value=50), max_size=7),
       max_response=st.integers(min_value=0, max_value=20), rows=st.integers(min_value=1, max_value=4))
def test_generation_batches_optimal_against_brute_force(prompts, max_response, rows):
    budget = rows * (50 + max_response)
    batches = plan_generation_batches(prompts, max_response, 1, budget)
    feasible = [p for p in set_partitions(list(range(len(prompts))))
                if all(len(b) * (max(prompts[i] for i in b) + max_response) <= budget for b in p)]
    best = min((len(p), padded_slots(prompts, p, max_response)) for p in feasible)
    assert (len(batches), padded_slots(prompts, batches, max_response)) == best


def test_generation_batches_keep_long_prompts_apart():
    # greedy runs would put the 151-token prompt with three 1-token ones (4 rows × 197 slots)
    batches = plan_generation_batches([1, 1, 1, 1, 151], 46, 1, 4 * 246)
    assert sorted(map(sorted, batches)) == [[0, 1, 2, 3], [4]]


def test_generation_batch_error_names_prompt_and_cost():
    with pytest.raises(PackingBudgetError) as err:
        plan_generation_batches([10, 300], 100, 4, 1000, budget_key="actor_rollout_ref.rollout.generation_batch_tokens")
    msg = str(err.value)
    assert "prompt 1" in msg and "cost 1600" in msg and "generation_batch_tokens" in msg


def test_split_into_rows_keeps_entries_and_width():
    lengths = [5, 40, 30, 30, 12, 7, 90]
    rows = split_into_rows(lengths, [1, 2, 3, 5], 64)
    assert sorted(i for r in rows for i in r) == [1, 2, 3, 5]
    assert all(sum(lengths[i] for i in r) <= 64 for r in rows)
    rows = split_into_rows(lengths, [6, 0, 4], 64)  # too long for the width: a row of its own
    assert sorted(map(sorted, rows)) == [[0, 4], [6]]


def test_efficiency_definitions_by_hand():
    lengths = [4, 2, 3, 1]
    bins = [[0, 3], [1, 2]]  # rows of 5 and 5 tokens
    assert packing_efficiency(lengths, bins, budget=8) == pytest.approx(10 / 16)
    assert packing_efficiency(lengths, bins) == pytest.approx(1.0)
    assert packing_efficiency(lengths, [[0], [1, 3]]) == pytest.approx(7 / 8)
    assert padded_batches_efficiency(lengths, bins) == pytest.approx(10 / (2 * 4 + 2 * 3))
    assert pad_to_longest_efficiency(lengths, 2) == pytest.approx(10 / (2 * 4 + 2 * 3))
    assert pad_to_longest_efficiency(lengths, 4) == pytest.approx(10 / 16)
