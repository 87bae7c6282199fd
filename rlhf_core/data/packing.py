"""Token-budget bin packing: generation batches, training/scoring micro-batches, and their efficiency.

Everything here works on *indices* into a list of sequence lengths and returns lists of indices
("bins"); callers gather their rows with them. Pure Python (no torch), O(n log n).

    bins = micro_batches_by_budget(lengths, budget=3072)            # one process: list of bins
    mine = micro_batches_by_budget(lengths, 3072, num_ranks=4, rank=r)  # rank r of 4: its bins

Packers
    pack_ffd   first-fit decreasing (segment tree over bins: the leftmost bin that still fits)
    pack_bfd   best-fit decreasing (sorted remaining capacities + bisect: the tightest bin that fits)
Both satisfy FFD's worst-case bound of 11/9·OPT + 6/9 bins; BFD usually leaves slightly fuller bins,
so it is what ``micro_batches_by_budget`` uses.

Across data-parallel ranks (``pack_balanced``) every rank must run the same number of micro-batches
(DeepSpeed / DDP all-reduce once per backward), and the ranks should carry similar token loads so no
rank waits for another. How verl does it (seqlen_balancing.py): Karmarkar-Karp partitions sequences
into ceil(total / budget) micro-batches, with the count all-reduced (max) across ranks. Here:
sequences go to ranks largest-first onto the least-loaded rank (so rank loads differ by at most the
longest sequence), each rank packs its share with BFD, and ranks with fewer bins split their fullest
multi-sequence bins until all counts match. Only a rank holding fewer sequences than the common
count gets empty bins (``[]``); the caller must still take a step for them (a zero-weight
forward/backward) so collective calls stay in step.

Efficiency (real tokens / token slots) depends on the layout a batch is given:
    packing_efficiency(lengths, bins, budget)   each bin one packed row, a fixed ``budget`` wide
    packing_efficiency(lengths, bins)           the bins stacked as one right-padded (R, L) tensor
    padded_batches_efficiency(lengths, batches) no packing: one sequence per row, padded to the
                                                batch's longest (left-padded generate, plain micro-batches)
    pad_to_longest_efficiency(lengths, n)       the baseline: batches of n sequences in (shuffled) order
"""

from __future__ import annotations

import heapq
import random
from bisect import bisect_left, insort
from typing import Optional, Sequence

from rlhf_core.errors import RLHFError


class PackingBudgetError(RLHFError, ValueError):
    """A sequence does not fit the token budget on its own; the message names the budget's key."""


Bins = list[list[int]]


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


def _check_fits(lengths: Sequence[int], budget: int, budget_key: Optional[str],
                what: str = "sequence", cost: Optional[Sequence[int]] = None) -> None:
    """Every item's cost (its length unless ``cost`` is given) must fit ``budget``."""
    if budget <= 0:
        raise PackingBudgetError(f"token budget must be positive, got {budget}"
                                 + (f" ({budget_key})" if budget_key else ""))
    costs = lengths if cost is None else cost
    for i, (n, c) in enumerate(zip(lengths, costs)):
        if n < 0:
            raise PackingBudgetError(f"{what} {i} has negative length {n}")
        if c > budget:
            detail = f"length {n}" if cost is None else f"length {n}, cost {c} tokens"
            key = budget_key or "the token budget"
            raise PackingBudgetError(
                f"{what} {i} ({detail}) does not fit the token budget of {budget}: raise {key} to "
                f"at least {c}, or lower the maximum prompt/response length so no {what} is that long"
            )


