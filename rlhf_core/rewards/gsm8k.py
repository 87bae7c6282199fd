"""Rule-based GSM8K reward: find the final answer in a response and compare it, as a number, with
the ground truth.

Two extraction methods (the names and the scoring rule follow verl's ``gsm8k.compute_score``):

``strict``    the response must state the answer in GSM8K's own format, ``#### <number>``; the first
              such marker counts (a model that keeps generating after it is not rewarded twice).
``flexible``  the answer may be stated the ways models commonly state it, tried in this order (the
              last occurrence of the first kind present wins): ``#### 18``, ``\\boxed{18}``,
              "the (final) answer is / Answer: 18", then the last number in the text.

Scoring (verl's rule): no answer found → 0; answer found but wrong → ``format_score``; right →
``score``. Unlike verl, which compares strings, numbers are compared as numbers in both methods:
thousands separators, currency signs, markdown bold, trailing periods and trailing zeros do not
matter (``$1,234.`` = ``1234`` and ``18.00`` = ``18``). The ground truth is parsed the same way: a
full GSM8K solution (``... #### 72``) or a bare answer (``72``, ``1,234``).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Optional

# A number as written in prose: optional sign and currency sign (either order), thousands groups or
# plain digits, optional decimals. The look-behind keeps "10-3" from reading as "-3" and "x2" as "2".
_NUMBER = (
    r"(?<![\w.])"
    r"(?P<sign>[-\u2212])?(?:\\?\$\s?)?(?P<sign2>[-\u2212])?"
    r"(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
    r"(?![\d,]*\d)"
)
NUMBER_RE = re.compile(_NUMBER)
# strict: the GSM8K marker followed directly by a number (a currency sign is tolerated)
STRICT_RE = re.compile(r"####\s*" + _NUMBER.replace(r"(?<![\w.])", ""))
MARKER_RE = re.compile(r"####\s*(?P<rest>[^\n]*)")
BOXED_RE = re.compile(r"\\boxed\s*\{(?P<rest>[^{}]*)\}")
ANSWER_PHRASE_RE = re.compile(
    r"answer\s*(?:is|:|=|would\s+be|will\s+be)\s*:?\s*(?P<rest>[^\n]*)", re.IGNORECASE
)
# markdown / LaTeX wrappers that hide a number from the patterns above
_DECORATION_RE = re.compile(r"\*\*|__|\\\(|\\\)|\\\[|\\\]|\\text\{[^}]*\}")

# relative tolerance for "the same number" (GSM8K answers are integers or short decimals)
REL_TOL = Decimal("1e-6")


def parse_number(match: re.Match) -> Optional[Decimal]:
    """Decimal value of a NUMBER_RE match (commas removed, sign applied)."""
    try:
        value = Decimal(match.group("digits").replace(",", ""))
    except InvalidOperation:
        return None
    return -value if (match.group("sign") or match.group("sign2")) else value


def _first_number(text: str) -> Optional[Decimal]:
    match = NUMBER_RE.search(text)
    return parse_number(match) if match else None


def _last_number(text: str) -> Optional[Decimal]:
    matches = list(NUMBER_RE.finditer(text))
    return parse_number(matches[-1]) if matches else None


def _last_marked_number(pattern: re.Pattern, text: str) -> Optional[Decimal]:
    """The number right after the last occurrence of ``pattern`` that is followed by a number."""
    for match in reversed(list(pattern.finditer(text))):
        value = _first_number(match.group("rest"))
        if value is not None:
            return value
    return None


def extract_answer(solution_str: str, method: str = "strict") -> Optional[Decimal]:
    """The final answer a response states, as a Decimal, or None when it states none."""
    if method == "strict":
        match = STRICT_RE.search(solution_str)
        return parse_number(match) if match else None
    if method != "flexible":
        raise ValueError(f"unknown GSM8K method {method!r}; use 'strict' or 'flexible'")
    text = _DECORATION_RE.sub("", solution_str)
    for pattern in (MARKER_RE, BOXED_RE, ANSWER_PHRASE_RE):
        value = _last_marked_number(pattern, text)
        if value is not None:
            return value
    return _last_number(text)


def parse_ground_truth(ground_truth: str) -> Optional[Decimal]:
    """The answer of a ground truth: a full GSM8K solution ('... #### 72') or a bare '72' / '1,234'."""
    text = str(ground_truth)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return _last_number(_DECORATION_RE.sub("", text))


def same_number(a: Decimal, b: Decimal) -> bool:
    return abs(a - b) <= REL_TOL * max(Decimal(1), abs(b))


def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """0 when no answer is found, ``format_score`` when it is wrong, ``score`` when it is right."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    truth = parse_ground_truth(ground_truth)
    if truth is None:  # a non-numeric ground truth: compare the stated answer's text form
        return float(score) if str(answer) == str(ground_truth).strip() else float(format_score)
    return float(score) if same_number(answer, truth) else float(format_score)
