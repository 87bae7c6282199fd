"""The update's data: the advantages table in memory, mini-batches, micro-batches, packed tensors.

Indices everywhere refer to rows of the iteration's table (``PPOData``). A mini-batch (one optimizer
step) is a list of row indices; its micro-batches (one forward/backward each) are lists of packed
rows, each a list of row indices. Shapes: B sequences in a micro-batch, T = their longest response.

Mini-batches follow verl: ``ppo_mini_batch_size`` counts prompts, so a step trains on prompts × n
sequences (``config.resolve.mini_batch_sequences``), cut as consecutive chunks of the batch with a
prompt's n responses side by side, so without shuffle they share a mini-batch as in verl's split.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from rlhf_core.data.packing import fixed_micro_batches, micro_batches_by_budget, split_into_rows
from rlhf_core.errors import DataError
from rlhf_core.models.packed import AttentionMode, pack_rows

PER_TOKEN_COLUMNS = ("old_log_probs", "ref_log_probs", "values", "advantages", "returns")
CORRECTION_COLUMNS = ("rollout_is_weights", "response_mask")
"""Rollout correction's per-token columns: null in a table written without it (or before it existed)."""

ROW_WIDTH_RULE = "longest sequence of the mini-batch"
"""How wide a packed row inside a micro-batch may be. With a dense 4-D mask attention costs L² per row
whatever the mask hides, so a row is never wider than the mini-batch's longest sequence: packing then
only fills padding that pad-to-longest would have wasted, and attention per token never exceeds what
one-sequence rows pay (measured on the tiny model against TRL's padded batches: 1024-token rows made
the update 2.4x slower than unpacked). A micro-batch in which no two sequences share a row needs no
mask at all (``rlhf_core.models.packed``)."""

BUDGET_KEYS = {"actor": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
               "critic": "critic.ppo_max_token_len_per_gpu"}


@dataclass
class PPOData:
    """The columns of ``iter_K/advantages.parquet`` the update reads, one entry per response."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    per_token: dict[str, list[np.ndarray]]
    """column name → N float32 arrays, array i of length len(response_ids[i])."""
    groups: Optional[list[str]] = None
    """prompt_id of each row: a prompt's responses form one group (None: every row its own)."""
    kept: Optional[list[np.ndarray]] = None
    """Rollout correction's response mask (N bool arrays, False = rejected token), None without
    rejection sampling: then every response token counts."""

    def __len__(self) -> int:
        return len(self.response_ids)

    def counted(self, i: int) -> int:
        """Response tokens of row i that the losses count (all, unless rejection removed some)."""
        return len(self.response_ids[i]) if self.kept is None else int(self.kept[i].sum())

    @property
    def lengths(self) -> list[int]:
        """Sequence lengths (prompt + response), what the token budget counts."""
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    def grouped_order(self) -> list[int]:
        """Row indices with each prompt's responses side by side, prompts in order of first
        appearance, rows of a prompt in table order (the identity when they already are)."""
        if self.groups is None:
            return list(range(len(self)))
        by_prompt: dict[str, list[int]] = {}
        for i, g in enumerate(self.groups):
            by_prompt.setdefault(g, []).append(i)
        return [i for rows in by_prompt.values() for i in rows]

    def sequence(self, i: int) -> list[int]:
        return self.prompt_ids[i] + self.response_ids[i]


