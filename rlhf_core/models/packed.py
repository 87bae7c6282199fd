"""Packed forward passes: several sequences in one row, kept apart.

A packed row concatenates sequences ``s_0 s_1 …``; ``position_ids`` restart at 0 for each, and the
attention layout keeps them apart. Two layouts (``packing_attention_mode`` picks one per model):

``"mask4d"`` (CPU, sdpa/eager anywhere): R right-padded rows plus a 4-D block-diagonal causal mask
    (R, 1, L, L), passed explicitly. Measured with transformers 5.24 on the tiny model: with a KV
    cache present (``use_cache=True``) position_ids alone do NOT isolate sequences (the second
    attends to the first); without a cache transformers' masking utilities infer the block mask
    from the restarting position_ids (``find_packed_sequence_indices``). We pass the mask ourselves
    so correctness never rests on that inference. Eager attention adds the mask to the scores, so
    it gets an additive float mask; sdpa takes the bool one.
``"varlen"`` (flash-attention on CUDA; ``sdpa_varlen`` anywhere): every sequence flattened into ONE
    row (1, N) without padding — transformers only treats position_ids as packed when the batch size is 1 — plus the
    ``cu_seq_lens_q/k`` and ``max_length_q/k`` kwargs (the same ones ``DataCollatorWithFlattening``
    returns), so the variable-length kernel runs without scanning position_ids in every layer.

Shapes: R rows, L = longest row (right-padded), V vocabulary, N = total tokens, S = sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal, Optional, Sequence

import torch

from rlhf_core.models.attention import is_flash, takes_varlen

AttentionMode = Literal["mask4d", "varlen"]


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # (R, L) long, right-padded with pad_id; (1, N) in varlen mode
    position_ids: torch.Tensor  # (R, L) long, restart at 0 per sequence (and for a packed row's padding)
    attention_mask: Optional[torch.Tensor]  # (R, 1, L, L) bool, True = may attend; None for varlen kernels
    spans: list[list[tuple[int, int, int]]] = field(default_factory=list)
    """Per row, (sequence index, start, end) of each sequence in the row."""
    cu_seq_lens: Optional[torch.Tensor] = None
    """varlen: (S + 1,) int32 cumulative sequence starts in the flattened row; None for mask4d."""
    max_length: int = 0
    """varlen: longest sequence (flash-attention's max_seqlen)."""

    @property
    def num_tokens(self) -> int:
        return sum(end - start for row in self.spans for _, start, end in row)

    @property
    def mode(self) -> AttentionMode:
        return "varlen" if self.cu_seq_lens is not None else "mask4d"


def _hf_config(model: torch.nn.Module):
    """The Hugging Face config of a model, also through a DeepSpeed engine (``.module``)."""
    config = getattr(model, "config", None)
    if config is None and hasattr(model, "module"):
        config = getattr(model.module, "config", None)
    return config


def packing_attention_mode(model: torch.nn.Module) -> AttentionMode:
    """'varlen' for a model whose attention implementation takes cu_seq_lens (flash_attention_2/3,
    a kernels-hub flash variant, sdpa_varlen), else 'mask4d'."""
    impl = getattr(_hf_config(model), "_attn_implementation", None) or ""
    return "varlen" if takes_varlen(impl) else "mask4d"


def block_causal_mask(lengths: Sequence[int], total: int) -> torch.Tensor:
    """(total, total) bool: token i may attend to j iff same sequence and j <= i. Padding tokens
    (after the last sequence) attend to themselves only, so no softmax row is empty (NaN)."""
    used = sum(lengths)
    seg = torch.cat([torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(list(lengths), dtype=torch.long)),
                     -1 - torch.arange(total - used)])  # each pad token its own segment
    same = seg[:, None] == seg[None, :]
    return same.tril_()


