"""Every model this project computes with holds its weights in storage of its own, 64-byte aligned.

Why it matters: transformers hands back CPU parameters whose storage starts wherever the weights
happened to land while a safetensors file was read — 8-byte aligned, at an address that depends
on the file (its header's length, the tensors before it). MKL's matrix kernels choose how to split
a reduction by the operands' alignment, so the same weights loaded from two files compute
gradients that differ in the last bits. Measured on the demo preset: the critic loaded from
``models/critic_init`` (score head at an address ≡ 60 mod 64) and the same critic reloaded from a
later checkpoint (≡ 56) gave one value-loss gradient element 4 ulps apart in the first optimizer step
that accumulated two micro-batches, so a replay from the checkpoint never reproduced the live run
(issue: "replay exact under gradient accumulation").

``own_aligned_storage`` copies every misaligned parameter and buffer into a fresh allocation from
torch's CPU allocator (64-byte aligned, as every activation and gradient already is): the
arithmetic then depends on the values alone, whichever file, engine or process they came from.
On an accelerator ``.to(device)`` allocates afresh anyway; a partitioned ZeRO-3 parameter (an
empty placeholder) is left alone.
"""

from __future__ import annotations

from typing import Any

import torch

ALIGNMENT = 64
"""Bytes: torch's CPU allocator's alignment (c10 ``gAlignment``), a cache line, an AVX-512 vector."""


def is_aligned(tensor: torch.Tensor) -> bool:
    return tensor.numel() == 0 or tensor.data_ptr() % ALIGNMENT == 0


def own_aligned_storage(model: torch.nn.Module) -> torch.nn.Module:
    """Re-home every misaligned parameter and buffer of ``model`` (in place; tied parameters stay one
    tensor) and return it."""
    seen: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                if not is_aligned(param):
                    param.data = param.data.clone(memory_format=torch.contiguous_format)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and not is_aligned(buffer):
                    module._buffers[name] = buffer.clone(memory_format=torch.contiguous_format)
    return model


def load_pretrained(auto_class: Any, path: Any, **kwargs: Any) -> torch.nn.Module:
    """``auto_class.from_pretrained(path, **kwargs)`` with its weights in aligned storage of their own
    (``own_aligned_storage``): the one way this project loads a model it computes with."""
    return own_aligned_storage(auto_class.from_pretrained(path, **kwargs))