def read_advantages(path: str | Path) -> PPOData:
    """Load the update's columns and check each row's per-token lists against ``response_length``
    (a mismatch names the row and column: the table was written by something else than gae)."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} not found: run the gae stage for this iteration first")
    columns = ["prompt_id", "prompt_token_ids", "response_token_ids", "response_length", *PER_TOKEN_COLUMNS]
    columns += [c for c in CORRECTION_COLUMNS if c in pq.read_schema(path).names]
    try:
        table = pq.read_table(path, columns=columns)
    except (KeyError, ValueError) as exc:  # pyarrow names the missing column
        raise DataError(f"{path}: not an advantages table ({exc}); rerun the gae stage") from None
    data = table.to_pydict()
    present = [c for c in CORRECTION_COLUMNS if c in data and table.column(c).null_count < table.num_rows]
    per_token = {c: [np.asarray(v, dtype=np.float32) for v in data[c]]
                 for c in [*PER_TOKEN_COLUMNS, *(c for c in present if c != "response_mask")]}
    kept = ([np.asarray(v, dtype=bool) for v in data["response_mask"]] if "response_mask" in present else None)
    for i, (resp, n) in enumerate(zip(data["response_token_ids"], data["response_length"])):
        if len(resp) != n:
            raise DataError(f"{path} row {i}: {len(resp)} response tokens but response_length={n}")
        if not data["prompt_token_ids"][i]:
            raise DataError(f"{path} row {i}: empty prompt_token_ids (a response needs a prompt to condition on)")
        for c, arrays in [*per_token.items(), ("response_mask", kept or [])]:
            if arrays and len(arrays[i]) != n:
                raise DataError(f"{path} row {i}: column {c} has {len(arrays[i])} entries, "
                                f"response_length is {n}; rerun the gae stage")
    return PPOData(prompt_ids=[list(p) for p in data["prompt_token_ids"]],
                   response_ids=[list(r) for r in data["response_token_ids"]], per_token=per_token,
                   groups=[str(g) for g in data["prompt_id"]], kept=kept)


def mini_batches(order: Sequence[int], size: int, *, shuffle: bool, seed: str | int, epoch: int) -> list[list[int]]:
    """Consecutive chunks of ``size`` row indices of ``order`` (the last may be shorter), after a
    shuffle of the sequences seeded by (seed, epoch) when ``shuffle``: every rank and every rerun
    sees the same order. Without shuffle, ``order`` = ``PPOData.grouped_order()`` and ``size`` a
    multiple of rollout.n keep every prompt's responses in one mini-batch."""
    order = list(order)
    if shuffle:
        random.Random(f"{seed}:{epoch}").shuffle(order)
    return [order[s:s + size] for s in range(0, len(order), size)]


@dataclass(frozen=True)
class MicroBatchPlan:
    use_dynamic_bsz: bool
    token_budget: int
    """ppo_max_token_len_per_gpu: real tokens per micro-batch with dynamic batching."""
    micro_batch_size: int
    """ppo_micro_batch_size_per_gpu: sequences per micro-batch without it."""
    pack_rows: bool = True
    """Several sequences per row (block-diagonal mask): model.use_remove_padding; False = one padded
    sequence per row."""
    budget_key: str = BUDGET_KEYS["actor"]
    """The config key of ``token_budget``, for error messages."""


def check_budget(data: PPOData, plan: MicroBatchPlan, source: str | Path) -> None:
    """Fail before any model loads when a sequence cannot fit a micro-batch, naming its table row."""
    if not plan.use_dynamic_bsz or not len(data):
        return
    lengths = data.lengths
    row = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[row] > plan.token_budget:
        raise DataError(f"{source} row {row}: prompt + response = {lengths[row]} tokens does not fit one micro-batch; "
                        f"raise {plan.budget_key} (now {plan.token_budget}) to at least {lengths[row]}")