def _pack_varlen(rows: Sequence[Sequence[int]], sequences: Sequence[Sequence[int]]) -> PackedRows:
    """All sequences of ``rows`` (in row order) in one unpadded row with cu_seq_lens."""
    order = [i for row in rows for i in row]
    pieces = [torch.as_tensor(list(sequences[i]), dtype=torch.long) for i in order]
    lengths = [p.numel() for p in pieces]
    input_ids = torch.cat(pieces)[None] if pieces else torch.zeros((1, 0), dtype=torch.long)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None] if pieces else input_ids.clone()
    starts = torch.tensor([0] + lengths).cumsum(0)
    spans = [[(i, int(starts[k]), int(starts[k + 1])) for k, i in enumerate(order)]]
    return PackedRows(input_ids=input_ids, position_ids=position_ids, attention_mask=None, spans=spans,
                      cu_seq_lens=starts.to(torch.int32), max_length=max(lengths, default=0))


def pack_rows(rows: Sequence[Sequence[int]], sequences: Sequence[Sequence[int]], pad_id: int,
              build_mask: bool = True, *, mode: Optional[AttentionMode] = None) -> PackedRows:
    """Lay out ``sequences`` (token id lists); ``rows[r]`` lists the sequence indices that share
    row r (from the packer, e.g. ``rlhf_core.data.packing.split_into_rows``).

    ``mode`` ("mask4d" | "varlen", usually ``packing_attention_mode(model)``) wins over the older
    ``build_mask`` flag (True = "mask4d", False = "varlen"). In "varlen" mode the rows are flattened
    into one row: a varlen kernel has no padding to skip and no row width to respect.
    """
    mode = mode or ("mask4d" if build_mask else "varlen")
    if mode == "varlen":
        return _pack_varlen(rows, sequences)
    if mode != "mask4d":
        raise ValueError(f"unknown packing attention mode {mode!r}; valid: 'mask4d', 'varlen'")
    row_lens = [sum(len(sequences[i]) for i in row) for row in rows]
    L = max(row_lens) if row_lens else 0
    R = len(rows)
    input_ids = torch.full((R, L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((R, L), dtype=torch.long)
    spans, row_lengths = [], []
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
        row_lengths.append(lengths)
    if all(len(row) <= 1 for row in rows):
        return _single_sequence_rows(input_ids, spans)
    mask = torch.stack([block_causal_mask(lengths, L) for lengths in row_lengths])[:, None]
    return PackedRows(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, spans=spans)


def _single_sequence_rows(input_ids: torch.Tensor, spans: list[list[tuple[int, int, int]]]) -> PackedRows:
    """Rows of one right-padded sequence each need no mask: under plain causal attention a real
    token only sees the tokens before it in its own sequence, and the padding after it never
    influences it. Without a mask sdpa takes its causal fast path (no (R, 1, L, L) tensor; on CPU
    the flash kernel), and the position ids simply count on through the padding."""
    R, L = input_ids.shape
    position_ids = torch.arange(L).expand(R, L).clone()
    return PackedRows(input_ids=input_ids, position_ids=position_ids, attention_mask=None, spans=spans)


def _attention_kwargs(model: torch.nn.Module, packed: PackedRows, device: torch.device) -> dict:
    """The attention arguments of ``packed``'s layout, in the form the model's attention takes."""
    impl = getattr(_hf_config(model), "_attn_implementation", None) or ""
    if packed.mode == "varlen":
        cu = packed.cu_seq_lens.to(device)
        return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=packed.max_length,
                    max_length_k=packed.max_length)
    if packed.attention_mask is None:
        return {}
    if is_flash(impl):
        raise ValueError("flash-attention cannot take a 4-D mask: pack with "
                         "mode=packing_attention_mode(model) (= 'varlen' for this model)")
    mask = packed.attention_mask.to(device)
    if impl == "eager":  # eager adds the mask to the scores: a bool mask would add 1.0, not -inf
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
    return {"attention_mask": mask}


def packed_forward(model: torch.nn.Module, packed: PackedRows,
                   positions: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Run ``model`` on packed rows; returns its main output (logits (R, L, V) for a causal LM,
    (R, L, 1) for a token-classification value model). ``use_cache=False``: a cache is never
    wanted for scoring/training and would change how transformers reads the position_ids.

    ``positions`` = (rows, cols), two (N,) index tensors: return only the outputs at those positions,
    (N, V). For a model with an output-embedding head (a causal LM) the head then runs on those N
    hidden states only — on short responses after long prompts most of the (R, L, V) logits (and
    their backward) are never needed."""
    device = next(model.parameters()).device
    kwargs = dict(input_ids=packed.input_ids.to(device), position_ids=packed.position_ids.to(device),
                  use_cache=False, **_attention_kwargs(model, packed, device))
    if positions is None:
        return model(**kwargs).logits
    rows, cols = positions[0].to(device), positions[1].to(device)
    head = output_head(model)
    if head is None:
        return model(**kwargs).logits[rows, cols]
    hook = head.register_forward_pre_hook(lambda _module, args: (args[0][rows, cols], *args[1:]))
    try:
        return model(**kwargs).logits
    finally:
        hook.remove()


def output_head(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The output-embedding head (lm_head) of a Hugging Face model, also behind a DeepSpeed engine
    (``.module``) or peft; None when the model has none (e.g. a token-classification critic)."""
    inner = model.module if hasattr(model, "module") and not hasattr(model, "get_output_embeddings") else model
    getter = getattr(inner, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if isinstance(head, torch.nn.Module) else None


def response_slices(packed: PackedRows, prompt_lengths: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """For each sequence: (seq index, row, first, last) positions whose next-token logits predict the
    response tokens — i.e. logits[row, first:last] score tokens input_ids[row, first+1:last+1]."""
    out = []
    for r, row in enumerate(packed.spans):
        for i, start, end in row:
            first = start + prompt_lengths[i] - 1
            out.append((i, r, first, end - 1))
    return out


def response_positions(packed: PackedRows, prompt_lengths: Sequence[int]
                       ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """(rows, cols, owners): the (N,) row and column of every response-scoring position (those whose
    next-token output scores a response token), and (sequence index, count) per sequence in order."""
    rows, cols, owners = [], [], []
    for i, r, first, last in response_slices(packed, prompt_lengths):
        rows.append(torch.full((last - first,), r, dtype=torch.long))
        cols.append(torch.arange(first, last))
        owners.append((i, last - first))
    if not owners:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), []
    return torch.cat(rows), torch.cat(cols), owners


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 ``logits / temperature``; at temperature 1 fp32 logits themselves (x / 1 is x: no copy)."""
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def _chunked_logprobs(flat_logits: torch.Tensor, flat_labels: torch.Tensor, temperature: float,
                      chunk_tokens: int, sum_pi_squared: bool = False) -> torch.Tensor:
    """log softmax(logits / T)[label] per row of (N, V) logits, ``chunk_tokens`` rows at a time: (N,).
    With ``sum_pi_squared`` (N, 2): the log-prob and sum over the vocabulary of softmax(logits / T)^2."""
    out = []
    for s in range(0, flat_logits.shape[0], chunk_tokens):
        chunk = scaled(flat_logits[s:s + chunk_tokens], temperature)
        log_z = torch.logsumexp(chunk, dim=-1)
        picked = chunk.gather(-1, flat_labels[s:s + chunk_tokens, None]).squeeze(-1) - log_z
        if sum_pi_squared:
            squares = torch.exp(2 * (chunk - log_z.unsqueeze(-1))).sum(dim=-1)
            out.append(torch.stack([picked, squares], dim=-1))
        else:
            out.append(picked)
    return torch.cat(out)


def _split_by_owner(flat: torch.Tensor, owners: list[tuple[int, int]]) -> dict[int, torch.Tensor]:
    result, offset = {}, 0
    for i, n in owners:
        result[i] = flat[offset:offset + n]
        offset += n
    return result


def gather_response_logprobs(logits: torch.Tensor, packed: PackedRows, prompt_lengths: Sequence[int],
                             temperature: float = 1.0, chunk_tokens: int = 4096) -> dict[int, torch.Tensor]:
    """{sequence index: log p(response token) (n_response,)} from packed logits.

    Only response positions are gathered, and the log-softmax runs over chunks of them, so the full
    (tokens, V) log-probability matrix is never materialised. Logits are divided by the sampling
    temperature, matching the distribution the tokens were drawn from.
    """
    rows, cols, owners = response_positions(packed, prompt_lengths)
    if not owners:
        return {}
    labels = packed.input_ids[rows, cols + 1].to(logits.device)
    flat = _chunked_logprobs(logits[rows.to(logits.device), cols.to(logits.device)], labels, temperature, chunk_tokens)
    return _split_by_owner(flat, owners)


HEAD_CHUNK_BYTES = 256 << 20
"""Largest fp32 (rows, V) logits block a no-grad pass builds at once. A real vocabulary's logits are
the largest tensor of a pass (32 responses × 500 tokens × 49,152 = 3.1 GB): past this size the LM
head runs on row blocks of the response positions' hidden states, each block reduced before the next.
Under it (the tiny model always, typical micro-batches) the head runs once, as it always did."""


def head_rows(n: int, vocab: int) -> int:
    """Rows per LM-head block for ``n`` positions of a ``vocab``-wide head (n itself when they fit)."""
    per_row = 4 * max(vocab, 1)
    return n if n * per_row <= HEAD_CHUNK_BYTES else max(1, HEAD_CHUNK_BYTES // per_row)


def response_hidden(model: torch.nn.Module, packed: PackedRows,
                    positions: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.nn.Module]:
    """(the LM head's input at ``positions`` (N, H), the head) of ``model``'s forward on ``packed``: the
    head itself runs on no row here, so its (N, V) output is never built; ``head_logits`` runs it."""
    head = output_head(model)
    if head is None:
        raise ValueError("response_hidden needs a causal LM (a model with an output-embedding head)")
    device = next(model.parameters()).device
    rows, cols = positions[0].to(device), positions[1].to(device)
    seen: list[torch.Tensor] = []

    def keep_and_skip(_module, args):
        seen.append(args[0][rows, cols])
        return (seen[-1][:0], *args[1:])  # the head on 0 rows

    hook = head.register_forward_pre_hook(keep_and_skip)
    try:
        packed_forward(model, packed)
    finally:
        hook.remove()
    return seen[0], head


def head_logits(head: torch.nn.Module, hidden: torch.Tensor) -> Iterator[torch.Tensor]:
    """``head(hidden)`` in row blocks whose fp32 logits stay within HEAD_CHUNK_BYTES (``head_rows``):
    (rows_b, V) each, in order, in the head's dtype (one block: exactly the head on all rows)."""
    vocab = head.weight.shape[0] if getattr(head, "weight", None) is not None else 1
    step = head_rows(hidden.shape[0], vocab)
    for s in range(0, hidden.shape[0], step):
        yield head(hidden[s:s + step])


def response_logprobs(model: torch.nn.Module, packed: PackedRows, prompt_lengths: Sequence[int],
                      temperature: float = 1.0, chunk_tokens: int = 4096,
                      sum_pi_squared: bool = False, hidden_out: Optional[list] = None) -> dict[int, torch.Tensor]:
    """``gather_response_logprobs`` of ``model``'s forward on ``packed``, with the LM head run on the
    response positions only, in row blocks (``head_logits``): the same values, without the prompt
    positions' logits nor, past HEAD_CHUNK_BYTES, the responses' whole (N, V). With ``sum_pi_squared``
    each entry is (n, 2): log-prob and sum_v pi_v^2 of the same softmax. ``hidden_out``: gets the
    head's input (N, H) appended (what ``scoring.ref_states`` keeps)."""
    rows, cols, owners = response_positions(packed, prompt_lengths)
    if not owners:
        return {}
    hidden, head = response_hidden(model, packed, (rows, cols))  # (N, H)
    if hidden_out is not None:
        hidden_out.append(hidden.detach())
    labels = packed.input_ids[rows, cols + 1].to(hidden.device)
    out, offset = [], 0
    for block in head_logits(head, hidden):
        n = block.shape[0]
        out.append(_chunked_logprobs(block, labels[offset:offset + n], temperature, chunk_tokens, sum_pi_squared))
        offset += n
    return _split_by_owner(torch.cat(out), owners)


def gather_response_values(values: torch.Tensor, packed: PackedRows,
                           prompt_lengths: Sequence[int]) -> dict[int, torch.Tensor]:
    """{sequence index: V(state before each response token) (n_response,)} from a value head's
    (R, L, 1) output, aligned with the log-probs: value at position t scores the action t+1."""
    result = {}
    for i, r, first, last in response_slices(packed, prompt_lengths):
        result[i] = values[r, first:last, 0]
    return result
