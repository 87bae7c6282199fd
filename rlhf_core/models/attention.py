"""Which attention implementation a model is loaded with: one answer for scoring, update and guard.

Old log-probs (score stage), the update's log-probs and the KL guard's must come from the same
kernel on the same data, or the PPO ratio is not 1 at the first step and the guard measures kernel
noise. Every loader therefore asks ``resolve_attention`` with the config's
``actor_rollout_ref.model.override_config.attn_implementation`` (actor, reference) or
``critic.model.override_config.attn_implementation`` (critic), and the packing layout follows the
implementation the model was loaded with (``rlhf_core.models.packed.packing_attention_mode``):

    flash_attention_2/3 (CUDA, flash-attn installed) → varlen: one unpadded row + cu_seq_lens
    sdpa_varlen (anywhere; rlhf_core.models.sdpa_varlen) → varlen, each sequence through sdpa
    sdpa, eager (anywhere)                           → mask4d: padded rows + 4-D block mask

'auto' (our default; verl's is flash_attention_2, which fails on machines without flash-attn) picks
flash_attention_2 on CUDA when the flash-attn package is importable, else sdpa.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only annotations here: the config's schema imports this module without torch
    import torch

from rlhf_core.errors import RLHFError

SDPA_VARLEN = "sdpa_varlen"
"""Our name: the varlen layout on torch's sdpa (``rlhf_core.models.sdpa_varlen``), any device."""
IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", SDPA_VARLEN)
"""Values of ``override_config.attn_implementation`` this project can load (transformers' names,
plus ``sdpa_varlen``)."""

_FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def flash_attention_available(device: torch.device, implementation: str = "flash_attention_2") -> bool:
    """True on CUDA when the package behind ``implementation`` is importable."""
    return device.type == "cuda" and importlib.util.find_spec(_FLASH_PACKAGES[implementation]) is not None


def resolve_attention(requested: str, device: torch.device, key: str = "override_config.attn_implementation") -> str:
    """The implementation to load a model with on ``device``: 'auto' resolved, an explicit one
    checked to be loadable here (a flash kernel needs CUDA and its package), so a bad value fails
    at load with the key and the fix rather than deep inside transformers."""
    if requested not in IMPLEMENTATIONS:
        raise RLHFError(f"{key}={requested!r}: unknown attention implementation; valid: {', '.join(IMPLEMENTATIONS)}")
    if requested == "auto":
        return "flash_attention_2" if flash_attention_available(device) else "sdpa"
    if requested in _FLASH_PACKAGES and not flash_attention_available(device, requested):
        raise RLHFError(f"{key}={requested}: needs a CUDA device and the {_FLASH_PACKAGES[requested]} package "
                          f"(device here: {device.type}); use auto or sdpa")
    return requested


def is_flash(implementation: str) -> bool:
    """A flash-attention implementation (transformers' flash_attention_2/3, or a kernels-hub flash
    variant): it cannot take a 4-D mask."""
    return "flash" in (implementation or "")


def takes_varlen(implementation: str) -> bool:
    """Packed rows go in as one unpadded row with cu_seq_lens (flash kernels, sdpa_varlen)."""
    return is_flash(implementation) or implementation == SDPA_VARLEN