def _decreasing_order(lengths: Sequence[int]) -> list[int]:
    """Indices by length, longest first; ties by index so the result is deterministic."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


# ---------------------------------------------------------------------------------------------
# packers
# ---------------------------------------------------------------------------------------------


def pack_ffd(lengths: Sequence[int], budget: int, *, budget_key: Optional[str] = None) -> Bins:
    """First-fit decreasing: each sequence, longest first, goes to the lowest-numbered bin with room.

    A max segment tree over (at most n) bin slots finds that bin in O(log n); unopened slots hold
    the full budget, so "open a new bin" is the same query. Returns bins of indices into
    ``lengths``, each with sum of lengths <= ``budget``. ``budget_key`` names the config key in the
    error raised when one sequence alone exceeds the budget.
    """
    _check_fits(lengths, budget, budget_key)
    n = len(lengths)
    if n == 0:
        return []
    size = 1
    while size < n:
        size *= 2
    tree = [0] * (2 * size)  # tree[size + j] = room left in bin j
    for j in range(n):
        tree[size + j] = budget
    for node in range(size - 1, 0, -1):
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
    bins: Bins = []
    for i in _decreasing_order(lengths):
        node = 1
        while node < size:  # descend to the leftmost leaf with room >= lengths[i]
            node = 2 * node if tree[2 * node] >= lengths[i] else 2 * node + 1
        j = node - size
        if j == len(bins):
            bins.append([])
        bins[j].append(i)
        tree[node] -= lengths[i]
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins


def pack_bfd(lengths: Sequence[int], budget: int, *, budget_key: Optional[str] = None) -> Bins:
    """Best-fit decreasing: each sequence, longest first, goes to the open bin it fills most tightly.

    Open bins are kept as a sorted list of (room left, bin number); ``bisect`` finds the smallest
    room that still fits. Same contract as ``pack_ffd``.
    """
    _check_fits(lengths, budget, budget_key)
    bins: Bins = []
    rooms: list[tuple[int, int]] = []  # sorted (room left, bin number)
    for i in _decreasing_order(lengths):
        pos = bisect_left(rooms, (lengths[i], -1))
        if pos == len(rooms):
            bins.append([i])
            room, j = budget - lengths[i], len(bins) - 1
        else:
            room, j = rooms.pop(pos)
            bins[j].append(i)
            room -= lengths[i]
        insort(rooms, (room, j))
    return bins


def _split_bin(lengths: Sequence[int], items: list[int]) -> tuple[list[int], list[int]]:
    """Two halves of a multi-sequence bin with near-equal tokens (largest first onto the lighter)."""
    halves: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for i in sorted(items, key=lambda i: (-lengths[i], i)):
        side = 0 if loads[0] <= loads[1] else 1
        halves[side].append(i)
        loads[side] += lengths[i]
    return halves


def _equalise_bin_count(lengths: Sequence[int], bins: Bins, target: int) -> Bins:
    """Split the heaviest multi-sequence bins until there are ``target``; pad with ``[]`` when no
    bin holds two sequences any more (the rank has fewer sequences than ``target``)."""
    bins = [list(b) for b in bins]
    while len(bins) < target:
        splittable = [j for j, b in enumerate(bins) if len(b) >= 2]
        if not splittable:
            bins.extend([] for _ in range(target - len(bins)))
            break
        j = max(splittable, key=lambda j: (sum(lengths[i] for i in bins[j]), -j))
        bins[j], extra = _split_bin(lengths, bins[j])
        bins.append(extra)
    return bins


def _assign_to_ranks(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Largest sequence first onto the least-loaded rank (LPT). Each step adds item x to the
    minimum load m, so max - min <= max(previous spread, x): loads end within the longest sequence."""
    heap = [(0, 0, r) for r in range(num_ranks)]  # (tokens, sequences, rank)
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in _decreasing_order(lengths):
        load, count, r = heapq.heappop(heap)
        shares[r].append(i)
        heapq.heappush(heap, (load + lengths[i], count + 1, r))
    return shares


Share = tuple[int, int]
"""(rank, world): one of ``world`` processes working through the same plan together."""


