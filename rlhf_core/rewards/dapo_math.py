"""Rule-based DAPO math reward, the same rule as verl's ``verl/utils/reward_score/math_dapo.py`` as
verl's default reward calls it (Minerva-style checking, no strict box), for verl's data sources
``math_dapo``, ``math``, ``math_dapo_reasoning`` and every ``aime*``.

1. Only the response's last 300 characters are read.
2. The prediction is the text after the LAST "Answer:" (any case, spaces around the colon allowed)
   up to the end of its line; none → "[INVALID]".
3. Prediction and ground truth are both normalised by ``normalize_final_answer`` (text after the
   last '=', a fixed list of substitutions and unit words removed, ``$...$``, ``\\text{}``,
   ``\\textbf{}``, ``\\overline{}``, ``\\boxed{}`` unwrapped, ``\\fracab`` / ``\\sqrta`` braced, '$'
   dropped, thousands separators removed from plain integers) and compared as strings.

4. Without any "Answer:", the last ``\\boxed{...}`` (braces matched) in the last 100 of those
   characters is the prediction, compared as it stands with the ground truth as it stands.

Result, as verl's: ``{"score": 1.0 | -1.0, "acc": bool, "pred": the prediction}`` (a wrong or
missing answer scores −1).
"""

from __future__ import annotations

import re
from typing import Optional

CLIP_CHARS = 300
BOX_CHARS = 100
BOX_OPEN = "\\boxed{"
ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
NO_ANSWER = "[INVALID]"

# (old, new) replacements, applied in this order
REPLACEMENTS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
# then every one of these removed, in this order
REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)
# then these rewrites, in this order
REWRITES = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),     # keep the first $...$ only
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),     # \fracab → \frac{a}{b}
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),             # \sqrta → \sqrt{a}
)


def normalize_final_answer(answer: str) -> str:
    """The canonical form of a final answer (see the module docstring, step 3)."""
    answer = answer.split("=")[-1]
    for old, new in REPLACEMENTS:
        answer = answer.replace(old, new)
    for word in REMOVED:
        answer = answer.replace(word, "")
    for pattern, replacement in REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def prediction(solution_str: str) -> str:
    """The normalised text after the last "Answer:" in the response's last 300 characters."""
    found = ANSWER_RE.findall(solution_str[-CLIP_CHARS:])
    return normalize_final_answer(found[-1] if found else NO_ANSWER)


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` in ``text`` (its braces matched), None without one or
    when it is not closed."""
    start = text.rfind(BOX_OPEN)
    if start < 0:
        return None
    depth = 0
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if text[end] == "}" and depth == 0:
            return text[start + len(BOX_OPEN):end]
    return None


def compute_score(solution_str: str, ground_truth: str) -> dict:
    """{"score": 1.0 when the prediction equals the ground truth else −1.0, "acc", "pred"}: the
    "Answer:" line when there is one (both sides normalised), else the last box (both as they stand)."""
    text = solution_str[-CLIP_CHARS:]
    pred = prediction(text)
    if pred == NO_ANSWER:
        boxed = last_boxed(text[-BOX_CHARS:])
        if boxed is not None:
            return {"score": 1.0 if boxed == ground_truth else -1.0, "acc": boxed == ground_truth, "pred": boxed}
    correct = pred == normalize_final_answer(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
