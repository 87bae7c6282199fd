"""Rule-based MATH reward, the same rule as verl's ``verl/utils/reward_score/math_reward.py`` (itself
lm-evaluation-harness's hendrycks_math normalisation), for verl's data sources ``lighteval/MATH``,
``DigitalLearningGmbH/MATH-lighteval`` and ``HuggingFaceH4/MATH-500``.

1. The answer is the content of the response's LAST ``\\boxed{...}`` (braces matched), or the text
   after the last ``\\boxed `` up to the next ``$``; a bare ``\\fbox{...}`` is found but, as in
   verl, never unwrapped (score 0). No box → 0.
2. Answer and ground truth are both normalised (``normalize``: line breaks, ``\\!``, ``\\left`` /
   ``\\right``, degrees, ``\\$``, units after ``\\text{ ``, percent signs and spaces removed;
   ``tfrac``/``dfrac`` → ``frac``; leading ``.5`` → ``0.5``; a short ``k = `` prefix dropped;
   ``\\sqrt3`` → ``\\sqrt{3}``; ``\\frac12`` → ``\\frac{1}{2}``; ``0.5`` and ``1/2``-style integer
   ratios → ``\\frac{..}{..}``) and compared as strings: equal → 1.0, else 0.0.
3. When normalising either string fails (a malformed ``\\sqrt``/``\\frac`` at the end, two unit
   markers), the raw strings are compared instead, as verl does.
"""

from __future__ import annotations

from typing import Optional

BOXED = "\\boxed"
BOXED_SPACE = "\\boxed "
BOXED_BRACE = "\\boxed{"
FBOX = "\\fbox"


class _Unparsable(ValueError):
    """A string the normalisation cannot handle (verl's asserts / index errors)."""


def last_boxed(text: str) -> Optional[str]:
    """The last boxed expression of ``text`` including its wrapper, or None."""
    if BOXED_SPACE in text:
        return BOXED_SPACE + text.split(BOXED_SPACE)[-1].split("$")[0]
    start = text.rfind(BOXED)
    if start < 0:
        start = text.rfind(FBOX)
        if start < 0:
            return None
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return text[start:end + 1]
    return None


def unbox(boxed: str) -> str:
    """The content of ``\\boxed X`` or ``\\boxed{X}``; anything else is unparsable."""
    if BOXED_SPACE in boxed:
        if not boxed.startswith(BOXED_SPACE):
            raise _Unparsable(boxed)
        return boxed[len(BOXED_SPACE):]
    if not (boxed.startswith(BOXED_BRACE) and boxed.endswith("}")):
        raise _Unparsable(boxed)
    return boxed[len(BOXED_BRACE):-1]


def _braced_fracs(text: str) -> str:
    """``\\frac12`` → ``\\frac{1}{2}``, ``\\frac1{2}`` → ``\\frac{1}{2}``; unchanged if one is too short."""
    head, *pieces = text.split("\\frac")
    out = [head]
    for piece in pieces:
        out.append("\\frac")
        if not piece:
            raise _Unparsable(text)
        if piece[0] == "{":
            out.append(piece)
            continue
        if len(piece) < 2:
            return text
        numerator, second, rest = piece[0], piece[1], piece[2:]
        if second == "{":
            out.append("{" + numerator + "}" + second + rest)
        else:
            out.append("{" + numerator + "}{" + second + "}" + rest)
    return "".join(out)


def _integer_ratio_as_frac(text: str) -> str:
    """``3/4`` (two plain integers) → ``\\frac{3}{4}``."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    return f"\\frac{{{a}}}{{{b}}}" if text == f"{a}/{b}" else text


def _without_units(text: str) -> str:
    """Everything before ``\\text{ `` (units); two such markers are unparsable."""
    if "\\text{ " not in text:
        return text
    parts = text.split("\\text{ ")
    if len(parts) != 2:
        raise _Unparsable(text)
    return parts[0]


def _braced_sqrt(text: str) -> str:
    """``\\sqrt3`` → ``\\sqrt{3}``."""
    if "\\sqrt" not in text:
        return text
    head, *pieces = text.split("\\sqrt")
    out = [head]
    for piece in pieces:
        if not piece:
            raise _Unparsable(text)
        out.append("\\sqrt" + piece if piece[0] == "{" else "\\sqrt{" + piece[0] + "}" + piece[1:])
    return "".join(out)


_DROPPED = ("\n", "\\!")
_BEFORE_UNITS = (("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""), ("\\right", ""),
                 ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""))
_AFTER_UNITS = (("\\\\%", ""), ("\\%", ""), (" .", " 0."), ("{.", "{0."))


def normalize(text: str) -> str:
    """The canonical form two equal MATH answers share (see the module docstring, step 2)."""
    for token in _DROPPED:
        text = text.replace(token, "")
    for old, new in _BEFORE_UNITS:
        text = text.replace(old, new)
    text = _without_units(text)
    for old, new in _AFTER_UNITS:
        text = text.replace(old, new)
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" → " 5"
        text = sides[1]
    text = _braced_sqrt(text).replace(" ", "")
    text = _braced_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _integer_ratio_as_frac(text)


def same_answer(answer: Optional[str], truth: Optional[str]) -> bool:
    """Equal after normalisation; the raw strings when either cannot be normalised."""
    if answer is None or truth is None:
        return answer is None and truth is None
    try:
        return normalize(answer) == normalize(truth)
    except _Unparsable:
        return answer == truth


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer equals ``ground_truth`` after normalisation, else 0.0."""
    boxed = last_boxed(solution_str)
    if boxed is None:
        return 0.0
    try:
        answer = unbox(boxed)
    except _Unparsable:
        return 0.0
    return 1.0 if same_answer(answer, ground_truth) else 0.0
