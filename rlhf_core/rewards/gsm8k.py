"""Rule-based GSM8K reward, the same rule as verl's ``verl/utils/reward_score/gsm8k.py``.

Only the response's last 300 characters are searched (verl's speed cut: the final answer sits at
the end). The answer is then compared with the ground truth AS A STRING, so the ground truth must
be the bare answer the data preparation extracts (verl's GSM8K script: the number after '####'
with commas removed, e.g. "1234").

``strict``    the LAST match of ``#### <digits, '.', ','>`` (exactly one space after the marker, an
              optional leading '-'), commas removed: "#### 1,234" → "1234"; no marker → no answer.
``flexible``  the last run of digits / '.' / ',' (optional leading '-') anywhere in the tail that is
              not "" or "."; kept verbatim (commas and a trailing '.' stay: "18." ≠ "18").

Score: no answer → 0; an answer that differs → ``format_score``; equal → ``score``.
"""

from __future__ import annotations

import re
from typing import Optional

SOLUTION_CLIP_CHARS = 300
"""Characters at the end of a response that are searched (verl's _SOLUTION_CLIP_CHARS)."""

STRICT_RE = re.compile(r"#### (-?[0-9.,]+)")
NUMBER_RE = re.compile(r"(-?[0-9.,]+)")
_NOT_AN_ANSWER = ("", ".")
METHODS = ("strict", "flexible")


def extract_solution(solution_str: str, method: str = "strict") -> Optional[str]:
    """The answer a response states, as verl reads it (a string), or None when it states none."""
    if method not in METHODS:
        raise ValueError(f"unknown GSM8K method {method!r}; use one of: {', '.join(METHODS)}")
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = STRICT_RE.findall(tail)
        return found[-1].replace(",", "") if found else None
    candidates = NUMBER_RE.findall(tail)
    if not candidates:
        return None
    # the last candidate that is not "" or "."; when every one is, verl's loop ends on the first
    return next((c for c in reversed(candidates) if c not in _NOT_AN_ANSWER), candidates[0])


def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """0 when no answer is found, ``format_score`` when it differs from ``ground_truth``, else ``score``."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)