def shard_by_tokens(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Indices of ``lengths`` dealt to ``num_ranks`` processes with token loads within the longest
    sequence of each other (LPT, as ``_assign_to_ranks``), each share in ascending index order.
    Deterministic: every process computes the same shares from the same lengths."""
    if num_ranks < 1:
        raise PackingBudgetError(f"need at least one rank, got {num_ranks}")
    return [sorted(share) for share in _assign_to_ranks(lengths, num_ranks)]


def pack_balanced(lengths: Sequence[int], budget: int, num_ranks: int, *,
                  budget_key: Optional[str] = None) -> list[Bins]:
    """Per-rank micro-batches: ``result[r]`` is rank r's list of bins (indices into ``lengths``).

    Guarantees: every index appears exactly once across all ranks; no bin exceeds ``budget``; every
    rank has the same number of bins; rank token loads differ by at most ``max(lengths)``. A rank
    with fewer sequences than the common count gets empty bins (see the module docstring).
    """
    if num_ranks < 1:
        raise PackingBudgetError(f"num_ranks must be >= 1, got {num_ranks}")
    _check_fits(lengths, budget, budget_key)
    per_rank: list[Bins] = []
    for share in _assign_to_ranks(lengths, num_ranks):
        local = pack_bfd([lengths[i] for i in share], budget)
        per_rank.append([[share[k] for k in b] for b in local])
    target = max(len(b) for b in per_rank)
    return [_equalise_bin_count(lengths, bins, target) for bins in per_rank]


# ---------------------------------------------------------------------------------------------
# what the stages call
# ---------------------------------------------------------------------------------------------


def micro_batches_by_budget(lengths: Sequence[int], budget: int, num_ranks: int = 1, rank: int = 0, *,
                            budget_key: Optional[str] = None) -> Bins:
    """Micro-batches (lists of indices into ``lengths``) whose token sums fit ``budget``: the
    ``use_dynamic_bsz`` split that the scoring and update stages use. Stable signature.

    ``lengths`` are the sequences' real token counts (prompt + response). With ``num_ranks > 1``
    returns rank ``rank``'s share of ``pack_balanced`` (every rank computes the same plan from the
    same lengths, so no communication is needed) — it may contain empty bins, which the caller must
    still step through. With one rank: BFD bins, never empty.
    """
    if not 0 <= rank < num_ranks:
        raise PackingBudgetError(f"rank {rank} is outside 0..{num_ranks - 1}")
    if num_ranks == 1:
        return pack_bfd(lengths, budget, budget_key=budget_key)
    return pack_balanced(lengths, budget, num_ranks, budget_key=budget_key)[rank]


def fixed_micro_batches(n: int, size: int) -> Bins:
    """``use_dynamic_bsz=False``: consecutive chunks of ``size`` indices of ``range(n)`` (the last
    may be shorter)."""
    if size < 1:
        raise PackingBudgetError(f"micro-batch size must be >= 1, got {size}")
    return [list(range(s, min(s + size, n))) for s in range(0, n, size)]


def split_into_rows(lengths: Sequence[int], indices: Sequence[int], max_row_tokens: int) -> Bins:
    """Lay one micro-batch out as several packed rows of at most ``max_row_tokens`` each.

    With a dense 4-D mask (sdpa on CPU) attention costs L² per row whatever the mask hides, so a
    micro-batch of 8k tokens is cheaper as several narrower rows (measured on the tiny model, 2 CPU
    cores, three 8k-token bins of 200-700-token sequences: 13.4 s as 8k rows, 6.3 s at 4k, 3.9 s at
    2k, 3.8 s at 1k; about 2-3× the longest sequence is enough). The row width is a speed
    setting, not a memory limit: a sequence longer than ``max_row_tokens`` gets a row of its own.
    Returns lists of entries of ``indices``.
    """
    local = [lengths[i] for i in indices]
    width = max([max_row_tokens, *local])
    return [[indices[k] for k in row] for row in pack_bfd(local, width)]


def plan_generation_batches(prompt_lengths: Sequence[int], max_response_length: int, n_samples: int,
                            budget: int, *, budget_key: Optional[str] = None) -> Bins:
    """Generation batches (lists of prompt indices) for a left-padded ``generate``.

    A batch of k prompts, each sampled ``n_samples`` times, occupies
    ``k · n_samples · (longest prompt in the batch + max_response_length)`` KV-cache slots; that
    padded cost (not the sum of each prompt's own length) is what must fit ``budget``, because it is
    what generate allocates. Objective, in order: the fewest batches (each is a full run of up to
    ``max_response_length`` sequential decode steps), then the fewest padded slots.

    Prompts sorted longest first are cut into contiguous runs (similar lengths share a batch, so
    left padding stays small) by dynamic programming over the cut points: O(n · largest batch).
    """
    if n_samples < 1 or max_response_length < 0:
        raise PackingBudgetError(f"need n_samples >= 1 and max_response_length >= 0, got "
                                 f"{n_samples} and {max_response_length}")
    own_cost = [(p + max_response_length) * n_samples for p in prompt_lengths]
    _check_fits(prompt_lengths, budget, budget_key, what="prompt", cost=own_cost)
    order = _decreasing_order(prompt_lengths)
    n = len(order)
    # best[i] = (batches, padded slots) for the prompts order[i:]; cut[i] = end of the first batch
    best: list[tuple[int, int]] = [(0, 0)] * (n + 1)
    cut = [n] * (n + 1)
    for i in range(n - 1, -1, -1):
        width = prompt_lengths[order[i]] + max_response_length  # order[i] is the batch's longest
        largest = min(n - i, budget // (n_samples * width)) if width else n - i
        options = ((best[j][0] + 1, best[j][1] + (j - i) * width, j) for j in range(i + 1, i + largest + 1))
        batches, slots, cut[i] = min(options)
        best[i] = (batches, slots)
    plan, i = [], 0
    while i < n:
        plan.append(order[i:cut[i]])
        i = cut[i]
    return plan


# ---------------------------------------------------------------------------------------------
# efficiency
# ---------------------------------------------------------------------------------------------


def _bin_tokens(lengths: Sequence[int], b: Sequence[int]) -> int:
    return sum(lengths[i] for i in b)


def packing_efficiency(lengths: Sequence[int], bins: Sequence[Sequence[int]],
                       budget: Optional[int] = None) -> float:
    """Real tokens / token slots of packed bins, each bin one packed row.

    ``budget`` given: slots = ``len(bins) × budget`` (each row a fixed ``budget`` wide — how full the
    bins are, the number that decides how many forward passes a batch costs). ``budget`` None:
    slots = ``R × L`` for the bins stacked as one right-padded (R, L) tensor, L = the longest row
    (what ``pack_rows`` builds from them). 1.0 for no bins.
    """
    real = sum(_bin_tokens(lengths, b) for b in bins)
    if not bins:
        return 1.0
    width = budget if budget is not None else max(_bin_tokens(lengths, b) for b in bins)
    slots = len(bins) * width
    return real / slots if slots else 1.0


def padded_batches_efficiency(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Real tokens / slots when each batch is laid out unpacked, one sequence per row padded to the
    batch's longest: slots = Σ_batches |batch| × max length in it. 1.0 for no tokens."""
    real = sum(_bin_tokens(lengths, b) for b in batches)
    slots = sum(len(b) * max((lengths[i] for i in b), default=0) for b in batches)
    return real / slots if slots else 1.0


def pad_to_longest_efficiency(lengths: Sequence[int], batch_size: int, seed: Optional[int] = None) -> float:
    """Baseline: consecutive batches of ``batch_size`` sequences (after a seeded shuffle when
    ``seed`` is given), each padded to its longest. See ``padded_batches_efficiency``."""
    order = list(range(len(lengths)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    return padded_batches_efficiency(lengths, batches)


def lower_bound_bins(lengths: Sequence[int], budget: int) -> int:
    """ceil(total tokens / budget): no packing can use fewer bins."""
    return -(-sum(lengths) // budget)


__all__ = [
    "Bins", "PackingBudgetError", "fixed_micro_batches", "lower_bound_bins", "micro_batches_by_budget",
    "pack_balanced", "pack_bfd", "pack_ffd", "packing_efficiency", "pad_to_longest_efficiency",
    "padded_batches_efficiency", "plan_generation_batches", "split_into_rows",
]
