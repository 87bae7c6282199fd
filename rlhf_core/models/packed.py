"""Packed forward passes: several sequences in one row, kept apart.

A packed row concatenates sequences ``s_0 s_1 …``; ``position_ids`` restart at 0 for each, and the
attention layout keeps them apart. On CPU (and wherever flash-attention is absent) that layout is a
4-D block-diagonal causal mask used with sdpa: position_ids alone do NOT isolate sequences under
sdpa/eager (measured: the second sequence attends to the first). With flash-attention 2 on CUDA,
transformers detects packed sequences from the restarting position_ids and runs the variable-length
kernel, so no mask is built.

Shapes: R rows, L = longest row (right-padded), V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # (R, L) long, right-padded with pad_id
    position_ids: torch.Tensor  # (R, L) long, restart at 0 per sequence; padding continues counting
    attention_mask: Optional[torch.Tensor]  # (R, 1, L, L) bool, True = may attend; None for varlen kernels
    spans: list[list[tuple[int, int, int]]] = field(default_factory=list)
    """Per row, (sequence index, start, end) of each sequence in the row."""

    @property
    def num_tokens(self) -> int:
        return sum(end - start for row in self.spans for _, start, end in row)


def block_causal_mask(lengths: Sequence[int], total: int) -> torch.Tensor:
    """(total, total) bool: token i may attend to j iff same sequence and j <= i. Padding tokens
    (after the last sequence) attend to themselves only, so no softmax row is empty (NaN)."""
    seg = torch.full((total,), -1, dtype=torch.long)
    start = 0
    for i, n in enumerate(lengths):
        seg[start:start + n] = i
        start += n
    pad = seg < 0
    seg[pad] = -1 - torch.arange(int(pad.sum()))  # each pad token its own segment
    same = seg[:, None] == seg[None, :]
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    return same & causal


def pack_rows(rows: Sequence[Sequence[int]], sequences: Sequence[Sequence[int]], pad_id: int,
              build_mask: bool = True) -> PackedRows:
    """Lay out ``sequences`` (token id lists) into rows; ``rows[r]`` lists the sequence indices that
    share row r (from the packer). ``build_mask=False`` leaves the isolation to a varlen kernel."""
    row_lens = [sum(len(sequences[i]) for i in row) for row in rows]
    L = max(row_lens) if row_lens else 0
    R = len(rows)
    input_ids = torch.full((R, L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((R, L), dtype=torch.long)
    masks = [] if build_mask else None
    spans = []
    for r, row in enumerate(rows):
        start, row_spans, lengths = 0, [], []
        for i in row:
            seq = torch.as_tensor(list(sequences[i]), dtype=torch.long)
            n = seq.numel()
            input_ids[r, start:start + n] = seq
            position_ids[r, start:start + n] = torch.arange(n)
            row_spans.append((i, start, start + n))
            lengths.append(n)
            start += n
        position_ids[r, start:] = torch.arange(L - start)
        spans.append(row_spans)
        if masks is not None:
            masks.append(block_causal_mask(lengths, L))
    mask = torch.stack(masks)[:, None] if masks else None
    return PackedRows(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, spans=spans)


def packed_forward(model: torch.nn.Module, packed: PackedRows) -> torch.Tensor:
    """Run ``model`` on packed rows; returns its main output (logits (R, L, V) for a causal LM,
    (R, L, 1) for a token-classification value model)."""
    device = next(model.parameters()).device
    kwargs = dict(input_ids=packed.input_ids.to(device), position_ids=packed.position_ids.to(device),
                  use_cache=False)
    if packed.attention_mask is not None:
        kwargs["attention_mask"] = packed.attention_mask.to(device)
    return model(**kwargs).logits


def response_slices(packed: PackedRows, prompt_lengths: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """For each sequence: (seq index, row, first, last) positions whose next-token logits predict the
    response tokens — i.e. logits[row, first:last] score tokens input_ids[row, first+1:last+1]."""
    out = []
    for r, row in enumerate(packed.spans):
        for i, start, end in row:
            first = start + prompt_lengths[i] - 1
            out.append((i, r, first, end - 1))
    return out


def gather_response_logprobs(logits: torch.Tensor, packed: PackedRows, prompt_lengths: Sequence[int],
                             temperature: float = 1.0, chunk_tokens: int = 4096) -> dict[int, torch.Tensor]:
    """{sequence index: log p(response token) (n_response,)} from packed logits.

    Only response positions are gathered, and the log-softmax runs over chunks of them, so the full
    (tokens, V) log-probability matrix is never materialised. Logits are divided by the sampling
    temperature, matching the distribution the tokens were drawn from.
    """
    pieces, labels, owners = [], [], []
    for i, r, first, last in response_slices(packed, prompt_lengths):
        pieces.append(logits[r, first:last])
        labels.append(packed.input_ids[r, first + 1:last + 1].to(logits.device))
        owners.append((i, last - first))
    if not pieces:
        return {}
    flat_logits = torch.cat(pieces)  # (N, V) response positions only
    flat_labels = torch.cat(labels)
    out = []
    for s in range(0, flat_logits.shape[0], chunk_tokens):
        chunk = flat_logits[s:s + chunk_tokens].float() / temperature
        picked = chunk.gather(-1, flat_labels[s:s + chunk_tokens, None]).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    flat = torch.cat(out)
    result, offset = {}, 0
    for i, n in owners:
        result[i] = flat[offset:offset + n]
        offset += n
    return result


def gather_response_values(values: torch.Tensor, packed: PackedRows,
                           prompt_lengths: Sequence[int]) -> dict[int, torch.Tensor]:
    """{sequence index: V(state before each response token) (n_response,)} from a value head's
    (R, L, 1) output, aligned with the log-probs: value at position t scores the action t+1."""
    result = {}
    for i, r, first, last in response_slices(packed, prompt_lengths):
        result[i] = values[r, first:last, 0]
    return result
