"""Per-token log-probs and values of finished responses, over token-budget packed micro-batches.

Each sequence is ``prompt_token_ids + response_token_ids``. Sequences are cut into micro-batches
whose real tokens fit ``budget`` (``micro_batches_by_budget``), each micro-batch is laid out as
packed rows (sequences kept apart by a block-diagonal mask), and one no-grad forward runs per
micro-batch. Only response positions are read back:

    log_probs[i][t] = log softmax(logits(s_i[:P_i + t]) / T)[response_i[t]]     t < n_i
    values[i][t]    = V(s_i[:P_i + t])       (the critic's estimate before response token t)

Memory: the LM head runs on the response positions only and the log-softmax over chunks of them
(``response_logprobs``), so no (tokens, vocabulary) logits or log-probability matrix is ever built.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from rlhf_core.data.packing import micro_batches_by_budget, split_into_rows
from rlhf_core.models.packed import (
    gather_response_values, pack_rows, packed_forward, packing_attention_mode, response_logprobs,
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

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def plan_micro_batches(lengths: Sequence[int], budget: int, row_tokens: int = ROW_TOKENS) -> list[list[list[int]]]:
    """Micro-batches, each a list of packed rows, each a list of sequence indices."""
    width = max(row_tokens, max(lengths, default=0))
    return [split_into_rows(lengths, mb, width) for mb in
            micro_batches_by_budget(lengths, budget, budget_key=BUDGET_KEY)]


def _check_inputs(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> None:
    if len(sequences) != len(prompt_lengths):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths")
    for i, (seq, p) in enumerate(zip(sequences, prompt_lengths)):
        if not 1 <= p <= len(seq):
            raise ValueError(f"sequence {i}: prompt length {p} must be in 1..{len(seq)} (sequence length)")


@torch.no_grad()
def _packed_passes(model: torch.nn.Module, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
                   budget: int, score: Callable, *, pad_id: int, row_tokens: int, desc: str,
                   throughput: Optional[Throughput], progress: Optional[bool]) -> list[torch.Tensor]:
    """Run ``model`` over packed micro-batches; ``score(packed)`` → {index: (n_i,) tensor}."""
    from tqdm.auto import tqdm

    _check_inputs(sequences, prompt_lengths)
    lengths = [len(s) for s in sequences]
    plan = plan_micro_batches(lengths, budget, row_tokens)
    mode = packing_attention_mode(model)  # block-diagonal 4-D mask, or flash-attention varlen on CUDA
    out: list[Optional[torch.Tensor]] = [None] * len(sequences)
    started = time.perf_counter()
    with tqdm(total=sum(lengths), desc=desc, unit="tok", unit_scale=True, leave=False,
              disable=bar_disabled(progress)) as bar:
        for rows in plan:
            packed = pack_rows(rows, sequences, pad_id, mode=mode)
            for i, tensor in score(packed).items():
                out[i] = tensor.detach().float().cpu()
            bar.update(packed.num_tokens)
    if throughput is not None:
        throughput.tokens += sum(lengths)
        throughput.seconds += time.perf_counter() - started
        throughput.passes[desc] = throughput.passes.get(desc, 0) + len(plan)
    return out  # type: ignore[return-value]


def compute_token_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]],
                           prompt_lengths: Sequence[int], budget: int, temperature: float = 1.0, *,
                           pad_id: int = 0, row_tokens: int = ROW_TOKENS, desc: str = "log-probs",
                           throughput: Optional[Throughput] = None,
                           progress: Optional[bool] = None) -> list[torch.Tensor]:
    """log p(response token t | sequence before it) under ``model`` at ``temperature``.

    Args:
        model: causal LM in eval mode (sdpa or eager: 4-D block mask; flash-attention on CUDA: varlen).
        sequences: N token-id lists, prompt followed by response.
        prompt_lengths: N prompt lengths P_i (>= 1).
        budget: real tokens per micro-batch (every sequence must fit alone).
        temperature: the sampling temperature; logits are divided by it.
    Returns:
        N float32 CPU tensors, tensor i of shape (len(sequences[i]) - P_i,).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to define log-probs, got {temperature}")

    def score(packed):
        return response_logprobs(model, packed, prompt_lengths, temperature=temperature)

    return _packed_passes(model, sequences, prompt_lengths, budget, score, pad_id=pad_id,
                          row_tokens=row_tokens, desc=desc, throughput=throughput, progress=progress)


def compute_token_values(critic: torch.nn.Module, sequences: Sequence[Sequence[int]],
                         prompt_lengths: Sequence[int], budget: int, *, pad_id: int = 0,
                         row_tokens: int = ROW_TOKENS, desc: str = "values",
                         throughput: Optional[Throughput] = None,
                         progress: Optional[bool] = None) -> list[torch.Tensor]:
    """V(state before response token t) from a one-label token-classification critic.

    Same inputs as ``compute_token_logprobs``; returns N float32 CPU tensors of shape (n_i,).
    """

    def score(packed):
        return gather_response_values(packed_forward(critic, packed), packed, prompt_lengths)

    return _packed_passes(critic, sequences, prompt_lengths, budget, score, pad_id=pad_id,
                          row_tokens=row_tokens, desc=desc, throughput=throughput, progress=progress)
