"""Per-token log-probs and values of finished responses, over micro-batches cut as verl cuts them.

Each sequence is ``prompt_token_ids + response_token_ids``. The ``batching`` argument (a
``config.resolve.MicroBatching``, from ``micro_batching(cfg, "rollout" | "ref")`` or
``critic_value_batching``) says how sequences are grouped into forwards:

    use_dynamic_bsz   micro-batches whose real tokens fit ``token_budget`` (``micro_batches_by_budget``)
    otherwise         ``micro_batch_size`` consecutive sequences per forward (verl's ``split``)

and ``packed`` (``actor_rollout_ref.model.use_remove_padding``; the critic's own key) how one
micro-batch is laid out: several sequences per row kept apart by a block-diagonal mask (or one
flattened varlen row with flash-attention), or one right-padded sequence per row. Both layouts
give the same numbers (up to float rounding); packing only wastes fewer slots. A plain ``int``
budget is read as dynamic batching with packing (the older call form). One no-grad forward runs
per micro-batch. Only response positions are read back:

    log_probs[i][t] = log softmax(logits(s_i[:P_i + t]) / T)[response_i[t]]     t < n_i
    values[i][t]    = V(s_i[:P_i + t])       (the critic's estimate before response token t)

Memory: the LM head runs on the response positions only, in row blocks past
``models.packed.HEAD_CHUNK_BYTES``, and the log-softmax over chunks of them (``response_logprobs``), so
no (tokens, vocabulary) logits or log-probability matrix is ever built, nor a real vocabulary's
(responses, vocabulary) one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from rlhf_core.config.resolve import MicroBatching
from rlhf_core.data.packing import (
    Bins, Share, fixed_micro_batches, micro_batches_by_budget, shard_by_tokens, split_into_rows,
)
from rlhf_core.models.packed import (
    gather_response_values, pack_rows, packed_forward, packing_attention_mode, response_logprobs,
    response_positions,
)
from rlhf_core.progress import bar_disabled

BUDGET_KEY = "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"

ROW_TOKENS = 0
"""Minimum packed row width; 0 = rows as wide as the batch's longest sequence. With a dense 4-D mask
attention costs L² per row whatever the mask hides, so rows no wider than the longest sequence only
fill padding that pad-to-longest would waste. Measured on the tiny model, 256 demo-shaped sequences
(actor log-probs + critic values, budget 8192): 0.29-0.30 s with longest-wide rows vs 0.51-0.56 s with
512-token rows on 1 thread, 0.20-0.24 vs 0.31-0.36 s on 2. Ignored in varlen mode (flash-attention)."""


@dataclass
class Throughput:
    """Tokens pushed through forward passes and the seconds they took (summed over calls)."""

    tokens: int = 0
    seconds: float = 0.0
    passes: dict[str, int] = field(default_factory=dict)
    """Micro-batches per pass (by its progress description)."""
    pass_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds per pass (by its progress description)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


Batching = Union[MicroBatching, int]
"""How forwards are cut: a MicroBatching, or an int token budget (dynamic batching)."""

def own_micro_batches(plan: list[list[list[int]]], lengths: Sequence[int], rank: int,
                      world: int) -> list[list[list[int]]]:
    """Rank ``rank``'s micro-batches of ``plan`` (the one-process plan, micro-batches dealt by token
    load, ``shard_by_tokens``). Every micro-batch is laid out exactly as in one process, so each
    sequence's outputs are the one-process outputs bit for bit, whatever ``world`` is."""
    loads = [sum(lengths[i] for row in rows for i in row) for rows in plan]
    return [plan[j] for j in shard_by_tokens(loads, world)[rank]]


def as_micro_batching(batching: Batching) -> MicroBatching:
    """A plain token budget means dynamic batching by that budget."""
    if isinstance(batching, MicroBatching):
        return batching
    if batching is None:  # an Optional budget key read raw: its fall-back lives in config.resolve
        raise TypeError("no token budget given (None): pass config.resolve.micro_batching(cfg, role) or "
                        "critic_value_batching, which apply verl's fall-backs for unset budgets")
    return MicroBatching(use_dynamic_bsz=True, token_budget=int(batching), micro_batch_size=1)


def micro_batch_indices(lengths: Sequence[int], budget: Batching, budget_key: str = BUDGET_KEY) -> Bins:
    """Sequence indices per forward: by token budget with use_dynamic_bsz (``budget_key`` names the
    budget in the error for a sequence that does not fit), else ``micro_batch_size`` in order."""
    b = as_micro_batching(budget)
    if b.use_dynamic_bsz:
        return micro_batches_by_budget(lengths, b.token_budget, budget_key=budget_key)
    return fixed_micro_batches(len(lengths), b.micro_batch_size)


def plan_micro_batches(lengths: Sequence[int], budget: Batching, row_tokens: int = ROW_TOKENS, *,
                       packed: bool = True, budget_key: str = BUDGET_KEY) -> list[list[list[int]]]:
    """Micro-batches (cut by ``budget``: a MicroBatching, or an int token budget), each a list of
    rows, each a list of sequence indices: packed rows at least ``row_tokens`` wide when
    ``packed``, else one sequence per row."""
    width = max(row_tokens, max(lengths, default=0))
    micro = micro_batch_indices(lengths, budget, budget_key)
    if not packed:
        return [[[i] for i in mb] for mb in micro]
    return [split_into_rows(lengths, mb, width) for mb in micro]