def split_mini_batch(lengths: Sequence[int], rows: Sequence[int], plan: MicroBatchPlan,
                     world_size: int = 1, rank: int = 0) -> list[list[list[int]]]:
    """This rank's micro-batches of one mini-batch: a list of micro-batches, each a list of packed
    rows, each a list of table row indices. Every rank gets the same number of micro-batches (the
    DeepSpeed collectives run once per backward); a rank with nothing left gets ``[]`` entries, for
    which the caller runs a zero-weight step.

    Dynamic: ``micro_batches_by_budget`` (token-balanced shares across ranks). Fixed: rank r takes
    every world_size-th sequence, in chunks of ``micro_batch_size``.
    """
    local_lengths = [lengths[i] for i in rows]
    if plan.use_dynamic_bsz:
        bins = micro_batches_by_budget(local_lengths, plan.token_budget, world_size, rank, budget_key=plan.budget_key)
    else:
        share = list(range(rank, len(rows), world_size))
        bins = [[share[k] for k in b] for b in fixed_micro_batches(len(share), plan.micro_batch_size)]
        per_rank = -(-len(rows) // world_size)  # the largest share decides the common count
        bins += [[] for _ in range(-(-per_rank // plan.micro_batch_size) - len(bins))]
    width = max(local_lengths, default=0)  # ROW_WIDTH_RULE
    out = []
    for b in bins:
        if not plan.pack_rows:
            layout = [[k] for k in b]
        else:
            layout = split_into_rows(local_lengths, b, width) if b else []
        out.append([[rows[k] for k in row] for row in layout])
    return out


@dataclass
class MicroBatch:
    """One forward/backward's inputs. ``order`` lists the table rows in the (B, T) tensors' order."""

    packed: "object"  # rlhf_core.models.packed.PackedRows over local sequence indices 0..B-1
    prompt_lengths: list[int]  # (B,)
    order: list[int]  # (B,) table row of each local sequence
    tensors: dict[str, torch.Tensor]  # PER_TOKEN_COLUMNS (+ rollout_is_weights) → (B, T) float32, 0 past each response
    response_mask: torch.Tensor  # (B, T) bool: the response's tokens, less those rollout correction rejected
    weight: float = 1.0
    """0.0 for a filler micro-batch on a rank with no data left: it only keeps collectives in step."""

    @property
    def num_tokens(self) -> int:
        return self.packed.num_tokens


def _pad(arrays: Sequence[np.ndarray], T: int) -> torch.Tensor:
    out = torch.zeros(len(arrays), T, dtype=torch.float32)
    for b, a in enumerate(arrays):
        out[b, :len(a)] = torch.from_numpy(a)
    return out


def build_micro_batch(data: PPOData, layout: list[list[int]], pad_id: int,
                      filler_row: Optional[int] = None, mode: AttentionMode = "mask4d") -> MicroBatch:
    """Tensors for one micro-batch laid out as ``layout`` (rows of table indices). An empty layout
    becomes a filler: ``filler_row`` alone, weight 0. ``mode``: the packing layout of the model that
    trains on it (``packing_attention_mode``), the same one scoring used for its old log-probs."""
    weight = 1.0
    if not layout:
        if filler_row is None:
            raise ValueError("an empty micro-batch needs a filler_row")
        layout, weight = [[filler_row]], 0.0
    order = [i for row in layout for i in row]
    local = {i: k for k, i in enumerate(order)}
    sequences = [data.sequence(i) for i in order]
    packed = pack_rows([[local[i] for i in row] for row in layout], sequences, pad_id, mode=mode)
    T = max((len(data.response_ids[i]) for i in order), default=0)
    tensors = {c: _pad([data.per_token[c][i] for i in order], T) for c in data.per_token}
    lengths = torch.tensor([len(data.response_ids[i]) for i in order])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if data.kept is not None:
        mask &= _pad([data.kept[i].astype(np.float32) for i in order], T) > 0
    return MicroBatch(packed=packed, prompt_lengths=[len(data.prompt_ids[i]) for i in order], order=order,
                      tensors=tensors, response_mask=mask, weight=weight)


def global_counts(data: PPOData, rows: Sequence[int]) -> tuple[int, int]:
    """(response tokens, sequences) of a whole mini-batch, all ranks together: verl's
    ``batch_num_tokens`` and ``global_batch_size`` (which counts every sequence, an empty one too).
    Every rank reads the full table, so this needs no communication. Tokens rollout correction
    rejected do not count (they are out of the loss mask, as in verl)."""
    return sum(data.counted(i) for i in rows), len(rows)
