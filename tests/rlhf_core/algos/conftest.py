"""Shared mask generator for the algos tests (a session fixture: ``--import-mode=importlib``
leaves no clean way to import a helper module, and hypothesis rejects function-scoped ones)."""

from __future__ import annotations

import pytest
import torch

# Row layouts every mask-aware function must handle.
STYLES = ("all_masked", "full", "leading_masked", "trailing_masked", "gaps", "random")


def _row(gen: torch.Generator, length: int, style: str) -> torch.Tensor:
    row = torch.ones(length, dtype=torch.bool)
    cut = int(torch.randint(0, length + 1, (1,), generator=gen))
    if style == "all_masked":
        row[:] = False
    elif style == "leading_masked":
        row[:cut] = False
    elif style == "trailing_masked":
        row[cut:] = False
    elif style == "gaps":
        # Padding on both sides plus a hole in the middle (multi-turn observation tokens).
        lo, hi = sorted(torch.randint(0, length + 1, (2,), generator=gen).tolist())
        row[:lo // 2] = False
        row[(lo + hi) // 2 : hi] = False
        row[hi + (length - hi) // 2 :] = False
    elif style == "random":
        row = torch.rand(length, generator=gen) < 0.6
    return row


def make_mask(gen: torch.Generator, batch: int, length: int) -> torch.Tensor:
    """(batch, length) bool mask, each row's style drawn from ``gen``."""
    styles = [STYLES[int(torch.randint(0, len(STYLES), (1,), generator=gen))] for _ in range(batch)]
    return torch.stack([_row(gen, length, style) for style in styles])


def scramble_masked(x: torch.Tensor, mask: torch.Tensor, gen: torch.Generator, nonfinite: bool = True) -> torch.Tensor:
    """Copy of ``x`` with masked positions replaced by junk (huge, and optionally inf/nan)."""
    junk = torch.randn(x.shape, generator=gen, dtype=torch.float64) * 1e4
    if nonfinite:
        pick = torch.randint(0, 3, x.shape, generator=gen)
        junk = torch.where(pick == 0, torch.tensor(float("inf"), dtype=torch.float64), junk)
        junk = torch.where(pick == 1, torch.tensor(float("nan"), dtype=torch.float64), junk)
    return torch.where(mask, x, junk.to(x.dtype))


class MaskTools:
    make = staticmethod(make_mask)
    scramble = staticmethod(scramble_masked)


@pytest.fixture(scope="session")
def masks() -> MaskTools:
    return MaskTools()
