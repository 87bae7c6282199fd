"""``sdpa_varlen``: the variable-length (varlen) packing layout on torch's sdpa, on any device.

Packed rows laid out as flash-attention's varlen kernel takes them — every sequence flattened into
one unpadded row with ``cu_seq_lens`` — attended one sequence at a time with
``scaled_dot_product_attention(is_causal=True)``: no 4-D mask, no padding. It is the varlen path for
machines without flash-attn (the CPU here), so that path — the one flash-attention takes on GPUs — runs and is
tested everywhere: scoring, update and guard all pack as "varlen" with it.

Without ``cu_seq_lens`` (e.g. ``generate``) it is plain sdpa with transformers' own mask, so one
loaded model serves both. Registered with transformers' attention and mask interfaces on import.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from rlhf_core.models.attention import SDPA_VARLEN


def sdpa_varlen_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                        scaling: Optional[float] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query (1, H, N, D), key/value (1, H_kv, N, D) → (1, N, H, D), causal within each sequence of
    ``cu_seq_lens_q`` ((S + 1,) int, cumulative starts); transformers' sdpa when it is absent."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"sdpa_varlen takes one flattened row with cu_seq_lens, got a batch of {query.shape[0]}")
    gqa = key.shape[1] != query.shape[1]
    bounds = cu.tolist()
    pieces = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                             dropout_p=dropout if module.training else 0.0, scale=scaling,
                                             enable_gqa=gqa)
              for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    out = torch.cat(pieces, dim=2) if pieces else query[:, :, :0]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(SDPA_VARLEN, sdpa_varlen_forward)
AttentionMaskInterface.register(SDPA_VARLEN, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