def _check_inputs(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> None:
    if len(sequences) != len(prompt_lengths):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths")
    for i, (seq, p) in enumerate(zip(sequences, prompt_lengths)):
        if not 1 <= p <= len(seq):
            raise ValueError(f"sequence {i}: prompt length {p} must be in 1..{len(seq)} (sequence length)")


@torch.no_grad()
def _packed_passes(model: torch.nn.Module, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
                   batching: Batching, score: Callable, *, pad_id: int, row_tokens: int, packed: bool,
                   budget_key: str, desc: str, throughput: Optional[Throughput],
                   progress: Optional[bool], share: Optional[Share] = None) -> list[torch.Tensor]:
    """Run ``model`` over the micro-batches (this process's, with ``share``); ``score(packed rows)``
    → {index: (n_i,) tensor}."""
    from tqdm.auto import tqdm

    _check_inputs(sequences, prompt_lengths)
    lengths = [len(s) for s in sequences]
    plan = plan_micro_batches(lengths, batching, row_tokens, packed=packed, budget_key=budget_key)
    if share is not None:
        plan = own_micro_batches(plan, lengths, *share)
    # packed: block-diagonal 4-D mask, or flash-attention varlen on CUDA; padded: one sequence per
    # row, which needs no mask under causal attention (the padding comes after every real token)
    mode = packing_attention_mode(model) if packed else "mask4d"
    out: list[Optional[torch.Tensor]] = [None] * len(sequences)
    started = time.perf_counter()
    with tqdm(total=sum(lengths[i] for rows in plan for row in rows for i in row), desc=desc, unit="tok", unit_scale=True, leave=False,
              disable=bar_disabled(progress)) as bar:
        for rows in plan:
            layout = pack_rows(rows, sequences, pad_id, mode=mode)
            for i, tensor in score(layout).items():
                out[i] = tensor.detach().float().cpu()
            bar.update(layout.num_tokens)
    if throughput is not None:
        elapsed = time.perf_counter() - started
        throughput.tokens += sum(lengths[i] for rows in plan for row in rows for i in row)
        throughput.seconds += elapsed
        throughput.passes[desc] = throughput.passes.get(desc, 0) + len(plan)
        throughput.pass_seconds[desc] = throughput.pass_seconds.get(desc, 0.0) + elapsed
    return out  # type: ignore[return-value]


def compute_token_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]],
                           prompt_lengths: Sequence[int], budget: Batching, temperature: float = 1.0, *,
                           pad_id: int = 0, row_tokens: int = ROW_TOKENS, packed: bool = True,
                           budget_key: str = BUDGET_KEY, desc: str = "log-probs",
                           throughput: Optional[Throughput] = None,
                           progress: Optional[bool] = None, share: Optional[Share] = None,
                           sum_pi_squared: bool = False,
                           head_inputs: Optional[dict[int, torch.Tensor]] = None) -> list[torch.Tensor]:
    """log p(response token t | sequence before it) under ``model`` at ``temperature``.

    Args:
        model: causal LM in eval mode (sdpa or eager: 4-D block mask; flash-attention on CUDA: varlen).
        sequences: N token-id lists, prompt followed by response.
        prompt_lengths: N prompt lengths P_i (>= 1).
        budget: how forwards are cut (a ``MicroBatching``; an int = dynamic batching by that many
            real tokens per micro-batch, every sequence must fit alone).
        temperature: the sampling temperature; logits are divided by it.
        packed: several sequences per row (use_remove_padding) or one padded sequence per row.
        budget_key: the config key named when a sequence does not fit the token budget.
        share: (rank, world): only this process's micro-batches of the whole plan (``own_micro_batches``).
        sum_pi_squared: also sum_v pi_v^2 of the same softmax (verl's actor.calculate_sum_pi_squared).
        head_inputs: filled with {i: (n_i, H)}, the LM head's input at sequence i's response positions
            (the last hidden states the log-probs come from; ``scoring.ref_states`` keeps them).
    Returns:
        N float32 CPU tensors, tensor i of shape (len(sequences[i]) - P_i,), or (.., 2) with
        ``sum_pi_squared`` (None for the sequences of other processes' micro-batches when ``share`` is given).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to define log-probs, got {temperature}")

    def score(layout):
        seen: list[torch.Tensor] = []  # the head's input at the response positions, (N, H)
        out = response_logprobs(model, layout, prompt_lengths, temperature=temperature,
                                sum_pi_squared=sum_pi_squared, hidden_out=seen if head_inputs is not None else None)
        offset = 0
        for i, n in response_positions(layout, prompt_lengths)[2] if seen else ():
            head_inputs[i] = seen[0][offset:offset + n]
            offset += n
        return out

    return _packed_passes(model, sequences, prompt_lengths, budget, score, pad_id=pad_id, row_tokens=row_tokens,
                          packed=packed, budget_key=budget_key, desc=desc, throughput=throughput,
                          progress=progress, share=share)


def compute_token_values(critic: torch.nn.Module, sequences: Sequence[Sequence[int]],
                         prompt_lengths: Sequence[int], budget: Batching, *, pad_id: int = 0,
                         row_tokens: int = ROW_TOKENS, packed: bool = True,
                         budget_key: str = "critic.forward_max_token_len_per_gpu", desc: str = "values",
                         throughput: Optional[Throughput] = None,
                         progress: Optional[bool] = None, share: Optional[Share] = None) -> list[torch.Tensor]:
    """V(state before response token t) from a one-label token-classification critic.

    Same inputs as ``compute_token_logprobs``; returns N float32 CPU tensors of shape (n_i,).
    """

    def score(layout):
        return gather_response_values(packed_forward(critic, layout), layout, prompt_lengths)

    return _packed_passes(critic, sequences, prompt_lengths, budget, score, pad_id=pad_id, row_tokens=row_tokens,
                          packed=packed, budget_key=budget_key, desc=desc, throughput=throughput,
                          progress=progress, share=share)
