"""Forward passes with gradients over packed micro-batches, returning (B, T) response tensors.

``rlhf_core.models.packed`` lays sequences out and runs the model; here only the response positions
are picked out of the packed output (the actor's LM head runs on those positions alone) and turned into per-token log-probs, entropies (actor) or
values (critic), padded to (B, T) in the micro-batch's sequence order. Log-probs and entropy use
``rlhf_core.algos``' chunked custom-autograd functions over the (N, V) response logits only, so no
(tokens, V) log-softmax copy is kept for backward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn.utils.rnn import pad_sequence

from rlhf_core.algos.logits import entropy_from_logits, logprobs_from_logits
from rlhf_core.models.packed import packed_forward, response_slices
from rlhf_core.training.batch import MicroBatch


def _by_sequence(mb: MicroBatch) -> list[tuple[int, int, int]]:
    """(row, first, last) per local sequence 0..B-1: logits[row, first:last] score its response."""
    slices = {i: (r, first, last) for i, r, first, last in response_slices(mb.packed, mb.prompt_lengths)}
    return [slices[i] for i in range(len(mb.order))]


def _to_padded(flat: torch.Tensor, counts: list[int], T: int) -> torch.Tensor:
    """(N,) → (B, T), zero past each sequence's count."""
    pieces = list(torch.split(flat, counts))
    out = pad_sequence(pieces, batch_first=True) if pieces else flat.new_zeros(0, 0)
    if out.shape[1] < T:
        out = torch.nn.functional.pad(out, (0, T - out.shape[1]))
    return out


def actor_forward(model, mb: MicroBatch, temperature: float = 1.0, *, entropy: bool = True,
                  entropy_grad: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probs (B, T) of the responses under ``model`` at ``temperature``, and the
    policy's entropy (B, T) at each response position (None when ``entropy`` is False).

    ``entropy_grad``: keep the entropy in the autograd graph (only when it enters the loss).
    Positions past a response's end are 0.
    """
    slices = _by_sequence(mb)
    rows = torch.cat([torch.full((b - a,), r, dtype=torch.long) for r, a, b in slices])
    cols = torch.cat([torch.arange(a, b) for _, a, b in slices])
    flat = packed_forward(model, mb.packed, positions=(rows, cols))  # (N, V) response positions only
    if temperature != 1.0:
        flat = flat / temperature
    labels = mb.packed.input_ids[rows, cols + 1].to(flat.device)
    counts = [b - a for _, a, b in slices]
    T = mb.response_mask.shape[1]
    log_prob = _to_padded(logprobs_from_logits(flat, labels), counts, T)
    ent = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = _to_padded(entropy_from_logits(flat), counts, T)
    return log_prob, ent


def critic_forward(model, mb: MicroBatch) -> torch.Tensor:
    """V(state before response token t) (B, T) from a one-label token-classification model."""
    values = packed_forward(model, mb.packed)  # (R, L, 1)
    slices = _by_sequence(mb)
    flat = torch.cat([values[r, a:b, 0] for r, a, b in slices]).float()
    return _to_padded(flat, [b - a for _, a, b in slices], mb.response_mask.shape[1])
