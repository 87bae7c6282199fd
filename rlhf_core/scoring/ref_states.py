"""The reference policy's last hidden states at the response positions, kept from the score stage's
reference pass for the KL guard of the same iteration.

Why: the exact guard measures KL(actor_new ‖ ref) over the whole vocabulary at every response position,
so it needs the reference's full distribution there — which the score stage's reference pass computed
a moment before, on the very same sequences, and threw away after picking the sampled tokens' log-probs.
The reference is frozen, so its hidden states are still exactly those; the guard then runs only the
reference's LM head on them instead of its whole forward (at 4 layers of Qwen2.5-0.5B's shape the
reference's forward was ~40 % of the exact guard's time).

What is kept: per scored sequence, the (n_i, H) input of the LM head at its n_i response-scoring
positions (the model's last hidden state, after its final norm), on the host, in the pass's dtype,
keyed by the reference directory's identity (``scoring.cache.directory_identity``), the dtype, the
attention implementation and the sequence's tokens and prompt length. One pass's states at a time:
the next pass replaces them. Only when they fit ``KEEP_LIMIT_BYTES`` (else the guard runs the
reference's forward as before). One ``RefStates`` belongs to one run session
(``scoring.held.HeldModels``): a CLI rerun (`rlhf stage guard`) has none and runs the forward.

Exactness: the LM head of the same hidden states gives the logits of the reference's forward; where
the guard packs its micro-batches as scoring did (its budget is the reference's, ``KLPassSettings``)
they are bit for bit the logits its own forward would give (tests/rlhf_core/scoring/test_ref_states.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from rlhf_core.scoring.cache import directory_identity

KEEP_LIMIT_BYTES = 1 << 30
"""Host bytes of kept states above which nothing is kept (a 7B reference's 3,584-wide states of 1,024
responses x 512 tokens in bf16 would be 3.8 GB)."""


@dataclass
class _Kept:
    key: tuple
    states: dict[tuple, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0
    overflow: bool = False


def _key(ref_dir: Path, dtype: torch.dtype, attention: str) -> Optional[tuple]:
    identity = directory_identity(Path(ref_dir).resolve())
    return None if identity is None else (str(Path(ref_dir).resolve()), identity, str(dtype), attention)


def _row_key(sequence: Sequence[int], prompt_length: int) -> tuple:
    return (prompt_length, tuple(sequence))


def keep(record: Optional[_Kept], sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
         states: dict[int, torch.Tensor]) -> None:
    """Add ``states`` ({sequence index: (n_i, H) LM-head input}) to ``record``, on the host."""
    if record is None or record.overflow:
        return
    for i, state in states.items():
        host = state.detach().to("cpu", copy=True)
        record.nbytes += host.numel() * host.element_size()
        if record.nbytes > KEEP_LIMIT_BYTES:
            record.overflow, record.states = True, {}
            return
        record.states[_row_key(sequences[i], prompt_lengths[i])] = host


class RefStates:
    """The last score pass's reference states of one run (at most one pass's)."""

    def __init__(self) -> None:
        self._kept: Optional[_Kept] = None

    @contextlib.contextmanager
    def recording(self, ref_dir: Path, dtype: torch.dtype, attention: str) -> Iterator[Optional[_Kept]]:
        """Start a new record of the reference's states (dropping the previous one); ``keep`` adds
        to it. Yields None when the directory cannot be identified (nothing is kept then)."""
        key = _key(ref_dir, dtype, attention)
        self._kept = None
        record = None if key is None else _Kept(key)
        yield record
        if record is not None and not record.overflow:
            self._kept = record

    def lookup(self, ref_dir: Path, dtype: torch.dtype, attention: str, sequences: Sequence[Sequence[int]],
               prompt_lengths: Sequence[int]) -> Optional[list[torch.Tensor]]:
        """The kept states of every one of ``sequences`` (in order) for this reference, dtype and
        attention; None unless all of them are kept."""
        kept = self._kept
        if kept is None or kept.key != _key(ref_dir, dtype, attention):
            return None
        found = [kept.states.get(_row_key(s, p)) for s, p in zip(sequences, prompt_lengths)]
        return None if any(f is None for f in found) else found

    def forget(self) -> None:
        """Drop what is kept."""
        self._kept = None
